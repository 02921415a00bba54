"""The grouped GEMM with a stream-K tail (``kernels/triton_grouped_sk.py``) and ``group_linear``
read in place (``triton_grouped_tma.group_linear_tma``), under the interpreter on the CPU and on
a Hopper GPU."""

import pytest
import torch

pytest.importorskip("triton")

from v4stack.kernels import triton_grouped_sk as sk  # noqa: E402
from v4stack.kernels import triton_grouped_tma as tma  # noqa: E402

SMALL = dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=2, RC=8)
WHOLE = dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=2)


def _case(counts, N=64, K=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), K, generator=g).bfloat16()
    w = (torch.randn(len(counts), N, K, generator=g) * 0.1).bfloat16()
    off = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
    return x, w, off


def _tiles(counts, N, bm, bn):
    return sum(-(-c // bm) for c in counts) * -(-N // bn)


def test_stream_k_tail_sums_each_split_tile_once():
    # 3 + 0 + 2 row tiles x 2 column tiles = 10 tiles of 4 K steps: with P programs, the last
    # 10 % P tiles are split along K over all P programs (runs crossing tile ends, programs
    # without a run when the tail has fewer steps than programs)
    counts = [70, 0, 37]
    x, w, off = _case(counts)
    ref = torch.cat([x[off[e]:off[e + 1]].float() @ w[e].float().T for e in range(3)])
    whole = tma.grouped_linear_tma(x, w, off, torch.empty(x.shape[0], 64, dtype=x.dtype), WHOLE)
    assert _tiles(counts, 64, 32, 32) == 10
    for P in (3, 4, 7, 13, 40):
        y = torch.full_like(whole, float("nan"))
        sk.grouped_linear_sk(x, w, off, y, SMALL, P=P)
        torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
        if 10 % P == 0:  # no tail: every tile whole, the TMA kernel's bits
            assert torch.equal(y, whole)


def test_a_split_tile_is_summed_in_k_order_and_whole_tiles_keep_their_chain():
    # K-order-sensitive rows, one value a K step of 32: 2^24, 1, 1, -2^24. A fp32 chain from zero loses
    # both ones (2^24 + 1 rounds to 2^24): 0. One expert, 2 row tiles x 1 column tile, 8 K steps in all.
    # P = 2: both tiles whole (the chain). P = 3: both tiles in the tail, runs [0, 2) [2, 5) [5, 8) -
    # tile 0 is (2^24 + 1) + (1 - 2^24) = 1, tile 1 is 2^24 + (1 + 1 - 2^24) = 2 (the inverse control:
    # the split is real, and its partials are summed once each)
    K = 128
    xk = torch.zeros(64, K)
    xk[:, 0], xk[:, 32], xk[:, 64], xk[:, 96] = 2.0 ** 24, 1.0, 1.0, -2.0 ** 24
    x = xk.bfloat16()
    w = torch.ones(1, 32, K, dtype=torch.bfloat16)
    off = torch.tensor([0, 64])
    y2 = sk.grouped_linear_sk(x, w, off, torch.empty(64, 32, dtype=x.dtype), SMALL, P=2)
    y3 = sk.grouped_linear_sk(x, w, off, torch.empty(64, 32, dtype=x.dtype), SMALL, P=3)
    assert (y2 == 0).all()
    assert (y3[:32] == 1).all() and (y3[32:] == 2).all()
    # the whole-tile kernel agrees with P = 2
    assert torch.equal(tma.grouped_linear_tma(x, w, off, torch.empty_like(y2), WHOLE), y2)


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


@pytest.mark.gpu
def test_on_the_gpu_the_stream_k_tail_matches_the_whole_tiles_at_flash4_widths():
    # flash4 batch 256: 9 experts (the shared one joined), 1792 rows; gate N 2048 K 4096 and down N 4096
    # K 2048: split tiles within bf16 rounding of the whole-K chains, whole tiles bit-equal,
    # and the same bits on a second call and inside a CUDA graph
    from bench.grouped_tiles import routed

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs Hopper")
    gen = torch.Generator().manual_seed(0)
    for N, K in ((2048, 4096), (4096, 2048)):
        x, off, _ = routed(256, 9, K, "cuda", gen, shared=True)
        w = (torch.randn(9, N, K, device="cuda") * 0.02).to(torch.bfloat16)
        ref = tma.grouped_linear_tma(x, w, off, torch.empty(x.shape[0], N, device="cuda", dtype=x.dtype),
                                     dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3))
        y = sk.grouped_linear_sk(x, w, off, torch.empty_like(ref))
        torch.cuda.synchronize()
        torch.testing.assert_close(y.float(), ref.float(), atol=1e-2, rtol=1e-2)
        differ = (y != ref).any(dim=1)
        assert differ.any() and not differ.all()  # some tiles split (the tail), most whole
        assert torch.equal(sk.grouped_linear_sk(x, w, off, torch.empty_like(ref)), y)
        graph, out = torch.cuda.CUDAGraph(), torch.empty_like(ref)
        with torch.cuda.graph(graph):
            sk.grouped_linear_sk(x, w, off, out)
        for _ in range(3):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, y)


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
