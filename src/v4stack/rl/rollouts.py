"""A rollout server: one engine, one token WAL, one tool runner - the body of a rollout actor.

``rollout(jobs)`` runs a list of episodes to their END, scores them (the reward is a pure
function of the WAL: the question is in the prompt, the answer is the last turn), writes REWARD,
and returns for each finished trajectory its metadata (small) and its heavy fields (token ids,
rollout log-probs, loss mask). Jobs whose trajectory id is already in the WAL are not started
again: a restarted server first ``recover``s (finishes what was running, scores what ended
unscored) and reports those. ``set_weights`` installs a new policy version between rollouts:
in-flight requests finish on the version they started with (the engine is idle when weights
change), and every TOKENS record carries the version that produced it.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from v4stack.config import preset as get_preset
from v4stack.model import V4Model
from v4stack.rl import tasks as T
from v4stack.rl.agent import AgentWorker, turn_start
from v4stack.rl.sandboxes import ToolRunner
from v4stack.rollout.wal import TokenWAL, Trajectory
from v4stack.serve.engine import Engine, EngineConfig
from v4stack.serve.sampling import SamplingParams
from v4stack.tokenizer import ByteTokenizer

_TOK = ByteTokenizer()


def score(tr: Trajectory) -> float:
    """The trajectory's reward, from its WAL state alone."""
    prompt = _TOK.decode(tr.prompt)
    try:
        task = T.parse_question(prompt.split("\n", 1)[0])
    except ValueError:
        return 0.0
    if not tr.obs:
        return 0.0
    return T.reward(task, _TOK.decode(tr.tokens[turn_start(tr):]))


def meta_of(tr: Trajectory, worker: str) -> dict:
    sampled = len(tr.tokens) - sum(n for _, n in tr.obs)
    return {"traj": tr.traj, "worker": worker, "group": tr.group, "prompt_len": len(tr.prompt),
            "gen_len": sampled, "reward": float(tr.reward if tr.reward is not None else 0.0),
            "version": tr.version, "round": int(tr.traj.split("-")[0][1:]) if tr.traj.startswith("r") else 0,
            "consumed": tr.consumed is not None}


def heavy_of(tr: Trajectory) -> dict:
    mask = np.ones(len(tr.tokens), np.uint8)
    for off, n in tr.obs:
        mask[off : off + n] = 0
    return {"tokens": np.asarray(tr.prompt + tr.tokens, np.int32), "prompt_len": len(tr.prompt),
            "lp": np.asarray(tr.logprobs, np.float32), "mask": mask}


class RolloutServer:
    def __init__(self, name: str, root: str | os.PathLike, preset: str, dsec_url: str, dsec_token: str,
                 threads: int = 1, max_running: int = 64, ops_mode: str = "fast"):
        if threads:
            torch.set_num_threads(threads)
        self.name = name
        self.dir = Path(root) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.model = V4Model(get_preset(preset), seed=0)
        # fast ops: a recovered trajectory is still re-prefilled from its durable tokens (never
        # re-sampled), but its continuation is not bit-identical to an uninterrupted one
        self.engine_cfg = EngineConfig(n_blocks=512, n_slots=max_running + 8, token_budget=512,
                                       max_running=max_running, ops_mode=ops_mode)
        self.tools = ToolRunner(dsec_url, dsec_token)
        self.version = -1
        self.wal = TokenWAL(self.dir / "wal")
        self.worker = self._worker(self.wal, self.dir / "kv")

    def _worker(self, wal: TokenWAL, kv: Path) -> AgentWorker:
        return AgentWorker(Engine(self.model, self.engine_cfg), wal, self.tools, parse=T.tool_command,
                           observe=T.observation, kv_dir=kv, server=self.name, policy_version=max(self.version, 0))

    def pid(self) -> int:
        return os.getpid()

    def set_weights(self, state: dict, version: int) -> int:
        """Install policy ``version`` (the engine holds no running request between rollouts)."""
        if self.worker.has_work():
            raise RuntimeError(f"{self.name}: weights pushed while requests are in flight")
        self.model.load_state_dict(state)
        self.version = version
        self.worker.engine = Engine(self.model, self.engine_cfg)  # no cache computed by older weights
        self.worker.policy_version = version
        return version

    def _finish(self, trajs: list[str]) -> list[tuple[dict, dict]]:
        out = []
        for tid in trajs:
            tr = self.wal.trajectories[tid]
            if tr.finished and tr.reward is None:
                self.worker.reward(tid, score(tr))
            if tr.finished and tr.consumed is None:
                out.append((meta_of(tr, self.name), heavy_of(tr)))
        return out

    def recover(self) -> list[tuple[dict, dict]]:
        """Finish the WAL's unfinished trajectories, score the unscored; -> every finished,
        unconsumed trajectory (after a restart these are the ones the loop must not lose)."""
        self.worker.recover()
        self.worker.run()
        return self._finish(list(self.wal.trajectories))

    def rollout(self, jobs: list[tuple[str, str, str, int]], max_tokens: int = 64,
                temperature: float = 1.0, kill_after: int | None = None) -> list[tuple[dict, dict]]:
        """``jobs``: (trajectory id, group id, question, seed). ``kill_after``: fault injection -
        SIGKILL this process after that many engine steps."""
        t0 = time.perf_counter()
        for tid, group, question, seed in jobs:
            if tid in self.wal.trajectories:
                continue
            prompt = _TOK.encode(T.make_prompt(question))
            self.worker.submit(tid, prompt, SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                                           seed=seed, stop=("\n",)), group=group)
        if kill_after is not None:
            self.worker.run(max_steps=kill_after)
            os.kill(os.getpid(), signal.SIGKILL)
        self.worker.run()
        self.last_rollout_s = time.perf_counter() - t0
        return self._finish([j[0] for j in jobs])

    def consume(self, trajs: list[str], step: int) -> int:
        """CONSUMED marks for ``trajs`` (those not marked yet); -> how many were written."""
        n = 0
        for tid in trajs:
            tr = self.wal.trajectories.get(tid)
            if tr is not None and tr.consumed is None:
                self.worker.consume(tid, step)
                n += 1
        return n

    def evaluate(self, questions: list[str], seeds: list[int], max_tokens: int = 64,
                 temperature: float = 1.0) -> list[float]:
        """Rewards of one sample per (question, seed), on a scratch WAL that is then deleted."""
        with tempfile.TemporaryDirectory(dir=self.dir) as tmp:
            wal = TokenWAL(Path(tmp) / "wal")
            w = self._worker(wal, Path(tmp) / "kv")
            for i, (q, s) in enumerate(zip(questions, seeds)):
                w.submit(f"e{i}", _TOK.encode(T.make_prompt(q)),
                         SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=s, stop=("\n",)))
            w.run()
            out = [score(wal.trajectories[f"e{i}"]) for i in range(len(questions))]
            w._tools_pool.shutdown(wait=True)
            wal.close()
        return out

    def stats(self) -> dict:
        s = self.tools.stats
        return {"tool_calls": s.calls, "tool_retried": s.retried, "tool_failed": s.failed,
                "sandboxes": s.sandboxes, "resumed": dict(self.worker.stats.resumed)}

    def close(self) -> None:
        self.worker.close()
        self.tools.close()
