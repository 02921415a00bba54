"""The bench runs end to end and writes well-formed JSON (tiny sizes; the real run is bench/dsec.py)."""

from __future__ import annotations

import json


def test_bench_dsec_writes_json(dsec_home, tmp_path):
    from bench.dsec import bench_dsec

    out = tmp_path / "dsec.json"
    r = bench_dsec(out=str(out), iters=2, density=2, home=str(dsec_home / "bench"))
    written = json.loads(out.read_text())
    assert written.pop("stamp")["command"] and written == r
    for sub in ("process", "container"):
        v = r["substrates"][sub]
        for k in ("create", "first_exec", "snapshot", "restore", "fork_from_snapshot"):
            assert v[k]["n"] == 2 and 0 < v[k]["p50_ms"] <= v[k]["p99_ms"]
        assert v["density"]["sandboxes"] == 2
