"""Mode switch and explicit float semantics."""

import pytest
import torch

from v4stack import ops


def test_default_is_fast_and_context_restores():
    assert ops.get_mode() == "fast"
    with ops.mode("invariant"):
        assert ops.get_mode() == "invariant"
        with ops.mode("fast"):
            assert ops.get_mode() == "fast"
        assert ops.get_mode() == "invariant"
    assert ops.get_mode() == "fast"


def test_set_mode_returns_previous_and_rejects_unknown():
    prev = ops.set_mode("invariant")
    try:
        assert prev == "fast" and ops.get_mode() == "invariant"
    finally:
        ops.set_mode(prev)
    with pytest.raises(ValueError, match="mode must be one of"):
        ops.set_mode("fastest")
    with pytest.raises(ValueError, match="mode must be one of"):
        with ops.mode("deterministic"):
            pass


def test_opt_in_is_recorded_in_fast_mode_and_refused_in_invariant():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    fp = ops.opt_in("tests.ops.tf32_site", tf32=True)
    before = ops.recorded()["tests.ops.tf32_site"]["calls"]
    y = ops.linear(x, w, fp=fp)  # CPU has no TF32: same values, but the use is counted
    assert torch.equal(y, ops.linear(x, w))
    assert ops.recorded()["tests.ops.tf32_site"] == {"tf32": True, "fast_math": False, "calls": before + 1}
    with ops.mode("invariant"):
        with pytest.raises(ops.FloatSemanticsError, match="tests.ops.tf32_site.*tf32.*refused in invariant"):
            ops.linear(x, w, fp=fp)
        fm = ops.opt_in("tests.ops.fm_site", fast_math=True)
        with pytest.raises(ops.FloatSemanticsError, match="fast_math"):
            ops.attention_with_sink(torch.randn(1, 2, 4), torch.randn(1, 3, 4), torch.ones(1, 3, dtype=torch.bool),
                                    torch.zeros(2), 0.5, fp=fm)
        assert ops.linear(x, w, fp=ops.IEEE).shape == (3, 5)  # IEEE is always admitted
    assert ops.recorded()["tests.ops.tf32_site"]["calls"] == before + 1  # refused calls are not counted


def test_opt_in_site_rules():
    with pytest.raises(ValueError, match="site"):
        ops.opt_in("")
    ops.opt_in("tests.ops.twice", tf32=True)
    assert ops.opt_in("tests.ops.twice", tf32=True).tf32
    with pytest.raises(ValueError, match="already opted in"):
        ops.opt_in("tests.ops.twice", fast_math=True)
    forged = ops.FloatSemantics(site="tests.ops.never_declared", tf32=True)
    with pytest.raises(ops.FloatSemanticsError, match="not declared"):
        ops.linear(torch.randn(2, 4), torch.randn(3, 4), fp=forged)
