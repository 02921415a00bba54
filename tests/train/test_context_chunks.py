"""Chunk-ordered gradients (`--grad-chunks 8`): context parallelism bitwise equal to one process.

Gloo, tiny preset, fp32, invariant ops, sequences of 32 tokens in 8 units of 4. The trainer with
`--cp 2` and `--cp 4` (MTP loss on) gives, after 3 steps, every weight and every logged loss
bit for bit equal to the one-process run with the same switch. Inverse control: the one-process
run with 4 units instead of 8 (another order) differs. Slow: the gradients of one micro-batch
of two sequences under cp 2 equal one process's, and the controls that the same unit pieces with the parameter
gradients left to autograd (each shard sums its rows, shards added in rank order) and the
trainer with the switch off both differ from one process.
"""

import pytest
import torch

from v4stack import ops
from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.train.chunk_grads import ChunkGrads, check_units, tree
from v4stack.train.mesh import Mesh
from v4stack.train.unit_shard import chunked_accumulate

from ..optim.distributed import run_world
from .test_context import _train_run
from .test_pipeline import _assert_same_run, _weights

B, T, U = 1, 32, 8
RUN = dict(grad_chunks=U, mtp_weight=0.3)


def test_tree_and_unit_checks():
    xs = [torch.tensor([float(i)]) for i in range(5)]
    assert torch.equal(tree(xs), ((xs[0] + xs[1]) + (xs[2] + xs[3])) + xs[4])
    check_units(8, 32, 4)
    for units, seq, cp in ((8, 30, 1), (6, 36, 2), (12, 36, 1)):  # seq not a multiple; 6/4; 12/2 = 6
        with pytest.raises(ValueError, match="grad_chunks"):
            check_units(units, seq, cp)
    from v4stack.train.trainer import TrainConfig

    with pytest.raises(ValueError, match="ops invariant"):
        TrainConfig(seq_len=32, grad_chunks=8).validate()
    TrainConfig(seq_len=32, grad_chunks=8, cp=4, ops="invariant").validate()


def _grads(world: int, rank: int = 0, batch: int = B):
    tokens = torch.randint(0, 256, (batch, T), generator=torch.Generator().manual_seed(1))
    with ops.mode("invariant"):
        m = V4Model(preset("tiny"), seed=0)
        hook = ChunkGrads(dict(m.named_parameters()), U)
        chunked_accumulate(m, hook, [tokens], 1.0, Mesh(rank, world, 1, 1, cp=world), 0.3)
    return [p.grad for p in m.parameters()]


def _plain_grads(world: int, rank: int = 0):
    """Inverse control: the same unit pieces, parameter gradients left to autograd (each shard
    sums its own rows) and the shards added in rank order."""
    import torch.distributed as dist

    from v4stack.train.context import Layout, shard_means
    from v4stack.train.unit_shard import unit_losses

    tokens = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
    with ops.mode("invariant"):
        m = V4Model(preset("tiny"), seed=0)
        res = unit_losses(m, tokens, Layout(world, rank, T), U, mtp=True)
        main, extra = shard_means(res, tokens)
        (main + 0.3 * extra).backward()
    out = []
    for p in m.parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad
        if world > 1:
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g)
            g = sum(parts[1:], parts[0].clone())
        out.append(g)
    return out


def _worker(rank, world, out):
    g, plain = _grads(world, rank, batch=2), _plain_grads(world, rank)
    if rank == 0:
        torch.save((g, plain), out)


@pytest.mark.slow
def test_cp2_gradients_bitwise_and_order_control(tmp_path):
    one = _grads(1, batch=2)  # two sequences: units ordered sequence-major inside each pair
    run_world(_worker, 2, str(tmp_path / "g.pt"))
    g, plain = torch.load(tmp_path / "g.pt")
    assert all(torch.equal(a, b) for a, b in zip(g, one))
    plain_one = _plain_grads(1)
    assert not all(torch.equal(a, b) for a, b in zip(plain, plain_one))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _train_run(tmp_path_factory.mktemp("one"), **RUN)


@pytest.mark.parametrize("cp", [2, 4])
def test_train_cp_bitwise_equal_to_one_process(single, tmp_path, cp):
    run = _train_run(tmp_path / "cp", world=cp, cp=cp, **RUN)
    _assert_same_run(run, single, 3)


def test_another_chunk_order_differs(single, tmp_path):
    """Inverse control: 4 units instead of 8 (another summation order) changes the weights, so
    the bitwise comparisons above can fail."""
    other = _train_run(tmp_path / "u4", **{**RUN, "grad_chunks": 4})
    wa, wb = _weights(other, 3), _weights(single, 3)
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_switch_off_differs(single, tmp_path):
    """Inverse control: cp 2 with the switch off (each shard sums its own tokens) is not the
    one-process run's bits."""
    off_cp = _train_run(tmp_path / "offcp", world=2, cp=2, mtp_weight=0.3)
    wc, wb = _weights(off_cp, 3), _weights(single, 3)
    assert any(not torch.equal(wc[k], wb[k]) for k in wc)


@pytest.mark.slow
def test_recompute_keeps_chunk_gradients():
    """`--recompute full` / `matmul` re-run the row steps in the backward under the same hook:
    the chunk-ordered gradients are the plain run's bits."""
    from v4stack.train.recompute import apply_recompute

    plain = _grads(1)
    tokens = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
    for spec in ("full", "matmul"):
        with ops.mode("invariant"):
            m = V4Model(preset("tiny"), seed=0)
            apply_recompute(m, spec, (tokens,))
            hook = ChunkGrads(dict(m.named_parameters()), U)
            chunked_accumulate(m, hook, [tokens], 1.0, Mesh(0, 1, 1, 1), 0.3)
        assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), plain)), spec


@pytest.mark.slow
def test_resume_cp_run_on_other_layouts(tmp_path):
    """A cp 2 run (2 micro-batches a step) stopped after step 2 resumes as dp 2 (one micro-batch
    a replica) and as cp 4: step 3's weights and every loss equal the uninterrupted run's, bit for
    bit (the optimizer shards are merged and re-cut, optim/reshard.py). Control: resumed with
    another MTP weight it differs."""
    import shutil

    args = dict(RUN, grad_accum=2)
    whole = _train_run(tmp_path / "whole", world=2, cp=2, **args)
    _train_run(tmp_path / "cut", world=2, cp=2, **args, steps=2, ckpt_every=2)
    for name in ("cp4", "other"):
        shutil.copytree(tmp_path / "cut", tmp_path / name)
    dp2 = _train_run(tmp_path / "cut", world=2, **{**args, "grad_accum": 1})
    _assert_same_run(dp2, whole, 3)
    cp4 = _train_run(tmp_path / "cp4", world=4, cp=4, **args)
    _assert_same_run(cp4, whole, 3)
    other = _train_run(tmp_path / "other", world=2, cp=2, **{**args, "mtp_weight": 0.6})
    with pytest.raises(AssertionError):
        _assert_same_run(other, whole, 3)


@pytest.mark.slow
def test_pipeline_times_cp_times_dp_bitwise(tmp_path):
    """`--grad-chunks` under 1F1B with MTP (the first and last stages' embedding copies add their
    unit gradients per unit after the step): pp 2 x cp 2 (two micro-batches a step) and pp 2 x
    dp 2 x cp 2 (world 8, one micro-batch a replica) give one process's weights and losses, bit
    for bit."""
    args = dict(grad_chunks=U, grad_accum=2, mtp_weight=0.3)
    one = _train_run(tmp_path / "one", **args)
    pc = _train_run(tmp_path / "pc", world=4, pp=2, cp=2, **args)
    _assert_same_run(pc, one, 3)
    pdc = _train_run(tmp_path / "pdc", world=8, pp=2, cp=2, **{**args, "grad_accum": 1})
    _assert_same_run(pdc, one, 3)
