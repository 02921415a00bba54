"""Sample-ordered gradients (`--grad-order sample`): a step's parameter gradients, and the weights
after it, are the same bits for any order of its sequences and any split into micro-batches.

Inverse controls: the plain batched backward, and the per-sequence backward added in batch position
order instead of key order, give other bits for the other order (so the comparisons can fail)."""

import pytest
import torch
import torch.nn.functional as F

from v4stack.config import ModelConfig, preset
from v4stack.model import V4Model
from v4stack.train import checkpoint as ckpt
from v4stack.train.data import ByteBatches
from v4stack.train.sample_order import canonical_order, sample_accumulate
from v4stack.train.trainer import TrainConfig, lm_losses, train

T = 32


def _model() -> V4Model:
    cfg = {**preset("tiny").to_dict(), "num_hidden_layers": 2, "compress_ratios": [4, 16, 0],
           "num_hash_layers": 1, "num_nextn_predict_layers": 1}
    return V4Model(ModelConfig.from_dict(cfg), seed=0)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _sample(model, micro, keys) -> dict[str, torch.Tensor]:
    sample_accumulate(model, micro, keys, 1.0 / sum(m.shape[0] for m in micro), lm_losses, mtp_weight=0.3)
    return _grads(model)


def _batched(model, tokens) -> dict[str, torch.Tensor]:
    main, extra = lm_losses(model, tokens, True)
    (main + 0.3 * extra).backward()
    return _grads(model)


def _differ(a, b) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


def test_gradients_do_not_depend_on_the_order_or_split_of_the_sequences():
    model = _model()
    seqs = torch.randint(0, 256, (4, T), generator=torch.Generator().manual_seed(5))
    keys = [907, 13, 4410, 256]  # identities, not positions
    perm = [2, 0, 3, 1]
    ref = _sample(model, [seqs], [keys])
    assert len(ref) > 50 and any(".attn.compressor." in n for n in ref) and "embed.weight" in ref
    assert _differ(ref, _sample(model, [seqs[perm]], [[keys[i] for i in perm]])) == []
    # another batch_size x grad_accum split, sequences moved between the micro-batches
    split = [seqs[[3, 1]], seqs[[0, 2]]]
    assert _differ(ref, _sample(model, split, [[keys[3], keys[1]], [keys[0], keys[2]]])) == []
    # inverse controls: the plain batched backward, and keys that are batch positions
    plain = _differ(_batched(model, seqs), _batched(model, seqs[perm]))
    by_position = _differ(ref, _sample(model, [seqs[perm]], [list(range(4))]))
    assert plain and by_position, (plain, by_position)
    print(f"differ: plain {len(plain)}, by position {len(by_position)} of {len(ref)}")
    # the objective is the plain path's: the same gradients up to rounding
    close = _batched(model, seqs)
    assert all(torch.allclose(ref[n], close[n], rtol=1e-4, atol=1e-6) for n in ref)


def test_canonical_order_refuses_a_key_shared_by_different_sequences():
    a = torch.arange(8).view(2, 4)
    assert canonical_order([a, a[[1]]], [[5, 3], [3]]) == [(0, 1), (1, 0), (0, 0)]  # a tie of equal tokens
    with pytest.raises(ValueError, match="sample key 3 names two different sequences"):
        canonical_order([a, a[[0]]], [[5, 3], [3]])
    with pytest.raises(ValueError, match="2 sequences and 1 keys"):
        canonical_order([a], [[5]])


SMALL = dict(preset="tiny", steps=2, batch_size=4, seq_len=32, ckpt_every=2, corpus_bytes=1 << 15, threads=1,
             progress=False, eval_batches=1, warmup=1)


def _weights(tmp_path, name, monkeypatch, reverse: bool, **over):
    starts = ByteBatches.starts
    with monkeypatch.context() as m:
        if reverse:
            m.setattr(ByteBatches, "starts", lambda self, step, micro: starts(self, step, micro).flip(0))
        train(TrainConfig(**SMALL, **over, out=str(tmp_path / name)))
    return ckpt.load_model(tmp_path / name / "ckpt" / "step_000002")["model"]


def test_trainer_weights_after_two_steps_do_not_depend_on_the_batch_order(tmp_path, monkeypatch):
    a = _weights(tmp_path, "a", monkeypatch, False, grad_order="sample")
    b = _weights(tmp_path, "b", monkeypatch, True, grad_order="sample")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # inverse control: the default batch order
    c = _weights(tmp_path, "c", monkeypatch, False)
    d = _weights(tmp_path, "d", monkeypatch, True)
    assert any(not torch.equal(c[k], d[k]) for k in c)
    with pytest.raises(ValueError, match="grad_order"):
        TrainConfig(grad_order="sample", cp=2, seq_len=32).validate()
    with pytest.raises(ValueError, match="grad_order"):
        TrainConfig(grad_order="key").validate()
