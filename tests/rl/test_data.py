"""Tasks, records, the metadata table and the advantages: no model, no sandbox."""

from __future__ import annotations

import numpy as np
import pytest

from v4stack.rl import tasks as T
from v4stack.rl.grpo import group_advantages
from v4stack.rl.store import CONSUMED, LEASED, READY, MetaTable
from v4stack.rollout import records as R
from v4stack.rollout.wal import TokenWAL, WALInconsistent
from v4stack.serve.sampling import SamplingParams


def test_held_out_questions_never_reach_training_or_demonstrations():
    held = {t.question for t in T.eval_set(200)}
    train = {t.question for t in T.take("train", 3000, 0)}
    assert held and train and not held & train
    demo = T.demonstrations(40_000)
    assert not any(f"\n{q}\n$ " in "\n" + demo for q in held)
    # inverse control: the check above does find a question that is in the corpus
    assert any(f"\n{q}\n$ " in "\n" + demo for q in train)


def test_reward_and_protocol():
    t = T.make("sub", (12, 40))
    assert t.question == "12 - 40" and t.answer == "-28" and t.command == "expr 12 - 40"
    assert T.reward(t, "-28\n") == 1.0 and T.reward(t, "-27\n") == 0.0 and T.reward(t, "") == 0.0
    assert T.tool_command("12 - 40\n$ ", "expr 12 - 40\n") == "expr 12 - 40"
    assert T.tool_command("x\nA: ", "-28\n") is None  # an answer turn is not a command
    assert T.tool_command("12 - 40\n$ ", "expr 12") is None  # cut before its newline
    assert T.parse_question(t.question) == t
    for bad in ("rev ../../etc", "1 + 2 + 3", "upper \u00e9t\u00e9", "len " + "a" * 17, "9999 + 1", ""):
        with pytest.raises(ValueError, match="question"):
            T.parse_question(bad)


def test_records_tool_call_obs_and_logprobs(tmp_path):
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=1, stop=("\n",))
    with TokenWAL(tmp_path / "wal") as wal:
        wal.append([R.begin("a", [1, 2], p)])
        wal.append([R.tokens("a", 0, [5, 6, 10], lp=[-0.5, -1.0, -0.1])])
        wal.append([R.tool_call("a", 3, "expr 1 + 2", "sbx-1", 0), R.obs("a", 3, [51, 10], "ran")])
        wal.append([R.tokens("a", 5, [51], lp=[-0.2]), R.end("a", 6, "stop")])
        with pytest.raises(WALInconsistent, match="off"):  # an observation must start at the log's end
            wal.append([R.obs("a", 2, [1], "ran")])
    with TokenWAL(tmp_path / "wal") as wal:
        tr = wal.trajectories["a"]
        assert tr.tokens == [5, 6, 10, 51, 10, 51] and tr.obs == [(3, 2)]
        assert tr.logprobs == [-0.5, -1.0, -0.1, 0.0, 0.0, -0.2]
        assert tr.calls == [{"off": 3, "cmd": "expr 1 + 2", "sandbox": "sbx-1", "seq": 0}]
    for bad, field in ((R.tokens("a", 0, [1, 2], lp=[-1.0]), "lp"), (R.tokens("a", 0, [1], lp=[0.5]), "lp"),
                       (R.obs("a", 0, [], "ran"), "ids"), (R.obs("a", 0, [1], "guessed"), "how"),
                       (R.tool_call("a", 0, "", "s", 0), "cmd")):
        with pytest.raises(R.RecordError, match=field):
            R.encode(bad)


def test_observation_cannot_pass_the_token_budget(tmp_path):
    p = SamplingParams(temperature=1.0, max_tokens=4, seed=1)
    with TokenWAL(tmp_path / "wal") as wal:
        wal.append([R.begin("a", [1], p), R.tokens("a", 0, [5, 6])])
        with pytest.raises(WALInconsistent, match="max_tokens"):
            wal.append([R.obs("a", 2, [1, 2, 3], "ran")])


def _table(rewards: list[list[float]], versions: list[int]) -> MetaTable:
    t = MetaTable(capacity=2)
    metas = []
    for g, (rs, v) in enumerate(zip(rewards, versions)):
        for i, r in enumerate(rs):
            metas.append({"traj": f"g{g}-{i}", "worker": f"w{g % 2}", "group": f"g{g}", "prompt_len": 5,
                          "gen_len": 7, "reward": r, "version": v})
    t.add(metas, [{"payload": m["traj"]} for m in metas])
    return t


def test_selector_takes_oldest_complete_groups_and_consumes_once():
    t = _table([[1, 0], [0, 0], [1, 1], [0, 1], [1, 0]], versions=[0, 1, 1, 1, 2])
    t.add([{"traj": "g5-0", "worker": "w0", "group": "g5", "prompt_len": 5, "gen_len": 7, "reward": 1, "version": 2}])
    b = t.select(groups=3, group_size=2, min_version=1)  # g0 too old; g5 incomplete
    assert [t.ids[r] for r in b.rows] == ["g3-0", "g3-1"]  # spread groups are trained
    assert sorted(t.ids[r] for r in b.flat) == ["g1-0", "g1-1", "g2-0", "g2-1"]  # flat ones consumed untrained
    rows = np.concatenate([b.rows, b.flat])
    t.lease(rows)
    assert t.handles(b.rows) == [{"payload": "g3-0"}, {"payload": "g3-1"}]
    with pytest.raises(ValueError, match="state"):
        t.lease(rows)  # a leased row cannot be handed out again
    t.consume(rows)
    assert (t.col("state")[rows] == CONSUMED).all() and all(t.heavy[r] is None for r in rows)
    with pytest.raises(ValueError, match="state"):
        t.consume(rows)
    nxt = t.select(groups=3, group_size=2, min_version=0)
    assert sorted(t.ids[r] for r in np.concatenate([nxt.rows, nxt.flat])) == ["g0-0", "g0-1", "g4-0", "g4-1"]
    t.lease(nxt.rows)
    t.release(nxt.rows)  # a trainer that died: back to READY
    assert (t.col("state")[nxt.rows] == READY).all()
    assert t.by_worker(nxt.rows) == {"w0": ["g0-0", "g0-1", "g4-0", "g4-1"]}
    assert LEASED not in set(t.col("state").tolist())


def test_selector_token_budget_and_scale():
    t = MetaTable()
    n = 40_000
    t.add_columns(n, group=np.arange(n) // 4, prompt_len=np.full(n, 10, np.int32), gen_len=np.full(n, 30, np.int32),
                  reward=(np.arange(n) % 2).astype(np.float32))
    b = t.select(groups=100, group_size=4, max_tokens=4 * 40 * 7)
    assert len(b.rows) == 7 * 4 and b.rows.max() < 28  # the budget holds 7 groups, the oldest ones


def test_group_advantages():
    adv = group_advantages(np.array([1, 0, 0, 0, 1, 1], np.float32), np.array([0, 0, 0, 0, 1, 1]))
    assert adv[0] > 0 > adv[1] and abs(adv[:4].sum()) < 1e-5
    assert np.allclose(adv[4:], 0)  # a flat group has no advantage
    assert abs(np.std(adv[:4]) - 1) < 1e-3


def test_rl_rounds_ask_questions_neither_demonstrated_nor_held_out():
    import itertools

    shown = T.demonstrated(30_000)
    assert len(shown) > 100
    asked = [t for t in itertools.islice(T.rl_stream(3, shown), 400)]
    assert not any(t.question in shown or t.held_out for t in asked)
    # inverse control: without the exclusion, the same stream does ask demonstrated questions
    assert any(t.question in shown for t in itertools.islice(T.stream("train", 3), 400))
