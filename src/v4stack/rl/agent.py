"""Multi-turn rollouts: a ``RolloutWorker`` whose trajectories call tools in DSec sandboxes.

A trajectory is one WAL trajectory over several engine requests (turns). A turn ends at its stop
string; if ``parse(context, turn)`` names a command, the worker keeps the trajectory open (no
END), and after the turn's tokens are durable it writes TOOL_CALL (the sandbox and the sequence
number its log will give the call), runs the command, writes OBS (the observation's tokens,
loss mask 0) and admits the next turn with the whole context as its prompt. Otherwise the turn's
end is the trajectory's END. So a command never runs before the tokens that asked for it are
durable, and an observation is in the log before the model sees it.

Recovery (``resume``) reads only the WAL: a TOOL_CALL without its OBS is asked again of the same
sandbox with the same sequence number (the sandbox log answers from its record: ``fast_forward``)
or, when that sandbox is gone, re-run on a fresh one (``rerun``; the tasks' commands are pure); a
turn that ended with a command but has no TOOL_CALL gets one; a turn cut mid-way is re-prefilled
(prompt = the context at the turn's start, the durable tokens fed again, the sampler advanced).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Protocol

from v4stack.rollout import records as R
from v4stack.rollout.wal import Trajectory
from v4stack.rollout.worker import RolloutWorker, track_logprobs
from v4stack.serve.sampling import SamplingParams
from v4stack.tokenizer import ByteTokenizer

_TOK = ByteTokenizer()


class Tools(Protocol):
    def reserve(self) -> tuple[object, str, int]: ...  # (handle, sandbox id, next seq)

    def run(self, handle, seq: int, cmd: str) -> tuple[str, str]: ...  # (stdout, how)

    def replay(self, sandbox: str, seq: int, cmd: str) -> tuple[str, str]: ...  # (stdout, how)


def turn_start(tr: Trajectory) -> int:
    """Offset of the current turn's first token (just after the last observation)."""
    return tr.obs[-1][0] + tr.obs[-1][1] if tr.obs else 0


def turn_params(p: SamplingParams, tr: Trajectory, start: int) -> SamplingParams:
    """A turn's own request parameters: the remaining token budget, a seed derived from the turn."""
    seed = None if p.seed is None else (p.seed * 1_000_003 + start) % (1 << 62)
    return replace(p, max_tokens=p.max_tokens - start, seed=seed)


class AgentWorker(RolloutWorker):
    def __init__(self, engine, wal, tools: Tools, parse: Callable[[str, str], str | None],
                 observe: Callable[[str], str], **kw):
        if kw.get("pipeline"):
            raise ValueError("AgentWorker runs with pipeline=False (a tool waits for durable tokens anyway)")
        super().__init__(engine, wal, **kw)
        self.tools, self.parse, self.observe = tools, parse, observe
        self.awaiting: dict[str, str] = {}  # traj -> command whose TOOL_CALL is not written yet
        self.running: dict[str, Future] = {}  # traj -> the tool call in flight
        self._tools_pool = ThreadPoolExecutor(4, thread_name_prefix="v4stack-tools")
        self.tool_s = 0.0

    # ---- turns ------------------------------------------------------------------------------

    def _turn_ended(self, traj: str, reason: str | None) -> bool:
        req = self.live.get(traj)
        if reason != "stop" or req is None:
            return False
        cmd = self.parse(_TOK.decode(req.prompt), _TOK.decode(req.output))
        if cmd is None:
            return False
        self.live.pop(traj, None)
        self.awaiting[traj] = cmd
        return True

    def _dispatch(self) -> None:
        """TOOL_CALL records (durable) for every awaiting command, then run them."""
        if not self.awaiting:
            return
        recs, jobs = [], []
        for traj, cmd in self.awaiting.items():
            handle, sandbox, seq = self.tools.reserve()
            recs.append(R.tool_call(traj, len(self.wal.trajectories[traj].tokens), cmd, sandbox, seq))
            jobs.append((traj, handle, seq, cmd))
        self.awaiting.clear()
        self.wal.append(recs)
        for traj, handle, seq, cmd in jobs:
            self.running[traj] = self._tools_pool.submit(self.tools.run, handle, seq, cmd)

    def _collect(self, wait: bool = False) -> None:
        done = [t for t, f in self.running.items() if f.done()]
        if wait and not done and self.running:
            t0 = time.perf_counter()
            next(iter(self.running.values())).result()
            self.tool_s += time.perf_counter() - t0
            done = [t for t, f in self.running.items() if f.done()]
        for traj in done:
            out, how = self.running.pop(traj).result()
            self._observe(traj, out, how)

    def _observe(self, traj: str, stdout: str, how: str) -> None:
        tr = self.wal.trajectories[traj]
        room = tr.params.max_tokens - len(tr.tokens)
        ids = _TOK.encode(self.observe(stdout))[:room]
        recs = [R.obs(traj, len(tr.tokens), ids, how)] if ids else []
        if room - len(ids) < 1:  # no budget left for an answer
            recs.append(R.end(traj, len(tr.tokens) + len(ids), "length"))
            end = self.wal.append(recs)
            self._expose([(traj, len(tr.tokens), (), True, "length")], end)
            return
        self.wal.append(recs)
        self._admit(tr, [])

    def _admit(self, tr: Trajectory, output: list[int]) -> None:
        start = turn_start(tr)
        ctx = tr.prompt + tr.tokens[:start]
        params = turn_params(tr.params, tr, start)
        req = self.engine.add_request(ctx, params, tr.traj, self._on_event)
        if output:
            req.output = list(output)  # draw i depends on (seed, i) only: nothing to advance
        track_logprobs(req)
        self._restore_prefix(ctx + output)
        self.live[tr.traj] = req

    # ---- driving ----------------------------------------------------------------------------

    def step(self) -> int:
        n = super().step() if self.engine.has_work() else 0
        self._dispatch()
        self._collect(wait=not self.engine.has_work())
        return n

    def has_work(self) -> bool:
        return self.engine.has_work() or bool(self.awaiting) or bool(self.running)

    def run(self, max_steps: int | None = None) -> None:
        n = 0
        while self.has_work() and (max_steps is None or n < max_steps):
            self.step()
            n += 1

    # ---- recovery ---------------------------------------------------------------------------

    def resume(self, traj: str) -> str:
        tr = self.wal.trajectories.get(traj)
        if tr is None or tr.finished or traj in self.live or traj in self.running:
            raise ValueError(f"trajectory {traj!r} is not an unfinished trajectory outside the engine")
        start = turn_start(tr)
        call = tr.calls[-1] if tr.calls else None
        self.wal.append([R.resume(traj, len(tr.tokens), self.server, self.policy_version, "reprefilled",
                                  "multi-turn trajectory: context re-prefilled")])
        self.stats.resumed["reprefilled"] += 1
        if call is not None and call["off"] == len(tr.tokens) and not (tr.obs and tr.obs[-1][0] == call["off"]):
            out, how = self.tools.replay(call["sandbox"], call["seq"], call["cmd"])  # asked, answer not logged
            self._observe(traj, out, how)
            return how
        turn = tr.tokens[start:]
        cmd = self.parse(_TOK.decode(tr.prompt + tr.tokens[:start]), _TOK.decode(turn)) if turn else None
        if cmd is not None:
            self.awaiting[traj] = cmd
            return "tool"
        text = _TOK.decode(turn)
        if any(s in text for s in tr.params.stop) or len(tr.tokens) >= tr.params.max_tokens:
            reason = "length" if len(tr.tokens) >= tr.params.max_tokens and not any(
                s in text for s in tr.params.stop) else "stop"
            end = self.wal.append([R.end(traj, len(tr.tokens), reason)])
            self._expose([(traj, len(tr.tokens), (), True, reason)], end)
            return "ended"
        self._admit(tr, turn)
        return "reprefilled"

    def close(self) -> None:
        for f in self.running.values():
            f.cancel()
        self._tools_pool.shutdown(wait=False)
        super().close()
