"""Durable rollouts: the token WAL, preemption with saved KV, and recovery (spec/rollout_and_sandbox.md s1)."""

from v4stack.rollout.wal import TokenWAL, Trajectory, WALInconsistent
from v4stack.rollout.worker import Exposure, NotDurable, RolloutWorker

__all__ = ["TokenWAL", "Trajectory", "WALInconsistent", "RolloutWorker", "Exposure", "NotDurable"]
