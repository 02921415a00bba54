"""The model using the expert-parallel backends: a tiny V4 model with ``set_expert_backend`` on two
gloo ranks, each rank decoding its own prompt, gives the same logits bitwise as the single-process
model (ops in invariant mode, so the other layers do not depend on the batch either). The hash-routed
and score-routed layers, and the MTP block, all run through the backends."""

import pytest
import torch

from tests.optim.distributed import run_world
from v4stack import ops
from v4stack.config import preset
from v4stack.megamoe.backend import ExpertParallel, expert_parallel_factory
from v4stack.model import V4Model


def _world(rank, world):
    cfg = preset("tiny")
    g = torch.Generator().manual_seed(rank)
    toks = torch.randint(0, cfg.vocab_size, (1, 5 + 4 * rank), generator=g)  # ranks send different counts
    with ops.mode("invariant"), torch.no_grad():
        ref = V4Model(cfg, seed=1).eval()
        want, want_mtp = ref.forward_train(toks)
        for path in ("megamoe", "all_to_all"):
            model = V4Model(cfg, seed=1).eval().set_expert_backend(expert_parallel_factory(path, max_tokens=16))
            assert all(isinstance(b.ffn.backend, ExpertParallel) for b in list(model.layers) + list(model.mtp))
            got, got_mtp = model.forward_train(toks)
            assert torch.equal(got, want), path
            assert (got_mtp is None and want_mtp is None) or torch.equal(got_mtp, want_mtp), path
        # control: a lossy dispatch really changes the logits, so the comparison sees the experts
        lossy = V4Model(cfg, seed=1).eval().set_expert_backend(
            expert_parallel_factory("megamoe", max_tokens=16, dispatch_dtype=torch.float8_e4m3fn))
        assert not torch.equal(lossy.forward_train(toks)[0], want)


@pytest.mark.slow  # the default run calls _world inside test_exact's EP2 processes (spawns are slow)
def test_model_through_expert_parallel_backends():
    run_world(_world, 2)
