"""The indexer's choice in one kernel (``kernels/triton_select.py``): under Triton's interpreter the
kernel equals the torch composition (stable top-k, entry order, the pool rows) with ties, signed
zeros, hidden entries and fewer entries than ``k``; the CPU dispatch runs the composition; on CUDA
the kernel serves both modes with the same integers."""

import pytest
import torch

from v4stack import ops
from v4stack.ops import fused

ts = pytest.importorskip("v4stack.kernels.triton_select")


def _case(n, E, k, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, E, generator=g)
    s[:, ::5] = 0.0  # ties at zero ...
    s[0, 1::7] = -0.0  # ... of both signs (a sort compares them equal)
    s[1 % n, : E // 2] = 1.5  # a long run of ties at the top
    rows = torch.randint(0, 10 * E, (n, E), generator=g)
    rows[:, E // 3 : E // 3 + 3] = -1  # hidden entries
    rows[-1, k // 2 :] = -1  # a query with fewer entries than k
    return s, rows


@pytest.mark.parametrize("n,E,k", [(3, 40, 8), (5, 100, 32), (2, 7, 7), (4, 600, 512), (3, 4608, 512)])
def test_topk_rows_kernel_is_the_stable_top_k_in_entry_order(n, E, k):
    s, rows = _case(n, E, k, seed=n + E)
    got = ts.topk_rows(s, rows, k)
    want = fused.topk_rows_reference(s, rows, k)
    assert torch.equal(got, want)
    assert (got[-1] == -1).any()  # the short query's missing entries come out as -1
    if k == E:  # every entry is chosen: ties cannot matter
        return
    # inverse control: ties broken towards the later entry choose other rows
    flip = torch.flip(s, [1]).masked_fill(torch.flip(rows, [1]) < 0, float("-inf"))
    _, idx = ops.topk(flip, k, stable=True)
    later = rows.gather(1, torch.sort(E - 1 - idx, dim=1).values)
    assert not torch.equal(later, want)


def test_topk_rows_cpu_call_is_the_composition():
    s, rows = _case(2, 50, 10, seed=1)
    ops.reset_counters()
    out = fused.topk_rows(s, rows, 10)
    assert ops.counters()["topk_rows"] == {"torch_composite": 1}
    assert torch.equal(out, fused.topk_rows_reference(s, rows, 10))


@pytest.mark.gpu
def test_topk_rows_on_cuda_serves_the_kernel_in_both_modes():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    s32, rows = _case(64, 4100, 512, seed=3)
    rows = rows.cuda()
    for s in (s32.cuda(), s32.bfloat16().cuda()):  # bf16: the search over the keys' top 16 bits
        want = fused.topk_rows_reference(s.cpu(), rows.cpu(), 512)
        for mode in ("invariant", "fast"):
            with ops.mode(mode):
                ops.reset_counters()
                got = fused.topk_rows(s, rows, 512)
                assert ops.counters()["topk_rows"] == {"triton_topk_rows": 1}
                assert torch.equal(got.cpu(), want)


def test_select_kernels_build_for_hopper():
    """``kernels/builds.py``: the top-k (one bit a pass on fp32 scores; on bf16 at a 16k step's width
    two bits a pass, and one in two blocks), the indexer reading keys by index, the ids feed and the
    layout's read from the pinned staging compile for sm_90a."""
    from tests.ops.hopper import check, ptx

    got = ptx(("topk_rows", "topk_rows_bf16_wide", "topk_rows_bf16_pairs", "topk_rows_bf16_split", "indexer_scores",
               "feed_ids", "layout_in"))
    check(got)
    assert "wgmma.mma_async" in got["indexer_scores"]  # the indexer's dots on the tensor cores
    # the staging is rewritten by the host between a graph's replays: its loads fetch again (volatile)
    assert "ld.volatile.global" in got["layout_in"] and "ld.volatile" not in got["feed_ids"]


def test_split_top_k_fits_two_programs_an_sm():
    """Why a 16k step's row is held as 4096 + 512: at 4 warps (what the dispatch launches for a split
    row) its program fits twice in an SM's 65536 registers, where the 8192-wide one of 16 warps fits
    once (Triton's ptxas, no spills)."""
    from tests.ops.hopper import registers

    got = registers(("topk_rows_bf16_split", "topk_rows_bf16_wide"))
    split, wide = got["topk_rows_bf16_split"], got["topk_rows_bf16_wide"]
    assert split["spill_bytes"] == 0 and wide["spill_bytes"] == 0
    assert 2 * 128 * split["registers"] <= 65536 < 2 * 512 * wide["registers"]


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("split", [False, True])
def test_every_search_form_chooses_the_same_rows(bits, split):
    """The one-bit search (shipped), the two-bit one, each with the row in one block or in two (600
    entries as 512 + 128): the same choice, half scores too, and ties at the k-th score that run
    across the two blocks (every score equal: the first k entries)."""
    form = {"BITS": bits, "SPLIT": split}
    s, rows = _case(4, 600, 100, seed=9)
    want = fused.topk_rows_reference(s, rows, 100)
    assert torch.equal(ts.topk_rows(s, rows, 100, tile=form), want)
    sb = s.bfloat16()
    assert torch.equal(ts.topk_rows(sb, rows, 100, tile=form), fused.topk_rows_reference(sb, rows, 100))
    flat = torch.zeros(3, 600)
    flat[1, 550:] = 1.0  # the tail block's entries above the tied rest
    r = torch.arange(1800).view(3, 600)
    got = ts.topk_rows(flat, r, 530, tile=form)
    assert torch.equal(got, fused.topk_rows_reference(flat, r, 530))
    assert torch.equal(got[0], r[0, :530])  # the ties taken in entry order, across the blocks


def _last_bit_case(dtype, lsb):
    """Scores of ``dtype`` over several binades, both signs, ties, -0.0, hidden entries, and two
    entries ``1`` and ``1 + lsb`` (``lsb``: the dtype's last mantissa bit at 1.0), the larger one
    later, so a search that drops that bit ties them and keeps the earlier one."""
    g = torch.Generator().manual_seed(5)
    s = (torch.randn(3, 600, generator=g) * torch.logspace(-6, 3, 600)).to(dtype)
    s[:, ::7] = 0.0
    s[0, 3::11] = -0.0
    s[1, 100:160] = s[1, 99]  # a run of ties
    s[2, :] = -1.0
    s[2, 10], s[2, 20] = 1.0, 1.0 + lsb
    if dtype == torch.float16:
        s[0, 50:60] = torch.arange(1, 11) * 2.0 ** -24  # subnormals, widened to normal fp32 values
    rows = torch.arange(1800).view(3, 600)
    rows[0, 200:210] = -1  # hidden entries
    return s, rows


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype,lsb", [(torch.bfloat16, 2.0 ** -7), (torch.float16, 2.0 ** -10)])
def test_half_scores_search_only_their_significant_bits(bits, split, dtype, lsb, monkeypatch):
    """Half-width scores widen to fp32 with low bits that every score of a sign shares (16 for bf16,
    13 for fp16): the search drops them and chooses the same rows, for every form; inverse
    control: dropping more bits than the dtype leaves constant (18 / 14) ties scores the last bit
    told apart, and the earlier one is taken."""
    form = {"BITS": bits, "SPLIT": split, "SHIFT": True}
    for k in (1, 37, 100):
        s, rows = _last_bit_case(dtype, lsb)
        want = fused.topk_rows_reference(s, rows, k)
        assert torch.equal(ts.topk_rows(s, rows, k, tile=form), want)
    assert ts._SHIFTS[dtype] == (16 if dtype == torch.bfloat16 else 13)
    s, rows = _last_bit_case(dtype, lsb)
    want = fused.topk_rows_reference(s, rows, 1)
    assert want[2, 0] == rows[2, 20]
    monkeypatch.setitem(ts._SHIFTS, dtype, 18 if dtype == torch.bfloat16 else 14)
    got = ts.topk_rows(s, rows, 1, tile=form)
    assert got[2, 0] == rows[2, 10]  # the two tied: the earlier one taken


def test_the_two_bit_search_covers_an_odd_key_width():
    """Keys of an odd width (fp16's scores less their 13 constant bits: 19) leave the
    two-bit search's pairs one bit short; starting the first pair a bit above the keys, its last pair
    still takes bit 0. Two tied scores whose last bit is set, k = 1: the composition's one entry, and
    nothing written past k (a wider output holds a sentinel there). Without the odd start the search
    ends with that bit clear, counts both ties above it and writes two rows: this test fails."""
    from v4stack.kernels.launch import launch

    s = torch.full((2, 64), -1.0, dtype=torch.float16)
    s[0, 10] = s[0, 20] = 1.0 + 2.0 ** -10  # the last fp16 bit set
    s[0, 30] = 1.0
    s[1, 5] = 2.0
    rows = torch.arange(128).view(2, 64)
    want = fused.topk_rows_reference(s, rows, 1)
    assert want[0, 0] == 10
    for bits in (1, 2):
        out = torch.full((2, 3), -7, dtype=torch.int64)
        launch(ts.topk_rows_kernel, (2,), s, rows, out, 64, 1, s.stride(0), rows.stride(0), out.stride(0), EB=64,
               BITS=bits, EBT=0, SHIFT=13, num_warps=4)
        assert torch.equal(out[:, :1], want) and (out[:, 1:] == -7).all(), (bits, out)
