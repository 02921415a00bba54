"""Deterministic backward through sparse attention, the indexer and the compressors (CPU).

Two properties, on a 3-layer cut of the tiny preset (SWA, CSA with its indexer, HCA; hash-routed and
biased MoE):

- two backwards of the same batch give bitwise equal gradients (every parameter);
- across batch composition: a sequence's activation gradients - the gradient of its own loss with
  respect to its embedding rows and to every block's output streams - are bitwise the same whether
  it is trained alone or inside a batch with other sequences, at another position. Parameter
  gradients are sums over the batch and are not part of this promise (their independence of the
  batch order is `--grad-order sample`'s: tests/train/test_sample_order.py). It holds in invariant mode;
  the fast ops are the inverse control: there the same comparison differs.
"""

import torch

from v4stack import ops
from v4stack.config import ModelConfig, preset
from v4stack.model import V4Model
from v4stack.train.grad_probe import activation_grads

T = 32


def _activation_grads(model: V4Model, batch: torch.Tensor, mode: str):
    with ops.mode(mode):
        return activation_grads(model, batch)


def _model() -> V4Model:
    cfg = {**preset("tiny").to_dict(), "num_hidden_layers": 3, "compress_ratios": [0, 4, 16, 0], "num_hash_layers": 1}
    return V4Model(ModelConfig.from_dict(cfg), seed=0)


def test_backward_is_deterministic_and_independent_of_batch_composition():
    model = _model()
    seqs = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(3))
    mixed_order = seqs[[1, 0]]  # sequence 0 second, next to another sequence
    results = {}
    for mode in ("invariant", "fast"):
        alone, _ = _activation_grads(model, seqs[:1], mode)
        mixed, p1 = _activation_grads(model, mixed_order, mode)
        results[mode] = [torch.equal(a[0], m[1]) for a, m in zip(alone, mixed)]
        if mode == "fast":
            continue
        _, p2 = _activation_grads(model, mixed_order, mode)
        assert p1.keys() == p2.keys() and all(torch.equal(p1[n], p2[n]) for n in p1)
        # the compressors and the attention took part (the indexer only picks entries: the LM loss
        # sends it no gradient, its top-k indices are not differentiable)
        assert any(".attn.compressor." in n for n in p1) and any(".attn.wkv." in n for n in p1)
        assert not any(".attn.indexer." in n for n in p1)
    assert all(results["invariant"]), results["invariant"]
    assert not all(results["fast"])  # inverse control: the comparison can fail
