"""The token WAL's record kinds, as JSON payloads of journal records.

One record per event of one trajectory (``traj``):

- ``BEGIN``    group, prompt ids, sampling params (seed included), policy version, sandbox id
- ``TOKENS``   offset (tokens of the trajectory before these), ids, policy version, and ``lp``: the
               log-probability of each sampled id under the distribution it was drawn from
               (optional; needed for importance ratios)
- ``TOOL_CALL`` offset, the command, the sandbox and the sequence number its log will give the
               call (written durably before the command runs)
- ``OBS``      offset, observation token ids appended to the context (never sampled: loss mask 0),
               and how the result was obtained (``ran``, ``fast_forward`` from the sandbox log, or
               ``rerun`` on a fresh sandbox when the first one was lost)
- ``PREEMPT``  offset, reason, KV handle (``None`` when no cache was saved)
- ``RESUME``   offset, server, policy version, ``kv``: ``reused`` or ``reprefilled`` (and why)
- ``END``      offset (total tokens), stop reason
- ``REWARD``   value
- ``CONSUMED`` trainer step (so a restart never trains on a trajectory twice)

``encode`` checks every field before anything is written; ``decode`` checks again on read, so a
record that passed its CRC but is not a valid WAL record is reported by kind and field.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from v4stack.serve.sampling import SamplingParams

KINDS = ("BEGIN", "TOKENS", "TOOL_CALL", "OBS", "PREEMPT", "RESUME", "END", "REWARD", "CONSUMED")

# required fields per kind and their types (int fields are >= 0)
_FIELDS: dict[str, dict[str, type | tuple]] = {
    "BEGIN": {"traj": str, "group": str, "prompt": list, "params": dict, "version": int, "sandbox": (str, type(None))},
    "TOKENS": {"traj": str, "off": int, "ids": list, "version": int},
    "TOOL_CALL": {"traj": str, "off": int, "cmd": str, "sandbox": str, "seq": int},
    "OBS": {"traj": str, "off": int, "ids": list, "how": str},
    "PREEMPT": {"traj": str, "off": int, "reason": str, "kv": (dict, type(None))},
    "RESUME": {"traj": str, "off": int, "server": str, "version": int, "kv": str, "why": str},
    "END": {"traj": str, "off": int, "reason": str},
    "REWARD": {"traj": str, "value": (int, float)},
    "CONSUMED": {"traj": str, "step": int},
}
_KV_FIELDS = {"file": str, "digest": str, "pos": int, "bytes": int}


class RecordError(ValueError):
    """A WAL record with a missing or bad field."""


def _check(rec: dict) -> dict:
    kind = rec.get("t")
    if kind not in _FIELDS:
        raise RecordError(f"record field 't': expected one of {', '.join(KINDS)}, got {kind!r}")
    for name, typ in _FIELDS[kind].items():
        if name not in rec:
            raise RecordError(f"{kind} record: missing field '{name}'")
        v = rec[name]
        if not isinstance(v, typ) or (isinstance(v, bool) and typ is int):
            raise RecordError(f"{kind} record field '{name}': bad type {type(v).__name__}")
        if typ is int and v < 0:
            raise RecordError(f"{kind} record field '{name}': must be >= 0, got {v}")
    if not rec["traj"]:
        raise RecordError(f"{kind} record field 'traj': must be a non-empty string")
    for name in ("prompt", "ids"):
        if name in rec and not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in rec[name]):
            raise RecordError(f"{kind} record field '{name}': token ids must be ints >= 0")
    if kind in ("TOKENS", "OBS") and not rec["ids"]:
        raise RecordError(f"{kind} record field 'ids': must hold at least one token")
    if kind == "TOKENS" and "lp" in rec:
        lp = rec["lp"]
        if not isinstance(lp, list) or len(lp) != len(rec["ids"]) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x <= 0 for x in lp):
            raise RecordError("TOKENS record field 'lp': one log-probability (a number <= 0) per id")
    if kind == "OBS" and rec["how"] not in ("ran", "fast_forward", "rerun"):
        raise RecordError(f"OBS record field 'how': expected 'ran', 'fast_forward' or 'rerun', got {rec['how']!r}")
    if kind == "TOOL_CALL" and not rec["cmd"]:
        raise RecordError("TOOL_CALL record field 'cmd': must be a non-empty command")
    if kind == "BEGIN" and not rec["prompt"]:
        raise RecordError("BEGIN record field 'prompt': must hold at least one token")
    if kind == "RESUME" and rec["kv"] not in ("reused", "reprefilled"):
        raise RecordError(f"RESUME record field 'kv': expected 'reused' or 'reprefilled', got {rec['kv']!r}")
    if kind == "PREEMPT" and rec["kv"] is not None:
        for name, typ in _KV_FIELDS.items():
            if not isinstance(rec["kv"].get(name), typ):
                raise RecordError(f"PREEMPT record field 'kv.{name}': missing or not {typ.__name__}")
    return rec


def encode(rec: dict) -> bytes:
    """Check ``rec`` and return its payload bytes."""
    return json.dumps(_check(rec), separators=(",", ":"), sort_keys=True).encode()


def decode(payload: bytes) -> dict:
    try:
        rec = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecordError(f"WAL record is not JSON: {e}") from None
    if not isinstance(rec, dict):
        raise RecordError(f"WAL record: expected an object, got {type(rec).__name__}")
    return _check(rec)


def params_to_dict(p: SamplingParams) -> dict:
    d = asdict(p)
    d["stop"] = list(p.stop)
    return d


def params_from_dict(d: dict) -> SamplingParams:
    try:
        p = SamplingParams(**{**d, "stop": tuple(d.get("stop", ()))})
    except TypeError as e:
        raise RecordError(f"BEGIN record field 'params': {e}") from None
    return p.validate()


# -- constructors (the only way the rollout code builds records) --------------------------------

def begin(traj: str, prompt: list[int], params: SamplingParams, group: str = "", version: int = 0,
          sandbox: str | None = None) -> dict:
    return {"t": "BEGIN", "traj": traj, "group": group, "prompt": list(prompt),
            "params": params_to_dict(params), "version": version, "sandbox": sandbox}


def tokens(traj: str, off: int, ids: list[int], version: int = 0, lp: list[float] | None = None) -> dict:
    rec = {"t": "TOKENS", "traj": traj, "off": off, "ids": list(ids), "version": version}
    if lp is not None:
        rec["lp"] = [float(x) for x in lp]
    return rec


def tool_call(traj: str, off: int, cmd: str, sandbox: str, seq: int) -> dict:
    return {"t": "TOOL_CALL", "traj": traj, "off": off, "cmd": cmd, "sandbox": sandbox, "seq": seq}


def obs(traj: str, off: int, ids: list[int], how: str = "ran") -> dict:
    return {"t": "OBS", "traj": traj, "off": off, "ids": list(ids), "how": how}


def preempt(traj: str, off: int, reason: str, kv: dict | None) -> dict:
    return {"t": "PREEMPT", "traj": traj, "off": off, "reason": reason, "kv": kv}


def resume(traj: str, off: int, server: str, version: int, kv: str, why: str = "") -> dict:
    return {"t": "RESUME", "traj": traj, "off": off, "server": server, "version": version, "kv": kv, "why": why}


def end(traj: str, off: int, reason: str) -> dict:
    return {"t": "END", "traj": traj, "off": off, "reason": reason}


def reward(traj: str, value: float) -> dict:
    return {"t": "REWARD", "traj": traj, "value": value}


def consumed(traj: str, step: int) -> dict:
    return {"t": "CONSUMED", "traj": traj, "step": step}
