"""``bench/unsort_rows.py``'s former loop form of the MoE combine under the interpreter: it gives the
unrolled kernel's bits (so the bench compares two forms of one sum). Inverse control: another row
order gives other sums."""

import pytest
import torch

pytest.importorskip("triton")

from bench import unsort_rows as U  # noqa: E402


def test_the_loop_form_gives_the_unrolled_kernels_bits():
    from v4stack.kernels import triton_route as tr

    T, k, E, D = 9, 6, 8, 96
    g = torch.Generator().manual_seed(4)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    _, _, rank, _, _ = tr.moe_route(idx, w, E, joined=True)
    o = torch.randn(T * (k + 1), D, generator=g).bfloat16()
    now = tr.moe_unsort_combine(o, rank, idx, None, torch.bfloat16, joined=True)
    assert torch.equal(U.unsort_loop(o, rank, idx), now)
    assert not torch.equal(U.unsort_loop(o, rank.flip(0), idx), now)
