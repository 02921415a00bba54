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

``batch_order`` (a batch of 4 sequences and the same 4 permuted, each sequence keyed by an id):
parameter tensors that differ between the two orders and between two runs, for the plain batched
backward (the control) and for sample-ordered gradients (``train/sample_order.py``, the trainer's
``--grad-order sample``: one backward per sequence, added in key order), and the seconds of one
forward + backward of the batch each way (the option's cost; median of 3 after a warm-up).
Results are written after every setting, so a cut-off run keeps what it measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from v4stack import ops
from v4stack.config import ModelConfig, preset
from v4stack.model import V4Model
from v4stack.train.grad_probe import activation_grads
from v4stack.train.sample_order import sample_accumulate
from v4stack.train.trainer import lm_losses

ORDER_KEYS, ORDER_PERM = [907, 13, 4410, 256], [2, 0, 3, 1]

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


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _timed(fn, dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def batch_order(model, seqs: torch.Tensor, dev) -> dict:
    """Plain batched backward vs sample-ordered gradients over two orders of one batch: the first
    order runs four times (two runs compared: all four), the permuted order once (compared with
    the first run); the first call is the warm-up, the other four are timed."""
    perm = seqs[ORDER_PERM]
    keys = [ORDER_KEYS, [ORDER_KEYS[i] for i in ORDER_PERM]]

    def plain(i):
        lm_losses(model, (seqs, perm)[i], False)[0].backward()

    def sample(i):
        sample_accumulate(model, [(seqs, perm)[i]], [keys[i]], 1.0 / seqs.shape[0], lm_losses)

    model.zero_grad(set_to_none=True)
    out = {"sequences": seqs.shape[0], "permutation": ORDER_PERM}
    for name, fn in (("plain", plain), ("sample", sample)):
        got, secs = [], []
        for i in (0, 0, 1, 0, 0):
            secs.append(_timed(lambda: fn(i), dev))
            got.append(_grads(model))

        def differ(a, b):
            return sorted(n for n in a if not torch.equal(a[n], b[n]))

        out[name] = {"param_tensors": len(got[0]),
                     "params_differ_two_runs": sorted(set().union(*(differ(got[0], got[j]) for j in (1, 3, 4)))),
                     "params_differ_batch_order": len(differ(got[0], got[2])),
                     "seconds": secs[1:], "seconds_median": statistics.median(secs[1:])}
    out["sample_vs_plain_time"] = out["sample"]["seconds_median"] / out["plain"]["seconds_median"]
    return out


def measure(model: V4Model, name: str, setting: str, dtype, dev, seq: int) -> dict:
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
            g = torch.Generator().manual_seed(3)
            order = batch_order(model, torch.randint(0, model.cfg.vocab_size, (len(ORDER_KEYS), seq), generator=g).to(dev), dev)
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
        "batch_order": order,
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
        model = _model(name, dtype, dev)  # one model per configuration (a Flash-width build takes seconds)
        for setting in a.settings:
            if setting == "invariant" and name == "flash2":
                continue  # the plain-torch invariant ops at Flash width are too slow for this check
            rows.append(measure(model, name, setting, dtype, dev, a.seq_len))
            print(rows[-1], flush=True)
            write_result(a.out, {"device": a.device, "rows": rows})


if __name__ == "__main__":
    main()
