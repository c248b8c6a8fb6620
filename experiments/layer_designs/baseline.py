"""``--part baseline``: tunes and trains the baseline that ``svflow train`` runs by default
(:mod:`svflow_jax.training.recipes`).

A short learning-rate sweep (each rate of ``LR_GRID`` for a fifth of the recipe's steps, on its
own warm-up + cosine schedule), the full recipe at the recipe's rate (the report says whether the
sweep agrees), and the recipe's model on two-hop and one-hop associative recall. Writes
``baseline/report.md``, ``baseline/results.json`` and ``baseline/curve.png`` (validation bits
per character against minutes and tokens, with tokens per second). Its run time is on the
results page ``docs/results/baseline.md``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from svflow_jax.atomic import write_json, write_text

from .common import quick_recipe, validation_curve


def run_baseline(out: Path, *, quick: bool = False, progress: bool = True) -> dict:
    """The baseline part (module docstring): sweep, full recipe, recall. Each run lives in
    its own folder under ``out`` and resumes from its checkpoints."""
    from svflow_jax.environment import environment
    from svflow_jax.training.recipes import LR_GRID, recipe
    from svflow_jax.training.trainer import train

    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    base = recipe("austen")
    if quick:
        base = quick_recipe(base)
    short = max(2, base.steps // 5)
    sweep = []
    for lr in LR_GRID:
        config = dataclasses.replace(base, lr=lr, steps=short, warmup=max(1, short // 20),
                                     eval_every=max(1, short // 4), checkpoint_every=0)
        print(f"[{time.perf_counter() - start:6.0f}s] sweep: lr {lr:g}, {short} steps",
              flush=True)
        r = train(config, out / f"sweep-lr{lr:g}", progress=progress)
        sweep.append({"lr": lr, "steps": short, "val_bpc": r.final["val_bpc"],
                      "seconds": r.seconds})
    best = min(sweep, key=lambda row: row["val_bpc"])["lr"]
    print(f"[{time.perf_counter() - start:6.0f}s] the recipe: lr {base.lr:g}, {base.steps} "
          "steps", flush=True)
    full = train(base, out / "recipe", progress=progress)
    curve = validation_curve(full.history, "val_bpc")
    tokens, seconds = full.history[-1]["tokens"], full.history[-1]["seconds"]
    recall = {}
    for task in ("recall", "recall1"):
        config = recipe(task)
        if quick:
            config = quick_recipe(config)
        print(f"[{time.perf_counter() - start:6.0f}s] {task}: {config.steps} steps", flush=True)
        r = train(config, out / task, progress=progress)
        recall[task] = {"steps": config.steps, "lr": config.lr,
                        "val_accuracy": r.final["val_accuracy"], "seconds": r.seconds,
                        "curve": validation_curve(r.history, "val_accuracy")}
    results = {
        "recipe": base.to_json(), "sweep": sweep, "sweep_best_lr": best,
        "recipe_lr_is_sweep_best": best == base.lr,
        "final_bpc": full.final["val_bpc"], "seconds": seconds,
        "tokens_per_s": tokens / seconds, "curve": curve, "recall": recall,
        "environment": environment()}
    write_json(out / "results.json", results)
    _baseline_figure(out, results)
    _baseline_report(out, results)
    print(f"[{time.perf_counter() - start:6.0f}s] wrote {out / 'report.md'}", flush=True)
    return results


def _baseline_figure(out: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from svflow_jax.reporting import save_figure

    curve = np.array(results["curve"], float)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(curve[:, 2] / 60, curve[:, 3], "o-",
                 label=f"recipe, lr {results['recipe']['lr']:g}")
    axes[0].set_xlabel("wall-clock minutes (this machine)")
    axes[1].plot(curve[:, 1] / 1e6, curve[:, 3], "o-")
    axes[1].set_xlabel("training tokens (millions)")
    for ax in axes[:2]:
        ax.set_ylabel("validation bits per character (Persuasion)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    for task, row in results["recall"].items():
        c = np.array(row["curve"], float)
        axes[2].plot(c[:, 0], c[:, 3], "o-", label=task)
    axes[2].set_xlabel("optimiser step")
    axes[2].set_ylabel("held-out accuracy")
    axes[2].set_ylim(0, 1.02)
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    fig.suptitle("the baseline recipe of svflow train")
    save_figure(fig, out / "curve.png")


def _baseline_report(out: Path, results: dict) -> None:
    from svflow_jax.reporting import provenance

    r, m = results["recipe"], results["recipe"]["model"]
    lines = [
        "# The baseline recipe", "",
        f"Pre-norm {m['design']} design with per-layer weights (a Transformer): width "
        f"{m['d_model']}, {m['n_heads']} heads of {m['d_head']}, FFN {m['d_ff']}, "
        f"{m['num_steps']} layers, context {m['context']}; {r['steps']} AdamW steps of "
        f"{r['batch_size']} sequences, warm-up {r['warmup']}, weight decay "
        f"{r['weight_decay']:g}, peak learning rate {r['lr']:g}. "
        f"{provenance(results['environment'])}",
        "", "## Learning-rate sweep", "",
        "| peak lr | steps | val. bits/char | seconds |", "|---|---|---|---|"]
    for row in results["sweep"]:
        lines.append(f"| {row['lr']:g} | {row['steps']} | {row['val_bpc']:.3f} | "
                     f"{row['seconds']:.0f} |")
    agree = ("the recipe's rate" if results["recipe_lr_is_sweep_best"] else
             f"NOT the recipe's rate ({r['lr']:g}): update svflow_jax/training/recipes.py")
    lines += ["", f"Best: {results['sweep_best_lr']:g}, {agree}.", "",
              "## The recipe", "",
              f"Validation {results['final_bpc']:.3f} bits per character after "
              f"{results['seconds'] / 60:.1f} minutes, {results['tokens_per_s']:.0f} training "
              "tokens per second (evaluations included).", "",
              "| step | tokens | minutes | val. bits/char |", "|---|---|---|---|"]
    for step, tokens, seconds, bpc in results["curve"]:
        lines.append(f"| {step} | {tokens} | {seconds / 60:.1f} | {bpc:.3f} |")
    lines += ["", "## Associative recall (held-out accuracy)", "",
              "| task | steps | peak lr | accuracy | seconds |", "|---|---|---|---|---|"]
    for task, row in results["recall"].items():
        lines.append(f"| {task} | {row['steps']} | {row['lr']:g} | "
                     f"{row['val_accuracy']:.3f} | {row['seconds']:.0f} |")
    lines += ["", "![learning curves](curve.png)"]
    write_text(out / "report.md", "\n".join(lines) + "\n")
