"""The rollout benches on a small workload: JSON written whole, every mode's tokens equal."""

from __future__ import annotations

import json

import pytest

from bench.rollout_wal import bench_wal
from bench.prefix import bench_prefix


def test_bench_wal_small(tmp_path):
    out = tmp_path / "wal.json"
    res = bench_wal(trajectories=2, prompt_len=8, max_tokens=4, rounds=1, out=str(out), wal_dir=str(tmp_path))
    written = json.loads(out.read_text())
    assert set(written.pop("stamp")) >= {"commit", "dirty", "host", "device", "command"}
    assert written == json.loads(json.dumps(res))
    assert res["tokens_identical"] is True
    assert set(res["modes"]) == {"none", "inline", "pipeline"}
    assert res["modes"]["inline"]["records"] == 2 * 4 + 2  # TOKENS per trajectory per step + END each
    assert res["modes"]["none"]["wal_on_critical_path"]["mean_ms"] == 0
    assert res["modes"]["inline"]["wal_on_critical_path"]["mean_ms"] > 0
    with pytest.raises(ValueError, match="'max_tokens'"):
        bench_wal(max_tokens=1, out=None)


def test_bench_prefix_small(tmp_path):
    out = tmp_path / "prefix.json"
    res = bench_prefix(prefixes=1, prefix_len=40, suffix_len=3, requests_per_prefix=1, rounds=1,
                       strategies=("full", "periodic:32", "none"), out=str(out), store_dir=str(tmp_path))
    assert out.exists() and out.with_suffix(".png").stat().st_size > 0
    s = res["strategies"]
    assert all(r["tokens_equal_recompute"] for r in s.values())
    assert s["recompute"]["recomputed_tokens_mean"] == 43
    assert s["full"]["recomputed_tokens_mean"] == 43 - 32 and s["periodic:32"]["recomputed_tokens_mean"] == 43 - 32
    assert s["none"]["cone_tokens_mean"] == 32 and s["none"]["disk_bytes"]["states"] == 0
    assert s["full"]["disk_bytes"]["states"] > s["periodic:32"]["disk_bytes"]["states"] > 0
    with pytest.raises(ValueError, match="'prefixes'"):
        bench_prefix(prefixes=0, out=None)
