"""The model end to end: prompts alone vs in shuffled batches, bitwise at every step.

32 random prompts (lengths 1..12, each prefilled in random chunks, then 3 decode steps) run one
at a time and through continuous batches of 4 and 32 with the row order reshuffled every step,
so some requests prefill while others decode. Inverse control: the same workload in ``fast``
mode differs (CPU GEMMs change kernel with M, and sigmoid / silu / softplus use a scalar formula
on a tensor's tail), which shows the comparison can fail.
"""

import json

import pytest
import torch
from typer.testing import CliRunner

from v4stack import check, ops
from v4stack.config import preset
from v4stack.model import V4Model

WORKLOAD = dict(preset="tiny", prompts=32, batch_sizes=(4, 32), max_prompt=12, decode=3)


def test_invariant_mode_is_batch_invariant_and_deterministic():
    rep = check.check_invariance(mode="invariant", **WORKLOAD)
    assert rep["steps_compared"] == 2 * sum(rep["steps_per_request"]) > 2 * 32 * 3
    assert rep["steps_differ"] == 0 and rep["max_abs_diff"] == 0.0
    assert rep["invariant"] and rep["deterministic"]
    assert rep["chunking_invariant"] and rep["one_chunk"]["rows"] > 32 * 3


def test_control_fast_mode_differs_but_repeats():
    rep = check.check_invariance(mode="fast", **WORKLOAD)
    assert rep["steps_differ"] > 0 and not rep["invariant"]
    assert 0 < rep["max_abs_diff"] < 1e-3  # rounding-level, not a broken model
    assert rep["deterministic"]  # the same batch twice is bit-identical in fast mode too
    assert rep["one_chunk"]["rows_differ"] > 0  # and chunking changes rows in fast mode


@pytest.mark.slow
def test_invariant_mode_longer_prompts_bf16():
    rep = check.check_invariance(preset="tiny", prompts=32, mode="invariant", dtype="bfloat16",
                                 batch_sizes=(2, 7, 32), max_prompt=40, decode=8)
    assert rep["steps_differ"] == 0 and rep["deterministic"]


@torch.no_grad()
def test_prefill_equals_decode_bitwise_in_invariant_mode_only():
    """Token by token, in chunks, or the full forward: the same bits in invariant mode (75 tokens
    cross the window, m = 4, m' = 16 and lcm boundaries). Control: fast mode differs."""
    model = V4Model(preset("tiny"), seed=1).eval()
    t = torch.randint(0, 256, (1, 75), generator=torch.Generator().manual_seed(0))

    def runs():
        full = model(t)[0]
        st = model.new_state()
        tok = torch.cat([model.step([(t[0, i : i + 1], st)])[0] for i in range(75)])
        st = model.new_state()
        chunks = torch.cat([model.step([(t[0, a:b], st)])[0] for a, b in ((0, 10), (10, 11), (11, 40), (40, 75))])
        return full, tok, chunks

    with ops.mode("invariant"):
        full, tok, chunks = runs()
    assert torch.equal(tok.view(torch.int32), full.view(torch.int32))
    assert torch.equal(chunks.view(torch.int32), full.view(torch.int32))
    with ops.mode("fast"):
        full, tok, chunks = runs()
    assert not torch.equal(tok.view(torch.int32), full.view(torch.int32))


@torch.no_grad()
def test_incremental_matches_full_forward_in_invariant_mode():
    model = V4Model(preset("tiny"), seed=1).cast(torch.float64).eval()
    t = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with ops.mode("invariant"):
        full = model(t)[0]
        st = model.new_state()
        inc = torch.cat([model.step([(t[0, a:b], st)])[0] for a, b in ((0, 7), (7, 8), (8, 23), (23, 40))])
    with ops.mode("fast"):
        fast = model(t)[0]
    assert (inc - full).abs().max().item() < 1e-9
    assert (full - fast).abs().max().item() < 1e-9


def test_cli_exit_codes(monkeypatch):
    runner = CliRunner()
    res = runner.invoke(check.app, ["invariance", "--prompts", "3", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["invariant"] is True
    bad = {"preset": "tiny", "mode": "invariant", "dtype": "float32", "prompts": 1, "runs": [],
           "steps_differ": 1, "invariant": False, "deterministic": True, "chunking_invariant": True,
           "one_chunk": {"rows": 1, "rows_differ": 0, "requests_differ": 0}}
    monkeypatch.setattr(check, "check_invariance", lambda *a, **k: dict(bad))
    res = runner.invoke(check.app, ["invariance"])
    assert res.exit_code == 1 and "NOT invariant" in res.output
    monkeypatch.setattr(check, "check_invariance", lambda *a, **k: dict(bad, mode="fast"))
    assert runner.invoke(check.app, ["invariance", "--mode", "fast"]).exit_code == 0


def test_cli_rejects_bad_mode_naming_the_field():
    res = CliRunner().invoke(check.app, ["invariance", "--mode", "quick"])
    assert res.exit_code == 2 and "mode must be one of" in res.output
