"""Whether a variant gained in every round of an interleaved A/B of ``bench.serve_roofline`` runs:
prints 1 where each pair's second file has the lower step p50, else 0 (a missing or unreadable
file counts as no gain).

    python -m bench.ab_gain BASE_1.json VARIANT_1.json BASE_2.json VARIANT_2.json
"""

import json
import sys


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
    return all(a is not None and b is not None and b < a for a, b in pairs)


if __name__ == "__main__":
    print(int(gained(sys.argv[1:])))
