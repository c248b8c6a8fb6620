"""Writing a verification run: ``summary.json``, CSV tables, PNG figures and ``report.md``.

Everything here reads the claim results of :mod:`svflow_jax.claims.run` (``summary["claims"]``);
it measures nothing. The schema of ``summary.json`` is documented in ``docs/reports.md`` (the
documentation's "Report formats"). Timings (``timings``, ``compile``, the ``seconds`` of each
claim and of each sweep point) are the only values that change between two runs with the same
options.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from ..reporting import fmt as _fmt
from ..reporting import provenance, save_figure, verdict, write_csv, write_json, write_text
from . import measure

__all__ = ["headline", "verdict", "conclusion", "legend", "write_all", "write_tables",
           "write_figures", "write_markdown", "convergence_figure", "write_sweep"]

MARKERS = ("o", "s", "^", "v", "D", "x", "+", "*", "P", "h")
STYLES = ("-", "--", "-.", ":")


def headline(claim: dict[str, Any]) -> str:
    """The one figure that decides a claim (its ``headline``, named by the claim's
    :class:`~svflow_jax.claims.Evidence`), as text; ``""`` when it names none."""
    f, key = claim["figures"], claim.get("headline")
    if not key or key not in f:
        return ""
    if key == "fitted_order":
        lo, hi = f.get("order_ci", [math.nan, math.nan])
        return f"order {_fmt(f['fitted_order'])} [{_fmt(lo)}, {_fmt(hi)}]"
    return f"{key} = {_fmt(f[key])}"


def _slug(name: str) -> str:
    return name.replace("/", "__")


def write_tables(out: Path, summary: dict[str, Any]) -> list[str]:
    """``claims.csv`` (one row per claim) and ``tables/<claim>.csv`` (each claim's rows)."""
    write_csv(out / "claims.csv", [
        {"name": c["name"], "section": c["section"], "passed": c["passed"],
         "headline": headline(c), "tolerance": c["tolerance"], "seconds": c["seconds"],
         **{k: v for k, v in c["figures"].items() if not isinstance(v, (dict, list))}}
        for c in summary["claims"]])
    (out / "tables").mkdir(exist_ok=True)
    names = ["claims.csv"]
    for c in summary["claims"]:
        if c["rows"]:
            write_csv(out / "tables" / f"{_slug(c['name'])}.csv", c["rows"])
            names.append(f"tables/{_slug(c['name'])}.csv")
    return names


def _claims(summary: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    return [c for c in summary["claims"] if c["name"].startswith(prefix)]


def _styles():
    import matplotlib.pyplot as plt

    colors = itertools.cycle(plt.cm.tab10.colors)
    return ((next(colors), m, s) for m, s in zip(itertools.cycle(MARKERS),
                                                 itertools.cycle(STYLES)))


def convergence_figure(path: Path, sweeps: list[tuple[dict[str, Any], list[dict[str, Any]]]]
                       ) -> str:
    """The log-log convergence figure of step-size sweeps (``svflow verify``'s order claims,
    ``svflow sweep``'s methods): error against step size, one line per method with its fitted
    and nominal order in the legend, and the nominal slope dotted through the finest fitted
    point. ``sweeps``: each method's figures (``solver``, ``fitted_order``,
    ``expected_order``) and points (``step_size``, ``error``, ``in_fit``). Returns the file
    name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    for (f, pts), (color, marker, style) in zip(sweeps, _styles(), strict=False):
        h, e = [p["step_size"] for p in pts], [p["error"] for p in pts]
        ax.loglog(h, e, marker=marker, ls=style, color=color, ms=5, mfc="none",
                  label=f"{f['solver']} (p = {_fmt(f['fitted_order'])}, theory "
                        f"{f['expected_order']})")
        fitted = [(hh, ee) for hh, ee, p in zip(h, e, pts, strict=True) if p["in_fit"]]
        if fitted:  # theoretical slope through the finest fitted point
            h0, e0 = fitted[-1]
            ax.loglog([h0, 8 * h0], [e0, e0 * 8.0 ** f["expected_order"]], ":",
                      color=color, lw=1)
    ax.set(xlabel="step size h (= T / layers)", ylabel="max geodesic error at T",
           title="Convergence on the sphere (dotted: theoretical slope)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def write_figures(out: Path, summary: dict[str, Any]) -> list[str]:
    """Figures for the claims present; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    orders = _claims(summary, "order/")
    if orders:
        names.append(convergence_figure(out / "convergence.png",
                                        [(c["figures"], c["rows"]) for c in orders]))

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        for c, (color, marker, style) in zip(orders, _styles(), strict=False):
            pts = [p for p in c["rows"] if p["error"] > 0]
            for ax, key in zip(axes, ("evaluations", "seconds"), strict=True):
                ax.loglog([p[key] for p in pts], [p["error"] for p in pts], marker=marker,
                          ls=style, color=color, ms=4, mfc="none", label=c["figures"]["solver"])
        axes[0].set_xlabel("vector-field evaluations")
        axes[1].set_xlabel("wall time per solve [s] (median)")
        for ax in axes:
            ax.set_ylabel("max geodesic error at T")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.suptitle("Work-precision: which layer design buys accuracy cheapest")
        names.append(save_figure(fig, out / "work_precision.png"))

    drift = _claims(summary, "drift")
    if drift:
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        rows = drift[0]["rows"]
        solvers = list(dict.fromkeys(r["solver"] for r in rows))
        for name, (color, marker, style) in zip(solvers, _styles(), strict=False):
            pts = [r for r in rows if r["solver"] == name]
            how = "on the sphere by construction" if pts[0]["retracted"] else "no retraction"
            ax.loglog([p["step_size"] for p in pts], [max(p["norm_drift"], 1e-17) for p in pts],
                      marker=marker, ls=style, color=color, ms=5, mfc="none",
                      label=f"{name} ({how})")
        ax.set(xlabel="step size h", ylabel="max | |y(T)| - 1 |",
               title="Drift off the sphere without retraction")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        names.append(save_figure(fig, out / "drift.png"))

    stacks = {c["name"]: c for c in _claims(summary, "standard-layer/stack-order")
              + _claims(summary, "prenorm/")}
    if stacks:
        fig, ax = plt.subplots(figsize=(7.5, 5))
        curves = [("standard-layer/stack-order", "error_sphere_flow",
                   "post-norm (standard) vs sphere flow"),
                  ("prenorm/coupled-limit", "error_coupled",
                   "pre-norm vs its coupled limit (u, r)"),
                  ("prenorm/not-the-sphere-flow", "error_sphere_flow",
                   "pre-norm (unequal radii) vs sphere flow"),
                  ("prenorm/projected-unit-radii", "error_sphere_flow",
                   "pre-norm (projected, unit radii) vs sphere flow")]
        for (name, key, label), (color, marker, style) in zip(curves, _styles(), strict=False):
            if name in stacks:
                rows = stacks[name]["rows"]
                ax.loglog([r["step_size"] for r in rows], [r[key] for r in rows],
                          marker=marker, ls=style, color=color, ms=5, mfc="none", label=label)
        ax.set(xlabel="step size h = T / L", ylabel="max geodesic error of token directions",
               title="Transformer stacks against their continuous limits")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        names.append(save_figure(fig, out / "stacks.png"))
    return names


SECTIONS = {
    "exactness": "A Transformer is the discretisation (exactness)",
    "orders": "Convergence orders",
    "stacks": "Transformer stacks as depth grows",
}


def legend(section: str) -> str:
    """The legend under a section's table of ``report.md``: its columns and the rule that
    decides its verdicts, quoting the constants of :mod:`svflow_jax.claims.measure` the rule
    uses."""
    columns = ("*Legend.* Columns: *claim*; *statement*, what it asserts; *figure*, the one "
               "measured number that decides it; *criterion*, the rule it must meet; the verdict"
               " (PASS, FAIL, or UNRESOLVED when float32 round-off leaves too few points to fit"
               " an order). ")
    orders = (f"An order passes within {measure.ORDER_TOLERANCE:g} of the solver's order "
              f"(order >= 5: at least order - {measure.HIGH_ORDER_SHORTFALL:g}, and the lower "
              f"end of the fit's 95% Student-t interval at most order + "
              f"{measure.HIGH_ORDER_EXCESS:g}); the interval is otherwise a description. ")
    rules = {
        "exactness": ("Exactness passes when the largest geodesic distance between the "
                      f"Transformer's and the solver's hidden states is at most "
                      f"{measure.EXACT_FLOAT64:g} in float64, or {measure.C_FLOAT32:g} L eps s "
                      "in float32 (L layers, eps of the float32 matrix multiply, s the largest "
                      "token norm). "),
        "orders": orders,
        "stacks": orders + "A difference passes against the tolerance its criterion names. ",
    }
    return (columns + rules.get(section, "") + "Each claim is a deterministic check against "
            "its tolerance, decided on its own: no statistical test, no multiplicity correction.")


def conclusion(summary: dict[str, Any]) -> str:
    """The run's conclusion in one or two sentences, with the caveat that matters: which
    claims failed, how many orders float32 round-off left unresolved, and a quick run's sizes
    (its timings are not benchmarks)."""
    claims = summary["claims"]
    failed = [c["name"] for c in claims if c["passed"] is False]
    unresolved = [c["name"] for c in claims if c["passed"] is None]
    cfg = summary["config"]
    if failed:
        words = (f"**FAILED**: {len(failed)} of {len(claims)} claims do not hold "
                 f"({', '.join(failed[:6])}{', ...' if len(failed) > 6 else ''}).")
    else:
        words = (f"**PASSED**: all {len(claims)} claims hold: every Transformer block variant "
                 "equals the flow solver it discretises, and every solver and stack converges "
                 "at its expected order.")
    if unresolved:
        words += (f" {len(unresolved)} orders are unresolved: in {cfg['dtype']} too few "
                  "errors lie above round-off to fit them.")
    if cfg.get("quick"):
        words += (f" A quick run (n = {cfg['tokens']} tokens, d = {cfg['dim']}, "
                  f"{cfg['layers']} layers): the claims are checked on small problems, and its "
                  "timings are not benchmarks.")
    return words


def write_markdown(out: Path, summary: dict[str, Any], figures: list[str]) -> None:
    """``report.md``: the conclusion first, then every claim with its statement, figure,
    tolerance and verdict."""
    cfg = summary["config"]
    comp = summary["compile"]
    lines = [
        "# svflow verify",
        "",
        conclusion(summary),
        "",
        f"Overall: **{verdict(summary['passed'])}**. Seed {cfg['seed']}, {cfg['dtype']}, "
        f"n = {cfg['tokens']} tokens, d = {cfg['dim']}, {cfg['layers']} layers, T = {cfg['t1']}"
        f"{' (quick)' if cfg.get('quick') else ''}. {len(summary['claims'])} claims in "
        f"{comp['total_s']:.1f} s ({comp['xla_compilations']} XLA compilations, "
        f"{comp['cache_hits']} programs from the compilation cache; "
        f"{comp['compile_total_s']:.1f} of the claims' {comp['busy_s']:.1f} thread-seconds "
        "tracing and compiling).",
        "",
        "Error metric: the largest geodesic distance over tokens, 2 atan2(|x - y|, |x + y|). "
        f"References: float64, rtol = atol = {cfg['reference_tolerance']:g}. Orders: least "
        f"squares of log error on log h over errors in [{cfg['fit_floor']:g}, "
        f"{cfg['fit_ceiling']:g}] (sweeps: at least {cfg['min_steps_in_fit']} steps), with a "
        "95% Student-t interval. The mathematics: docs/theory.md.",
    ]
    if line := provenance(summary.get("environment")):
        lines += ["", line]
    for section, title in SECTIONS.items():
        claims = [c for c in summary["claims"] if c["section"] == section]
        if not claims:
            continue
        lines += ["", f"## {title}", "", "| claim | statement | figure | criterion | |",
                  "| --- | --- | --- | --- | --- |"]
        for c in claims:
            cells = [c["statement"], headline(c), c["tolerance"]]
            statement, figure, criterion = (cell.replace("|", "\\|") for cell in cells)
            lines.append(f"| `{c['name']}` | {statement} | {figure} | {criterion} | "
                         f"{verdict(c['passed'])} |")
        lines += ["", legend(section)]
    lines += [""]
    for name in figures:
        lines += [f"![{name[:-4]}]({name})", ""]
    write_text(out / "report.md", "\n".join(lines))


def write_all(out: Path, summary: dict[str, Any]) -> None:
    """Everything: ``summary.json``, ``config.json`` (strict JSON), CSVs, PNGs,
    ``report.md``."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", summary["config"])
    write_json(out / "summary.json", summary)
    write_tables(out, summary)
    write_markdown(out, summary, write_figures(out, summary))


def write_sweep(out: Path, rows: list[dict[str, Any]]) -> list[str]:
    """``svflow sweep``'s ``convergence.png`` (:func:`convergence_figure`) and ``report.md``
    beside its JSON files: one verdict line per method first (its fitted order against its
    nominal order), then the table of every point. ``rows``: the methods' JSON files. Returns
    the files' names."""
    figure = convergence_figure(out / "convergence.png",
                                [(r, r["points"]) for r in rows if r.get("points")])
    lines = ["# svflow sweep", ""]
    for r in rows:
        lo, hi = r["order_ci"]
        lines.append(f"- **{verdict(r['passed'])}** `{r['solver']}`: fitted order "
                     f"{_fmt(r['fitted_order'])} (95% [{_fmt(lo)}, {_fmt(hi)}], "
                     f"{r['fit_points']} points) against its nominal order "
                     f"{r['expected_order']}; criterion {r['tolerance']}.")
    lines += ["", f"![convergence]({figure})", "", "| method | steps | step size | error | "
              "in fit | evaluations | seconds |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for p in r["points"]:
            lines.append(f"| `{r['solver']}` | {p['num_steps']} | {_fmt(p['step_size'])} | "
                         f"{_fmt(p['error'])} | {'yes' if p['in_fit'] else 'no'} | "
                         f"{_fmt(p['evaluations'])} | {_fmt(p['seconds'])} |")
    if rows and (line := provenance(rows[-1].get("environment"))):
        lines += ["", line]
    write_text(out / "report.md", "\n".join(lines) + "\n")
    return [figure, "report.md"]
