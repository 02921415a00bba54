"""Training text: local files, or a small generated corpus when none are given.

The generated corpus is deterministic (a seed) and made to be learnable at CPU scale: sentences
from a small grammar, sums written out, and short records. A byte-level model that learns words
and the agreement between a sum and its result falls far below the byte unigram entropy, which
is the baseline the trainer reports.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

_DET = ["the", "a", "every", "one", "that"]
_ADJ = ["small", "red", "quiet", "old", "bright", "heavy", "green", "quick", "cold", "round"]
_NOUN = ["fox", "house", "river", "engine", "garden", "window", "cache", "kernel", "sandbox", "model",
         "token", "expert", "router", "matrix", "stream"]
_VERB = ["sees", "moves", "holds", "finds", "keeps", "reads", "writes", "follows", "builds", "opens"]
_PREP = ["near", "under", "behind", "inside", "above", "beside"]
_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi"]
_CITIES = ["paris", "lima", "oslo", "cairo", "kyoto", "quito", "perth", "delhi"]


def _np(rng: random.Random) -> str:
    words = [rng.choice(_DET)]
    if rng.random() < 0.6:
        words.append(rng.choice(_ADJ))
    words.append(rng.choice(_NOUN))
    return " ".join(words)


def _sentence(rng: random.Random) -> str:
    s = f"{_np(rng)} {rng.choice(_VERB)} {_np(rng)}"
    if rng.random() < 0.4:
        s += f" {rng.choice(_PREP)} {_np(rng)}"
    return s[0].upper() + s[1:] + "."


def _sum(rng: random.Random) -> str:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    return f"{a} + {b} = {a + b}."


def _record(rng: random.Random) -> str:
    i = rng.randrange(len(_NAMES))
    return f"name: {_NAMES[i]}; city: {_CITIES[i]}; age: {20 + 3 * i}."


def generate_corpus(n_bytes: int = 1 << 20, seed: int = 0) -> str:
    """About ``n_bytes`` of deterministic text, one line per paragraph of 1-4 items."""
    rng = random.Random(seed)
    out, size = [], 0
    makers = [_sentence] * 6 + [_sum] * 2 + [_record]
    while size < n_bytes:
        line = " ".join(rng.choice(makers)(rng) for _ in range(rng.randint(1, 4)))
        out.append(line)
        size += len(line) + 1
    return "\n".join(out) + "\n"


def load_text(paths: list[str] | None, n_bytes: int = 1 << 20, seed: int = 0) -> tuple[bytes, str]:
    """The training bytes and a description of where they came from.

    ``paths``: files, or directories searched for ``*.txt`` / ``*.md``; none -> the generated corpus.
    """
    if not paths:
        return generate_corpus(n_bytes, seed).encode(), f"generated corpus ({n_bytes} bytes, seed {seed})"
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            files += sorted(f for f in path.rglob("*") if f.suffix in (".txt", ".md") and f.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"train field 'data': no file or directory at {path}")
    if not files:
        raise FileNotFoundError(f"train field 'data': no .txt or .md files under {paths}")
    data = b"\n".join(f.read_bytes() for f in files)
    if len(data) < 1024:
        raise ValueError(f"train field 'data': need at least 1024 bytes of text, got {len(data)}")
    return data, f"{len(files)} file(s), {len(data)} bytes"


def unigram_entropy(data: bytes) -> float:
    """Byte unigram entropy in nats: the loss of the best context-free predictor."""
    counts = Counter(data)
    n = len(data)
    return -sum(c / n * math.log(c / n) for c in counts.values())


if __name__ == "__main__":  # write the generated corpus to a file
    import sys

    target = Path(sys.argv[1] if len(sys.argv) > 1 else "corpus.txt")
    target.write_text(generate_corpus())
    print(f"wrote {target} ({target.stat().st_size} bytes)")
