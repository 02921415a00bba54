import json

import pytest

from bench.megamoe import bench_megamoe, summarize


def test_summary_pairs_the_paths():
    rows = [dict(routing="zipf", tokens_per_rank=4, path="megamoe", p50_ms=2.0, throughput_tok_s=300.0,
                 bit_identical=True),
            dict(routing="zipf", tokens_per_rank=4, path="baseline", p50_ms=3.0, throughput_tok_s=200.0,
                 bit_identical=True)]
    (s,) = summarize(rows)
    assert s["speedup_p50"] == 1.5 and s["speedup_throughput"] == 1.5 and s["bit_identical"]


@pytest.mark.parametrize("kw, field", [({"world": 3}, "experts"), ({"topk": 0}, "topk"),
                                       ({"tokens": [0]}, "tokens"), ({"bogus": 1}, "bogus")])
def test_bench_options_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        bench_megamoe(out=None, **kw)


@pytest.mark.slow
def test_bench_writes_json_and_png(tmp_path):
    out = tmp_path / "megamoe.json"
    report = bench_megamoe(out=str(out), tokens=[2, 8], iters=3, warmup=1, hidden=64, inner=32, experts=4,
                           topk=2, tile=4)
    data = json.loads(out.read_text())
    assert (tmp_path / "megamoe.png").stat().st_size > 0
    assert data["summary"] == report["summary"] and len(data["results"]) == 2 * 2 * 2
    assert all(r["bit_identical"] for r in data["results"])
    assert all(r["p99_ms"] >= r["p50_ms"] > 0 for r in data["results"])
