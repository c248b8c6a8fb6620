"""What a training run shows a person at its end: ``loss.png`` and a one-line summary.

Both read the rows of ``metrics.jsonl`` (:mod:`.loop`): every logged step from the start of
the run, also when it was resumed, so a resumed run's figure covers all its steps. The
validation metric is the task's (``val_bpc``: bits per character; ``val_accuracy``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from svflow_jax.reporting import fmt, save_figure

__all__ = ["loss_figure", "summary_line", "METRIC_WORDS"]

#: the words of each validation metric of the tasks (:mod:`.tasks`)
METRIC_WORDS = {"val_bpc": "bits/char", "val_accuracy": "accuracy"}


def _metric(rows: list[dict[str, Any]]) -> str | None:
    return next((k for k in METRIC_WORDS if any(k in r for r in rows)), None)


def _finite(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def loss_figure(path: str | Path, rows: list[dict[str, Any]]) -> str | None:
    """``loss.png``: the training and validation loss (nats per scored token) against step,
    and below it the validation metric (bits per character, or accuracy); ``None`` (nothing
    written) when no row has a finite loss. Returns the file name."""
    train = _finite(rows, "loss")
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = _metric(rows)
    validation = _finite(rows, metric) if metric else []
    fig, axes = plt.subplots(2 if validation else 1, 1, figsize=(7.5, 6 if validation else 4),
                             sharex=True, squeeze=False)
    top = axes[0][0]
    top.plot(*zip(*train, strict=True), lw=1, label="training loss")
    if val_loss := _finite(rows, "val_loss"):
        top.plot(*zip(*val_loss, strict=True), "o-", ms=4, label="validation loss")
    top.set(ylabel="loss [nats per token]", title="svflow train")
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8)
    if validation:
        bottom = axes[1][0]
        bottom.plot(*zip(*validation, strict=True), "o-", ms=4, color="C2")
        bottom.set(ylabel=f"validation {METRIC_WORDS[metric]}")  # pyright: ignore
        bottom.grid(True, alpha=0.3)
    axes[-1][0].set_xlabel("optimiser step")
    return save_figure(fig, path)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def summary_line(rows: list[dict[str, Any]], steps: int, seconds: float, out: str,
                 resumed_from: int | None = None) -> str:
    """``done: 1800 steps in 19 min, validation 2.02 bits/char (best 2.01 at step 1750); out:
    results/baseline``: the last validation and the best (the lowest bits per character, the
    highest accuracy), else the last training loss."""
    head = f"done: {steps} step{'s' if steps != 1 else ''} in {_duration(seconds)}"
    if resumed_from:
        head += f" (resumed at step {resumed_from})"
    metric = _metric(rows)
    values = _finite(rows, metric) if metric else []
    if values:
        words = METRIC_WORDS[metric]  # pyright: ignore
        pick = max if metric == "val_accuracy" else min
        best_step, best = pick(values, key=lambda sv: sv[1])
        last = values[-1][1]
        value = (f"validation accuracy {fmt(last)}" if metric == "val_accuracy"
                 else f"validation {fmt(last)} {words}")
        head += f", {value} (best {fmt(best)} at step {best_step})"
    elif train := _finite(rows, "loss"):
        head += f", training loss {fmt(train[-1][1])} nats"
    return f"{head}; out: {out}"
