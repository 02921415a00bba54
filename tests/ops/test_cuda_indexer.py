"""The CUDA C++ indexer scores over key rows read by index (``kernels/cuda_indexer.cu``).

CPU: the launcher asks for the shared memory the source lays out and names entries the source
defines; where ``nvcc`` is installed every form builds for sm_90a without spills. GPU (Hopper):
against the float64 reference over the same rows - hidden rows (-1, a row past the pool) in the
middle, a query with no row at all, slices with no row (the table's padding), widths that are and
are not multiples of a chunk, int32 and int64 indices, every form (the same bits: a column's
arithmetic does not depend on the slice it sits in) - under a CUDA graph too and through fast
mode's dispatch where switched on; the inverse controls show the tolerance sees the head weights
misplaced and the ReLU left out."""

import re
import shutil

import pytest
import torch

from v4stack.kernels import cubin
from v4stack.kernels import cuda_indexer as ci

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
needs_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and cubin.usable()),
                                  reason="needs a Hopper GPU and nvcc")


def test_the_launcher_asks_for_the_layout_and_the_entries_the_source_has():
    src = (cubin.HERE / ci.SOURCE).read_text()
    entries = set(re.findall(r"^IENTRY\((\w+), (\w+), (\d+), (\d+)\)", src, re.M))
    for form, (nst, cpb) in ci.FORMS.items():
        assert (f"indexer_rows_i64_{form}", "int64_t", str(nst), str(cpb)) in entries
        assert ci.smem(form) <= 227 * 1024
    assert (f"indexer_rows_i32_{ci.FORM}", "int32_t", *map(str, ci.FORMS[ci.FORM])) in entries
    # the .cu's ISMEM(NST, CPB) with its macros, against the launcher's count
    env = {}
    for name, expr in re.findall(r"^#define (I\w+) ([^\n/]*?)\s*(?://[^\n]*)?$", src, re.M):
        if "(" not in name:
            env[name] = eval(expr, {"__builtins__": {}}, env)
    body = re.search(r"^#define ISMEM\(NST, CPB\) (.*?)\s*$", src, re.M).group(1)
    for form, (nst, cpb) in ci.FORMS.items():
        assert eval(body, {"__builtins__": {}}, dict(env, NST=nst, CPB=cpb)) == ci.smem(form)
    # the control: one stage more is another count
    assert eval(body, {"__builtins__": {}}, dict(env, NST=4, CPB=8)) != ci.smem("s3_c8")


@needs_nvcc
def test_every_form_builds_for_hopper_without_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("V4STACK_CUDA_CACHE", str(tmp_path))
    path, report = cubin.build(ci.SOURCE)
    names = [f"indexer_rows_i64_{f}" for f in ci.FORMS] + [f"indexer_rows_i32_{ci.FORM}"]
    for n in names:
        assert f"Compiling entry function '{n}' for 'sm_90a'" in report
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == len(names), report
    regs = [int(line.split("Used ")[1].split()[0]) for line in report.splitlines() if "Used " in line]
    # registers for three blocks of 128 threads an SM at least (the forms' shared memory allows two to four)
    assert regs and max(regs) <= 65536 // (3 * 128)
    # the shipped form: four blocks an SM, by its registers (each entry's report follows its name) and its
    # shared memory (228 KB an SM, 1 KB of it reserved a block); control: s3_c8's shared memory allows three
    entry = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", report, re.S))
    for it in ("i64", "i32"):
        assert int(entry[f"indexer_rows_{it}_{ci.FORM}"]) <= 65536 // (4 * 128)
    assert 4 * (ci.smem(ci.FORM) + 1024) <= 228 * 1024 < 4 * (ci.smem("s3_c8") + 1024)


def test_accepts_only_the_written_shapes():
    q = torch.zeros(64, 64, 128, dtype=torch.bfloat16)
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    pool = torch.zeros(100, 128, dtype=torch.bfloat16)
    rows = torch.zeros(64, 300, dtype=torch.int64)
    assert not ci.accepts(q, w, pool, rows)  # not on CUDA
    if torch.cuda.is_available():
        q, w, pool, rows = q.cuda(), w.cuda(), pool.cuda(), rows.cuda()
        assert ci.accepts(q, w, pool, rows)
        assert ci.accepts(q, w, pool, rows.int())
        assert not ci.accepts(q[:, :32], w[:, :32], pool, rows)  # 32 heads
        assert not ci.accepts(q[..., :64], w, pool[:, :64], rows)  # 64-wide keys
        assert not ci.accepts(q, w, pool.float(), rows)
        assert not ci.accepts(q, w, torch.zeros(100, 144, dtype=torch.uint8, device="cuda"), rows)  # packed keys
        assert not ci.accepts(q, w, pool, rows.float())


def _reference(q, w, pool, rows):
    r = rows.long()
    ok = (r >= 0) & (r < pool.shape[0])
    k = pool[r.clamp(0, pool.shape[0] - 1)].double()  # [T, S, D]
    dots = torch.einsum("thd,tsd->ths", q.double(), k).clamp(min=0)
    return torch.einsum("ths,th->ts", dots, w.double()).masked_fill(~ok, float("-inf"))


def _case(T, S, N, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, 64, 128, device="cuda", generator=g).bfloat16()
    w = (torch.randn(T, 64, device="cuda", generator=g) / 8).bfloat16()
    pool = torch.randn(N, 128, device="cuda", generator=g).bfloat16()
    rows = torch.randint(0, N, (T, S), device="cuda", generator=g)
    rows[:, 5::17] = -1  # hidden in the middle
    rows[:, 9::23] = N + 3  # past the pool: never read
    rows[1] = -1  # a query with no row
    if S >= 1024:
        rows[:, S - 512:] = -1  # the table's padding: a slice with no row (the shipped form's 512 columns)
    return q, w, pool, rows


def _close(got, want):
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin) and bool(torch.all(got[~fin] == float("-inf")))
    scale = want[fin].abs().max().item()
    return (got.double()[fin] - want[fin]).abs().max().item() / scale


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_matches_the_float64_reference_in_every_form(dtype):
    for T, S in ((300, 4608), (70, 1000), (64, 40)):
        q, w, pool, rows = _case(T, S, N=5000, seed=S)
        rows = rows.to(dtype)
        want = _reference(q, w, pool, rows)
        first = None
        for form in ci.FORMS:
            got = ci.indexer_scores_rows(q, w, pool, rows, form=form)
            err = _close(got, want)
            assert err < 1e-2, (T, S, form, err)  # bf16 output: 2^-8 of a score at most, plus fp32 sums
            if first is None:
                first = got
            assert torch.equal(got, first), form  # a column's bits do not depend on its slice
        # inverse controls: the head weights one head off, and no ReLU, are far outside the tolerance
        bad_w = ci.indexer_scores_rows(q, w.roll(1, 1).contiguous(), pool, rows)
        assert _close(bad_w, want) > 0.05
        no_relu = torch.einsum("thd,tsd->ts", q.double() * w.double()[..., None],
                               pool[rows.long().clamp(0, 4999)].double()).masked_fill(~torch.isfinite(want), float("-inf"))
        assert _close(got, no_relu) > 0.05


@pytest.mark.gpu
@needs_hopper
def test_agrees_with_the_triton_kernel_and_runs_under_a_graph_and_the_dispatch(monkeypatch):
    from v4stack import ops
    from v4stack.kernels import triton_gemm as tg

    q, w, pool, rows = _case(256, 4608, N=256 * 4096)
    eager = ci.indexer_scores_rows(q, w, pool, rows)
    tri = tg.indexer_scores(q, w, pool, rows)
    # the same function: within a bf16 rounding of each other wherever finite
    assert _close(eager, tri.double()) < 1e-2
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ci.indexer_scores_rows(q, w, pool, rows)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ci.indexer_scores_rows(q, w, pool, rows)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    for on, name, want in ((True, "cuda_indexer_scores_rows", eager), (False, "triton_indexer_scores_rows", tri)):
        monkeypatch.setattr(ci, "ENABLED", on)
        ops.reset_counters()
        with ops.mode("fast"):
            via = ops.indexer_scores(q, w, pool, rows=rows)
        assert ops.counters()["indexer_scores_rows"] == {name: 1}
        assert torch.equal(via, want)
