"""The closed loop: rollouts in sandboxes -> the data path -> a GRPO step with Muon -> weights back.

One step ``k``:

1. every rollout server runs its share of round ``k`` (groups of ``group_size`` samples of one
   training-split question each), durably in its token WAL, tools in DSec sandboxes;
2. the metadata table takes the new rows; the selector picks the oldest complete groups;
3. the trainer fetches those rows' heavy fields, takes one GRPO step and commits checkpoint ``k``
   naming the trajectories it consumed;
4. the rollout servers write CONSUMED marks; the new weights (version ``k``) go to every server;
5. every ``eval_every`` steps (and at the start and the end) the held-out split is scored.

A restart (of the loop, or of one member after SIGKILL) resumes from the trainer's latest
checkpoint and the WALs: marks named by the checkpoint are re-applied, unfinished trajectories are
finished, unconsumed ones re-enter the table, and a round already in a WAL is not sampled again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from v4stack.atomic import atomic_write
from v4stack.rl import tasks as T
from v4stack.rl.fleet import ActorDied, LocalFleet, RayFleet
from v4stack.rl.grpo import GRPOConfig, group_advantages
from v4stack.rl.policy import SFTConfig, ensure_sft
from v4stack.rl.report import mean_se, paired, plot
from v4stack.rl.store import MetaTable

FAULT_KINDS = ("worker", "trainer", "edge")


@dataclass
class LoopConfig:
    preset: str = "tiny"
    out: str = "runs/loop"
    minutes: float = 5.0  # wall-clock budget of the RL steps (0 = no limit)
    steps: int = 0  # 0 = as many as the minutes allow
    workers: int = 2
    groups: int = 4  # questions per step
    group_size: int = 8  # samples per question
    max_tokens: int = 48
    temperature: float = 0.5  # rollouts and evaluations sample at it; the update's log-probs use it too
    max_lag: int = 1  # oldest policy version a trained trajectory may come from: current - max_lag
    eval_n: int = 256
    eval_every: int = 0  # 0 = start and end only
    seed: int = 0
    threads: int = 1
    trainer_procs: int = 1  # trainer processes (a gloo group with ZeRO when > 1)
    ray: bool = True
    address: str | None = None
    edges: int = 1
    edge_resource: str | None = None  # Ray resource an edge actor needs (the hosts that may run sandboxes)
    policy: str | None = None  # where supervised runs are kept (default <out>/policy); shared runs reuse one
    faults: list[str] = field(default_factory=list)  # "worker@3", "trainer@2", "edge@4"
    progress: bool = True
    sft: SFTConfig = field(default_factory=SFTConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)

    def validate(self) -> "LoopConfig":
        for name in ("workers", "groups", "group_size", "max_tokens", "eval_n", "edges", "trainer_procs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"loop field '{name}' must be an integer >= 1, got {v!r}")
        if self.group_size < 2:
            raise ValueError(f"loop field 'group_size' must be >= 2 (advantages are relative), got {self.group_size}")
        if not self.temperature > 0:
            raise ValueError(f"loop field 'temperature' must be > 0 (GRPO needs sampled groups), got {self.temperature}")
        if self.minutes < 0 or self.steps < 0 or self.eval_every < 0 or self.max_lag < 0:
            raise ValueError("loop fields 'minutes', 'steps', 'eval_every', 'max_lag' must be >= 0")
        if self.minutes == 0 and self.steps == 0:
            raise ValueError("loop fields 'minutes' and 'steps' are both 0: the loop would never stop")
        if any(not f.startswith("edge@") for f in self.faults) and not self.ray:
            raise ValueError("loop field 'faults': killing a rollout worker or the trainer needs the Ray fleet "
                             "(separate processes)")
        for f in self.faults:
            kind, _, at = f.partition("@")
            if kind not in FAULT_KINDS or not at.isdigit() or int(at) < 1:
                raise ValueError(f"loop field 'faults': {f!r} is not KIND@STEP with KIND in {FAULT_KINDS}")
        self.grpo.validate()
        return self


def round_jobs(cfg: LoopConfig, step: int, workers: list[str], exclude: frozenset[str] = frozenset()
               ) -> dict[str, list[tuple]]:
    """Round ``step``'s episodes, split over ``workers`` by group: a pure function of (seed, step).
    ``exclude``: questions the round must not ask (the demonstrated ones)."""
    rng = random.Random(cfg.seed * 7_919 + step)
    it = T.rl_stream(rng.randrange(1 << 30), exclude)
    out: dict[str, list[tuple]] = {w: [] for w in workers}
    for g in range(cfg.groups):
        task = next(it)
        w = workers[g % len(workers)]
        for i in range(cfg.group_size):
            out[w].append((f"r{step}-{w}-g{g}-{i}", f"r{step}-g{g}", task.question, rng.randrange(1 << 31)))
    return out


class Loop:
    def __init__(self, cfg: LoopConfig, log=None):
        self.cfg = cfg.validate()
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_stream = log
        self.doc = self._load_log()
        self.table = MetaTable()
        self.dsec = None
        self.fleet = None
        self.fault_log: list[dict] = []
        self._ray_started = False

    # ---- bookkeeping ------------------------------------------------------------------------

    def _load_log(self) -> dict:
        p = self.out / "loop.json"
        if p.exists():
            return json.loads(p.read_text())
        return {"config": _asdict(self.cfg), "records": [], "evals": [], "faults": [], "runs": []}

    def _save_log(self) -> None:
        atomic_write(self.out / "loop.json", (json.dumps(self.doc, indent=1) + "\n").encode())

    def _emit(self, rec: dict) -> None:
        if self.log_stream is not None:
            self.log_stream.write(json.dumps(rec) + "\n")
            self.log_stream.flush()

    def _say(self, msg: str) -> None:
        if self.cfg.progress:
            print(msg, file=sys.stderr, flush=True)

    # ---- start ------------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.sft_run, self.sft_summary = ensure_sft(Path(cfg.policy) if cfg.policy else self.out / "policy", cfg.sft,
                                                    progress=cfg.progress)
        self.doc["sft"] = {"run": str(self.sft_run), **{k: v for k, v in self.sft_summary.items()
                                                        if isinstance(v, (int, float, str, bool))}}
        phases = {"policy_s": time.perf_counter() - t0}
        if cfg.ray:
            from v4stack.rl.fleet import init_ray

            self._ray_started = init_ray(cfg.address, cfg.workers)
        phases["ray_s"] = time.perf_counter() - t0 - sum(phases.values())
        url, token = os.environ.get("DSEC_API_URL"), os.environ.get("DSEC_TOKEN")
        if not url:
            from v4stack.rl.edges import node_address
            from v4stack.rl.sandboxes import LocalDsec

            host = node_address() if cfg.address else "127.0.0.1"  # a cluster's actors must reach it
            self.dsec = LocalDsec(self.out / "dsec", edges=cfg.edges, pool=2, host=host, ray_edges=cfg.ray,
                                  edge_resource=cfg.edge_resource)
            url, token = self.dsec.url, self.dsec.token
        phases["dsec_s"] = time.perf_counter() - t0 - sum(phases.values())
        names = [f"w{i}" for i in range(cfg.workers)]
        grpo = {**dataclasses.asdict(cfg.grpo), "temperature": cfg.temperature}
        targs = (cfg.preset, str(self.out / "trainer"), str(self.sft_run), grpo, cfg.threads, cfg.trainer_procs)
        root = str(self.out / "rollouts")
        if cfg.ray:
            self.fleet = RayFleet(names, root, cfg.preset, url, token, targs, cfg.threads, cfg.address)
        else:
            self.fleet = LocalFleet(names, root, cfg.preset, url, token, targs, cfg.threads)
        self.startup_s = time.perf_counter() - t0
        phases["fleet_s"] = self.startup_s - sum(phases.values())
        self.step_no, meta = self.fleet.train("position")
        self._apply_marks(meta)
        self.doc["records"] = [r for r in self.doc["records"] if r["step"] <= self.step_no]
        self.doc["evals"] = [e for e in self.doc["evals"] if e["step"] <= self.step_no]
        if self.step_no and not any(r["step"] == self.step_no for r in self.doc["records"]):
            # the last run committed this step and died before logging it
            self.doc["records"].append({"step": self.step_no, "committed_before_restart": True})
        self._push_weights()
        for n in self.fleet.names:
            self._add(self.fleet.call(n, "recover"))
        self.doc["runs"].append({"resumed_from": self.step_no, "startup_s": round(self.startup_s, 2),
                                 **{k: round(v, 2) for k, v in phases.items()},
                                 "table_rows_recovered": len(self.table)})

    def _apply_marks(self, meta: dict) -> None:
        """CONSUMED marks of the committed step (idempotent: a mark already written is skipped)."""
        for w, trajs in (meta.get("consumed") or {}).items():
            if w in self.fleet.names:
                self.fleet.call(w, "consume", trajs, int(meta["step"]))
            rows = [self.table.index[t] for t in trajs if t in self.table.index]
            st = self.table.cols["state"]
            for r in rows:
                st[r] = 2
                self.table.heavy[r] = None

    def _push_weights(self) -> None:
        ref = self.fleet.put(self.fleet.train("weights"))
        self.fleet.map("set_weights", {n: (ref, self.step_no) for n in self.fleet.names})

    def _add(self, pairs) -> None:
        fresh = [(m, h) for m, h in pairs if m["traj"] not in self.table.index]
        for m, h in pairs:  # a restarted server re-reads its WAL: its old handles are gone, take the new
            r = self.table.index.get(m["traj"])
            if r is not None and self.table.cols["state"][r] != 2:
                self.table.heavy[r] = h
        if fresh:
            self.table.add([m for m, _ in fresh], [h for _, h in fresh])

    # ---- faults -----------------------------------------------------------------------------

    def _faults_at(self, step: int) -> list[str]:
        return [f.partition("@")[0] for f in self.cfg.faults if int(f.partition("@")[2]) == step
                and not any(x["step"] == step and x["kind"] == f.partition("@")[0] for x in self.doc["faults"])]

    def _kill_edge(self, step: int) -> None:
        """SIGKILL the first edge before the round's rollouts and start its next incarnation: the
        rollout servers' pooled sandboxes live on the dead edge, so the round's first tool calls
        are addressed to it, fail, and are re-run on fresh sandboxes (OBS how='rerun')."""
        if self.dsec is None:
            raise RuntimeError("fault 'edge': the loop kills edges of its own DSec (DSEC_API_URL is set)")
        name = self.dsec.edges.names[0]
        dead = self.dsec.kill_edge(name)
        new = self.dsec.ensure_edge(name)
        rec = {"step": step, "kind": "edge", "edge": dead["id"], "pid": dead["pid"], "replacement": new["id"],
               "when": "before the round's rollouts", "t": time.time()}
        self.fault_log.append(rec)
        self.doc["faults"].append(rec)
        self._say(f"fault: SIGKILL edge {dead['id']} (pid {dead['pid']}) at step {step}; now {new['id']}")

    # ---- one step ---------------------------------------------------------------------------

    def _rollouts(self, step: int) -> float:
        t0 = time.perf_counter()
        if not hasattr(self, "_demonstrated"):
            self._demonstrated = T.demonstrated(self.cfg.sft.corpus_bytes, self.cfg.sft.seed)
        jobs = round_jobs(self.cfg, step, self.fleet.names, self._demonstrated)
        due = self._faults_at(step)
        if "edge" in due:
            self._kill_edge(step)
        kill = {}
        if "worker" in due:  # the first worker SIGKILLs itself a few engine steps into the round
            kill = {self.fleet.names[0]: 4}
            rec = {"step": step, "kind": "worker", "pid": self.fleet.pids.get(self.fleet.names[0]),
                   "when": "after 4 engine steps", "t": time.time()}
            self.doc["faults"].append(rec)
            self._say(f"fault: SIGKILL rollout worker {self.fleet.names[0]} (pid {rec['pid']}) in step {step}")
        for _ in range(5):
            try:
                res = self.fleet.map("rollout", {n: (j, self.cfg.max_tokens, self.cfg.temperature, kill.pop(n, None))
                                                 for n, j in jobs.items()})
                for pairs in res.values():
                    self._add(pairs)
                break
            except ActorDied as e:  # a rollout server died: it restarts, recovers from its WAL
                self._say(f"rollout server died ({e}); recovering from its WAL")
                for n in self.fleet.names:
                    self.fleet.refresh_pid(n)
                    self.fleet.call(n, "set_weights", self.fleet.put(self.fleet.train("weights")), self.step_no)
                    self._add(self.fleet.call(n, "recover"))
        else:
            raise RuntimeError(f"step {step}: rollouts failed five times")
        return time.perf_counter() - t0

    def _tool_stats(self) -> dict:
        """Tool calls so far, summed over the rollout servers (since each server's last start)."""
        tot: dict = {}
        for n in self.fleet.names:
            for k, v in self.fleet.call(n, "stats").items():
                if isinstance(v, int):
                    tot[k] = tot.get(k, 0) + v
        return tot

    def _train(self, step: int) -> dict:
        cfg = self.cfg
        batch = self.table.select(cfg.groups, cfg.group_size, min_version=max(0, self.step_no - cfg.max_lag))
        rows = np.concatenate([batch.rows, batch.flat])
        self.table.lease(rows)
        adv = group_advantages(self.table.col("reward")[batch.rows], self.table.col("group")[batch.rows])
        consumed = self.table.by_worker(rows)
        handles = self.table.handles(batch.rows)
        extra = {"reward_mean": float(self.table.col("reward")[rows].mean()) if len(rows) else 0.0}
        if "trainer" in self._faults_at(step):  # SIGKILLed inside the step: before or after its commit
            when = "before_commit" if sum(f["kind"] == "trainer" for f in self.doc["faults"]) % 2 == 0 else "after_commit"
            rec = {"step": step, "kind": "trainer", "pid": self.fleet.pids.get("trainer"), "when": when, "t": time.time()}
            self.doc["faults"].append(rec)
            self._say(f"fault: SIGKILL trainer (pid {rec['pid']}) in step {step}, {when}")
            extra = {**extra, "fault": when}
        try:
            stats = self.fleet.train("step", step, handles, adv, consumed, extra)
        except ActorDied:
            self.fleet.refresh_pid("trainer")
            pos, meta = self.fleet.train("position")
            self._say(f"trainer died in step {step}; restarted at committed step {pos}")
            if pos == step:  # it committed before dying: its marks are the truth
                self.table.consume(rows)
                self._apply_marks(meta)
                return {"loss": float("nan"), "tokens": 0, "recovered": True}
            self.table.release(rows)
            return self._train(step)
        self.table.consume(rows)
        self._apply_marks({"consumed": consumed, "step": step})
        stats.update(rows=int(len(batch.rows)), flat_rows=int(len(batch.flat)),
                     reward_mean=extra["reward_mean"])
        return stats

    def evaluate(self, step: int) -> dict:
        t0 = time.perf_counter()
        tasks = T.eval_set(self.cfg.eval_n, seed=self.cfg.seed + 12345)
        seeds = [1000 + i for i in range(len(tasks))]
        names = self.fleet.names
        parts = {n: ([t.question for t in tasks[i :: len(names)]], seeds[i :: len(names)], self.cfg.max_tokens,
                     self.cfg.temperature) for i, n in enumerate(names)}
        res = self.fleet.map("evaluate", parts)
        rewards = [0.0] * len(tasks)
        for i, n in enumerate(names):
            for j, r in enumerate(res[n]):
                rewards[i + j * len(names)] = r
        m, se = mean_se(rewards)
        ev = {"step": step, "reward_mean": m, "reward_se": se, "n": len(rewards), "rewards": rewards,
              "eval_s": round(time.perf_counter() - t0, 2)}
        self.doc["evals"].append(ev)
        self._save_log()
        self._emit({"event": "eval", **{k: v for k, v in ev.items() if k != "rewards"}})
        self._say(f"eval step {step}: held-out reward {m:.3f} +- {se:.3f} (n={len(rewards)})")
        return ev

    def run(self) -> dict:
        cfg = self.cfg
        self.start()
        if not any(e["step"] == self.step_no for e in self.doc["evals"]):
            self.evaluate(self.step_no)
        t_start = time.perf_counter()
        deadline = t_start + 60 * cfg.minutes if cfg.minutes else float("inf")
        last = cfg.steps if cfg.steps else None
        while time.perf_counter() < deadline and (last is None or self.step_no < last):
            step = self.step_no + 1
            t0 = time.perf_counter()
            roll_s = self._rollouts(step)
            stats = self._train(step)
            stats["tools"] = self._tool_stats()
            self.step_no = step
            self._push_weights()
            rec = {"step": step, "rollout_s": round(roll_s, 3), "step_s": round(time.perf_counter() - t0, 3),
                   "table_rows": len(self.table), "load1": round(os.getloadavg()[0], 2),
                   **{k: (round(v, 5) if isinstance(v, float) else v) for k, v in stats.items()}}
            self.doc["records"].append(rec)
            self._save_log()
            self._emit({"event": "step", **rec})
            self._progress(step, rec, t_start, deadline, last)
            if cfg.eval_every and step % cfg.eval_every == 0:
                self.evaluate(step)
        if not self.doc["evals"] or self.doc["evals"][-1]["step"] != self.step_no:
            self.evaluate(self.step_no)
        return self.finish()

    def _progress(self, step: int, rec: dict, t0: float, deadline: float, last: int | None) -> None:
        if not self.cfg.progress:
            return
        now = time.perf_counter()
        frac = (step / last) if last else min(1.0, (now - t0) / max(deadline - t0, 1e-9))
        bar = "#" * int(24 * frac)
        print(f"[{bar:.<24}] step {step} reward {rec.get('reward_mean', 0):.3f} loss {rec.get('loss', 0):.4f} "
              f"rollout {rec['rollout_s']:.1f}s step {rec['step_s']:.1f}s", file=sys.stderr, flush=True)

    def finish(self) -> dict:
        first, final = self.doc["evals"][0], self.doc["evals"][-1]
        diff = final["reward_mean"] - first["reward_mean"]
        se = math.sqrt(first["reward_se"] ** 2 + final["reward_se"] ** 2)
        summary = {"steps": self.step_no, "sft_eval": {k: first[k] for k in ("step", "reward_mean", "reward_se", "n")},
                   "final_eval": {k: final[k] for k in ("step", "reward_mean", "reward_se", "n")},
                   "rise": diff, "rise_se": se, "rise_in_se": diff / se if se > 0 else None,
                   "paired": paired(first, final),
                   "faults": self.doc["faults"], "trajectories": len(self.table),
                   "consumed": int((self.table.col("state") == 2).sum())}
        self.doc["summary"] = summary
        self._save_log()
        plot(self.doc, self.out / "loop.png")
        return summary

    def close(self) -> None:
        if self.fleet is not None:
            self.fleet.close()
        if self.dsec is not None:
            self.dsec.close()
        if self._ray_started:
            import ray

            ray.shutdown()


def _asdict(cfg: LoopConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def clear_rl_state(out: str | Path) -> None:
    """Remove a run's RL state (trainer checkpoints, WALs, log, sandboxes), keeping policy/."""
    import shutil

    from v4stack.rl.sandboxes import _cleanup

    out = Path(out)
    if (out / "dsec").exists():
        _cleanup(out / "dsec")
    for name in ("trainer", "rollouts", "dsec"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("loop.json", "loop.png"):
        (out / name).unlink(missing_ok=True)


def run(cfg: LoopConfig, log=None) -> dict:
    loop = Loop(cfg, log)
    try:
        return loop.run()
    finally:
        loop.close()
