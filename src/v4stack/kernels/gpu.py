"""CUDA registrations for ``ops``' dispatch table.

Each entry names its kernel, the table key it serves and its ``accepts`` (the kernel's contract,
``v4stack.kernels.contracts``, plus the library being installed). Kernel modules (Triton,
TileLang, CUDA C++ through ``cubin``) are imported on first call, so this module imports no GPU library.

Choice of language per kernel: the GEMM, RMSNorm and dense attention kept from before are
TileLang; the kernels added with the dispatch table are Triton, because Triton's interpreter
runs them on the CPU (so the default test run checks their logic against float64 torch) and
the GPU image carries Triton but not TileLang.
"""

import functools
import importlib
import importlib.util

import torch

from v4stack.kernels import contracts as C
from v4stack.kernels.attention_tiles import takes_online as _takes_online

_grad_enabled = torch.is_grad_enabled


@functools.lru_cache(maxsize=None)
def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _lazy(module: str, attr: str, spec: str | None = None):
    """The kernel wrapper ``module.attr``, imported on first call; its contract ``spec`` is proved
    with Z3 then (``specs.build``), before the kernel is built."""
    fn = None

    def call(*args, **kw):
        nonlocal fn
        if fn is None:
            if spec is not None:
                from v4stack.kernels import specs

                specs.build(spec)
            fn = getattr(importlib.import_module(f"v4stack.kernels.{module}"), attr)
        return fn(*args, **kw)

    call.__name__ = f"{module}.{attr}"
    return call


def _needs_grad(args, kw) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in (*args, *kw.values()))


def _with(lib: str, check):
    """The project kernels compute forward values only: a call that autograd must differentiate
    (grad mode on and an input requiring grad: training) goes to the next implementation, a torch
    one with its backward. (Every op call on CUDA runs one of these: kept to a few attribute reads;
    whether ``lib`` is installed is asked once.)"""
    have = []

    def accepts(*args, **kw):
        if not have:
            have.append(installed(lib))
        if not have[0] or (_grad_enabled() and _needs_grad(args, kw)):
            return False
        return check(*args, **kw)

    return accepts


_grouped_mm_refused = False


def _grouped_mm(x, w, offsets):
    """The framework's grouped GEMM (fast mode): ``torch._grouped_mm`` with int32 row ends. A shape
    or build it refuses turns it off for the process (the Triton grouped GEMM serves instead)."""
    global _grouped_mm_refused
    import torch

    try:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets[1:].to(torch.int32), out_dtype=x.dtype)
    except (RuntimeError, TypeError, NotImplementedError):
        _grouped_mm_refused = True
        return _lazy_grouped(x, w, offsets)


def _grouped_mm_ok(x, w, offsets) -> bool:
    return not _grouped_mm_refused and C.torch_grouped_mm(x, w, offsets)


def _fp8_linear(x, qw):
    """A ``QuantizedWeight`` in fp8: its scales as fp32 once (kept on the weight), then the kernel."""
    sc = getattr(qw, "_scale_f32", None)
    if sc is None:
        import torch

        s = qw.scale
        if s.dtype == torch.float8_e8m0fnu:  # 2^(byte - 127), exact
            e = s.view(torch.uint8).to(torch.int32)
            s = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127)
        sc = qw._scale_f32 = s.float().contiguous()
    return _lazy_fp8(x, qw.data, sc)


_lazy_fp8 = _lazy("triton_gemm", "fp8_linear", "fp8_gemm")
_lazy_grouped = _lazy("triton_grouped", "grouped_linear", "gemm_grouped")


def register_all(register) -> None:
    inv, fast = "invariant", "fast"
    for dt in ("bfloat16", "float16"):
        register("linear", "tilelang_gemm_nt", _lazy("tilelang_ops", "linear"), mode=inv, fmt=dt, device="cuda",
                 accepts=_with("tilelang", C.tilelang_linear))
        register("rms_norm", "tilelang_rms_norm", _lazy("tilelang_ops", "rms_norm_cuda"), mode=inv, fmt=dt,
                 device="cuda", accepts=_with("tilelang", C.tilelang_rms_norm))
        register("attention_with_sink", "tilelang_attention_sink", _lazy("tilelang_ops", "attention"), mode=inv,
                 fmt=dt, device="cuda", accepts=_with("tilelang", C.tilelang_attention))
    trit = lambda check: _with("triton", check)  # noqa: E731
    register("linear", "triton_fp8_block_gemm", _fp8_linear, fmt="fp8", device="cuda", accepts=trit(C.fp8_linear))
    register("linear", "triton_fp4_gemm", _lazy("triton_fp4", "fp4_linear"), fmt="fp4", device="cuda",
             accepts=trit(lambda x, qw: qw.data.is_cuda and x.dim() >= 1 and x.dtype in C.HALF and x.shape[-1] % 32 == 0
                          and qw.data.dim() == 2 and 2 * qw.data.shape[1] == x.shape[-1]))
    register("linear", "triton_fp32_gemm", _lazy("triton_gemm", "linear", "gemm_half"), mode=inv, fmt="float32", device="cuda",
             accepts=trit(C.linear))
    for dt in ("bfloat16", "float16"):  # where TileLang is absent or refuses the shape
        register("linear", "triton_gemm", _lazy("triton_gemm", "linear", "gemm_half"), mode=inv, fmt=dt, device="cuda",
                 accepts=trit(C.linear))
    register("rms_norm", "triton_rms_norm", _lazy("triton_rows", "rms_norm", "rms_norm"), mode=inv, device="cuda",
             accepts=trit(C.rms_norm))
    register("attention_with_sink", "triton_sparse_attention", _lazy("triton_attention", "attention_with_sink",
             "sparse_attention"), mode=inv, device="cuda", accepts=trit(C.attention_with_sink))
    register("hc_read", "triton_hc_read", _lazy("triton_rows", "hc_read", "row_mix"), mode=inv, device="cuda",
             accepts=trit(C.hc_read))
    register("hc_write", "triton_hc_write", _lazy("triton_rows", "hc_write", "row_mix"), mode=inv, device="cuda",
             accepts=trit(C.hc_write))
    register("hc_mix", "triton_hc_mix", _lazy("triton_gemm", "hc_mix", "hc_mix"), mode=inv, fmt="float32", device="cuda",
             accepts=trit(C.hc_mix))
    register("indexer_scores", "triton_indexer_scores", _lazy("triton_gemm", "indexer_scores", "indexer"), mode=inv,
             device="cuda", accepts=trit(C.indexer_scores))
    register("softmax", "triton_softmax", _lazy("triton_rows", "softmax", "softmax"), mode=inv, device="cuda",
             accepts=trit(C.softmax))
    register("log_softmax", "triton_log_softmax", _lazy("triton_rows", "log_softmax", "softmax"), mode=inv, device="cuda",
             accepts=trit(C.softmax))
    register("weighted_pool", "triton_weighted_pool", _lazy("triton_rows", "weighted_pool", "row_mix"), mode=inv,
             device="cuda", accepts=trit(C.weighted_pool))
    register("moe_combine", "triton_moe_combine", _lazy("triton_rows", "moe_combine", "row_mix"), mode=inv, device="cuda",
             accepts=trit(C.moe_combine))
    # fast mode: the project kernel where it measured faster than the framework's. The committed
    # table (kernels/fast_picks.json, from bench/results/ops_h200.json by bench.fast_picks: device
    # time under CUDA graphs, by rows) decides where it has a bucket; the rule given here elsewhere.
    def rows(t):
        return t.numel() // max(1, t.shape[-1]) if t.dim() else 1

    def measured(op, nrows, rule=None):
        import bisect

        from v4stack.kernels import fast_table

        table = []

        def when(*a):  # fast_table.prefers_project, with the op's buckets read once
            if not table:
                table.append(fast_table._buckets(op, str(fast_table.TABLE)))
            bounds, picks = table[0]
            i = bisect.bisect_left(bounds, nrows(*a))
            return (rule is not None and rule(*a)) if i >= len(picks) else picks[i]
        return when

    # the grouped GEMM by routed rows per expert (bench/fast_picks.py's key for it); past the last
    # bucket the project kernel (bench/results/grouped_serving_h200.json: 200 rows per expert of 9,
    # the flash4 engine at batch 256, 201 vs 288 us a layer under graphs)
    grouped_measured = measured("grouped_linear", lambda x, w, offsets: -(-x.shape[0] // max(1, w.shape[0])),
                                lambda x, w, offsets: True)
    fast_picks = (
        ("rms_norm", "triton_rms_norm", _lazy("triton_rows", "rms_norm", "rms_norm"), C.rms_norm, None),
        ("indexer_scores", "triton_indexer_scores", _lazy("triton_gemm", "indexer_scores", "indexer"), C.indexer_scores, None),
        ("weighted_pool", "triton_weighted_pool", _lazy("triton_rows", "weighted_pool", "row_mix"), C.weighted_pool,
         measured("weighted_pool", lambda kv, s, dim: kv.numel() // (kv.shape[-1] * kv.shape[-2]),
                  lambda kv, s, dim: kv.numel() // (kv.shape[-1] * kv.shape[-2]) >= 1024)),
        ("moe_combine", "triton_moe_combine", _lazy("triton_rows", "moe_combine", "row_mix"), C.moe_combine,
         measured("moe_combine", lambda y, idx: y.shape[0], lambda y, idx: y.shape[0] >= 1024)),
        ("softmax", "triton_softmax", _lazy("triton_rows", "softmax", "softmax"), C.softmax,
         measured("softmax", lambda x, dim=-1: rows(x), lambda x, dim=-1: rows(x) >= 1024 and x.shape[-1] <= 4096)),
        ("log_softmax", "triton_log_softmax", _lazy("triton_rows", "log_softmax", "softmax"), C.softmax,
         measured("log_softmax", lambda x, dim=-1: rows(x))),
        ("hc_mix", "triton_hc_mix", _lazy("triton_gemm", "hc_mix", "hc_mix"), C.hc_mix,
         measured("hc_mix", lambda flat, fn, eps: rows(flat), lambda flat, fn, eps: rows(flat) <= 64)),
        ("attention_with_sink", "triton_sparse_attention",
         _lazy("triton_attention", "attention_with_sink", "sparse_attention"), C.attention_with_sink,
         measured("attention_with_sink", lambda q, keys, mask, sink, scale: q.shape[0],
                  lambda q, keys, mask, sink, scale: q.shape[0] <= 64)),
        ("grouped_linear", "triton_grouped_gemm", _lazy_grouped, C.grouped_linear,
         lambda x, w, offsets: not _grouped_mm_ok(x, w, offsets)  # also wherever torch refuses
         or grouped_measured(x, w, offsets)),
    )
    for op, name, fn, check, when in fast_picks:
        ok = check if when is None else (lambda c, w: lambda *a: c(*a) and w(*a))(check, when)
        register(op, name, fn, mode=fast, device="cuda", accepts=trit(ok))
    for dt, name in (("float32", "triton_fp32_gemm"), ("bfloat16", "triton_gemm")):  # fast linear: measured picks only
        when = measured(f"linear.{dt}", lambda x, w: rows(x))
        register("linear", name, _lazy("triton_gemm", "linear", "gemm_half"), mode=fast, fmt=dt, device="cuda",
                 accepts=trit((lambda w: lambda x, weight: C.linear(x, weight) and w(x, weight))(when)))
    register("grouped_linear", "torch_grouped_mm", _grouped_mm, mode=fast, device="cuda", accepts=_grouped_mm_ok)
    register("grouped_linear", "triton_grouped_gemm", _lazy_grouped, mode=inv, device="cuda",
             accepts=_with("triton", C.grouped_linear))
    # fast mode, many rows: the online-softmax launch (no fixed arithmetic across launch shapes)
    register("sparse_attention", "triton_sparse_attention_online",
             _lazy("triton_attention_online", "sparse_attention", "sparse_attention"), mode=fast, device="cuda",
             accepts=_with("triton", lambda q, pools, idx, sink, scale: C.sparse_attention(q, pools, idx, sink, scale)
                           and _takes_online(q.shape[0], q.shape[1])))
    # and with the queries' RMS normalisation done on the loaded queries (the model hands over raw queries
    # where this accepts them; ``pools`` None: that question, asked before the candidates exist)
    register("normed_sparse_attention", "triton_normed_sparse_attention_online",
             _lazy("triton_attention_online", "normed_sparse_attention", "sparse_attention"), mode=fast, device="cuda",
             accepts=_with("triton", lambda q, pools, idx, sink, scale, eps: q.dtype in (torch.bfloat16, torch.float16)
                           and _takes_online(q.shape[0], q.shape[1])
                           and (pools is None or C.sparse_attention(q, pools, idx, sink, scale))))
    # fast mode, many rows, Hopper: the CUDA C++ decode attention ahead of the Triton launches
    # (``cuda_attention``; rows from ``cuda_attention.MIN_ROWS``, bench/attention_cuda.py)
    def cuda_attention_ok(q, pools, idx, sink, scale, eps=None):
        from v4stack.kernels import cuda_attention as ca

        return (q.shape[0] >= ca.MIN_ROWS and not (_grad_enabled() and _needs_grad((q, sink, *(pools or ())), {}))
                and ca.accepts(q, pools, idx, sink, scale) and ca.ready())
    register("sparse_attention", "cuda_sparse_attention", _lazy("cuda_attention", "sparse_attention"), mode=fast,
             device="cuda", accepts=cuda_attention_ok, first=True)
    register("normed_sparse_attention", "cuda_normed_sparse_attention",
             _lazy("cuda_attention", "normed_sparse_attention"), mode=fast, device="cuda", accepts=cuda_attention_ok,
             first=True)
    # fast mode, many rows, Hopper: the CUDA C++ indexed scores (a CSA decode step's) ahead of the Triton
    # launch (``cuda_indexer``; ``V4STACK_CUDA_INDEXER=0`` keeps the Triton launch)
    def cuda_indexer_ok(q, w, pool, rows):
        from v4stack.kernels import cuda_indexer as ci

        return (ci.ENABLED and q.shape[0] >= ci.MIN_ROWS and not (_grad_enabled() and _needs_grad((q, w, pool), {}))
                and ci.accepts(q, w, pool, rows) and ci.ready())
    register("indexer_scores_rows", "cuda_indexer_scores_rows", _lazy("cuda_indexer", "indexer_scores_rows"),
             mode=fast, device="cuda", accepts=cuda_indexer_ok, first=True)
    for mode in (inv, fast):
        register("indexer_scores_rows", "triton_indexer_scores_rows", _lazy("triton_gemm", "indexer_scores_rows", "indexer"),
                 mode=mode, device="cuda", accepts=trit(C.indexer_scores_rows))
        register("sparse_attention", "triton_sparse_attention", _lazy("triton_attention", "sparse_attention", "sparse_attention"),
                 mode=mode, device="cuda", accepts=_with("triton", C.sparse_attention))
    importlib.import_module("v4stack.kernels.fused_gpu").register_all(register)  # hc_split, rope (ops/fused.py)
