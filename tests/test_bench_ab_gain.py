"""``bench/ab_gain.py``: a variant counts as gaining only where every round's step p50 is lower by
at least ``MIN_GAIN``."""

import json

from bench.ab_gain import MIN_GAIN, gained


def _run(path, p50):
    path.write_text(json.dumps({"runs": [{"step_s_p50": p50}]}))
    return str(path)


def test_every_round_must_gain(tmp_path):
    a1, b1 = _run(tmp_path / "a1.json", 2.40e-3), _run(tmp_path / "b1.json", 2.35e-3)
    a2, b2 = _run(tmp_path / "a2.json", 2.38e-3), _run(tmp_path / "b2.json", 2.34e-3)
    assert gained([a1, b1, a2, b2])
    worse = _run(tmp_path / "w.json", 2.39e-3)  # control: one round lost
    assert not gained([a1, b1, a2, worse])
    assert not gained([a1, b1, a2, str(tmp_path / "missing.json")])  # an unreadable run is no gain
    assert not gained([a1, b1, a2]) and not gained([])  # unpaired
    assert not gained([a1, a1])  # equal is no gain
    tie = _run(tmp_path / "t.json", 2.38e-3 * (1 - MIN_GAIN / 2))  # lower, but by less than the margin
    assert not gained([a1, b1, a2, tie])
