"""Durable rollouts: the token WAL, preemption with saved KV, and recovery (spec/rollout_and_sandbox.md s1).

Names load on first use, so ``v4stack.rollout.cli`` (and the ``v4stack`` command) stay free of torch.
"""

import importlib

_EXPORTS = {
    "TokenWAL": "v4stack.rollout.wal", "Trajectory": "v4stack.rollout.wal", "WALInconsistent": "v4stack.rollout.wal",
    "RolloutWorker": "v4stack.rollout.worker", "Exposure": "v4stack.rollout.worker",
    "NotDurable": "v4stack.rollout.worker",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'v4stack.rollout' has no attribute {name!r}")
