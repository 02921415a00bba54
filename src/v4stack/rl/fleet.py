"""The fleet: rollout servers and the policy trainer, in this process or as Ray actors.

``LocalFleet`` calls the objects directly (heavy fields are in-process objects). ``RayFleet``
starts each rollout server and the trainer as a Ray actor (a local Ray by default; ``address``
joins a cluster): a rollout actor puts each trajectory's heavy fields into Ray's object store and
returns only the reference with the metadata; the trainer resolves the references of the batch it
is given, and nothing else. Actors restart after a crash (``max_restarts``); a call that was in
flight raises ``ActorDied`` and the loop recovers (a restarted rollout actor re-reads its WAL, a
restarted trainer its latest checkpoint). Weights travel once per version through the object store.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor


class ActorDied(RuntimeError):
    """A fleet member died while serving a call (it restarts; the caller recovers)."""


def _resolve(handles: list) -> list:
    """Heavy fields of a batch: Ray references are fetched here (and only here)."""
    refs = [i for i, h in enumerate(handles) if type(h).__name__ == "ObjectRef"]
    if not refs:
        return handles
    import ray

    got = ray.get([handles[i] for i in refs])
    out = list(handles)
    for i, g in zip(refs, got):
        out[i] = g
    return out


class TrainerHost:
    """The trainer side of the fleet: a ``PolicyTrainer`` (or rank 0 of a ``TrainerGroup`` of
    ``procs`` processes) that resolves the batch's heavy handles itself."""

    def __init__(self, preset: str, out: str, init: str | None, grpo: dict, threads: int, procs: int = 1):
        from v4stack.rl.grpo import GRPOConfig, PolicyTrainer
        from v4stack.rl.trainer_group import TrainerGroup

        if procs > 1:  # rank 0 here, the other ranks launched by it (a gloo group, ZeRO)
            self.t = TrainerGroup(procs, preset, out, init, grpo, threads)
        else:
            self.t = PolicyTrainer(preset, out, init, GRPOConfig(**grpo), threads=threads)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if hasattr(self.t, "close"):
            self.t.close()

    def position(self) -> tuple[int, dict]:
        return self.t.step_no, self.t.meta

    def weights(self) -> dict:
        return self.t.weights()

    def step(self, step_no: int, handles: list, adv, consumed: dict, extra: dict | None = None) -> dict:
        heavy = _resolve(handles)
        if not heavy:
            return self.t.commit_empty(step_no, consumed, extra)
        return self.t.step(step_no, heavy, adv, consumed, extra)


class RolloutHost:
    """A rollout server whose heavy fields go into Ray's object store when ``use_ray``."""

    def __init__(self, name: str, root: str, preset: str, dsec_url: str, dsec_token: str, threads: int,
                 use_ray: bool):
        from v4stack.rl.rollouts import RolloutServer

        self.s = RolloutServer(name, root, preset, dsec_url, dsec_token, threads=threads)
        self.use_ray = use_ray

    def _out(self, pairs):
        if not self.use_ray:
            return pairs
        import ray

        return [(m, ray.put(h)) for m, h in pairs]

    def pid(self) -> int:
        return os.getpid()

    def set_weights(self, state: dict, version: int) -> int:
        return self.s.set_weights(state, version)

    def recover(self):
        return self._out(self.s.recover())

    def rollout(self, jobs, max_tokens: int, temperature: float, kill_after: int | None = None):
        return self._out(self.s.rollout(jobs, max_tokens, temperature, kill_after))

    def consume(self, trajs: list[str], step: int) -> int:
        return self.s.consume(trajs, step)

    def evaluate(self, questions, seeds, max_tokens: int, temperature: float) -> list[float]:
        return self.s.evaluate(questions, seeds, max_tokens, temperature)

    def stats(self) -> dict:
        return self.s.stats()


def init_ray(address: str | None, workers: int) -> bool:
    """A local Ray (``address`` None) or the cluster at ``address``; -> whether this call started
    a local one (and its owner shuts it down). Actors see this process's PYTHONPATH."""
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
    if address:
        ray.init(address=address, runtime_env=env, logging_level="ERROR")
        return False
    ray.init(num_cpus=max(os.cpu_count() or 1, workers + 1), include_dashboard=False,
             runtime_env=env, logging_level="ERROR", log_to_driver=False)
    return True


class LocalFleet:
    def __init__(self, workers: list[str], root: str, preset: str, dsec_url: str, dsec_token: str,
                 trainer_args: tuple, threads: int = 0):
        self.names = list(workers)
        self.workers = {n: RolloutHost(n, root, preset, dsec_url, dsec_token, threads, False) for n in workers}
        self.trainer = TrainerHost(*trainer_args)

    def map(self, method: str, args: dict[str, tuple]) -> dict:
        return {n: getattr(self.workers[n], method)(*a) for n, a in args.items()}

    def call(self, name: str, method: str, *args):
        return getattr(self.workers[name], method)(*args)

    def train(self, method: str, *args):
        return getattr(self.trainer, method)(*args)

    def put(self, obj):
        return obj

    def kill(self, who: str) -> int:
        raise RuntimeError("fault injection needs separate processes (the Ray fleet)")

    def close(self) -> None:
        for w in self.workers.values():
            w.s.close()
        self.trainer.close()


class RayFleet:
    def __init__(self, workers: list[str], root: str, preset: str, dsec_url: str, dsec_token: str,
                 trainer_args: tuple, threads: int = 1, address: str | None = None):
        import ray

        self.ray = ray
        self._started = init_ray(address, len(workers))
        R = ray.remote(num_cpus=1, max_restarts=-1)(RolloutHost)
        Tr = ray.remote(num_cpus=1, max_restarts=-1)(TrainerHost)
        self.names = list(workers)
        self.workers = {n: R.remote(n, root, preset, dsec_url, dsec_token, threads, True) for n in workers}
        self.trainer = Tr.remote(*trainer_args)
        self.pids = {n: self._get(w.pid.remote()) for n, w in self.workers.items()}
        self.pids["trainer"] = self._get(self.trainer.pid.remote())
        self._pool = ThreadPoolExecutor(4)

    def _get(self, ref):
        try:
            return self.ray.get(ref)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.ActorDiedError) as e:
            raise ActorDied(str(e).splitlines()[0]) from None

    def map(self, method: str, args: dict[str, tuple]) -> dict:
        refs = {n: getattr(self.workers[n], method).remote(*a) for n, a in args.items()}
        out, died = {}, []
        for n, r in refs.items():
            try:
                out[n] = self._get(r)
            except ActorDied:
                died.append(n)
        if died:
            raise ActorDied(",".join(died))
        return out

    def _call(self, actor, method: str, *args, wait: float = 180.0):
        """A call that waits out an actor's restart (it is unavailable while it restarts)."""
        import time

        deadline = time.time() + wait
        while True:
            try:
                return self.ray.get(getattr(actor, method).remote(*args))
            except (self.ray.exceptions.ActorUnavailableError,) as e:
                if method == "step" or time.time() > deadline:  # a step is never sent twice blindly
                    raise ActorDied(str(e).splitlines()[0]) from None
                time.sleep(0.5)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.ActorDiedError) as e:
                raise ActorDied(str(e).splitlines()[0]) from None

    def call(self, name: str, method: str, *args):
        return self._call(self.workers[name], method, *args)

    def train(self, method: str, *args):
        return self._call(self.trainer, method, *args)

    def put(self, obj):
        return self.ray.put(obj)

    def refresh_pid(self, who: str) -> int:
        actor = self.trainer if who == "trainer" else self.workers[who]
        self.pids[who] = self._call(actor, "pid")
        return self.pids[who]

    def kill(self, who: str) -> int:
        """SIGKILL the process of ``who`` (a worker name or 'trainer'); Ray restarts it."""
        pid = self.pids[who]
        os.kill(pid, signal.SIGKILL)
        return pid

    def close(self) -> None:
        for w in self.workers.values():
            try:
                self.ray.kill(w)
            except Exception:
                pass
        try:
            self.ray.get(self.trainer.close.remote(), timeout=60)  # its group's other ranks exit
        except Exception:
            pass
        try:
            self.ray.kill(self.trainer)
        except Exception:
            pass
        if self._started:
            self.ray.shutdown()
