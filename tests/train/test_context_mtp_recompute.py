"""Context parallelism with the MTP loss and with recompute (gloo, tiny preset, fp32, invariant ops).

MTP: the MTP block's attention runs over the sharded sequence with its own halo exchange; every
per-token MTP loss and the MTP mean are one process's to the bit (cp = 2); the gradients of
main + w MTP stay within the fp32 envelope of test_context.py. Inverse controls: the trunk's
exchanges intact but the MTP block's halos swapped between its two chunks changes the MTP losses;
the one-process gradient of another MTP weight breaks the envelope.

Recompute (`full` and `matmul`): the recomputed forward re-runs the layer's exchanges; the
parameter gradients equal the non-recompute CP run's bitwise. Inverse control: a recompute whose
halo exchange returns its rows times (1 + 2^-12) changes the gradients, so the comparison sees an
inconsistent recompute.

Pipeline x context parallelism (2 stages x 2 shards, MTP on the last stage): the main and MTP
means are one process's to the bit; inverse control: streams sent to the other shard's peer.
Slow: the trainer `--pp 2 --cp 2` with MTP follows one process (step 1 equal, then within 1e-5);
with recompute full, resumed after step 2 it equals the uninterrupted run bitwise.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from v4stack import ops
from v4stack.train import context
from v4stack.train.context import Layout, cp_loss_value, cp_losses
from v4stack.train.recompute import apply_recompute

from ..optim.distributed import run_world
from .test_context import _gather_rows, _model, _tokens, _train_run

B, T = 1, 32
W_MTP = 0.5
STATE = {"calls": 0, "break_from": 1 << 30}
_EXCHANGE = context.exchange_rows


class BreaksLater(Layout):
    """Inverse controls: the halo plan's calls after the ``STATE['break_from']``-th deliver each
    local chunk the other chunk's halo (same shapes, other values; each attention layer asks once
    per forward, the trunk's 6 layers before the MTP block)."""

    def row_plan(self, halo):
        p = super().row_plan(halo)
        STATE["calls"] += 1
        if STATE["calls"] <= STATE["break_from"]:
            return p
        return dataclasses.replace(p, recv_slots=tuple((s + halo) % (2 * halo) for s in p.recv_slots))


def _perturbed_rows(rows, plan, group=None):
    """Inverse control for recompute: the halo exchange delivering slightly other values."""
    return _EXCHANGE(rows, plan, group) * (1 + 2.0 ** -12)


def _run(model, tokens, lay, break_from=1 << 30, perturb_recompute=False):
    STATE.update(calls=0, break_from=break_from)
    model.zero_grad(set_to_none=True)
    res = cp_losses(model, tokens, lay, mtp=True)
    total = res.main[res.has].sum() / (B * (T - 1)) + W_MTP * res.mtp[res.mtp_has].sum() / (B * (T - 2))
    if torch.is_grad_enabled():
        context.exchange_rows = _perturbed_rows if perturb_recompute else _EXCHANGE
        try:
            total.backward()
        finally:
            context.exchange_rows = _EXCHANGE
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return res, grads


def _worker(rank, world, out):
    torch.manual_seed(0)
    tokens = _tokens()
    lay = BreaksLater(world, rank, T)
    out_res = {}
    with ops.mode("invariant"):
        plain = _model()
        res, g_plain = _run(plain, tokens, lay)
        out_res["main"] = _gather_rows(res.main.detach().view(B, -1), lay)
        out_res["mtp"] = _gather_rows(res.mtp.detach().view(B, -1), lay)
        out_res["mtp_value"] = cp_loss_value(res.mtp, res.mtp_has, lay, shift=2)
        summed = []
        for g in g_plain:  # the shards' partial gradients, added in rank order
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g)
            summed.append(sum(parts[1:], parts[0].clone()))
        out_res["grads"] = summed
        out_res["mtp_grad_nonzero"] = any(p.grad is not None and p.grad.abs().sum() > 0
                                          for p in plain.mtp.parameters())
        with torch.no_grad():  # control: the trunk's 6 exchanges intact, the MTP block's halos swapped
            bad, _ = _run(plain, tokens, lay, break_from=6)
        out_res["mtp_no_halo"] = _gather_rows(bad.mtp.view(B, -1), lay)
        for spec in ("full", "matmul"):
            m = _model()
            apply_recompute(m, spec, ())
            _, g = _run(m, tokens, lay)
            out_res[spec] = all(torch.equal(a, b) for a, b in zip(g, g_plain))
        m = _model()
        apply_recompute(m, "full", ())
        _, g = _run(m, tokens, lay, perturb_recompute=True)
        out_res["inconsistent_recompute_equal"] = all(torch.equal(a, b) for a, b in zip(g, g_plain))
    dist.barrier()
    if rank == 0:
        torch.save(out_res, out)


def _one_process(dtype, mode, w=W_MTP):
    """Per-token main and MTP losses, the MTP mean and the gradients of main + w * MTP."""
    tokens = _tokens()
    with ops.mode(mode):
        torch.manual_seed(0)
        m = _model(dtype)
        logits, mtp_logits = m.forward_train(tokens)
        V = logits.shape[-1]
        per = F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1), reduction="none")
        mtp_per = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), tokens[:, 2:].reshape(-1), reduction="none")
        mtp_mean = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), tokens[:, 2:].reshape(-1))
        (per.mean() + w * mtp_mean).backward()
        grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]
    return per.detach(), mtp_per.detach(), mtp_mean.detach(), grads


def _within_envelope(cp_grads, g32, g64, target=None) -> bool:
    """Every CP gradient within 8x one process's own fp32 error (``g32`` against ``g64``) of
    ``target`` (default ``g64``), as in test_context.py."""
    for a, b, exact, t in zip(cp_grads, g32, g64, g64 if target is None else target):
        exact, t = exact.float(), t.float()
        err_one, err_cp = (b - exact).abs().max().item(), (a - t).abs().max().item()
        if err_cp > 8 * err_one + 2.0 ** -20 * exact.abs().max().item():
            return False
    return True


def test_cp_mtp_bitwise_and_recompute_gradients(tmp_path):
    per, mtp_per, mtp_mean, g32 = _one_process(torch.float32, "invariant")
    g64 = _one_process(torch.float64, "fast")[3]
    g64_half_mtp = _one_process(torch.float64, "fast", W_MTP / 2)[3]
    out = tmp_path / "r.pt"
    run_world(_worker, 2, str(out))
    res = torch.load(out)
    assert torch.equal(res["main"][:, :-1], per.view(B, -1))
    assert torch.equal(res["mtp"][:, :-2], mtp_per.view(B, -1))  # every MTP token's loss, bitwise
    assert torch.equal(res["mtp_value"], mtp_mean)
    assert res["mtp_grad_nonzero"]
    assert not torch.equal(res["mtp_no_halo"][:, :-2], mtp_per.view(B, -1))  # control: MTP needs its halo
    # gradients with the MTP loss: within the fp32 envelope of one process; control: against the
    # one-process gradient of another MTP weight the envelope is broken (it sees MTP's share)
    assert _within_envelope(res["grads"], g32, g64)
    assert not _within_envelope(res["grads"], g32, g64, target=g64_half_mtp)
    assert res["full"] and res["matmul"]  # recompute: gradients bitwise equal to no recompute
    assert not res["inconsistent_recompute_equal"]  # control: a recompute seeing other halos differs


def _pp_worker(rank, world, out):
    from v4stack.train.mesh import build_mesh
    from v4stack.train.pipeline import Stage, run_1f1b

    torch.manual_seed(0)
    tokens = _tokens()
    res = {}
    with ops.mode("invariant"):
        for name in ("right", "swapped"):
            mesh = build_mesh(2, 2)
            if name == "swapped":  # inverse control: streams go to the other shard's peer
                mesh.peer = lambda stage, m=mesh: (stage * m.dp + m.replica) * m.cp + 1 - m.cp_rank
            stage = Stage.build(_model(), mesh, mtp=True)
            res[name] = run_1f1b(stage, [tokens], W_MTP, 1.0)
    if rank == 2:  # the last stage's first shard holds the means
        torch.save(res, out)


def test_pp2_cp2_losses_equal_one_process(tmp_path):
    """Pipeline x context parallelism (2 stages x 2 shards, MTP on the last stage): each stage's
    attention layers exchange over the stage's cp group, streams pass between peers of the same
    shard; the main and MTP means are one process's to the bit."""
    tokens = _tokens()
    with ops.mode("invariant"):
        torch.manual_seed(0)
        logits, mtp_logits = _model().forward_train(tokens)
        V = logits.shape[-1]
        main = F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1))
        mtp = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), tokens[:, 2:].reshape(-1))
    out = tmp_path / "pp.pt"
    run_world(_pp_worker, 4, str(out))
    res = torch.load(out)
    assert torch.equal(res["right"], torch.stack([main, mtp]))
    assert not torch.equal(res["swapped"][0], main)  # control: the other shard's streams are seen


@pytest.mark.slow
def test_train_pp2_cp2_follows_one_process(tmp_path):
    """Pipeline x context parallelism (world 4: 2 stages x 2 shards, MTP on the last stage): each
    stage's attention layers exchange over the stage's cp group; the streams pass between peers
    of the same shard."""
    from .test_pipeline import _losses

    one = _train_run(tmp_path / "one", mtp_weight=0.3, grad_accum=2)
    pc = _train_run(tmp_path / "pc", world=4, pp=2, cp=2, mtp_weight=0.3, grad_accum=2)
    la, lb = _losses(pc), _losses(one)
    assert la[0] == lb[0] and all(abs(x - y) <= 1e-5 for x, y in zip(la, lb)), (la, lb)
    import json

    meta = json.loads((pc / "loss.json").read_text())["meta"]
    assert (meta["pp"], meta["cp"], meta["dp"]) == (2, 2, 1)
    ma = [r["mtp_loss"] for r in json.loads((pc / "loss.json").read_text())["records"]]
    mb = [r["mtp_loss"] for r in json.loads((one / "loss.json").read_text())["records"]]
    assert ma[0] == mb[0] and all(abs(x - y) <= 1e-5 for x, y in zip(ma, mb)), (ma, mb)


def test_cp_refusals_name_the_field():
    """What `--cp` still refuses gets a clear error; what it now runs validates."""
    from v4stack.train.trainer import TrainConfig

    ok = dict(cp=2, seq_len=32)
    TrainConfig(**ok, mtp_weight=0.3, recompute="matmul").validate()
    TrainConfig(**ok, pp=2).validate()
    for bad, match in ((dict(recompute="plan:0.5"), "plan:F"), (dict(ep=2), "ep 1"),
                       (dict(pp=2, pp_schedule="interleaved", pp_virtual=2, grad_accum=2), "1f1b"),
                       (dict(seq_len=30), "multiple of 2 x cp")):
        with pytest.raises(ValueError, match=match):
            TrainConfig(**{**ok, **bad}).validate()


@pytest.mark.slow
def test_train_pp2_cp2_resume_is_bitwise(tmp_path):
    """--pp 2 --cp 2 (MTP, recompute full): stopped after step 2 and resumed, step 3's weights and
    every loss equal the uninterrupted run's bitwise; control: the same checkpoint resumed with
    another MTP weight is seen to differ."""
    import shutil

    from .test_pipeline import _assert_same_run

    args = dict(world=4, pp=2, cp=2, mtp_weight=0.3, recompute="full", grad_accum=2)
    whole = _train_run(tmp_path / "whole", **args)
    _train_run(tmp_path / "cut", **args, steps=2, ckpt_every=2)
    shutil.copytree(tmp_path / "cut", tmp_path / "other")
    cut = _train_run(tmp_path / "cut", **args)
    _assert_same_run(cut, whole, 3)
    other = _train_run(tmp_path / "other", **{**args, "mtp_weight": 0.6})
    with pytest.raises(AssertionError):
        _assert_same_run(other, whole, 3)
