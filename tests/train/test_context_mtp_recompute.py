"""Context parallelism with the MTP loss and with recompute (gloo, tiny preset, fp32, invariant ops).

MTP: the MTP block's attention runs over the sharded sequence with its own halo exchange; every
per-token MTP loss and the MTP mean are one process's to the bit (cp = 2). Inverse control: the
trunk's exchanges intact but the MTP block's halos swapped between its two chunks changes the
MTP losses.

Recompute (`full` and `matmul`): the recomputed forward re-runs the layer's exchanges; the
parameter gradients equal the non-recompute CP run's bitwise. Inverse control: a recompute whose
halo exchange returns its rows times (1 + 2^-12) changes the gradients, so the comparison sees an
inconsistent recompute.

Pipeline x context parallelism (2 stages x 2 shards, MTP on the last stage): the main and MTP
means are one process's to the bit; inverse control: streams sent to the other shard's peer.
Slow: the trainer `--pp 2 --cp 2` with MTP follows one process (step 1 equal, then within 1e-5).
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


def test_cp_mtp_bitwise_and_recompute_gradients(tmp_path):
    tokens = _tokens()
    with ops.mode("invariant"):  # one process: the main and MTP per-token losses
        torch.manual_seed(0)
        logits, mtp_logits = _model().forward_train(tokens)
        V = logits.shape[-1]
        per = F.cross_entropy(logits[:, :-1].reshape(-1, V), tokens[:, 1:].reshape(-1), reduction="none")
        mtp_per = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), tokens[:, 2:].reshape(-1), reduction="none")
        mtp_mean = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), tokens[:, 2:].reshape(-1))
    out = tmp_path / "r.pt"
    run_world(_worker, 2, str(out))
    res = torch.load(out)
    assert torch.equal(res["main"][:, :-1], per.view(B, -1))
    assert torch.equal(res["mtp"][:, :-2], mtp_per.view(B, -1))  # every MTP token's loss, bitwise
    assert torch.equal(res["mtp_value"], mtp_mean)
    assert res["mtp_grad_nonzero"]
    assert not torch.equal(res["mtp_no_halo"][:, :-2], mtp_per.view(B, -1))  # control: MTP needs its halo
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
