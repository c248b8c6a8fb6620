"""Writing an ``svflow inspect`` run: ``summary.json``, CSV tables, PNG figures, ``report.md``.

Reads the results of :func:`svflow_jax.inspection.study.inspect_model` (as ``summary["results"]``,
each a :class:`~svflow_jax.claims.ClaimResult` in JSON); measures nothing.

``summary.json`` (``schema_version`` 1): ``model`` (the argument), ``config`` (the
Transformer's), ``options`` (:class:`~svflow_jax.inspection.study.InspectOptions`), ``text``
(source, characters), ``results`` (name, section, statement, passed, figures, tolerance, rows,
seconds), ``seconds`` (the whole run).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..reporting import ci as _ci
from ..reporting import fmt as _fmt
from ..reporting import markdown_table as _table
from ..reporting import provenance, save_figure, write_csv, write_json, write_text
from .study import layer_groups

__all__ = ["write_inspection", "markdown", "conclusion", "sweep_section"]

SCHEMA_VERSION = 1


def _by_name(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in summary["results"]}


# A refinement that moves the next-token loss by less than this (nats), and the final states by
# less than this relative change, leaves the model where it was: its depth is close to its flow.
CLOSE_LOSS, CLOSE_STATES = 0.05, 0.05


def conclusion(summary: dict[str, Any]) -> str:
    """The run's conclusion in one or two sentences: whether the model is exactly a solver of
    its flow, whether its depth is close to that flow's solution (the largest change of loss
    and final states under refinement, against ``CLOSE_LOSS`` and ``CLOSE_STATES``),
    and, for a quick run, its sample size."""
    res = _by_name(summary)
    ex, ref = res.get("exactness"), res.get("refinement")
    words = []
    if ex and "relative_float64" in ex["figures"]:
        words.append(
            f"The model is {'exactly' if ex['passed'] else 'NOT'} a forward-Euler solver of its "
            f"own flow ({'PASS' if ex['passed'] else 'FAIL'}: largest relative difference "
            f"{_fmt(ex['figures']['relative_float64'])} in float64).")
    elif ex:
        words.append(f"The model is not the discretisation of a flow: "
                     f"{ex['figures'].get('not_a_flow', 'see below')}.")
    if ref and "loss_model" in ref["figures"]:
        finer = [r for r in ref["rows"] if "loss" in r and r["scheme"] != "euler x1"]
        if finer:
            worst = max(finer, key=lambda r: abs(r["loss_change"]))
            states = max(r["final_change_median"] for r in finer)
            close = abs(worst["loss_change"]) < CLOSE_LOSS and states < CLOSE_STATES
            words.append(
                f"Its depth is {'close to' if close else 'far from'} the solution of that "
                f"flow: integrating it more finely changes the next-token loss by up to "
                f"{worst['loss_change']:+.3g} nats ({worst['scheme']}) and the final states "
                f"by up to {_fmt(states)} (median relative change).")
    options = summary.get("options", {})
    if summary.get("quick"):
        words.append(f"A quick run: {options.get('windows')} window of "
                     f"{options.get('window')} tokens, so the figures are indicative only.")
    return " ".join(words)


def markdown(summary: dict[str, Any]) -> str:
    """``report.md``: the conclusion first, then the findings in words and tables."""
    res = _by_name(summary)
    config = summary["config"]
    ex, geo, smooth, ref = (res.get(k) for k in ("exactness", "geometry", "depth-smoothness",
                                                  "refinement"))
    lines = [f"# svflow inspect: {summary['model']}", "", conclusion(summary), "",
             f"{config['n_layers']} layers, d = {config['d_model']}, {config['n_heads']} heads "
             f"({config['n_kv_heads'] or config['n_heads']} key/value), "
             f"{config['norm_position']}-norm, block {config['block']}. Text: "
             f"{summary['text']['source']}; {summary['options']['windows']} windows of "
             f"{summary['options']['window']} tokens. Run time {summary['seconds']:.0f} s.", ""]
    if ex:
        f = ex["figures"]
        lines += ["## Is the model exactly a solver of its flow?", ""]
        if "relative_float64" in f:
            lines += [f"`to_flow` reproduces every hidden state of {f['tokens']} tokens: largest "
                      f"relative difference {_fmt(f['relative_float64'])} in float64 "
                      f"(criterion {ex['tolerance']}: "
                      f"{'PASS' if ex['passed'] else 'FAIL'}), {_fmt(f['relative_float32'])} "
                      "in float32.", ""]
        else:
            ellipsoid = ("" if f.get("ellipsoid_residual") is None else
                         f" (ellipsoid residual {_fmt(f['ellipsoid_residual'])})")
            lines += [f"No: {f['not_a_flow']}. Largest departure of a layer's token norms "
                      f"from their RMS: {_fmt(f['sphere_departure'])}{ellipsoid}.", "",
                      _table(ex["rows"])]
    if geo:
        f = geo["figures"]
        lines += ["## How the layers move the tokens", "",
                  f"Over {f['tokens']} tokens (position 0 left out): median total turn "
                  f"{_fmt(f['total_angle_deg_median'])} degrees from the first to the last "
                  f"state; median update size |x_(l+1) - x_l| / |x_l| = "
                  f"{_fmt(f['relative_step_median'])}; median radial share of an update "
                  f"{_fmt(f['radial_share_median'])}; median norm growth over the stack "
                  f"{_fmt(f['growth_total_median'])}x.", "",
                  _table(layer_groups(geo["rows"], 6)), ""]
    if smooth:
        f = smooth["figures"]
        groups = [k[: -len("_relative_change_median")] for k in f
                  if k.endswith("_relative_change_median")]
        lines += ["## Are the weights smooth in depth?", "",
                  "Median over consecutive layers of |theta_(l+1) - theta_l| / |theta_l| "
                  "(unrelated weights of equal norm: 1.41, cosine 0):", "",
                  _table([{"group": g, "relative_change": f[f"{g}_relative_change_median"],
                           "cosine": f[f"{g}_cosine_median"]} for g in groups]), ""]
    if ref and "loss_model" in ref["figures"]:
        f = ref["figures"]
        schemes = [r for r in ref["rows"] if "loss" in r]
        lines += ["## Refinement consistency", "",
                  f"Model next-token loss {_fmt(f['loss_model'])} nats (perplexity "
                  f"{_fmt(f['loss_perplexity_model'])}). The same weights, integrated more "
                  "finely (`euler x1` is the model itself, solved as its flow):", "",
                  _table(schemes), "",
                  "Ratios |x_(2m) - x_m| / |x_(4m) - x_(2m)| of the final states for Euler "
                  f"sub-steps: {', '.join(_fmt(r) for r in f['richardson_ratios']) or 'n/a'} "
                  "(2 in the asymptotic regime of a first-order method).", ""]
    sweep = res.get("alpha-sweep")
    if sweep and "loss_model" in sweep["figures"]:
        lines += sweep_section(sweep)
    lens_res = res.get("lens")
    if lens_res and "remainder" in lens_res["figures"]:
        f = lens_res["figures"]
        states = [r for r in lens_res["rows"] if r["kind"] == "lens"]
        lines += ["## The model layer by layer", "",
                  f"Logit lens on {f['tokens']} tokens: next-token loss "
                  f"{_fmt(f['loss_embedding'])} nats read off the embedding, "
                  f"{_fmt(f['loss_model'])} at the output. The target logits split into the "
                  "embedding's, every branch's, the final Norm's bias and the head's bias (the "
                  "final Norm's scale frozen at the final state) with a relative remainder of "
                  f"{_fmt(f['remainder'])} "
                  + ("(round-off: below its bound " if f.get("remainder_is_roundoff", True)
                     else "(NOT round-off: above its bound ")
                  + f"{_fmt(f.get('remainder_bound', float('nan')))}); largest: "
                  f"{', '.join(f['largest_components'])}.", "",
                  _table(layer_groups_by_index(states, 8)), ""]
    lines += ["Figures: `geometry.png`, `depth_smoothness.png`, `refinement.png`"
              + (", `alpha_sweep.png`" if sweep and "loss_model" in sweep["figures"] else "")
              + (", `lens.png`" if lens_res and "remainder" in lens_res["figures"] else "")
              + ". Tables: `*.csv`. Everything: `summary.json`.", ""]
    if line := provenance(summary.get("environment")):
        lines += [line, ""]
    return "\n".join(lines)


def _ppl_interval(row: dict[str, Any]) -> str:
    return f"{_fmt(row['perplexity'])} {_ci((row['perplexity_low'], row['perplexity_high']))}"


def _change_interval(row: dict[str, Any]) -> str:
    return f"{row['loss_change']:+.3g} {_ci((row['loss_change_low'], row['loss_change_high']))}"


#: What "order" does and does not say about the sweep (report and documentation).
ORDER_NOTE = (
    "Order is a statement about the limit h -> 0 on a smooth field: a method of order p "
    "has a global error O(h^p). Here every layer takes one step of size alpha h = alpha with "
    "coefficients that jump at every layer boundary; no limit is taken, so a method's order "
    "does not predict how close it lands to the model or to any solution of the ODE. Each row "
    "is another map y_l -> y_(l+1) made of the same per-layer fields; the weights were trained "
    "for one of them.")


def sweep_section(sweep: dict[str, Any]) -> list[str]:
    """The step-size sweep's part of ``report.md``: the (method, variant) table with what
    each row changes relative to the model, the derivative beside the removals, the linear
    profiles and the fitted profile."""
    f, rows = sweep["figures"], sweep["rows"]
    glob = [r for r in rows if r["kind"] == "global"]
    alphas = sorted({r["alpha"] for r in glob})
    table = []
    for sc in dict.fromkeys(r["scheme"] for r in glob):
        mine = {r["alpha"]: r for r in glob if r["scheme"] == sc}
        first = next(iter(mine.values()))
        table.append({"method/variant": sc, "structure": first["structure"],
                      "changes vs the model": first["changes"],
                      "evaluations/layer": first["evaluations_per_layer"],
                      **{f"alpha {a:g}": _fmt(mine[a]["perplexity"]) for a in alphas},
                      "alpha 1: 95% interval": _ci((mine[1.0]["perplexity_low"],
                                                    mine[1.0]["perplexity_high"])),
                      "best alpha": f["best_alpha"][sc]})
    low, high = f.get("perplexity_model_interval", (None, None))
    lines = ["## The step-size sweep", "",
             "Every layer's step h scaled by alpha (its output maps scaled, so its field is), "
             "the same flow integrated one step per layer; each method inside the model's own "
             "block structure (`split`: for a sequential block, Lie-Trotter of the method's "
             "sub-steps) and on the sum field F_A + F_F (`sum`; `euler/sum` is the "
             "parallel-Euler control), a splitting in its catalogue ordering and with its "
             "fields exchanged (`swapped`). Perplexity on "
             f"{f['windows']} windows ({f['tokens']} tokens); the model is `euler/split` at "
             f"alpha = 1: {_fmt(f['perplexity_model'])} {_ci((low, high))} (95% Student-t "
             "interval of the mean loss over the windows):", "", _table(table), "",
             ORDER_NOTE, ""]
    deriv = [r for r in rows if r["kind"] == "derivative"]
    if deriv:
        removal = "removal_change" in deriv[0]
        lines += ["### Which layers matter: the derivative and the removals", "",
                  "d loss / d alpha_l at alpha = 1 for every layer, by one backward pass "
                  f"through the flow ({f['derivative_seconds']:.1f} s with its compilation); "
                  "-d loss / d alpha_l is the first-order prediction of the change that "
                  "removing layer l (alpha_l = 0) makes. Largest |d loss / d alpha_l|: layers "
                  f"{', '.join(map(str, f['layers_by_derivative']))}"
                  + (f"; largest removal effects: layers "
                     f"{', '.join(map(str, f['layers_by_removal']))}; Spearman rank "
                     "correlation of -d loss / d alpha_l with the removal's change "
                     f"{_fmt(f['spearman_derivative_removal'])}, of the two importances "
                     f"(magnitudes) {_fmt(f['spearman_importance'])}" if removal else "")
                  + ".", "",
                  _table([{"layer": r["layer"], "d loss / d alpha_l": r["derivative"],
                           **({"removal: loss change": r["removal_change"]} if removal
                              else {})} for r in deriv]), ""]
    layer_rows = [r for r in rows if r["kind"] == "layer"]
    if layer_rows:
        lowering = sorted({r["layer"] for r in layer_rows if r["loss_change"] < 0})
        lines += ["One layer's alpha changed at a time: the layers that move the loss most are "
                  f"{', '.join(map(str, f['layers_that_matter_most']))}; changes that lower "
                  f"the loss: {f['one_layer_changes_that_lower_the_loss']} (layers "
                  f"{', '.join(map(str, lowering)) or 'none'}). Rows: `alpha-sweep.csv`.", ""]
    profiles = [r for r in rows if r["kind"] == "profile"]
    if profiles:
        lines += ["Linear profiles alpha_l = 1 + a (2 (l - 1) / (L - 1) - 1) (from 1 - a at the "
                  "first layer to 1 + a at the last):", "",
                  _table([{"slope a": r["slope"], "alpha_1": r["alpha_first"],
                           "alpha_L": r["alpha_last"], "perplexity [95%]": _ppl_interval(r),
                           "loss change [paired 95%]": _change_interval(r)}
                          for r in profiles]), ""]
    fit = [r for r in rows if r["kind"] == "fit"]
    if fit:
        lines += ["### A fitted step-size profile", "",
                  f"One alpha per layer fitted by Adam ({f['fit_steps']} steps, learning rate "
                  f"{_fmt(f['fit_rate'])}, {f['fit_seconds']:.0f} s) on the sweep's windows, "
                  "scored on as many held-out windows of the same length from "
                  f"{', '.join(f['fit_heldout_novels'])}; beside the global alpha = 0.9 and "
                  "alpha_l proportional to 1/sqrt(l) (mean 1). Loss changes are paired with the "
                  "model on the same windows. Held-out perplexity ratio of the fitted profile "
                  f"to the model: {_fmt(f['fit_heldout_perplexity_ratio'])} "
                  f"{_ci(f['fit_heldout_perplexity_ratio_interval'])}.", "",
                  _table([{"profile": r["profile"], "text": r["text"],
                           "perplexity [95%]": _ppl_interval(r),
                           "loss change [paired 95%]": _change_interval(r)} for r in fit]), "",
                  "Fitted alpha by layer: " + ", ".join(
                      f"{r['layer']}: {r['alpha']:.3f}" for r in rows
                      if r["kind"] == "fitted_alpha") + ".", ""]
    return lines


def _figures(out: Path, summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = _by_name(summary)
    geo = res.get("geometry")
    if geo:
        rows = geo["rows"]
        layers = [r["layer"] for r in rows]
        fig, axes = plt.subplots(1, 4, figsize=(15, 3.4))
        for ax, (key, label) in zip(axes, (
                ("angle_deg_median", "turning angle (deg, median)"),
                ("growth_median", "norm growth |x_(l+1)|/|x_l|"),
                ("radial_share_median", "radial share of the update"),
                ("relative_step_median", "|x_(l+1) - x_l| / |x_l|")), strict=True):
            ax.plot(layers, [r[key] for r in rows], "o-", ms=3)
            ax.set_xlabel("layer")
            ax.set_title(label, fontsize=9)
        if "angle_deg_p90" in rows[0]:
            axes[0].plot(layers, [r["angle_deg_p90"] for r in rows], "--", label="p90")
            axes[0].legend(fontsize=8)
        fig.suptitle(f"{summary['model']}: how each layer moves the tokens")
        save_figure(fig, out / "geometry.png")
    smooth = res.get("depth-smoothness")
    if smooth:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
        for group in dict.fromkeys(r["group"] for r in smooth["rows"]):
            rows = [r for r in smooth["rows"] if r["group"] == group]
            axes[0].plot([r["layer"] for r in rows], [r["relative_change"] for r in rows],
                         "o-", ms=3, label=group)
            axes[1].plot([r["layer"] for r in rows], [r["cosine"] for r in rows], "o-", ms=3,
                         label=group)
        axes[0].axhline(math.sqrt(2), color="gray", ls=":", label="unrelated: sqrt 2")
        axes[0].set_title("|theta_(l+1) - theta_l| / |theta_l|", fontsize=9)
        axes[1].set_title("cosine(theta_l, theta_(l+1))", fontsize=9)
        for ax in axes:
            ax.set_xlabel("layer l")
            ax.legend(fontsize=8)
        save_figure(fig, out / "depth_smoothness.png")
    ref = res.get("refinement")
    if ref and "loss_model" in ref["figures"]:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        per_layer = [r for r in ref["rows"] if "change_median" in r]
        for scheme in dict.fromkeys(r["scheme"] for r in per_layer):
            rows = [r for r in per_layer if r["scheme"] == scheme]
            ax.semilogy([r["layer"] for r in rows],
                        [max(r["change_median"], 1e-16) for r in rows], "o-", ms=3,
                        label=scheme)
        ax.set_xlabel("layer")
        ax.set_ylabel("median |x_l' - x_l| / |x_l|")
        ax.set_title("refinement: the same flow, integrated more finely", fontsize=10)
        ax.legend(fontsize=8)
        save_figure(fig, out / "refinement.png")
    _sweep_and_lens_figures(out, summary, plt)


def layer_groups_by_index(rows: list[dict[str, Any]], groups: int) -> list[dict[str, Any]]:
    """Every ``len(rows) / groups``-th row (the first and the last always): a short table of a
    long per-state list."""
    if len(rows) <= groups:
        return rows
    picks = sorted({round(i * (len(rows) - 1) / (groups - 1)) for i in range(groups)})
    return [rows[i] for i in picks]


def _sweep_and_lens_figures(out: Path, summary: dict[str, Any], plt) -> None:
    res = _by_name(summary)
    sweep = res.get("alpha-sweep")
    if sweep and "loss_model" in sweep["figures"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.8))
        glob = [r for r in sweep["rows"] if r["kind"] == "global"]
        for scheme in dict.fromkeys(r["scheme"] for r in glob):
            rows = [r for r in glob if r["scheme"] == scheme]
            axes[0].semilogy([r["alpha"] for r in rows], [r["perplexity"] for r in rows],
                             "o-" if rows[0]["variant"] == "split" else "s--", ms=3,
                             label=f"{scheme} ({rows[0]['changes']})")
        axes[0].axvline(1.0, color="gray", ls=":")
        axes[0].set_xlabel("alpha (every layer's step h scaled)")
        axes[0].set_ylabel("perplexity")
        axes[0].set_title("perplexity against (method/variant, alpha)", fontsize=10)
        axes[0].legend(fontsize=6.5, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
        deriv = [r for r in sweep["rows"] if r["kind"] == "derivative"]
        layers = [r["layer"] for r in deriv]
        axes[1].bar([x - 0.2 for x in layers], [-r["derivative"] for r in deriv], width=0.4,
                    label="-d loss / d alpha_l (first order)")
        if deriv and "removal_change" in deriv[0]:
            axes[1].bar([x + 0.2 for x in layers], [r["removal_change"] for r in deriv],
                        width=0.4, label="removal, alpha_l = 0")
        axes[1].axhline(0, color="gray", lw=0.5)
        axes[1].set_xlabel("layer l")
        axes[1].set_ylabel("change of the loss (nats)")
        axes[1].set_title("removing one layer: predicted and measured", fontsize=10)
        axes[1].legend(fontsize=8)
        save_figure(fig, out / "alpha_sweep.png")
    lens_res = res.get("lens")
    if lens_res and "remainder" in lens_res["figures"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
        states = [r for r in lens_res["rows"] if r["kind"] == "lens"]
        axes[0].semilogy([r["state"] for r in states], [r["loss"] for r in states], ".-")
        axes[0].set_xlabel("state (0: embedding, then after each sub-step)")
        axes[0].set_ylabel("next-token loss (nats)")
        axes[0].set_title("logit lens", fontsize=10)
        comps = [r for r in lens_res["rows"] if r["kind"] == "component"]
        axes[1].bar(range(len(comps)), [r["mean"] for r in comps])
        axes[1].set_xlabel("component (0: embedding, then each branch)")
        axes[1].set_ylabel("mean contribution to the target logit")
        axes[1].set_title("direct logit decomposition (exact)", fontsize=10)
        save_figure(fig, out / "lens.png")


def write_inspection(out: str | Path, summary: dict[str, Any]) -> Path:
    """Writes ``summary.json``, one CSV per result, the figures and ``report.md`` to ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "summary.json", summary)
    for r in summary["results"]:
        write_csv(out / f"{r['name']}.csv", r["rows"])
    _figures(out, summary)
    write_text(out / "report.md", markdown(summary))
    return out
