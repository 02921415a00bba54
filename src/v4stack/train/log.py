"""The loss log (JSON, rewritten atomically), the progress bar, and the loss-curve PNG."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from v4stack.atomic import atomic_png, atomic_write


class LossLog:
    """``{"meta": {...}, "records": [{"step", "loss", ...}, ...]}`` at ``path``."""

    def __init__(self, path: Path, meta: dict, records: list[dict] | None = None):
        self.path, self.meta, self.records = path, meta, list(records or [])

    def add(self, **rec) -> None:
        self.records.append(rec)

    def truncate(self, step: int) -> None:
        """Drop records past ``step`` (after a resume the run re-does them)."""
        self.records = [r for r in self.records if r["step"] <= step]

    def save(self) -> None:
        doc = {"meta": self.meta, "records": self.records}
        atomic_write(self.path, (json.dumps(doc, indent=1) + "\n").encode())

    @staticmethod
    def read(path: Path) -> dict:
        return json.loads(Path(path).read_text())


class Progress:
    """One status line on stderr: redrawn in place on a terminal, printed every ``every`` steps otherwise."""

    def __init__(self, total: int, start: int = 0, every: int = 10, stream=None):
        self.total, self.start, self.every = total, start, every
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        done = step - self.start
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        width = 24
        fill = int(width * step / max(self.total, 1))
        line = (f"[{'#' * fill}{'.' * (width - fill)}] step {step}/{self.total} loss {loss:.4f} "
                f"{tokens_per_s:,.0f} tok/s eta {eta:,.0f}s")
        if self.tty:
            self.stream.write("\r" + line)
            if step >= self.total:
                self.stream.write("\n")
        elif step % self.every == 0 or step >= self.total:
            self.stream.write(line + "\n")
        self.stream.flush()


def plot_curves(curves: dict[str, list[tuple[int, float]]], path: Path, title: str,
                baseline: float | None = None, xlabel: str = "step") -> None:
    """Loss curves into a PNG (written atomically)."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, pts in curves.items():
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=name, linewidth=1.4)
    if baseline is not None:
        ax.axhline(baseline, color="gray", linestyle="--", linewidth=1, label=f"unigram {baseline:.3f}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_png(fig, path)
    plt.close(fig)
