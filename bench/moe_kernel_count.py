"""Kernels one MoE layer launches per decode step, counted on the CPU: before / after the fused
routing kernels (``kernels/triton_route.py``); and one compressor's decode-step ring write
(``kernels/triton_ring.py``).

Each torch op that does work (not a view, not an allocation) counts as one launch, and each
Triton kernel as one (the routing kernels run in Triton's interpreter, registered for the CPU in
the child that counts them). The "before" side runs the same layer from another tree's ``src``
(``--before-src``, e.g. an export of the commit before the change) in a child process; its ops
are the torch compositions the CUDA path ran (a GPU trace may split an op further: a stable sort
is a radix sort plus set-up kernels). Widths do not change the count, so the layer is small.

    python -m bench.moe_kernel_count --before-src /tmp/main_src
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

NOT_KERNELS = {"view", "_unsafe_view", "t", "transpose", "expand", "as_strided", "detach", "alias", "slice", "select",
               "unsqueeze", "squeeze", "permute", "empty", "empty_strided", "empty_like", "lift_fresh", "reshape",
               "_reshape_alias", "unflatten", "split", "unbind", "numpy_T", "clone_view"}


def _child(kernels: bool, batch: int) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from v4stack import ops
    from v4stack.config import ModelConfig, preset
    from v4stack.model.moe import MoE

    inside = [False]
    triton = Counter()
    if kernels:
        import importlib.util

        # the interpreter shims the test suite installs (NumPy 2 scalars)
        spec = importlib.util.spec_from_file_location("_shims", Path(__file__).resolve().parents[1] / "tests/conftest.py")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        from v4stack.kernels import triton_route as tr
        from v4stack.ops.dispatch import register

        def counted(name, fn):
            def run(*a):
                inside[0] = True
                try:
                    return fn(*a)
                finally:
                    inside[0] = False
                    triton[name] += 1
            return run

        for op in ("moe_gate", "moe_route", "moe_unsort_combine"):
            register(op, f"triton_{op}", counted(op, getattr(tr, op)), device="cpu", first=True)

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside[0] and name not in NOT_KERNELS:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    base = preset("flash").to_dict()
    cfg = ModelConfig.from_dict({**base, "hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 8})
    g = torch.Generator().manual_seed(0)
    out = {}
    for kind, layer in (("hash", 0), ("routed", cfg.num_hash_layers)):
        moe = MoE(cfg, layer)
        with torch.no_grad():
            for name, p in moe.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
                if not name.endswith("gate.bias"):
                    p.data = p.data.bfloat16()
            if moe.gate.hashed:
                moe.gate.tid2eid.copy_(torch.randint(0, 8, moe.gate.tid2eid.shape, generator=g))
        x = torch.randn(batch, cfg.hidden_size, generator=g).bfloat16()
        tok = torch.randint(0, 1000, (batch,), generator=g)
        for mode in ("fast", "invariant"):
            with torch.no_grad(), ops.mode(mode):
                moe(x, tok)  # stacks the expert weights once
                triton.clear()
                with Count() as c:
                    y = moe(x, tok)
            out[f"{kind}/{mode}"] = {"torch_ops": sum(c.ops.values()), "triton_kernels": sum(triton.values()),
                                     "launches": sum(c.ops.values()) + sum(triton.values()),
                                     "ops": dict(sorted(c.ops.items())), "triton": dict(triton),
                                     "out_sum": float(y.float().sum())}
    # a compressor's decode-step ring write (kv and score rows of 4 requests): the composition the
    # CUDA path ran before ``ops.fused.tail_write``, or its kernel
    if kernels:
        from v4stack.kernels import triton_ring

        register("tail_write", "triton_tail_write", counted("tail_write", lambda *a: triton_ring.tail_write(*a[:8])),
                 device="cpu", first=True)
    from v4stack.ops import fused

    if hasattr(fused, "tail_write"):
        write = fused.tail_write
    else:  # the code before the op: ``Compressor.project``'s casts and ape add, then ``Rings``' two writes
        def write(kv, score, ape, pos, ratio, rk, rs, dest, cd):
            kv, score = kv.to(cd), score.to(cd) + ape.to(cd)[pos % ratio]
            for ring, new in ((rk, kv), (rs, score)):
                ring.view(-1, ring.shape[-1]).index_copy_(0, dest, new.to(ring.dtype))
    kv, sc = torch.randn(4, 64).bfloat16(), torch.randn(4, 64).bfloat16()
    rings = [torch.zeros(4, 8, 64) for _ in range(2)]
    ape, pos, dest = torch.randn(4, 64), torch.arange(4), torch.arange(4) * 8
    triton.clear()
    with Count() as c:
        write(kv, sc, ape, pos, 4, rings[0], rings[1], dest, torch.float32)
    out["tail_write"] = {"torch_ops": sum(c.ops.values()), "triton_kernels": sum(triton.values()),
                         "launches": sum(c.ops.values()) + sum(triton.values()), "ops": dict(sorted(c.ops.items()))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-src", required=False, help="another tree's src/ (the code before the change)")
    ap.add_argument("--before-label", default="")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default="bench/results/moe_kernel_count.json")
    ap.add_argument("--child", choices=("before", "after"))
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(a.child == "after", a.batch)))
        return 0
    here = Path(__file__).resolve().parents[1]
    runs = {}
    sides = [("after", str(here / "src"))] + ([("before", a.before_src)] if a.before_src else [])
    for side, src in sides:
        env = {**os.environ, "PYTHONPATH": f"{src}:{here}", "TRITON_INTERPRET": "1"}
        r = subprocess.run([sys.executable, "-m", "bench.moe_kernel_count", "--child", side, "--batch", str(a.batch)],
                           capture_output=True, text=True, env=env, cwd=here, timeout=600)
        if r.returncode:
            raise SystemExit(r.stderr[-3000:])
        runs[side] = json.loads(r.stdout.strip().splitlines()[-1])
    from bench.runner import write_result

    summary = {k: {s: runs[s][k]["launches"] for s in runs if k in runs[s]} for k in runs["after"]}
    write_result(a.out, {"batch": a.batch, "before_src": a.before_label or a.before_src, "launches_per_layer": summary,
                         "runs": runs})
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
