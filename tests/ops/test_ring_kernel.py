"""The decode step's ring writes under Triton's interpreter: the compressor's rows
(``kernels/triton_ring.py``) and the window's rotated rows (``triton_mhc.rope_into``) hold the
composition's bits, and a paged decode through them equals one without them."""

import pytest
import torch

from tests.ops.hopper import check, ptx
from v4stack import ops
from v4stack.ops import fused

tk = pytest.importorskip("v4stack.kernels.triton_ring")


def _case(N=5, W=1100, ratio=4, S=6, R=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(N, W, generator=g).bfloat16()
    score = torch.randn(N, W, generator=g).bfloat16()
    ape = torch.randn(ratio, W, generator=g)
    pos = torch.randint(0, 1000, (N,), generator=g)
    dest = torch.randperm(S * R, generator=g)[:N]
    rings = [torch.randn(S, R, W, generator=g) for _ in range(2)]
    return kv, score, ape, pos, dest, rings


def test_tail_write_kernel_writes_the_composition_bits():
    kv, score, ape, pos, dest, rings = _case()
    got = [r.clone() for r in rings]
    tk.tail_write(kv, score, ape, pos, 4, got[0], got[1], dest)
    want = [r.clone() for r in rings]
    for m in ("fast", "invariant"):
        with ops.mode(m):
            fused.tail_write(kv, score, ape, pos, 4, want[0], want[1], dest, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    untouched = torch.ones(6 * 8, dtype=torch.bool)
    untouched[dest] = False
    assert torch.equal(got[0].view(48, -1)[untouched], rings[0].view(48, -1)[untouched])
    # inverse control: another position in the block adds another ape row
    other = [r.clone() for r in rings]
    tk.tail_write(kv, score, ape, pos + 1, 4, other[0], other[1], dest)
    assert torch.equal(other[0], got[0]) and not torch.equal(other[1], got[1])


def test_rope_into_kernel_writes_the_rotation_bits():
    tm = pytest.importorskip("v4stack.kernels.triton_mhc")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 192, generator=g).bfloat16()  # 128 channels copied, 64 rotated
    pos = torch.randint(0, 5000, (5,), generator=g)
    freqs = 1.0 / (1e4 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    pool = torch.randn(12, 192, generator=g).bfloat16()
    dest = torch.tensor([7, 0, 11, 3, 4])
    want = pool.clone()
    want.index_copy_(0, dest, tm.rope(x, pos, freqs, False))
    got = pool.clone()
    tm.rope_into(x, pos, freqs, got, dest)
    assert torch.equal(got, want)
    ref = pool.clone()
    fused.rope_into(x, pos, freqs, ref, dest)  # the CPU composition
    torch.testing.assert_close(ref.float(), got.float(), atol=0, rtol=2 ** -7)  # (the interpreter truncates bf16)
    # inverse control: the rows land where dest says
    assert not torch.equal(got[dest], pool[dest]) and torch.equal(got[1], pool[1])


def test_tail_write_cpu_call_is_the_composition_and_the_kernel_builds():
    kv, score, ape, pos, dest, rings = _case(N=2, W=16)
    ops.reset_counters()
    fused.tail_write(kv, score, ape, pos, 4, rings[0], rings[1], dest, torch.float32)
    assert ops.counters()["tail_write"] == {"torch_composite": 1}
    from v4stack.kernels.fused_gpu import tail_write_ok

    assert not tail_write_ok(kv, score, ape, pos, 4, rings[0], rings[1], dest, torch.float32)
    built = ptx(("tail_write", "rope_dest0", "rope_dest1", "rope_inplace", "rope_inplace_nobarrier", "rope_pair",
                 "rope_pair_nobarrier"))
    check(built)  # sm_90a, the declared float semantics
    # the in-place rotation waits for every load of its block before it stores: one barrier more
    # than the same kernel built without it (the pairs' layout changes go through shared memory
    # with barriers of their own, which order only the threads' shared-memory traffic)
    n = built["rope_inplace"].count("bar.sync")
    assert n >= 1 and n == built["rope_inplace_nobarrier"].count("bar.sync") + 1
    # and so does the pair's in-place branch (the launch that also rotates the window rows into the ring)
    assert built["rope_pair"].count("bar.sync") == built["rope_pair_nobarrier"].count("bar.sync") + 1


@pytest.fixture
def ring_kernel_on_cpu(monkeypatch):
    from v4stack.ops import dispatch

    monkeypatch.setattr(dispatch, "_table", {k: list(v) for k, v in dispatch._table.items()})

    def run(kv, score, ape, pos, ratio, rk, rs, dest, cd):
        assert cd == torch.float32
        return tk.tail_write(kv, score, ape, pos, ratio, rk, rs, dest)

    dispatch.register("tail_write", "triton_tail_write", run, device="cpu", first=True)
    # the rotation through its kernel in both runs (the interpreter rounds bf16 its own way), and
    # the window rows rotated straight into the ring in one of them
    tm = pytest.importorskip("v4stack.kernels.triton_mhc")
    dispatch.register("rope", "triton_rope", tm.rope, device="cpu", first=True)
    dispatch.register("rope_into", "triton_rope_into", tm.rope_into, device="cpu", first=True)
    yield
    dispatch._resolved.clear()


@torch.no_grad()
def test_paged_decode_through_the_ring_kernel_keeps_the_bits(ring_kernel_on_cpu):
    """Prefill, then decode steps with the compressors' rows written by the kernel: the logits and
    the bytes the cache counts equal a run without it (``tests/model/test_paged.py`` holds the
    composition to the reference paths)."""
    from v4stack.config import preset
    from v4stack.model import V4Model
    from v4stack.ops import dispatch
    from v4stack.serve.cache import CacheManager
    from v4stack.serve.model_runner import ModelRunner

    model = V4Model(preset("tiny"), seed=3).eval().cast(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (21, 14)]

    def drive():
        cm = CacheManager(model.cfg, model.dtype, n_blocks=16, n_slots=2)
        runner = ModelRunner(model, cm)
        rcs = [cm.admit(s[:6]) for s in seqs]
        for rc in rcs:
            assert cm.reserve(rc, 6)
        outs, written = [runner.run([(rc, s[:6]) for rc, s in zip(rcs, seqs)])], []
        for p in range(6, 9):  # decode steps; a ratio 4 entry closes at position 7
            for rc in rcs:
                assert cm.reserve(rc, 1)
            outs.append(runner.run([(rc, [s[p]]) for rc, s in zip(rcs, seqs)]))
            written.append(runner.last_bytes)
        return outs, written

    ops.reset_counters()
    got, bytes1 = drive()
    assert ops.counters()["tail_write"].get("triton_tail_write", 0) >= 3
    assert ops.counters()["rope_into"].get("triton_rope_into", 0) >= 3
    saved = dispatch._table
    dispatch._table = {k: [i for i in v if i.name not in ("triton_tail_write", "triton_rope_into")]
                       for k, v in saved.items()}
    dispatch._resolved.clear()
    try:
        ops.reset_counters()
        want, bytes2 = drive()
        assert ops.counters()["tail_write"] == {"torch_composite": ops.counters()["tail_write"]["torch_composite"]}
        assert "triton_rope_into" not in ops.counters()["rope_into"]
    finally:
        dispatch._table = saved
        dispatch._resolved.clear()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert bytes1 == bytes2 and min(bytes1) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tail_write_on_cuda_equals_the_composition_in_both_modes():
    from v4stack.kernels import fused_gpu

    kv, score, ape, pos, dest, rings = (t.cuda() if isinstance(t, torch.Tensor) else [r.cuda() for r in t]
                                        for t in _case(N=40, W=1024, S=64, R=16))
    for m in ("fast", "invariant"):
        with ops.mode(m):
            got = [r.clone() for r in rings]
            ops.reset_counters()
            fused.tail_write(kv, score, ape, pos, 4, got[0], got[1], dest, torch.float32)
            assert ops.counters()["tail_write"] == {"triton_tail_write": 1}
            want = [r.clone() for r in rings]
            fused.tail_write_reference(kv, score, ape, pos, 4, want[0], want[1], dest, torch.float32)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not {k: v for k, v in fused_gpu.refused.items() if k in ("tail_write", "rope_into")}, fused_gpu.refused  # this file's kernels (the record is per process)
    x = torch.randn(40, 512, device="cuda").bfloat16()
    pos2 = torch.randint(0, 100000, (40,), device="cuda")
    freqs = (1.0 / (1e4 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))).cuda()
    pool = torch.randn(256, 512, device="cuda").bfloat16()
    rows = torch.randperm(256, device="cuda")[:40]
    for m in ("fast", "invariant"):
        with ops.mode(m):
            got, want = pool.clone(), pool.clone()
            ops.reset_counters()
            fused.rope_into(x, pos2, freqs, got, rows)
            assert ops.counters()["rope_into"] == {"triton_rope_into": 1}
            want.index_copy_(0, rows, fused.rope(x, pos2, freqs))
            assert torch.equal(got, want)
    assert not {k: v for k, v in fused_gpu.refused.items() if k in ("tail_write", "rope_into")}, fused_gpu.refused  # this file's kernels (the record is per process)


def test_rope_inplace_kernel_keeps_the_rotation_bits_and_touches_only_the_tail():
    tm = pytest.importorskip("v4stack.kernels.triton_mhc")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 3, 192, generator=g).bfloat16()  # [T, heads, D]: 128 channels kept, 64 rotated
    pos = torch.randint(0, 5000, (6,), generator=g)
    freqs = 1.0 / (1e4 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    for inverse in (False, True):
        want = tm.rope(x, pos, freqs, inverse)
        got = x.clone()
        assert tm.rope_(got, pos, freqs, inverse) is got
        assert torch.equal(got, want)
        assert torch.equal(got[..., :128], x[..., :128])  # the head channels are not rewritten
        # inverse control: the other direction gives other bits in the tail
        assert not torch.equal(tm.rope_(x.clone(), pos, freqs, not inverse)[..., 128:], want[..., 128:])
    ref = x.clone()
    fused.rope_(ref, pos, freqs, False)  # the CPU composition, in place
    torch.testing.assert_close(ref.float(), tm.rope(x, pos, freqs, False).float(), atol=0, rtol=2 ** -7)


def test_rope_pair_kernel_is_the_two_rotations():
    """A decode step's queries rotated in place and its window rows rotated into their ring rows in
    one launch: the bits of ``rope_`` and ``rope_into``'s kernels. Inverse controls: the queries'
    head channels are not rewritten, and ring rows not named by ``dest`` are left as they were."""
    tm = pytest.importorskip("v4stack.kernels.triton_mhc")
    g = torch.Generator().manual_seed(6)
    T = 5
    q = torch.randn(T, 3, 192, generator=g).bfloat16()  # [T, heads, D]: 128 channels kept, 64 rotated
    kv = torch.randn(T, 192, generator=g).bfloat16()
    pos = torch.randint(0, 5000, (T,), generator=g)
    freqs = 1.0 / (1e4 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    pool = torch.randn(12, 192, generator=g).bfloat16()
    dest = torch.tensor([7, 0, 11, 3, 4])
    for table in (None, tm.rope_table(pos, freqs)):
        want_q, want_pool = tm.rope_(q.clone(), pos, freqs, False, table), pool.clone()
        tm.rope_into(kv, pos, freqs, want_pool, dest, table)
        got_q, got_pool = q.clone(), pool.clone()
        assert tm.rope_pair(got_q, kv, pos, freqs, got_pool, dest, table) is got_q
        assert torch.equal(got_q, want_q) and torch.equal(got_pool, want_pool)
        assert torch.equal(got_q[..., :128], q[..., :128]) and not torch.equal(got_q, q)
        assert torch.equal(got_pool[1], pool[1]) and not torch.equal(got_pool[dest], pool[dest])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rope_pair_on_cuda_is_the_two_rotations_at_flash_widths():
    """Through the dispatch at flash widths (queries [T, 64, 512], window rows [T, 512], bf16): the
    pair's one launch gives the two rotations' bits, T from 1 to 256, with and without the table."""
    from v4stack.kernels import fused_gpu

    freqs = (1.0 / (1e4 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))).cuda()
    ops.reset_counters()
    for T in (1, 3, 64, 256):
        q = torch.randn(T, 64, 512, device="cuda").bfloat16()
        kv = torch.randn(T, 512, device="cuda").bfloat16()
        pos = torch.randint(0, 100000, (T,), device="cuda")
        pool = torch.randn(2 * T + 3, 512, device="cuda").bfloat16()
        dest = torch.randperm(2 * T + 3, device="cuda")[:T]
        for table in (None, fused.rope_table(pos, freqs)):
            want_q, want_pool = fused.rope_(q.clone(), pos, freqs, False, table), pool.clone()
            fused.rope_into(kv, pos, freqs, want_pool, dest, table)
            got_q, got_pool = q.clone(), pool.clone()
            fused.rope_pair(got_q, kv, pos, freqs, got_pool, dest, table)
            assert torch.equal(got_q, want_q) and torch.equal(got_pool, want_pool), (T, table is None)
    assert ops.counters()["rope_pair"] == {"triton_rope_pair": 8}
    assert not {k: v for k, v in fused_gpu.refused.items() if k.startswith("rope")}, fused_gpu.refused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rope_inplace_on_cuda_keeps_the_rotation_bits_at_flash_widths():
    """A decode step's queries / outputs ([T, 64 heads, 512], bf16) rotated in place through the
    dispatch hold exactly ``rope``'s bits, in both directions, for T from 1 to 512, and the head
    channels are not rewritten; neither rotation is refused (from be8757e to 8813765 the light
    launcher refused the copying forms' calls, their torch compositions served while the in-place
    one ran its kernel, and the flash4 model check differed in 23 of 47 steps). Inverse control: the
    other direction gives other bits in the tail."""
    from v4stack.kernels import fused_gpu

    freqs = (1.0 / (1e4 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))).cuda()
    ops.reset_counters()
    for T in (1, 3, 8, 64, 256, 512):
        for H in (64, 8, 1):
            x = torch.randn(T, H, 512, device="cuda").bfloat16()
            pos = torch.randint(0, 100000, (T,), device="cuda")
            for inverse in (False, True):
                want = fused.rope(x, pos, freqs, inverse)
                got = x.clone()
                assert fused.rope_(got, pos, freqs, inverse) is got
                assert torch.equal(got, want), (T, H, inverse)
                assert torch.equal(got[..., :448], x[..., :448])
                assert not torch.equal(fused.rope_(x.clone(), pos, freqs, not inverse)[..., 448:], want[..., 448:])
    assert ops.counters()["rope_"] == {"triton_rope_inplace": 6 * 3 * 2 * 2}
    assert ops.counters()["rope"] == {"triton_rope": 6 * 3 * 2}
    assert not {k: v for k, v in fused_gpu.refused.items() if k.startswith("rope")}, fused_gpu.refused


@pytest.mark.parametrize("m,coff", [(4, 2), (16, 1), (4, 1)])
def test_closing_rows_kernel_reads_the_composition_rows(m, coff):
    """The rows closing entries pool, read from the tail rings by one kernel: equal to the
    composition (positions before 0 as 0 / -inf, the overlapped halves), for entries at the start
    (entry 0: the previous block is padding) and later. Control: another request's ring gives other rows."""
    g = torch.Generator().manual_seed(m + coff)
    S, c = 5, 24
    R = coff * m
    kv_pool, score_pool = torch.randn(S * R, coff * c, generator=g), torch.randn(S * R, coff * c, generator=g)
    slots = torch.tensor([3, 1, 4, 0])
    seq, entry = torch.tensor([0, 2, 3, 0]), torch.tensor([0, 5, 11, 0])
    lookback = m if coff == 2 else 0
    got = tk.closing_rows(kv_pool, score_pool, slots, seq, entry, R, m, lookback, coff, c)
    want = fused.closing_rows_reference(kv_pool, score_pool, slots, seq, entry, R, m, lookback, coff, c)
    assert all(a.shape == (4, coff * m, c) and torch.equal(a, b) for a, b in zip(got, want))
    if coff == 2:  # entry 0 has no previous block
        assert bool((got[0][0, :m] == 0).all()) and bool((got[1][0, :m] == float("-inf")).all())
    for mode in ("fast", "invariant"):
        with ops.mode(mode):
            again = fused.closing_rows(kv_pool, score_pool, slots, seq, entry, R, m, lookback, coff, c)
        assert all(torch.equal(a, b) for a, b in zip(again, want))
    other = tk.closing_rows(kv_pool, score_pool, slots, torch.tensor([1, 2, 3, 1]), entry, R, m, lookback, coff, c)
    assert not torch.equal(other[0][0], got[0][0]) and torch.equal(other[0][2], got[0][2])


def test_closing_rows_builds_for_hopper():
    check(ptx(("closing_rows",)))


@torch.no_grad()
def test_paged_decode_captures_through_the_capture_kernel(monkeypatch):
    """Decode steps across a block's end (the tiny preset's 16 tokens): the boundary snapshots the
    capture kernel writes (every ring: window, compressor tails) and the entries closed from the rows
    the closing kernel reads, the logits and the bytes counted equal the compositions'. Control: the
    kernels ran (the dispatch counted them) and a snapshot was written (the pool's snapshots are not
    all their initial values)."""
    from v4stack.config import preset
    from v4stack.model import V4Model
    from v4stack.ops import dispatch
    from v4stack.serve.cache import CacheManager
    from v4stack.serve.model_runner import ModelRunner

    monkeypatch.setattr(dispatch, "_table", {k: list(v) for k, v in dispatch._table.items()})
    model = V4Model(preset("tiny"), seed=3).eval().cast(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (22, 19)]

    def drive():
        cm = CacheManager(model.cfg, model.dtype, n_blocks=16, n_slots=2, n_snapshots=4)
        runner = ModelRunner(model, cm)
        fresh = {k: [t.clone() for t in ts] for k, ts in cm.snap.tensors.items()}
        rcs = [cm.admit(s[:12]) for s in seqs]
        for rc in rcs:
            assert cm.reserve(rc, 12)
        outs, written = [runner.run([(rc, s[:12]) for rc, s in zip(rcs, seqs)])], []
        for p in range(12, 18):  # decode steps; position 16 ends block 0
            for rc in rcs:
                assert cm.reserve(rc, 1)
            outs.append(runner.run([(rc, [s[p]]) for rc, s in zip(rcs, seqs)]))
            written.append(runner.last_bytes)
        return outs, written, cm.snap.tensors, fresh

    dispatch.register("ring_capture", "triton_ring_capture", tk.ring_capture, device="cpu", first=True)
    dispatch.register("closing_rows", "triton_closing_rows", tk.closing_rows, device="cpu", first=True)
    dispatch._resolved.clear()
    ours = ("triton_ring_capture", "triton_closing_rows")
    try:
        ops.reset_counters()
        got, bytes1, snaps1, fresh = drive()
        assert ops.counters()["ring_capture"].get("triton_ring_capture", 0) >= 2
        assert ops.counters()["closing_rows"].get("triton_closing_rows", 0) >= 2
    finally:
        dispatch._table = {k: [i for i in v if i.name not in ours] for k, v in dispatch._table.items()}
        dispatch._resolved.clear()
    ops.reset_counters()
    want, bytes2, snaps2, _ = drive()
    assert "triton_ring_capture" not in ops.counters()["ring_capture"]
    assert "triton_closing_rows" not in ops.counters()["closing_rows"]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert bytes1 == bytes2
    assert all(torch.equal(a, b) for k in snaps1 for a, b in zip(snaps1[k], snaps2[k]))
    assert any(not torch.equal(a, b) for k in snaps1 for a, b in zip(snaps1[k], fresh[k]))


@pytest.mark.parametrize("dtype,fill,R,D", [(torch.bfloat16, 0.0, 16, 300), (torch.float32, float("-inf"), 8, 40)])
def test_ring_capture_kernel_writes_the_composition_snapshots(dtype, fill, R, D):
    """Boundary captures of a decode step (``Rings.capture``): each capture's ring, as it stood at
    its position, into its snapshot slot - in one kernel, with the composition's result: rows before
    position 0 are ``fill``, a padding capture repeats the first into the scratch slot, slots not
    captured are untouched. Inverse control: the positions one later give other snapshots."""
    g = torch.Generator().manual_seed(7)
    S, T, P = 6, 5, 4  # state slots, step rows, snapshot slots (the last one scratch)
    pool = torch.randn(S * R, D, generator=g).to(dtype)
    slots = torch.tensor([4, 0, 2, 5, 1])
    seq = torch.tensor([2, 0, 3, 2])  # the last repeats the first: padding
    pos = torch.tensor([R * 7, 3, R * 2 + 5, R * 7])  # capture 1 is before R rows exist
    slot = torch.tensor([1, 0, 2, 3])
    snap = torch.randn(P, R, D, generator=g).to(dtype)
    got, want = snap.clone(), snap.clone()
    tk.ring_capture(pool, got, slots, seq, pos, slot, R, fill)
    fused.ring_capture_reference(pool, want, slots, seq, pos, slot, R, fill)
    assert torch.equal(got, want)
    assert bool((got[0, 3:] == fill).all()) and torch.equal(got[0, :3], pool[slots[0] * R : slots[0] * R + 3])
    assert torch.equal(got[3], got[1])  # the padding capture holds the first one's rows
    for m in ("fast", "invariant"):  # the dispatch on the CPU: the composition
        with ops.mode(m):
            again = snap.clone()
            fused.ring_capture(pool, again, slots, seq, pos, slot, R, fill)
        assert torch.equal(again, want)
    later = snap.clone()
    tk.ring_capture(pool, later, slots, seq, pos + 1, slot, R, fill)
    assert not torch.equal(later, got)


def test_ring_capture_builds_for_hopper():
    check(ptx(("ring_capture",)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ring_capture_on_cuda_equals_the_composition():
    """Flash widths on the GPU (window ring 128 x 512 bf16; a compressor's fp32 tail rings with -inf
    fill): the dispatch runs the kernel, and the snapshots equal the composition's; control: the
    positions one later give other snapshots."""
    from v4stack.kernels import fused_gpu

    g = torch.Generator(device="cuda").manual_seed(1)
    for dtype, fill, R, D in ((torch.bfloat16, 0.0, 128, 512), (torch.float32, float("-inf"), 8, 1024)):
        S, P = 300, 40
        pool = torch.randn(S * R, D, device="cuda", generator=g).to(dtype)
        slots = torch.randperm(S, device="cuda", generator=g)[:256]
        seq = torch.tensor([3, 77, 250, 3], device="cuda")
        pos = torch.tensor([R * 40, 5, R * 9 + 7, R * 40], device="cuda")
        slot = torch.tensor([2, 9, 31, P - 1], device="cuda")
        snap = torch.randn(P, R, D, device="cuda", generator=g).to(dtype)
        want = snap.clone()
        fused.ring_capture_reference(pool, want, slots, seq, pos, slot, R, fill)
        ops.reset_counters()
        got = snap.clone()
        fused.ring_capture(pool, got, slots, seq, pos, slot, R, fill)
        assert ops.counters()["ring_capture"] == {"triton_ring_capture": 1}
        assert torch.equal(got, want)
        later = snap.clone()
        fused.ring_capture(pool, later, slots, seq, pos + 1, slot, R, fill)
        assert not torch.equal(later, got)
    assert "ring_capture" not in fused_gpu.refused, fused_gpu.refused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_closing_rows_on_cuda_equals_the_composition():
    """Flash widths on the GPU (a CSA compressor: ratio 4 overlapped, 512 channels a half; an HCA one:
    ratio 128, 512 channels; the indexer's: 128 a half): the dispatch runs the kernel and the rows
    equal the composition's; control: another request's ring gives other rows."""
    from v4stack.kernels import fused_gpu

    g = torch.Generator(device="cuda").manual_seed(2)
    for m, coff, c in ((4, 2, 512), (128, 1, 512), (4, 2, 128)):
        R, S = coff * m, 300
        kv_pool = torch.randn(S * R, coff * c, device="cuda", generator=g)
        score_pool = torch.randn(S * R, coff * c, device="cuda", generator=g)
        slots = torch.randperm(S, device="cuda", generator=g)[:256]
        seq = torch.tensor([0, 17, 255, 0], device="cuda")
        entry = torch.tensor([0, 33, 4000 // m, 0], device="cuda")
        lookback = m if coff == 2 else 0
        want = fused.closing_rows_reference(kv_pool, score_pool, slots, seq, entry, R, m, lookback, coff, c)
        ops.reset_counters()
        got = fused.closing_rows(kv_pool, score_pool, slots, seq, entry, R, m, lookback, coff, c)
        assert ops.counters()["closing_rows"] == {"triton_closing_rows": 1}
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        other = fused.closing_rows(kv_pool, score_pool, slots, (seq + 1) % slots.shape[0], entry, R, m, lookback, coff, c)
        assert not torch.equal(other[0], got[0])
    assert "closing_rows" not in fused_gpu.refused, fused_gpu.refused
