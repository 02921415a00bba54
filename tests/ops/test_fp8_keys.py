"""V4's packed indexer keys (``ops/fp8_keys.py``): exact for keys under V4's activation rounding,
scored as their unpacked values by the references of both modes and by the Triton kernel (under
the interpreter on the CPU). Inverse controls: keys that were not rounded do not survive packing,
and a changed exponent or code byte changes the scores."""

import pytest
import torch

from v4stack import ops
from v4stack.model.quant import IndexRounding, fp4_round
from v4stack.ops import fp8_keys

g = torch.Generator().manual_seed(3)


def rounded_keys(n: int, d: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Keys as V4's indexer compressor leaves them under the rounding, over twelve decades of size,
    with an all-zero key and a key with one zero block."""
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.logspace(-6, 6, n, dtype=torch.float64)[:, None]
    x[2] = 0
    x[4, : min(d, 32)] = 0
    x = x.to(dtype)
    # a width that is no power of two (no rotation): the rounding's blocks, the last one narrower
    return IndexRounding()(x) if d & (d - 1) == 0 else fp4_round(x)


@pytest.mark.parametrize("d", [128, 64, 16, 48])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rounded_keys_pack_exactly(d, dtype):
    k = rounded_keys(300, d, dtype)
    p = fp8_keys.pack(k)
    assert p.dtype == torch.uint8 and p.shape == (300, fp8_keys.width(d)) and fp8_keys.holds(p, d)
    assert torch.equal(fp8_keys.unpack(p, dtype, d), k)
    assert not p[:, d + fp8_keys.blocks(d):].any()  # the alignment's bytes are zeros
    # control: keys that did not pass the rounding keep more bits than e4m3 holds
    raw = torch.randn(300, d, generator=g).to(dtype)
    assert not torch.equal(fp8_keys.unpack(fp8_keys.pack(raw), dtype, d), raw)


def test_v4_width_is_the_reports_132_bytes_aligned_to_16():
    assert fp8_keys.width(128) == 144 and 128 + fp8_keys.blocks(128) == 132
    for d in range(1, 300):
        w = fp8_keys.width(d)
        assert w % 16 == 0 and d + fp8_keys.blocks(d) <= w < d + fp8_keys.blocks(d) + 16


def _case(T=5, H=8, d=32, N=90, E=300, dtype=torch.bfloat16):
    q = torch.randn(T, H, d, generator=g).to(dtype)
    w = torch.randn(T, H, generator=g).to(dtype)
    pool = rounded_keys(N, d, dtype) * 1024  # a power of two keeps them on the grid
    rows = torch.randint(0, N, (T, E), generator=g)
    rows[:, 60:] = -1
    rows[1, :5] = -1
    return q, w, pool, rows


@pytest.mark.parametrize("mode", ["invariant", "fast"])
def test_references_score_packed_pools_as_their_values(mode):
    q, w, pool, rows = _case()
    packed = fp8_keys.pack(pool)
    with ops.mode(mode):
        want = ops.indexer_scores(q, w, pool, rows=rows)
        got = ops.indexer_scores(q, w, packed, rows=rows)
        assert torch.equal(got, want)
        bad = packed.clone()
        bad[rows[0, 0], 32] += 1  # its block's scale doubled (the exponent byte after 32 codes)
        assert not torch.equal(ops.indexer_scores(q, w, bad, rows=rows), want)
    with pytest.raises(ValueError, match="pool"):
        ops.indexer_scores(q, w, packed[:, :-1], rows=rows)  # a row of no key width's bytes


def test_the_triton_kernel_reads_packed_keys_with_the_pools_bits():
    tg = pytest.importorskip("v4stack.kernels.triton_gemm")
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter without a GPU
    q, w, pool, rows = (t.to(dev) for t in _case())
    packed = fp8_keys.pack(pool)
    want = tg.indexer_scores(q, w, pool, rows)
    got = tg.indexer_scores(q, w, packed, rows)
    assert torch.equal(got, want)  # the same MMA on the same key values
    assert bool((got[rows < 0] == float("-inf")).all())
    bad = packed.clone()
    bad[rows[0, 0], 0] ^= 0x08  # one code's lowest exponent bit
    assert not torch.equal(tg.indexer_scores(q, w, bad, rows), want)


@pytest.mark.parametrize("d", [128, 16])
def test_the_pack_kernel_writes_the_compositions_bytes(d):
    tr = pytest.importorskip("v4stack.kernels.triton_ring")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    keys = torch.cat((rounded_keys(40, d), torch.randn(40, d, generator=g).bfloat16() * 3)).to(dev)
    keys[7] = 0
    dest = torch.randperm(100, generator=g)[:80].to(dev)
    want = torch.zeros(100, fp8_keys.width(d), dtype=torch.uint8, device=dev)
    want[dest] = fp8_keys.pack(keys)
    got = torch.zeros_like(want)
    tr.pack_keys_into(keys, got, dest)
    assert torch.equal(got, want)  # raw keys (rounding ties) and rounded ones, a zero key, scattered rows
    assert torch.equal(fp8_keys.unpack(got[dest[:40]], keys.dtype, d), keys[:40])
    other = torch.zeros_like(want)
    tr.pack_keys_into(keys * 2, other, dest)  # control: other keys, other bytes
    assert not torch.equal(other, want)


def test_aligned_rows_keep_the_indexer_kernel_in_its_registers():
    """The packed rows are padded to a multiple of 16 bytes so the decode launch's key stride is:
    built for sm_90a as that launch runs, the indexer over packed keys takes the bf16 kernel's
    registers and does not spill; control: with 132-byte rows (no aligned stride) it spills."""
    pytest.importorskip("triton")
    from tests.ops.hopper import registers

    got = registers(("indexer_scores_decode", "indexer_scores_fp8", "indexer_scores_fp8_132"))
    assert got["indexer_scores_fp8"]["spill_bytes"] == 0
    assert got["indexer_scores_fp8"]["registers"] <= got["indexer_scores_decode"]["registers"] + 8
    assert got["indexer_scores_fp8_132"]["spill_bytes"] > 0
    assert fp8_keys.width(128) % 16 == 0
