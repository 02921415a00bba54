"""Fast mode's measured picks: the committed table is what ``bench.fast_picks`` derives from the
committed ops measurement, each bucket picks the lower device time, and the lookup follows it."""

import copy
import json
from pathlib import Path

import pytest
import torch

from bench import fast_picks
from v4stack import ops
from v4stack.kernels import fast_table

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "bench/results/ops_h200.json"
GROUPED = "bench/results/grouped_serving_h200.json"  # the engine's decode calls (9 / 65 experts)


def _source():
    return json.loads((ROOT / SOURCE).read_text())


def _carried(table: dict) -> dict:
    """The buckets ``table`` kept from an earlier measurement (``carried_from``)."""
    return {"ops": {k: {"kernel": e["kernel"], "buckets": [b for b in e["buckets"] if "carried_from" in b]}
                    for k, e in table["ops"].items()}}


def _grouped():
    return fast_picks.serving_grouped(json.loads((ROOT / GROUPED).read_text()), GROUPED)


def test_committed_table_is_derived_from_the_committed_measurement():
    committed = fast_table.load()
    derived = fast_picks.derive(_source(), SOURCE, _carried(committed), _grouped())
    assert derived == committed
    # a carried bucket is one this measurement could not re-derive, never one it measured
    fresh = fast_picks.derive(_source(), SOURCE)
    for k, e in _carried(committed)["ops"].items():
        assert not {b["M"] for b in e["buckets"]} & {b["M"] for b in fresh["ops"].get(k, {}).get("buckets", [])}
    assert derived["source_commit"] == _source()["stamp"]["commit"]
    for e in derived["ops"].values():
        for b in e["buckets"]:
            faster = b["project_graph_s"] < b["framework_graph_s"]
            assert b["pick"] == ("project" if faster else "framework")
    # the picks this table exists for: the grouped GEMM by routed rows per expert (the serving sweep's
    # decode calls, and the ops check's 256 experts: 96 rows each at 4096 tokens), log_softmax at vocab widths
    g = {b["rows"]: b["pick"][0] for b in derived["ops"]["grouped_linear"]["buckets"]}
    assert g == {1: "p", 2: "p", 6: "p", 7: "p", 13: "p", 28: "p", 50: "p", 96: "f", 200: "p"}
    assert {b["pick"] for b in derived["ops"]["log_softmax"]["buckets"]} == {"project"}
    # one dispatch op, two dtypes: linear's picks are kept per dtype (the key gpu.py looks up)
    assert {"linear.bfloat16", "linear.float32"} <= set(derived["ops"])
    assert derived["ops"]["linear.float32"]["kernel"] == "triton_fp32_gemm"


def test_swapped_times_flip_the_picks(tmp_path):
    # inverse control: the same measurement with the two times exchanged picks the other side everywhere
    src = copy.deepcopy(_source())
    for r in src["results"]:  # the framework's time (fast mode's, or timed alone) and the kernel's exchanged
        case = fast_picks.CASES.get(r["op"])
        if case is None or r.get("fast_graph_s") is None:
            continue
        ran_fw = set(r["fast_served"].get(case[0], {})) <= fast_picks.FRAMEWORK
        fw = r["fast_graph_s"] if ran_fw else r.get("framework_graph_s")
        if fw is not None:
            inv = r["invariant_graph_s"]
            r["invariant_graph_s"], r["fast_graph_s"] = fw, inv
            if "framework_graph_s" in r:
                r["framework_graph_s"] = inv
    a, b = fast_picks.derive(_source(), SOURCE), fast_picks.derive(src, SOURCE)
    flips = [(x["pick"], y["pick"]) for op in a["ops"] for x, y in zip(a["ops"][op]["buckets"], b["ops"][op]["buckets"])]
    assert flips and all(p != q for p, q in flips)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(b))
    assert fast_table.prefers_project("grouped_linear", 96, str(path)) is True  # 4096 tokens over 256 experts
    assert fast_table.prefers_project("grouped_linear", 96) is False


def test_lookup_by_rows():
    p = fast_table.prefers_project
    # the grouped GEMM by routed rows per expert
    assert p("grouped_linear", 1) and p("grouped_linear", 6) and p("grouped_linear", 50)
    assert p("grouped_linear", 96) is False  # 4096 tokens of 256 experts: torch._grouped_mm measured faster
    assert p("grouped_linear", 97) is True  # 200 rows per expert of 9 (the flash4 engine at batch 256)
    assert p("grouped_linear", 10**6) is None  # past the last bucket: the registered rule
    assert p("moe_combine", 1) is False and p("moe_combine", 64) is True
    assert p("no_such_op", 1) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_mode_dispatch_follows_the_table_on_cuda():
    from v4stack.ops import dispatch

    w = torch.randn(8, 256, 512, device="cuda", dtype=torch.bfloat16)
    # by routed rows per expert: 1 and 200+ the project kernel, 96 (the ops check's 4096 tokens) torch
    for rows, want in ((6, "triton_grouped_gemm"), (8 * 96, "torch_grouped_mm"), (8 * 384, "triton_grouped_gemm")):
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        off = torch.linspace(0, rows, 9, device="cuda").long()
        assert dispatch.resolve("grouped_linear", "fast", "bfloat16", "cuda", x, w, off).name == want
        with ops.mode("fast"):
            y = ops.grouped_linear(x, w, off)
        ref = torch.cat([x[off[e]:off[e + 1]].float() @ w[e].float().T for e in range(8)])
        torch.testing.assert_close(y.float(), ref, atol=0.1, rtol=0.02)
    lg = torch.randn(4, 129280, device="cuda")
    assert dispatch.resolve("log_softmax", "fast", "float32", "cuda", lg, -1).name == "triton_log_softmax"
    with ops.mode("fast"):
        torch.testing.assert_close(ops.log_softmax(lg, -1), torch.log_softmax(lg, -1), atol=1e-5, rtol=1e-5)
