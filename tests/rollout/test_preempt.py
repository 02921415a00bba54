"""Preemption with saved KV, resume, and recovery in one process (tiny model): every path continues
bit-identically to the uninterrupted run, seeded sampling included."""

from __future__ import annotations

import pytest
import torch

from v4stack.config import preset
from v4stack.model import V4Model
from v4stack.rollout import NotDurable, RolloutWorker, TokenWAL
from v4stack.rollout import records as R
from v4stack.serve.cache.disk import DiskPrefixStore
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams

TRAJ = {
    "s": ([7, 3, 99, 41, 12, 250, 8, 8, 1, 17, 64, 5, 33, 2, 90, 71, 6, 6, 18, 40, 9],
          SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=11)),
    "g": ([200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], SamplingParams(max_tokens=14)),
}


@pytest.fixture(scope="module")
def model():
    return V4Model(preset("tiny"), seed=0).cast(torch.float32).eval()


def make(model, path, pipeline=False, store_dir=None, save_every=0):
    seen: dict[str, list[int]] = {}

    def expose(e):
        assert e.durable_lsn >= e.record_end
        s = seen.setdefault(e.traj, [])
        assert e.off == len(s)
        s.extend(e.ids)

    eng = Engine(model, EngineConfig(n_blocks=64, n_slots=8))
    store = DiskPrefixStore(store_dir, eng.cache, "full") if store_dir is not None else None
    w = RolloutWorker(eng, TokenWAL(path), expose, pipeline=pipeline, prefix_store=store, save_every=save_every)
    return w, seen


def start(w):
    for tid, (p, sp) in TRAJ.items():
        w.submit(tid, p, sp)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    w, seen = make(model, tmp_path_factory.mktemp("ref") / "wal")
    start(w)
    w.run()
    w.close()
    assert all(len(v) == 14 for v in seen.values())
    return seen


@pytest.mark.parametrize("damage", [None, "delete", "flip", "wrong-file", "truncated", "foreign"])
def test_preempt_resume(model, tmp_path, reference, damage):
    w, seen = make(model, tmp_path / "wal", pipeline=damage == "flip")
    start(w)
    w.run(max_steps=6)
    h = w.preempt("s", save_kv=True)
    assert h is not None and (w.kv_dir / h["file"]).exists() and h["pos"] > len(TRAJ["s"][0])
    path = w.kv_dir / h["file"]
    if damage == "delete":
        path.unlink()
    elif damage == "flip":
        b = bytearray(path.read_bytes())
        b[len(b) // 2] ^= 1
        path.write_bytes(bytes(b))
    elif damage == "wrong-file":
        w.preempt("g", save_kv=True)  # g's file under s's name: right format, wrong digest
        path.write_bytes((w.kv_dir / w.wal.trajectories["g"].kv["file"]).read_bytes())
        assert w.resume("g") == "reused"
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-64])
    elif damage == "foreign":  # the file another worker saved under the same name (same id, offset)
        other = make(model, tmp_path / "other-wal")[0]
        other.submit("s", TRAJ["s"][0] + [5], TRAJ["s"][1])
        other.run(max_steps=6)
        oh = other.preempt("s", save_kv=True)
        assert oh["file"] == h["file"] and oh["digest"] != h["digest"]
        path.write_bytes((other.kv_dir / oh["file"]).read_bytes())
        other.close()
    w.run(max_steps=2)  # the other trajectory keeps going meanwhile
    before = w.engine.stats.tokens_computed
    mode = w.resume("s")
    rq = w.live["s"]
    w.step()
    fed = w.engine.stats.tokens_computed - before
    hit = rq.cache.hit_tokens
    w.run()
    w.close()
    assert seen == reference
    t = TokenWAL(tmp_path / "wal")
    tr = t.trajectories["s"]
    t.close()
    assert tr.finished and tr.preemptions == 1
    if damage is None:
        assert mode == "reused" and tr.resumes == ["reused"] and not path.exists()
        assert fed <= 2  # the pending token (plus g's decode token), not the whole history
    else:
        assert mode == "reprefilled" and tr.resumes == ["reprefilled"]
        assert fed > 2 and fed + hit >= h["pos"]  # the durable tokens were fed again (less any prefix hit)


def test_recover_after_close_and_cut_tail(model, tmp_path, reference):
    w, seen = make(model, tmp_path / "wal")
    start(w)
    w.run(max_steps=5)
    w.close()  # as if the process died here (tokens durable, requests gone)
    seg = sorted((tmp_path / "wal").glob("seg-*.log"))[-1]
    with open(seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00garbage")  # a torn record at the tail
    w2, seen2 = make(model, tmp_path / "wal")
    assert w2.wal.recovery.cut_bytes == 11
    durable = {k: list(v.tokens) for k, v in w2.wal.trajectories.items()}
    assert all(seen[k] == durable[k] for k in durable)
    assert w2.recover() == {"s": "reprefilled", "g": "reprefilled"}
    for k, v in seen.items():
        seen2[k] = list(v)
    w2.run()
    w2.close()
    assert seen2 == reference


def test_recover_ends_complete_trajectory_without_end(model, tmp_path):
    p, sp = TRAJ["g"]
    with TokenWAL(tmp_path / "wal") as wal:
        wal.append([R.begin("g", p, sp), R.tokens("g", 0, list(range(14)))])
    w, seen = make(model, tmp_path / "wal")
    ends = []
    w.expose = lambda e: ends.append(e)
    assert w.recover() == {"g": "ended"}
    assert ends[0].finished and ends[0].reason == "length" and not w.engine.has_work()
    assert w.wal.trajectories["g"].status == "ended"
    w.close()


def test_exposure_refused_before_durable(model, tmp_path):
    w, _ = make(model, tmp_path / "wal")
    with pytest.raises(NotDurable):
        w._expose([("x", 0, (1,), False, None)], w.wal.durable_lsn + 1)
    w.close()


def test_reward_and_consumed_once(model, tmp_path):
    p, sp = TRAJ["g"]
    with TokenWAL(tmp_path / "wal") as wal:
        wal.append([R.begin("g", p, sp), R.tokens("g", 0, [1, 2]), R.end("g", 2, "stop")])
    w, _ = make(model, tmp_path / "wal")
    w.reward("g", 1.0)
    w.consume("g", 3)
    with pytest.raises(Exception, match="already consumed at step 3"):
        w.consume("g", 4)
    w.close()
    with TokenWAL(tmp_path / "wal") as wal:
        assert (wal.trajectories["g"].reward, wal.trajectories["g"].consumed) == (1.0, 3)


def test_cancel_running_and_preempted(model, tmp_path):
    w, seen = make(model, tmp_path / "wal")
    ends = []
    inner = w.expose
    w.expose = lambda e: (inner(e), ends.append((e.traj, e.finished, e.reason)))
    start(w)
    w.run(max_steps=3)
    w.preempt("g", save_kv=True)
    w.cancel("s")
    w.cancel("g")
    assert not w.engine.has_work() and not w.live and not list(w.kv_dir.glob("*.kv"))
    assert ("s", True, "abort") in ends and ("g", True, "abort") in ends
    with pytest.raises(ValueError, match="not an unfinished"):
        w.cancel("s")
    w.close()
    with TokenWAL(tmp_path / "wal") as wal:
        assert all(t.end_reason == "abort" and t.tokens == seen[t.traj] for t in wal.trajectories.values())


def test_sampler_advance_matches_the_draws_of_sampled_tokens():
    from v4stack.serve.sampling import Sampler

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(256, generator=g) for _ in range(12)]
    for sp in (SamplingParams(temperature=0.8, top_p=0.9, seed=4), SamplingParams(seed=4)):
        a, b = Sampler(sp), Sampler(sp)
        whole = [a(lg) for lg in logits]
        b.advance(7)
        assert [b(lg) for lg in logits[7:]] == whole[7:]
    a, c = Sampler(SamplingParams(temperature=0.8, seed=4)), Sampler(SamplingParams(temperature=0.8, seed=4))
    whole = [a(lg) for lg in logits]
    assert [c(lg) for lg in logits[7:]] != whole[7:]  # without the advance the stream is off
    with pytest.raises(ValueError, match="n must be >= 0"):
        c.advance(-1)


def test_recover_restores_prefix_from_disk(model, tmp_path, reference):
    w, seen = make(model, tmp_path / "wal", store_dir=tmp_path / "pfx", save_every=2)
    start(w)
    w.run(max_steps=6)
    w.close()  # the process dies; the WAL and the prefix store survive
    w2, seen2 = make(model, tmp_path / "wal", store_dir=tmp_path / "pfx")
    for k, v in seen.items():
        seen2[k] = list(v)
    durable = sum(len(TRAJ[k][0]) + len(t.tokens) for k, t in w2.wal.trajectories.items())
    assert w2.recover() == {"s": "reprefilled", "g": "reprefilled"}
    w2.step()
    hit = w2.engine.cache.prefix_hit_tokens
    assert hit >= 16 and w2.engine.stats.tokens_computed == durable - hit  # only what the store lacked
    w2.run()
    w2.close()
    assert seen2 == reference
