"""What the loop reports: held-out reward statistics and the reward / evaluation curve."""

from __future__ import annotations

import math
from pathlib import Path

from v4stack.atomic import atomic_png


def mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    var = sum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return m, math.sqrt(var / n)


def paired(a: dict, b: dict) -> dict | None:
    """The rise over the same questions and seeds: mean and standard error of per-question
    differences (the evaluations share questions, so this SE is the tighter, paired one)."""
    if len(a["rewards"]) != len(b["rewards"]):
        return None
    m, se = mean_se([y - x for x, y in zip(a["rewards"], b["rewards"])])
    return {"rise": m, "se": se, "rise_in_se": m / se if se > 0 else None}


def plot(doc: dict, path: Path) -> None:

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    recs = doc["records"]
    if recs:
        xs = [r["step"] for r in recs]
        ys = [r.get("reward_mean", 0.0) for r in recs]
        ax.plot(xs, ys, label="training batch reward", linewidth=1.0, alpha=0.6)
    ev = doc["evals"]
    if ev:
        ax.errorbar([e["step"] for e in ev], [e["reward_mean"] for e in ev], yerr=[e["reward_se"] for e in ev],
                    label="held-out reward (+- 1 SE)", marker="o", capsize=3, linewidth=1.6)
    for f in doc.get("faults", []):
        ax.axvline(f["step"], color="red", alpha=0.3, linestyle=":")
    ax.set_xlabel("GRPO step (policy version)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"v4stack loop --preset {doc['config']['preset']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_png(fig, path)
    plt.close(fig)
