"""Writing a verification run: ``summary.json``, CSV tables, PNG figures and ``report.md``.

The schema of ``summary.json`` is documented in the README ("The verify report"). Timings are
kept under ``timings`` (and in the per-point ``seconds`` of the sweep), the only fields that
change between two runs with the same seed.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1


def _csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _fmt(v: float) -> str:
    return "nan" if not math.isfinite(v) else f"{v:.3g}"


def write_tables(out: Path, summary: dict[str, Any]) -> list[str]:
    """CSV files; returns their names."""
    names = []
    _csv(out / "exactness.csv", summary["exactness"])
    names.append("exactness.csv")
    points = [
        {"solver": row["solver"], **point}
        for row in summary["convergence"] for point in row["points"]
    ]
    _csv(out / "convergence.csv", points)
    _csv(out / "orders.csv", [
        {k: (v if not isinstance(v, list) else ";".join(map(str, v))) for k, v in row.items()
         if k != "points"} for row in summary["convergence"]
    ])
    _csv(out / "drift.csv", [
        {"solver": row["solver"], "retracted": row["retracted"], **p}
        for row in summary["drift"] for p in row["points"]
    ])
    _csv(out / "prenorm_vs_postnorm.csv", summary["prenorm_vs_postnorm"]["points"])
    names += ["convergence.csv", "orders.csv", "drift.csv", "prenorm_vs_postnorm.csv"]
    return names


def _save(fig, path: Path) -> str:
    """Lay out, write and close a figure; returns its file name."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def write_figures(out: Path, summary: dict[str, Any]) -> list[str]:
    """Convergence, work-precision, drift and pre/post-norm figures; returns their names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    colors = dict(zip([r["solver"] for r in summary["convergence"]],
                      plt.cm.tab10.colors, strict=False))

    # Convergence: error against step size, with reference slopes.
    fig, ax = plt.subplots(figsize=(7, 5))
    for row in summary["convergence"]:
        h = [p["step_size"] for p in row["points"]]
        e = [p["error"] for p in row["points"]]
        ax.loglog(h, e, "o-", color=colors[row["solver"]], ms=4,
                  label=f"{row['solver']} (p={_fmt(row['fitted_order'])}, "
                        f"theory {row['expected_order']})")
        # reference slope through the finest fitted point
        fitted = [(hh, ee) for hh, ee, p in zip(h, e, row["points"], strict=True) if p["in_fit"]]
        if fitted:
            h0, e0 = fitted[-1]
            hs = [h0, h0 * 8]
            ax.loglog(hs, [e0 * (x / h0) ** row["expected_order"] for x in hs], ":",
                      color=colors[row["solver"]], lw=1)
    ax.set_xlabel("step size h (= T / layers)")
    ax.set_ylabel("max geodesic error at T")
    ax.set_title("Convergence on S^{d-1} (dotted: theoretical slope)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    names.append(_save(fig, out / "convergence.png"))

    # Work-precision: error against field evaluations and wall time.
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for row in summary["convergence"]:
        pts = [p for p in row["points"] if p["error"] > 0]
        axes[0].loglog([p["evaluations"] for p in pts], [p["error"] for p in pts], "o-",
                       color=colors[row["solver"]], ms=3, label=row["solver"])
        axes[1].loglog([p["seconds"] for p in pts], [p["error"] for p in pts], "o-",
                       color=colors[row["solver"]], ms=3, label=row["solver"])
    axes[0].set_xlabel("vector-field evaluations")
    axes[1].set_xlabel("wall time per solve [s] (median)")
    for ax in axes:
        ax.set_ylabel("max geodesic error at T")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Work-precision: which layer design buys accuracy cheapest")
    names.append(_save(fig, out / "work_precision.png"))

    # Drift off the sphere without retraction.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in summary["drift"]:
        h = [p["step_size"] for p in row["points"]]
        dr = [max(p["norm_drift"], 1e-17) for p in row["points"]]
        label = row["solver"] + (" (on the sphere by construction)" if row["retracted"]
                                 else " (no retraction)")
        ax.loglog(h, dr, "o-", ms=4, label=label, color=colors.get(row["solver"]))
    ax.set_xlabel("step size h")
    ax.set_ylabel("max | |y(T)| - 1 |")
    ax.set_title("Drift off the sphere without retraction")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    names.append(_save(fig, out / "drift.png"))

    # Pre-norm against post-norm.
    pp = summary["prenorm_vs_postnorm"]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    h = [p["step_size"] for p in pp["points"]]
    ax.loglog(h, [p["postnorm_error"] for p in pp["points"]], "o-", label="post-norm stack")
    ax.loglog(h, [p["prenorm_error"] for p in pp["points"]], "s-",
              label="pre-norm stack (unequal radii)")
    ax.set_xlabel("step size h (= T / layers)")
    ax.set_ylabel("max geodesic error of token directions")
    ax.set_title("Against the spherical flow: post-norm converges, pre-norm runs on its clocks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    names.append(_save(fig, out / "prenorm_vs_postnorm.png"))
    return names


def _mark(passed: bool | None) -> str:
    if passed is None:  # float32: too few points above round-off to fit an order
        return "UNRESOLVED (float32 round-off)"
    return "PASS" if passed else "FAIL"


def write_markdown(out: Path, summary: dict[str, Any]) -> None:
    """``report.md``: every claim with PASS/FAIL, the tables, and the figures embedded."""
    cfg = summary["config"]
    lines = [
        "# svflow verify",
        "",
        f"Overall: **{_mark(summary['passed'])}**. Seed {cfg['seed']}, {cfg['dtype']}, "
        f"n = {cfg['tokens']} tokens, d = {cfg['dim']}, T = {cfg['t1']}"
        f"{' (quick)' if cfg['quick'] else ''}.",
        "",
        "## 1. A Transformer is the discretisation (exactness)",
        "",
        "Each row runs a random Transformer and the flow solver it equals, from the same input,"
        " and reports the largest difference over layers, tokens and coordinates.",
        "",
        "| variant | flow solver | depth | max abs diff | tolerance | |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in summary["exactness"]:
        lines.append(f"| {r['variant']} | {r['solver']} | {r['depth']} | "
                     f"{r['max_abs_diff']:.2e} | {r['tolerance']:.1e} | {_mark(r['passed'])} |")
    lines += [
        "",
        "## 2. Convergence orders (step-size sweep)",
        "",
        "Error: max over tokens of the geodesic distance at T to a Retracted(Dopri8) reference "
        f"(rtol = atol = {cfg['reference_tolerance']:g}). Fit: least squares of log error on "
        f"log h over the points with error in [{cfg['fit_floor']:g}, {cfg['fit_ceiling']:g}] "
        f"and at least {cfg['min_steps_in_fit']} steps.",
        "",
        "| solver | expected | fitted | 95% interval | points in fit | max norm drift | |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in summary["convergence"]:
        lo, hi = r["order_ci"]
        lines.append(f"| {r['solver']} | {r['expected_order']} | {_fmt(r['fitted_order'])} | "
                     f"[{_fmt(lo)}, {_fmt(hi)}] | {r['fit_points']} | "
                     f"{r['max_norm_drift']:.1e} | {_mark(r['passed'])} |")
    lines += ["", "![convergence](convergence.png)", "",
              "## 3. Work-precision", "",
              "![work-precision](work_precision.png)", "",
              "## 4. Drift off the sphere without retraction", "",
              "| solver | drift at the coarsest step | drift at the finest step |",
              "| --- | --- | --- |"]
    for r in summary["drift"]:
        lines.append(f"| {r['solver']}{' (on-sphere method)' if r['retracted'] else ''} | "
                     f"{r['points'][0]['norm_drift']:.1e} | {r['points'][-1]['norm_drift']:.1e} |")
    pp = summary["prenorm_vs_postnorm"]
    lines += ["", "![drift](drift.png)", "",
              "## 5. Pre-norm against post-norm", "",
              f"Token radii in the pre-norm stack: {min(pp['radii']):.2f} to "
              f"{max(pp['radii']):.2f}. Post-norm fitted order {_fmt(pp['postnorm_order'])}; "
              f"pre-norm error at the finest step {pp['prenorm_error_finest']:.3g} (order "
              f"{_fmt(pp['prenorm_order'])}): each token direction runs on its own clock "
              f"d tau = dt / r. **{_mark(pp['passed'])}**", "",
              "![prenorm](prenorm_vs_postnorm.png)", ""]
    (out / "report.md").write_text("\n".join(lines))


def write_all(out: Path, summary: dict[str, Any], config_for_rerun: dict[str, Any]) -> None:
    """Everything: ``summary.json``, ``config.json``, CSVs, PNGs, ``report.md``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_for_rerun, indent=2) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_tables(out, summary)
    write_figures(out, summary)
    write_markdown(out, summary)
