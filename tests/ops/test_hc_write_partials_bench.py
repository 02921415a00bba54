"""``bench/hc_write_partials.py``'s candidate (the mHC write with the next coefficients' partials, all
four output streams a program) under the interpreter: the streams ``hc_write`` writes, and the
coefficients and input of those streams as the engine's pair computes them at the same K steps.
Inverse control: another sublayer's output writes other streams."""

import pytest
import torch

pytest.importorskip("triton")

from bench import hc_write_partials as H  # noqa: E402

SMALL = dict(BM=16, KC=32, BK=16, num_warps=4, num_stages=1)


def test_the_candidate_writes_the_streams_and_their_coefficients():
    args = H.case(13, 64, "cpu", seed=3)
    got = H.write_pre_read_norm(*args, tile=SMALL)
    ref = H.pair(*args, tile=SMALL)  # the pair at the same K steps
    torch.testing.assert_close(got[0].float(), ref[0].float(), atol=0, rtol=2 ** -7)  # bf16 of one fp32 sum
    c = H.compare(got, ref)
    assert c["post_max_diff"] < 1e-5 and c["comb_max_diff"] < 1e-5 and c["input_max_diff"] < 5e-2, c
    x, out, *rest = args
    other = H.write_pre_read_norm(x, out.flip(0), *rest, tile=SMALL)
    assert not torch.equal(other[0], got[0])
