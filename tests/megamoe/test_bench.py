import json

import pytest

from bench.megamoe import bench_megamoe, summarize


def test_summary_pairs_the_paths():
    rows = [dict(shape="flash", routing="zipf", tokens_per_rank=4, path="megamoe", p50_ms=2.0,
                 throughput_tok_s=300.0, frac_of_limit=0.5, link_GB_s=10.0, bit_identical=True),
            dict(shape="flash", routing="zipf", tokens_per_rank=4, path="baseline", p50_ms=3.0,
                 throughput_tok_s=200.0, frac_of_limit=0.3, link_GB_s=7.0, bit_identical=True)]
    (s,) = summarize(rows)
    assert s["speedup_p50"] == 1.5 and s["speedup_throughput"] == 1.5 and s["bit_identical"]


@pytest.mark.parametrize("kw, field", [({"world": 3}, "world"), ({"shapes": ["huge"]}, "shapes"),
                                       ({"tokens": [0]}, "tokens"), ({"bogus": 1}, "bogus"),
                                       ({"dispatch": "fp4"}, "dispatch")])
def test_bench_options_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        bench_megamoe(out=None, **kw)


@pytest.mark.slow
def test_bench_writes_stamped_json(tmp_path):
    out = tmp_path / "megamoe.json"
    report = bench_megamoe(out=str(out), shapes=["tiny"], tokens=[2, 8], iters=3, warmup=1)
    data = json.loads(out.read_text())
    assert data["summary"] == report["summary"] and len(data["results"]) == 2 * 2 * 2
    assert data["stamp"]["command"]
    assert all(r["bit_identical"] for r in data["results"])
    assert all(r["p99_ms"] >= r["p50_ms"] > 0 for r in data["results"])
