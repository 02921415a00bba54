"""Whether a variant gained in every round of an interleaved A/B of ``bench.serve_roofline`` runs:
prints 1 where each pair's second file has a step p50 lower by at least ``MIN_GAIN`` of the first's,
else 0 (a missing or unreadable file counts as no gain). The margin keeps a tie from passing: two
runs of one tree differ by ~0.5% (flash4 fast batch 256 16k on an H100 at b7d789c: 2671.6 / 2683.8
us with the side stream off, 2668.5 / 2683.7 on - a "gain" of 0.06 us in one round).

    python -m bench.ab_gain BASE_1.json VARIANT_1.json BASE_2.json VARIANT_2.json
"""

import json
import sys

MIN_GAIN = 0.002  # of the base's p50: 5 us at 2.5 ms


def p50(path: str):
    try:
        with open(path) as f:
            return json.load(f)["runs"][0]["step_s_p50"]
    except (OSError, KeyError, IndexError, ValueError, TypeError):
        return None


def gained(paths: list[str]) -> bool:
    if not paths or len(paths) % 2:
        return False
    pairs = [(p50(a), p50(b)) for a, b in zip(paths[::2], paths[1::2])]
    return all(a is not None and b is not None and b < a * (1 - MIN_GAIN) for a, b in pairs)


if __name__ == "__main__":
    print(int(gained(sys.argv[1:])))
