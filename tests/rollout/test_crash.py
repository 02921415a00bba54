"""SIGKILL a real rollout worker process at random points during decode, restart it, and check:

- no committed token is lost: what the WAL held at the kill is a prefix of the final trajectory;
- no token was exposed before it was durable: every client-log line carries the WAL's durable
  position at exposure, which must cover the line's records, and its tokens were in the WAL at
  the kill;
- the client saw each trajectory exactly once, contiguously, and the finished trajectories equal
  an uninterrupted run of the same worker token for token (seeded sampling and greedy).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from v4stack.journal import read_records
from v4stack.rollout import records as R

WORKER = Path(__file__).with_name("crash_worker.py")
N, MAX_TOKENS = 3, 20


def start(d: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, str(WORKER), "--wal", str(d / "wal"), "--client-log", str(d / "client.log"),
           "--n", str(N), "--max-tokens", str(MAX_TOKENS), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})


def wal_tokens(d: Path) -> tuple[dict[str, list[int]], set[str]]:
    """Tokens per trajectory and the ended ones, as a fresh reader sees the WAL on disk."""
    toks, ended = {}, set()
    for _, payload in read_records(d / "wal"):
        rec = R.decode(payload)
        if rec["t"] == "BEGIN":
            toks[rec["traj"]] = []
        elif rec["t"] == "TOKENS":
            assert rec["off"] == len(toks[rec["traj"]])
            toks[rec["traj"]].extend(rec["ids"])
        elif rec["t"] == "END":
            ended.add(rec["traj"])
    return toks, ended


def client_lines(d: Path) -> list[dict]:
    p = d / "client.log"
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_bytes().split(b"\n")[:-1]]


def check_exposed_durable(lines: list[dict], wal: dict[str, list[int]]) -> None:
    """Every exposure came after its records were durable, and its tokens are in the WAL."""
    for e in lines:
        assert e["durable"] >= e["end"], f"exposed before durable: {e}"
        got = wal.get(e["traj"], [])[e["off"] : e["off"] + len(e["ids"])]
        assert got == e["ids"], f"exposed tokens not in the WAL: {e} vs {got}"


def client_view(lines: list[dict]) -> dict[str, list[int]]:
    """Each trajectory as the client saw it; exposures must be contiguous, one finish each."""
    seen: dict[str, list[int]] = {}
    fins: dict[str, int] = {}
    for e in lines:
        s = seen.setdefault(e["traj"], [])
        assert e["off"] == len(s), f"gap or repeat in what the client saw: {e}, had {len(s)}"
        assert not fins.get(e["traj"]), f"tokens after the finish: {e}"
        s.extend(e["ids"])
        fins[e["traj"]] = fins.get(e["traj"], 0) + int(e["fin"])
    assert all(v == 1 for v in fins.values()), fins
    return seen


def run_to_end(d: Path, *extra: str) -> float:
    t0 = time.perf_counter()
    p = start(d, *extra)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("uninterrupted")
    run_to_end(d)
    toks, ended = wal_tokens(d)
    assert len(toks) == N and ended == set(toks) and all(len(t) == MAX_TOKENS for t in toks.values())
    assert client_view(client_lines(d)) == toks
    return toks


def crash_trial(d: Path, rng: random.Random, kills: int, extra: tuple[str, ...]) -> int:
    """Kill the worker ``kills`` times at random points after it starts decoding; returns how
    many kills hit a live process. Checks the invariants after every kill."""
    hit = 0
    for _ in range(kills):
        p = start(d, *extra)
        line = ""
        while "decoding" not in line:
            line = p.stdout.readline()
            if not line:
                break
        time.sleep(rng.uniform(0.0, 1.5))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            hit += 1
        p.communicate(timeout=600)
        wal, _ = wal_tokens(d)
        check_exposed_durable(client_lines(d), wal)
        d.joinpath(f"at-kill-{hit}.json").write_text(json.dumps(wal))
    run_to_end(d, *extra)
    return hit


def verify(d: Path, reference: dict[str, list[int]]) -> None:
    final, ended = wal_tokens(d)
    assert final == reference and ended == set(reference)
    for snap in d.glob("at-kill-*.json"):
        for tid, toks in json.loads(snap.read_text()).items():
            assert final[tid][: len(toks)] == toks, f"committed tokens of {tid} lost or changed"
    lines = client_lines(d)
    check_exposed_durable(lines, final)
    assert client_view(lines) == reference


@pytest.mark.parametrize("extra", [(), ("--pipeline", "--preempt-every", "4")], ids=["inline", "pipeline+preempt"])
def test_sigkill_during_decode(tmp_path, reference, extra):
    rng = random.Random(7 + len(extra))
    hit = crash_trial(tmp_path, rng, kills=2, extra=extra)
    assert hit >= 1
    verify(tmp_path, reference)


@pytest.mark.slow
def test_sigkill_fifty_times(tmp_path, reference):
    rng = random.Random(2026)
    hits, trial = 0, 0
    while hits < 50:
        d = tmp_path / f"trial-{trial}"
        d.mkdir()
        extra = [(), ("--pipeline",), ("--preempt-every", "3"), ("--pipeline", "--preempt-every", "5")][trial % 4]
        hits += crash_trial(d, rng, kills=3, extra=extra)
        verify(d, reference)
        trial += 1


def test_checker_catches_early_exposure():
    """The client-log check fails on an exposure made before its record was durable."""
    wal = {"t": [1, 2, 3]}
    check_exposed_durable([{"traj": "t", "off": 0, "ids": [1, 2], "end": 90, "durable": 90}], wal)
    with pytest.raises(AssertionError, match="before durable"):
        check_exposed_durable([{"traj": "t", "off": 0, "ids": [1, 2], "end": 90, "durable": 60}], wal)
    with pytest.raises(AssertionError, match="not in the WAL"):
        check_exposed_durable([{"traj": "t", "off": 2, "ids": [3, 4], "end": 90, "durable": 90}], wal)
