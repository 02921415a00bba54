"""``group_linear`` read in place (``triton_grouped_tma.group_linear_tma``, invariant mode's ``wo_a``
on Hopper): each group's rows read from the queries' layout, the gathered rows' bits."""

import pytest
import torch

pytest.importorskip("triton")

from v4stack.kernels import triton_grouped_tma as tma  # noqa: E402


def test_group_linear_read_in_place_gives_the_gathered_rows_bits():
    # group g's rows x[:, g] read from column g K of x viewed as [T, G K]: the bits of the grouped GEMM
    # on the gathered rows (the former path), at a tile that does not divide T
    from v4stack.kernels import triton_grouped as tgr

    g = torch.Generator().manual_seed(1)
    T, G, K, N = 45, 3, 64, 48
    x = torch.randn(T, G, K, generator=g).bfloat16()
    w = (torch.randn(G, N, K, generator=g) * 0.1).bfloat16()
    t = dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=2)
    assert tma.group_usable(x, w, 32)
    y = tma.group_linear_tma(x, w, t)
    rows = x.transpose(0, 1).reshape(G * T, K)
    off = torch.arange(0, (G + 1) * T, T)
    gathered = tgr.grouped_linear(rows, w, off, dict(t, tma=True)).view(G, T, N).transpose(0, 1).reshape(T, G * N)
    assert torch.equal(y, gathered)
    # inverse control: the groups' columns swapped give other columns
    assert not torch.equal(tma.group_linear_tma(x.flip(1).contiguous(), w, t), y)
    assert not tma.group_usable(x, w, 128)  # K not a multiple of the box: refused
    assert not tma.group_usable(x.transpose(0, 1).contiguous().transpose(0, 1), w, 32)  # strided rows: refused


@pytest.mark.gpu
def test_on_the_gpu_group_linear_in_place_gives_the_gathered_rows_bits_at_flash_widths():
    # invariant wo_a at batch 256 and 64 (8 groups, K 4096, N 1024): the in-place read at the tile it ships
    # with and at the grouped table's tiles, bit for bit against the gathered rows' path
    from v4stack import ops
    from v4stack.kernels.fused_gpu import GROUP_TILE, group_linear_inplace, group_linear_inplace_ok, group_linear_rows

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper")
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in (256, 64):
        x = torch.randn(T, 8, 4096, device="cuda", generator=g).bfloat16()
        w = (torch.randn(8, 1024, 4096, device="cuda", generator=g) * 0.02).bfloat16()
        with ops.mode("invariant"):
            ref = group_linear_rows(x, w)
            assert group_linear_inplace_ok(x, w) and torch.equal(group_linear_inplace(x, w), ref)
            for t in (GROUP_TILE, dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3)):
                assert torch.equal(tma.group_linear_tma(x, w, t), ref), t
            # inverse control: another group's weights give other columns
            assert not torch.equal(tma.group_linear_tma(x, w.roll(1, 0).contiguous(), GROUP_TILE), ref)
