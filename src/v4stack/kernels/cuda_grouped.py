"""The MoE layers' grouped GEMMs in CUDA C++ (``cuda_grouped.cu``: TMA loads, warpgroup MMA, a
persistent warp-specialised kernel; its comment says how it works): ``grouped_linear`` (``y`` rows
of expert ``e`` = ``x`` rows of ``e`` @ ``w[e].T``) and ``grouped_swiglu`` (the expert's gate and up
projections and SwiGLU's activation in one launch, only the activations written).

``bn`` is the output columns a unit of work covers (128 or 256); ``sk`` runs stream-K (every
multiprocessor an equal share of the K steps; fast mode only: the sum's order depends on the batch)."""

from __future__ import annotations

import functools
import subprocess
import warnings

import torch

from v4stack.kernels import cubin

SOURCE = "cuda_grouped.cu"
BK, SUB = 64, 64 * 128
STAGES = {(128, 1): 6, (128, 2): 4}  # the .cu's ENTRY lines, by (BN, 64-row tiles a warpgroup)
TYPES = ("tmap", "tmap", "tmap", "p", "i32", "i32", "i32", "p", "i64", "p", "f32", "p", "p")
_work: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(dev: int, grid: int):
    """Stream-K's partial sums (one fp32 tile slot a CTA) and flags (zero between launches: the
    CTA that adds a slot clears its flag), made once per device, outside any graph capture."""
    w = _work.get(dev)
    if w is None or w[1].numel() < grid + 1:
        if torch.cuda.is_current_stream_capturing():
            return None
        w = _work[dev] = (torch.empty(grid * 2 * 2 * 64 * 128, dtype=torch.float32, device=f"cuda:{dev}"),
                          torch.zeros(grid + 1, dtype=torch.int32, device=f"cuda:{dev}"))
    return w


def smem(bn: int, rw: int) -> int:
    st = STAGES[(bn, rw)]
    return st * (2 * rw * SUB + bn * 128) + 2 * st * 8 + 1024


@functools.lru_cache(maxsize=None)
def ready() -> bool:
    """A Hopper GPU, and nvcc builds the source (asked once; where it cannot, fast mode keeps the
    Triton kernels and a warning says why)."""
    if not cubin.usable():
        return False
    try:
        cubin.build(SOURCE)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"cuda_grouped: not built, the Triton grouped GEMM stays: {e}", RuntimeWarning)
        return False
    return True


def _ok(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype == torch.bfloat16 and t.data_ptr() % 16 == 0


def accepts(x, w, offsets, swiglu: bool = False) -> bool:
    """bf16 ``x [T, K]`` (unit column stride, 16-byte aligned rows), ``w [E, N, K]`` contiguous, K
    a multiple of 64, N of 128 (of 64 for the fused activation), int64 ``offsets [E + 1]``."""
    if x.dim() != 2 or w.dim() != 3 or not (_ok(x) and _ok(w)) or not w.is_contiguous():
        return False
    T, K = x.shape
    E, N, K2 = w.shape
    if K2 != K or K % BK or N % 128 or x.stride(1) != 1 or (x.stride(0) * 2) % 16:
        return False
    if T >= 2**31 or E * N >= 2**31:
        return False
    return offsets.is_cuda and offsets.dtype == torch.int64 and offsets.shape == (E + 1,)


def _launch(kind: str, x, w1, w3, offsets, y, ws, limit: float, bn: int, sk: bool, rw: int):
    T, K = x.shape
    E, N, _ = w1.shape
    if T == 0:
        return y
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    work = _workspace(dev, nsm) if sk else None
    fn = cubin.load(SOURCE, f"grouped_{kind}" + ("_r2" if rw == 2 else "") + f"_n{bn}" + ("_sk" if work is not None else ""), TYPES,
                    smem(bn, rw), dev)
    wbox = bn // 2 if kind == "swiglu" else bn
    tx = cubin.tensor_map(x, 128 * rw, BK)
    t1 = cubin.tensor_map(w1.view(E * N, K), wbox, BK)
    t3 = cubin.tensor_map(w3.view(E * N, K), wbox, BK) if w3 is not None else t1
    blocks = N // (bn // 2 if kind == "swiglu" else bn)
    chunks = T // (128 * rw) + E  # at most
    grid = nsm if work is not None else min(nsm, chunks * blocks)
    fn.launch((grid, 1, 1), 384, tx, t1, t3, offsets, E, N, K, y, y.stride(0), 0 if ws is None else ws,
              float(limit), 0 if work is None else work[0], 0 if work is None else work[1])
    return y


def grouped_linear(x, w, offsets, bn: int = 128, sk: bool = True, rw: int = 2):
    y = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    return _launch("gemm", x, w, None, offsets, y, None, 0.0, bn, sk, rw)


def grouped_swiglu(x, w1, w3, offsets, weight, limit: float, bn: int = 128, sk: bool = True, rw: int = 2):
    """``silu(min(x w1[e].T, limit)) * clamp(x w3[e].T, -limit, limit) [* weight]`` per row of
    expert ``e`` (the projections rounded to bf16 first, as the two-GEMM path stores them; ``limit``
    0: no clamps), in bf16."""
    if w3.shape != w1.shape or not w3.is_contiguous():
        raise ValueError("cuda_grouped: w1 and w3 differ in shape or layout")
    ws = None if weight is None else weight.float().contiguous()
    y = torch.empty(x.shape[0], w1.shape[1], dtype=x.dtype, device=x.device)
    return _launch("swiglu", x, w1, w3, offsets, y, ws, limit, bn, sk, rw)
