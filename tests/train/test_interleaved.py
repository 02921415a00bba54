"""The interleaved 1F1B schedule: its order (every op once, micro-batch order per chunk, no deadlock,
the textbook bubble), and on real gloo groups pp 2 x 2 chunks bitwise equal to one process
accumulating the same micro-batches; bad options are refused naming the field."""

import json

import pytest
import torch
from typer.testing import CliRunner

from v4stack.train.interleaved import order, simulate, virtual_bounds
from v4stack.train.trainer import TrainConfig, train

from .test_pipeline import BASE, _assert_same_run, _spawn, _weights


@pytest.fixture(scope="module")
def single4(tmp_path_factory):
    out = tmp_path_factory.mktemp("single4")
    train(TrainConfig(**{**BASE, "grad_accum": 4, "ckpt_every": 1, "out": str(out)}))
    return out


def test_chunks_are_round_robin_and_cover_the_model():
    assert virtual_bounds(6, 2, 2) == [[range(0, 2), range(4, 5)], [range(2, 4), range(5, 6)]]
    assert virtual_bounds(6, 2, 3) == [[range(0, 1), range(2, 3), range(4, 5)], [range(1, 2), range(3, 4), range(5, 6)]]
    with pytest.raises(ValueError, match="'pp_virtual'"):
        virtual_bounds(6, 4, 2)


@pytest.mark.parametrize("P,V,M", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 4, 8), (8, 2, 16), (3, 2, 6)])
def test_order_runs_every_op_once_in_micro_batch_order_without_deadlock(P, V, M):
    for r in range(P):
        ops = order(P, V, M, r)
        want = {(k, c, i) for k in "FB" for c in range(V) for i in range(M)}
        assert len(ops) == len(want) and set(ops) == want
        for k in "FB":
            for c in range(V):
                assert [i for kk, cc, i in ops if (kk, cc) == (k, c)] == list(range(M))
    f, b = 1.0, 2.0
    sim = simulate(P, V, M, f, b)
    # the bubble of the interleaved schedule is (P - 1)(F + B) / V (1F1B's divided by V)
    assert sim["makespan"] - sim["busy"] == pytest.approx((P - 1) * (f + b) / V)
    one = simulate(P, 1, M, f, b)
    assert one["makespan"] - one["busy"] == pytest.approx((P - 1) * (f + b))


def _messages(P, V, orders):
    """Per (sender, receiver): the messages in the sender's send order and the receiver's recv order."""
    K, sends, recvs = P * V, {}, {}
    for r in range(P):
        for kind, c, i in orders[r]:
            k = c * P + r
            if kind == "F" and k > 0:
                recvs.setdefault(((k - 1) % P, r), []).append(("F", k, i))
            if kind == "F" and k < K - 1:
                sends.setdefault((r, (k + 1) % P), []).append(("F", k + 1, i))
            if kind == "B" and k < K - 1:
                recvs.setdefault(((k + 1) % P, r), []).append(("B", k, i))
            if kind == "B" and k > 0:
                sends.setdefault((r, (k - 1) % P), []).append(("B", k - 1, i))
    return sends, recvs


@pytest.mark.parametrize("P,V,M", [(2, 2, 4), (2, 3, 6), (4, 2, 8), (4, 4, 16), (8, 2, 16)])
def test_each_pair_receives_in_the_order_it_sends(P, V, M):
    sends, recvs = _messages(P, V, [order(P, V, M, r) for r in range(P)])
    assert sends == recvs


def test_inverse_control_a_bad_order_is_caught():
    # rank 0 starting with a backward waits on rank 1, which waits on rank 0's first forward
    orders = [order(2, 2, 4, r) for r in range(2)]
    orders[0] = [orders[0][-1]] + orders[0][:-1]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(2, 2, 4, orders=orders)
    # and the message-order check sees rank 0 running two forwards of chunk 0 the other way round
    orders = [order(2, 2, 4, r) for r in range(2)]
    assert orders[0][:2] == [("F", 0, 0), ("F", 0, 1)]
    orders[0][:2] = orders[0][1::-1]
    sends, recvs = _messages(2, 2, orders)
    assert sends != recvs
    with pytest.raises(ValueError, match="'grad_accum'"):
        order(2, 2, 3, 0)


def test_interleaved_equals_one_process_and_resumes_under_1f1b(single4, tmp_path):
    # steps 1-2 interleaved (pp 2, 2 chunks per rank), step 3 resumed from its checkpoint under 1F1B
    _spawn(2, tmp_path, steps=2, ckpt_every=2, pp=2, pp_schedule="interleaved", pp_virtual=2, grad_accum=4)
    wa, wb = _weights(tmp_path, 2), _weights(single4, 2)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # each rank wrote its own non-contiguous chunks: rank 0 blocks 0-1 and 4 with the embedding
    d = tmp_path / "ckpt" / "step_000002"
    assert json.loads((d / "meta.json").read_text())["pp_virtual"] == 2
    part0 = torch.load(d / "model.stage0.pt", weights_only=False)["model"]
    assert {int(n.split(".")[1]) for n in part0 if n.startswith("layers.")} == {0, 1, 4}
    assert "embed.weight" in part0 and "head.weight" not in part0
    _spawn(2, tmp_path, pp=2, grad_accum=4)  # another stage layout: the optimizer shards are re-cut
    _assert_same_run(tmp_path, single4, 3)


def test_inverse_control_accumulation_order_changes_the_bits():
    # what the pipeline must preserve: the same 4 micro-batches summed in another order differ
    from v4stack.config import preset
    from v4stack.model import V4Model
    from v4stack.train.data import ByteBatches
    from v4stack.train.trainer import lm_losses

    data = bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0)).tolist())
    batches = ByteBatches(data, BASE["seq_len"], BASE["batch_size"], 0)
    micro = [batches.batch(1, m) for m in range(4)]
    grads = []
    for seq in (micro, micro[::-1]):
        model = V4Model(preset("tiny"), seed=0)
        for tokens in seq:
            (lm_losses(model, tokens, False)[0] * 0.25).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert any(not torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_bad_options_name_the_field(tmp_path):
    from .test_cli import _app

    def run(*args):
        return CliRunner().invoke(_app(), ["train", "--out", str(tmp_path), *args])

    res = run("--pp-schedule", "zigzag")
    assert res.exit_code == 2 and "'pp_schedule' must be one of" in res.output
    res = run("--pp-virtual", "2")
    assert res.exit_code == 2 and "'pp_virtual' must be 1 with pp_schedule 1f1b" in res.output
    res = run("--pp-schedule", "interleaved", "--pp-virtual", "1", "--pp", "2")
    assert res.exit_code == 2 and "'pp_virtual'" in res.output
    res = run("--pp-schedule", "interleaved", "--pp-virtual", "2", "--pp", "2", "--grad-accum", "3")
    assert res.exit_code == 2 and "'grad_accum' (3) must be a multiple of pp (2)" in res.output
    res = run("--pp-schedule", "interleaved", "--pp-virtual", "2")
    assert res.exit_code == 2 and "'pp' must be >= 2" in res.output


@pytest.mark.slow
@pytest.mark.parametrize("world,over", [(2, {"mtp_weight": 0.3}), (4, {})])
def test_interleaved_equals_1f1b_with_mtp_and_with_data_parallel(tmp_path, world, over):
    # MTP on the last virtual stage (the embedding tied across ranks 0 and P - 1), and pp 2 x dp 2:
    # both schedules sum every gradient in the same order, so they agree bit for bit
    a, b = tmp_path / "1f1b", tmp_path / "interleaved"
    _spawn(world, a, pp=2, grad_accum=2, **over)
    _spawn(world, b, pp=2, pp_schedule="interleaved", pp_virtual=2, grad_accum=2, **over)
    _assert_same_run(a, b, 3)


@pytest.mark.slow
def test_three_ranks_of_two_chunks_equal_one_process(tmp_path):
    # pp 3 x 2 chunks: six one-block virtual stages, the streams wrapping from rank 2 to rank 0 once
    one, three = tmp_path / "one", tmp_path / "three"
    train(TrainConfig(**{**BASE, "grad_accum": 6, "out": str(one)}))
    _spawn(3, three, pp=3, pp_schedule="interleaved", pp_virtual=2, grad_accum=6)
    _assert_same_run(three, one, 3)
