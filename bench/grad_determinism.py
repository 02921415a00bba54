"""Gradient determinism of the training backward on one device: two runs, batch composition.

    python -m bench.grad_determinism --device cuda --out bench/results/grad_determinism_h200.json
    python -m bench.grad_determinism --configs tiny --seq-len 32     # CPU smoke

Per configuration (a 2-layer slice with one CSA and one HCA layer, so sparse attention, the indexer's
selection and both compressors run) and per setting:

- ``fast``: the fast ops, torch's defaults;
- ``fast+deterministic``: the fast ops under ``torch.use_deterministic_algorithms(True)``;
- ``invariant``: the batch-invariant ops.

it records: parameter tensors whose gradients differ between two backwards of the same batch;
with one sequence trained alone and then second in a batch of two, the activation tensors (its
embedding rows and each block's output streams) whose gradient rows differ and the largest
difference; and, reported only, parameter tensors that differ when the batch is reversed.
Results are written after every setting, so a cut-off run keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from v4stack import ops
from v4stack.config import ModelConfig, preset
from v4stack.model import V4Model
from v4stack.train.grad_probe import activation_grads

SLICES = {
    "flash2": ("flash", {"num_hidden_layers": 2, "compress_ratios": [4, 128], "num_nextn_predict_layers": 0,
                         "n_routed_experts": 8, "num_hash_layers": 1, "vocab_size": 8192}),
    "tiny": ("tiny", {"num_hidden_layers": 2, "compress_ratios": [4, 16], "num_nextn_predict_layers": 0,
                      "num_hash_layers": 1}),
}


def _model(name: str, dtype, dev) -> V4Model:
    base, over = SLICES[name]
    cfg = ModelConfig.from_dict({**preset(base).to_dict(), **over})
    return V4Model(cfg, seed=0).cast(dtype).to(dev)


def measure(name: str, setting: str, dtype, dev, seq: int) -> dict:
    model = _model(name, dtype, dev)
    g = torch.Generator().manual_seed(2)
    seqs = torch.randint(0, model.cfg.vocab_size, (2, seq), generator=g).to(dev)
    mode = "invariant" if setting == "invariant" else "fast"
    det = setting == "fast+deterministic"
    prev = torch.are_deterministic_algorithms_enabled()
    t0 = time.perf_counter()
    try:
        torch.use_deterministic_algorithms(det)
        with ops.mode(mode):
            alone, _ = activation_grads(model, seqs[:1])
            mixed, p1 = activation_grads(model, seqs[[1, 0]])
            _, p2 = activation_grads(model, seqs[[1, 0]])
            _, p3 = activation_grads(model, seqs)
    except RuntimeError as e:  # e.g. an op without a deterministic implementation
        return {"config": name, "setting": setting, "error": str(e).splitlines()[0][:300]}
    finally:
        torch.use_deterministic_algorithms(prev)
    act_diff = [i for i, (a, m) in enumerate(zip(alone, mixed)) if not torch.equal(a[0], m[1])]
    return {
        "config": name, "setting": setting, "dtype": str(dtype)[6:], "seq_len": seq, "seconds": time.perf_counter() - t0,
        "param_tensors": len(p1),
        "params_differ_two_runs": sorted(n for n in p1 if not torch.equal(p1[n], p2[n])),
        "activation_tensors": len(alone),
        "activations_differ_alone_vs_batch": act_diff,
        "activation_max_abs_diff": max(((a[0].float() - m[1].float()).abs().max().item()
                                        for a, m in zip(alone, mixed)), default=0.0),
        "params_differ_reversed_batch": len([n for n in p1 if n in p3 and not torch.equal(p1[n], p3[n])]),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="bench grad-determinism", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--configs", nargs="+", default=["flash2", "tiny"])
    ap.add_argument("--settings", nargs="+", default=["fast", "fast+deterministic", "invariant"])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", default="bench/results/grad_determinism.json")
    a = ap.parse_args(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS under deterministic algorithms
    from bench.runner import write_result

    dev = torch.device(a.device)
    rows = []
    for name in a.configs:
        dtype = torch.bfloat16 if name == "flash2" else torch.float32
        for setting in a.settings:
            if setting == "invariant" and name == "flash2":
                continue  # the plain-torch invariant ops at Flash width are too slow for this check
            rows.append(measure(name, setting, dtype, dev, a.seq_len))
            print(rows[-1], flush=True)
            write_result(a.out, {"device": a.device, "rows": rows})


if __name__ == "__main__":
    main()
