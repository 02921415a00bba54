"""``bench/indexer_fp8.py``'s candidate (the indexer's scores over e4m3 keys with a scale a key) under
the interpreter: its scores are those of the dequantised keys in fp32, a missing entry scores -inf,
and the quantisation keeps each key within e4m3's step. Inverse controls: other scales give other
scores, and the quantised keys are not the keys."""

import pytest
import torch

pytest.importorskip("triton")

from bench import indexer_fp8 as X  # noqa: E402

SMALL = dict(BS=16, num_warps=4, num_stages=1)


def test_the_candidate_scores_the_dequantised_keys():
    q, w, keys, rows = X.case(3, 40, "cpu", H=8, D=32, seed=2)
    rows = rows.clone()
    rows[1, 7] = -1  # no entry there
    k8, ks = X.quantize(keys)
    got = X.scores_fp8(q, w, k8, ks, rows, SMALL)
    want = X.reference(q, w, k8, ks, rows)
    assert torch.isinf(got[1, 7]) and got[1, 7] < 0
    ok = torch.isfinite(want)
    torch.testing.assert_close(got[ok], want[ok], rtol=1e-5, atol=1e-6)
    assert not torch.equal(X.scores_fp8(q, w, k8, ks * 2, rows, SMALL), got)


def test_the_keys_keep_within_e4m3s_step_and_a_zero_key_stays_zero():
    _, _, keys, _ = X.case(1, 64, "cpu", H=8, D=32, seed=5)
    keys = keys.clone()
    keys[3] = 0
    k8, ks = X.quantize(keys)
    back = k8.float() * ks[:, None]
    assert torch.equal(back[3], torch.zeros_like(back[3])) and ks[3] == 1
    # e4m3 keeps 3 mantissa bits: a value within 1/16 of its magnitude, or the subnormal step near 0
    err = (back - keys.float()).abs()
    assert bool((err <= keys.float().abs() / 16 + ks[:, None] * 2.0 ** -9).all())
    assert float(err.max()) > 0  # not the identity


def test_overlap_counts_the_kept_entries():
    a = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    assert X.overlap(a, a, 2) == 1.0
    assert X.overlap(a, torch.tensor([[5.0, 1.0, 3.0, 2.0, 4.0]]), 2) == 0.5

