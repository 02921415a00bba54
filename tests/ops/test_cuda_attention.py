"""The CUDA C++ decode attention (``kernels/cuda_attention.cu``).

CPU: the launcher asks for the shared memory the source lays out; where ``nvcc`` is installed, it
builds for sm_90a with no spills, the cache keys the build by source and compiler (a changed
source builds again; a cached one is reused, never half written). GPU (Hopper): against the fp32 torch reference over the same candidates - hidden
candidates (-1, an index past the pool) in the middle of the lists, a row with no visible
candidate, two head groups, int32 and int64 indices, lists that are and are not multiples of a
chunk, rows of every live length, more items than SMs, blocks walking several items or one (the
same bits), the queries' RMS norm in the launch - under a CUDA graph too;
the inverse controls show the tolerance sees a wrong scale and a norm not applied."""

import shutil

import pytest
import torch

from v4stack.kernels import cubin
from v4stack.kernels import cuda_attention as ca

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@needs_nvcc
def test_builds_for_hopper_without_spills_and_caches_by_source(tmp_path, monkeypatch):
    source = ca.SOURCE
    monkeypatch.setenv("V4STACK_CUDA_CACHE", str(tmp_path))
    path, report = cubin.build(source)
    assert path.parent == tmp_path and path.stat().st_size > 0
    entries = ("decode_attention_i64", "decode_attention_i32")
    for entry in entries:
        assert f"Compiling entry function '{entry}' for 'sm_90a'" in report
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == len(entries), report
    # no MMA fenced apart by a register written between two of them (ptxas's C7519 note; the p @ v
    # steps packed their A fragments between MMAs until every K step's were packed first)
    assert "C7519" not in report, report
    regs = [int(line.split("Used ")[1].split()[0]) for line in report.splitlines() if "Used " in line]
    assert regs and max(regs) <= 255
    assert list(tmp_path.iterdir()) == [path]  # only the finished file: no temporary left behind
    again, report2 = cubin.build(source)
    assert again == path and report2 == ""  # cached
    # a source named by a path outside the package (an A/B's old tree) is keyed with the header beside
    # it, where nvcc reads it (the package's header unchanged, the other one changed: another key)
    elsewhere = tmp_path / "old"
    elsewhere.mkdir()
    for f in (source, "hopper.cuh"):
        (elsewhere / f).write_text((cubin.HERE / f).read_text())
    key_old = cubin.cubin_path(str(elsewhere / source))
    (elsewhere / "hopper.cuh").write_text((cubin.HERE / "hopper.cuh").read_text() + "\n// changed\n")
    assert cubin.cubin_path(str(elsewhere / source)) != key_old
    # the same file name with other bytes is another key (the control: the key reads the bytes)
    other = tmp_path / "src"
    other.mkdir()
    (other / source).write_text((cubin.HERE / source).read_text() + "\n// changed\n")
    (other / "hopper.cuh").write_text((cubin.HERE / "hopper.cuh").read_text())
    monkeypatch.setattr(cubin, "HERE", other)
    changed = cubin.cubin_path(source)
    assert changed != path
    # and a changed header it includes is another key too (the key reads the included bytes)
    (other / "hopper.cuh").write_text((cubin.HERE / "hopper.cuh").read_text() + "\n// changed\n")
    assert cubin.cubin_path(source) not in (path, changed)


@needs_nvcc
def test_a_source_nvcc_rejects_raises_and_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    cache, src = tmp_path / "cache", tmp_path / "src"
    src.mkdir()
    (src / "broken.cu").write_text('extern "C" __global__ void k() { this is not C++; }\n')
    monkeypatch.setenv("V4STACK_CUDA_CACHE", str(cache))
    monkeypatch.setattr(cubin, "HERE", src)
    with pytest.raises(RuntimeError, match="nvcc failed on broken.cu"):
        cubin.build("broken.cu")
    assert not cache.exists() or list(cache.iterdir()) == []


def _macros(text: str) -> dict:
    """The ``#define NAME value`` lines of a source, each value evaluated with the ones before."""
    import re

    env = {"__builtins__": {}}
    for name, expr in re.findall(r"^#define (\w+) ([^\n]*?)\s*(?://[^\n]*)?$", text, re.M):
        env[name] = eval(expr, env)  # integer arithmetic of the values before
    return env


def test_the_launcher_asks_for_the_shared_memory_the_source_lays_out():
    src = (cubin.HERE / ca.SOURCE).read_text()
    m = _macros(src)
    assert (ca.SMEM, ca.CHUNK, ca.STAGES) == (m["SMEM_BYTES"], m["CH"], m["NST"])
    assert ca.SMEM <= 227 * 1024  # Hopper's most for one block
    # the control: a layout one stage larger would not match
    assert _macros(src.replace("NST * CH * 1024)", "(NST + 1) * CH * 1024)"))["SMEM_BYTES"] != ca.SMEM


def test_accepts_only_the_written_shapes():
    q = torch.zeros(4, 64, 512, dtype=torch.bfloat16)
    assert not ca.accepts(q, None, None, None, 1.0)  # not on CUDA
    if torch.cuda.is_available():
        qc = q.cuda()
        assert ca.accepts(qc, None, None, None, 1.0)
        assert not ca.accepts(qc[:, :48], None, None, None, 1.0)  # 48 heads: not a 64-head group
        assert not ca.accepts(qc[..., :256], None, None, None, 1.0)
        assert not ca.accepts(qc.float(), None, None, None, 1.0)


def _reference(q, pools, idx, sink, scale):
    keys, seen = [], []
    for p, i in zip(pools, idx):
        i = i.long()
        ok = (i >= 0) & (i < p.shape[0])
        keys.append(p[i.clamp(0, p.shape[0] - 1)].float())
        seen.append(ok)
    keys, seen = torch.cat(keys, 1), torch.cat(seen, 1)
    s = (torch.einsum("thd,tkd->thk", q.float(), keys) * scale).masked_fill(~seen[:, None, :], float("-inf"))
    s = torch.cat([s, sink.float()[None, :, None].expand(s.shape[0], -1, 1)], 2)
    return torch.einsum("thk,tkd->thd", torch.softmax(s, 2)[..., :-1], keys)


def _case(T, H, K0, K1, N0, N1, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, 512, device="cuda", generator=g).bfloat16()
    pools = [torch.randn(N0, 512, device="cuda", generator=g).bfloat16(),
             torch.randn(N1, 512, device="cuda", generator=g).bfloat16()]
    i0 = torch.randint(0, N0, (T, K0), device="cuda", generator=g)
    i1 = torch.randint(0, N1, (T, K1), device="cuda", generator=g)
    i0[:, 5::17] = -1  # hidden in the middle of the window
    i1[:, 3::11] = -1
    i1[:, 7::13] = N1 + 5  # past the pool: no candidate, never read
    # padded top-k tails of every length from row to row: the live chunks stop before them, so the
    # items a block walks have different chunk counts
    tail = (torch.arange(T, device="cuda") * 37) % (K1 + 1)
    i1[torch.arange(K1, device="cuda")[None, :] >= (K1 - tail)[:, None]] = -1
    i0[1] = -1  # row 1: nothing visible at all
    i1[1] = -1
    return q, pools, [i0.to(dtype), i1.to(dtype)], torch.randn(H, device="cuda", generator=g), 512 ** -0.5


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and cubin.usable()), reason="needs a Hopper GPU and nvcc")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("walk", [False, True])
def test_matches_the_fp32_reference(dtype, H, walk):
    # a window and a top-k that are multiples of a chunk, then ones that are not (a chunk across the
    # two pools, a last chunk part past the lists), then a window of 40 alone (one chunk, padded to
    # two); 300 rows: more items than SMs, so a walking block takes several, the next one's loads in
    # this one's
    for K0, K1 in ((128, 384), (100, 203), (40, 0)):
        q, pools, idx, sink, scale = _case(T=300, H=H, K0=K0, K1=K1, N0=300 * 128, N1=2000, dtype=dtype)
        want = _reference(q, pools, idx, sink, scale)
        got = ca.sparse_attention(q, pools, idx, sink, scale, walk=walk).float()
        assert torch.all(got[1] == 0)  # no candidate: the sink alone, an exact zero output
        err = (got - want).abs().max().item()
        assert err < 2e-2, (K0, K1, err)
        # inverse control: a wrong scale is far outside the tolerance
        bad = ca.sparse_attention(q, pools, idx, sink, scale * 1.5, walk=walk).float()
        assert (bad - want).abs().max().item() > 10 * max(err, 2e-3)
        # the queries' RMS norm in the launch equals norming first: queries 3x too large give the
        # normed reference, and (the control) do not without the norm
        eps = 1e-6
        qn = (q.float() * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + eps)).bfloat16()
        want_n = _reference(qn, pools, idx, sink, scale)
        big = (q.float() * 3).bfloat16()
        normed = ca.sparse_attention(big, pools, idx, sink, scale, q_eps=eps, walk=walk).float()
        assert (normed - want_n).abs().max().item() < 2e-2
        raw = ca.sparse_attention(big, pools, idx, sink, scale, walk=walk).float()
        assert (raw - want_n).abs().max().item() > 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and cubin.usable()), reason="needs a Hopper GPU and nvcc")
def test_an_items_bits_do_not_depend_on_the_grid():
    # one block an item against blocks walking several (the launcher's choice by chunk count):
    # the same bits, short rows and long ones, two head groups, the query norm too
    for K0, K1 in ((128, 0), (128, 512)):
        q, pools, idx, sink, scale = _case(T=300, H=128, K0=K0, K1=K1, N0=300 * 128, N1=2000, dtype=torch.int64)
        for eps in (None, 1e-6):
            one = ca.sparse_attention(q, pools, idx, sink, scale, q_eps=eps, walk=False)
            walked = ca.sparse_attention(q, pools, idx, sink, scale, q_eps=eps, walk=True)
            assert torch.equal(one, walked), (K0, K1, eps)
        # the control: one query element changed changes its row's bits
        q2 = q.clone()
        q2[7, 3, 11] += 1
        other = ca.sparse_attention(q2, pools, idx, sink, scale, walk=True)
        assert not torch.equal(other[7], ca.sparse_attention(q, pools, idx, sink, scale, walk=False)[7])


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and cubin.usable()), reason="needs a Hopper GPU and nvcc")
def test_runs_under_a_cuda_graph_and_through_the_dispatch():
    from v4stack import ops

    q, pools, idx, sink, scale = _case(T=256, H=64, K0=128, K1=512, N0=256 * 128, N1=4096, dtype=torch.int64)
    eager = ca.sparse_attention(q, pools, idx, sink, scale)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ca.sparse_attention(q, pools, idx, sink, scale)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        out = ca.sparse_attention(q, pools, idx, sink, scale)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    ops.reset_counters()
    with ops.mode("fast"):
        via = ops.sparse_attention(q, pools, idx, sink, scale)
    assert ops.counters()["sparse_attention"] == {"cuda_sparse_attention": 1}
    assert torch.equal(via, eager)
