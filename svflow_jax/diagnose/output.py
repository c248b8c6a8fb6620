"""Writing a diagnostics run: ``config.json``, ``summary.json``, CSV tables, PNG figures and
``report.md``. Everything here reads the summary of :func:`svflow_jax.diagnose.diagnose`; it
measures nothing (the headline verdicts compare the measured numbers with the paper's
statements, as listed in :data:`PAPER`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..reporting import ci as _ci
from ..reporting import fmt as _fmt
from ..reporting import provenance, save_figure, write_csv, write_json, write_text
from .metrics import BY_NAME
from .stats import ALPHA

__all__ = ["PAPER", "DEPTH_BOUND", "headline", "headline_legend", "tracks_perplexity",
           "former_verdict", "legend", "conclusion",
           "write_all"]

def _kind(name: str, entry: dict[str, Any]) -> str:
    """The kind of a metric (:class:`~svflow_jax.diagnose.metrics.Metric`): from the summary,
    else from the record, else from the name (summaries written before the kinds)."""
    if "kind" in entry:
        return entry["kind"]
    if name in BY_NAME:
        return BY_NAME[name].kind
    return "model_units" if name.endswith("_model") else "svflow"


def _tested(rho: dict[str, Any]) -> int:
    """The number of metrics tested (Bonferroni's ``m``): the SVFlow metrics; the model-unit
    twins are descriptions and the controls check the rule."""
    return sum(_kind(name, e) == "svflow" for name, e in rho.items())


def _controlled(summary_shuffle: dict[str, Any]) -> bool:
    """Whether the run had model-free controls (the SVFlow verdicts then require them)."""
    return bool(summary_shuffle.get("design", {}).get("controls"))


def _verdict(name: str, entry: dict[str, Any], comparisons: int, controls: bool) -> str:
    kind = _kind(name, entry)
    if kind == "model_units":
        return "description (model units)"
    if kind == "control":
        return ("passes the rule (control)" if tracks_perplexity(entry, comparisons)
                else "fails the rule (control)")
    if tracks_perplexity(entry, comparisons, controls=controls):
        return "reproduced"
    if controls and tracks_perplexity(entry, comparisons):
        return "not reproduced (not beyond the control)"
    return "not reproduced"


def former_verdict(entry: dict[str, Any], comparisons: int, alpha: float = ALPHA) -> str:
    """The verdict the former rule gave: within-level and partial p-values from the former
    null (each level's windows permuted separately), no control. For comparison only."""
    lc = entry["level_controlled"]
    former = {**lc, "stratified_p": lc["former_stratified_p"],
              "partial_p": lc["former_partial_p"]}
    return ("reproduced" if tracks_perplexity({"level_controlled": former}, comparisons, alpha)
            else "not reproduced")


PAPER = {
    "rho": "metrics correlate with perplexity and calibration, Spearman rho about 0.87",
    "depth": "deeper layers are more sensitive to prefix shuffling than shallow ones",
    "scaling": "extreme concentrations make divergences explode and the model over-confident "
               "(Qwen3)",
}
# "deeper layers are more sensitive" is reproduced when the lower end of the deep/shallow
# ratio's 95% interval lies above this
DEPTH_BOUND = 1.0


def tracks_perplexity(entry: dict[str, Any], comparisons: int, alpha: float = ALPHA,
                      controls: bool = False) -> bool:
    """The verdict rule of "a metric tracks perplexity": both level-controlled statistics
    (:func:`svflow_jax.diagnose.stats.level_controlled_spearman`, the within-level and the
    partial rho) have the expected sign with a one-sided permutation p-value strictly below
    ``alpha / comparisons`` (Bonferroni over the metrics tested), the p-values from the null
    that fits the design (one permutation of the windows at every level; documents permuted
    whole). With ``controls``, the partial rank correlation given the level and the
    model-free controls must pass the same way. A metric that depends on the shuffle level
    alone fails it, however monotone; one that follows the text's difficulty alone fails it
    with ``controls``."""
    # a NaN statistic or p-value (null in summary.json) never passes
    lc = {k: float("nan") if v is None else v for k, v in entry["level_controlled"].items()}
    bound = alpha / comparisons
    s = lc["sign"]
    ok = (lc["stratified_p"] < bound and lc["partial_p"] < bound
          and s * lc["stratified"] > 0 and s * lc["partial"] > 0)
    if controls:
        ok = ok and lc["controlled_p"] < bound and s * lc["controlled"] > 0
    return bool(ok)


def headline(summary: dict[str, Any]) -> list[dict[str, str]]:
    """The headline table: paper statement, our number, verdict (reproduced / not reproduced
    / not comparable / description). Decision rules (``docs/theory.md``, section 19): a
    metric "tracks perplexity" by :func:`tracks_perplexity` (the expected sign fixed before the
    run, the shuffle level controlled, Bonferroni over the metrics); rho across levels and
    across (window, level) cells are shown beside it as descriptions (perplexity rises with the
    level by construction, so any metric monotone in the level gets |rho| = 1 across levels).
    The rho with ECE exists only across levels (ECE is a per-level statistic): a description.
    Depth: the deep/shallow ratio's interval lies above 1. Scaling: from c = 1 to the largest
    c, the clean-vs-shuffled KL grows by more than the factor (faster than linearly) and the
    over-confidence (mean confidence - accuracy) rises with intervals that do not overlap."""
    rows = []
    sh = summary["shuffle"]
    if "rho" in sh:
        m, controls = _tested(sh["rho"]), _controlled(sh)
        for name, e in sh["rho"].items():
            r, ci = e["perplexity"]["rho"], e["perplexity"]["ci"]
            re_, cie = e["ece"]["rho"], e["ece"]["ci"]
            cells = e["perplexity_cells"]
            lc = e["level_controlled"]
            given = (f", given the controls {_fmt(lc.get('controlled'), 2)} "
                     f"(p {_fmt(lc.get('controlled_p'), 2)})"
                     if controls and _kind(name, e) != "control" else "")
            rows.append({"statement": f"{name} tracks perplexity (expected sign "
                                      f"{'+' if lc['sign'] > 0 else '-'})",
                         "ours": f"within-level {_fmt(lc['stratified'], 2)} "
                                 f"(p {_fmt(lc['stratified_p'], 2)}), partial "
                                 f"{_fmt(lc['partial'], 2)} (p {_fmt(lc['partial_p'], 2)})"
                                 f"{given}; across levels {_fmt(r, 2)} {_ci(ci)}, cells "
                                 f"{_fmt(cells['rho'], 2)} {_ci(cells['ci'])}",
                         "verdict": _verdict(name, e, m, controls)})
            if _kind(name, e) == "control":
                continue
            rows.append({"statement": f"rho({name}, ECE) across levels",
                         "ours": f"levels {_fmt(re_, 2)} {_ci(cie)}",
                         "verdict": "description (monotonicity in the level)"})
    # cumulative (the shuffled run: a layer inherits every upstream change) and layer-local
    # (only that layer's context shuffled, the clean stream at its input)
    for key, how, name in [(k, h, n) for k, h in (("depth", ""), ("depth_local", "layer-local, "))
                           for n in ("kl_clean", "kl_q_p", "entropy", "log_evidence")]:
        if name not in sh.get(key, {}):
            continue
        e = sh[key][name]
        lo, _ = e["deep_over_shallow_ci"]
        rows.append({"statement": f"deep layers more sensitive ({how}{name})",
                     "ours": f"deep/shallow {_fmt(e['deep_over_shallow'])} "
                             f"{_ci(e['deep_over_shallow_ci'])} (unnormalised "
                             f"{_fmt(e.get('raw_deep_over_shallow'))} "
                             f"{_ci(e.get('raw_deep_over_shallow_ci', (None, None)))})",
                     "verdict": "reproduced" if lo > DEPTH_BOUND else "not reproduced"})
    sc = summary.get("scaling")
    if sc:
        rs = {r["factor"]: r for r in sc["rows"]}
        top = max(rs)
        if 1.0 in rs and top > 1:
            a, b = rs[1.0], rs[top]
            growth = b["kl_clean"] / a["kl_clean"]
            oc_up = b["overconfidence_ci"][0] > a["overconfidence_ci"][1]
            ok = growth > top and oc_up
            bands = ", ".join(f"{e['band']}-entropy heads x{_fmt(e['growth'], 2)}"
                              for e in sc.get("by_entropy_band", []))
            rows.append({"statement": PAPER["scaling"] + " (an intervention on this one model)",
                         "ours": f"x{top:g} logits: KL(q_clean||q_shuf) x{growth:.2f} "
                                 f"({bands}), over-confidence {a['overconfidence']:+.3f} -> "
                                 f"{b['overconfidence']:+.3f}, ECE {a['ece']:.3f} -> "
                                 f"{b['ece']:.3f}",
                         "verdict": "reproduced" if ok else "not reproduced"})
    else:
        rows.append({"statement": PAPER["scaling"], "ours": "no LM head: not run",
                     "verdict": "not comparable"})
    return rows


def write_tables(out: Path, summary: dict[str, Any]) -> None:
    sh = summary["shuffle"]
    levels = sh["levels"]
    rows = []
    for k, level in enumerate(levels):
        row: dict[str, Any] = {"level": level}
        if "task" in sh:
            t = sh["task"]
            row.update(perplexity=t["perplexity"][k], perplexity_ci=t["perplexity_ci"][k],
                       ece=t["ece"][k], ece_ci=t["ece_ci"][k],
                       mean_confidence=t["mean_confidence"][k], accuracy=t["accuracy"][k])
        for name, m in sh["level_means"].items():
            row[name] = sum(m[k]) / len(m[k])
        rows.append(row)
    write_csv(out / "levels.csv", rows)
    rows = []
    for name, m in sh["level_means"].items():
        for k, level in enumerate(levels):
            for t, v in enumerate(m[k]):
                rows.append({"metric": name, "level": level, "layer": t, "value": v})
    write_csv(out / "levels_by_layer.csv", rows)
    if "rho" in sh:
        write_csv(out / "rho.csv", [
            {"metric": n, "rho_perplexity": e["perplexity"]["rho"],
             "ci_perplexity": e["perplexity"]["ci"], "rho_ece": e["ece"]["rho"],
             "ci_ece": e["ece"]["ci"], "rho_perplexity_cells": e["perplexity_cells"]["rho"],
             "ci_perplexity_cells": e["perplexity_cells"]["ci"],
             **{f"level_controlled_{k}": v for k, v in e["level_controlled"].items()}}
            for n, e in sh["rho"].items()])
        write_csv(out / "rho_by_layer.csv", [
            {"metric": n, "layer": t, "rho_perplexity": e["perplexity"]["per_layer"][t],
             "rho_ece": e["ece"]["per_layer"][t]}
            for n, e in sh["rho"].items() for t in range(len(e["perplexity"]["per_layer"]))])
    write_csv(out / "depth.csv", [
        {"metric": n, "layer": t, "sensitivity": s, "ci": e["sensitivity_ci"][t],
         "change": e["change"][t] if "change" in e else None}
        for n, e in sh["depth"].items() for t, s in enumerate(e["sensitivity"])])
    if summary.get("scaling"):
        write_csv(out / "scaling.csv", [
            {k: v for k, v in r.items() if not k.endswith("_per_layer")}
            for r in summary["scaling"]["rows"]])


def write_figures(out: Path, summary: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sh = summary["shuffle"]
    levels = sh["levels"]
    names = list(sh["level_means"])
    written = []
    # 1. heat maps: metric change from level 0, per layer and level
    fig, axes = plt.subplots(2, (len(names) + 1) // 2, figsize=(4 * ((len(names) + 1) // 2), 7),
                             squeeze=False)
    for ax, name in zip(axes.ravel(), names, strict=False):
        m = np.asarray(sh["level_means"][name])  # (K, L)
        delta = (m - m[:1]).T
        top = float(np.max(np.abs(delta))) or 1.0  # colour scale centred at "no change"
        im = ax.imshow(delta, aspect="auto", origin="lower", cmap="coolwarm", vmin=-top,
                       vmax=top)
        ax.set_xticks(range(len(levels)), [f"{v:g}" for v in levels])
        ax.set_xlabel("shuffled fraction of the prefix")
        ax.set_ylabel("layer")
        ax.set_title(f"{name} - clean", fontsize=9)
        fig.colorbar(im, ax=ax)
    save_figure(fig, out / "heatmaps.png", dpi=90)
    written.append("heatmaps.png")
    # 2. metric vs perplexity with rho
    if "task" in sh:
        ppl = sh["task"]["perplexity"]
        fig, axes = plt.subplots(2, (len(names) + 1) // 2,
                                 figsize=(4 * ((len(names) + 1) // 2), 7), squeeze=False)
        for ax, name in zip(axes.ravel(), names, strict=False):
            m = np.asarray(sh["level_means"][name]).mean(1)
            ax.plot(ppl, m, "o-")
            for k, lv in enumerate(levels):
                ax.annotate(f"{lv:g}", (ppl[k], m[k]), fontsize=7)
            e = sh["rho"][name]["perplexity"]
            ax.set_title(f"{name}: rho {e['rho']:.2f} {_ci(e['ci'])}", fontsize=9)
            ax.set_xlabel("perplexity (scored tokens)")
            ax.set_ylabel("layer mean")
        save_figure(fig, out / "metric_vs_perplexity.png", dpi=90)
        written.append("metric_vs_perplexity.png")
    # 3. depth sensitivity
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        e = sh["depth"][name]
        ax.plot(e["sensitivity"], label=f"{name} ({e['deep_over_shallow']:.2f})")
    ax.set_xlabel("layer")
    ax.set_ylabel("|change clean -> fully shuffled| / sd")
    ax.set_title("depth sensitivity (deep/shallow ratio in brackets)")
    ax.legend(fontsize=7)
    save_figure(fig, out / "depth_sensitivity.png", dpi=90)
    written.append("depth_sensitivity.png")
    # 4. concentration scaling
    sc = summary.get("scaling")
    if sc:
        rows = sc["rows"]
        c = [r["factor"] for r in rows]
        panels = [("perplexity", "perplexity (clean)"), ("ece", "ECE (clean)"),
                  ("overconfidence", "mean confidence - accuracy"),
                  ("kl_clean", "KL(q_clean || q_shuffled)"), ("kl_q_p", "KL(q || p)"),
                  ("entropy", "attention entropy"), ("kappa_attn", "attention kappa"),
                  ("kappa_posterior", "E_q |eta|")]
        fig, axes = plt.subplots(2, 4, figsize=(15, 6.5))
        for ax, (key, title) in zip(axes.ravel(), panels, strict=True):
            y = [r[key] for r in rows]
            ci = [r.get(key + "_ci") for r in rows]
            if all(ci):
                # a percentile interval need not contain the point estimate: clip at 0
                lo = [max(0.0, y[i] - ci[i][0]) for i in range(len(y))]
                hi = [max(0.0, ci[i][1] - y[i]) for i in range(len(y))]
                ax.errorbar(c, y, yerr=[lo, hi], fmt="o-", capsize=3)
            else:
                ax.plot(c, y, "o-")
            ax.set_xscale("log")
            ax.set_xlabel("attention-logit factor c")
            ax.set_title(title, fontsize=9)
        save_figure(fig, out / "concentration_scaling.png", dpi=90)
        written.append("concentration_scaling.png")
    return written


def conclusion(summary: dict[str, Any]) -> str:
    """The run's conclusion in one or two sentences: how many of the paper's statements this
    run reproduced, and the caveat that matters: how many windows it rests on (a "not
    reproduced" from a few windows means "not detected at this sample size")."""
    rows = headline(summary)
    judged = [r for r in rows if r["verdict"] == "reproduced"
              or r["verdict"].startswith("not reproduced")]
    reproduced = [r for r in judged if r["verdict"] == "reproduced"]
    cfg, sh = summary["config"], summary["shuffle"]
    words = (f"{len(reproduced)} of the {len(judged)} comparisons with the paper's statements "
             f"are reproduced on {summary['model']['name']}, from {sh['windows']} windows of "
             f"{cfg['context']} tokens.")
    quick = (summary.get("run") or {}).get("quick")
    if quick or sh["windows"] < 16:
        words += (f" {'A quick run: ' if quick else ''}{sh['windows']} windows are too few to "
                  "detect these effects, so a \"not reproduced\" here means \"not detected at "
                  "this sample size\", not that the effect is absent.")
    return words


def _rule(sh: dict[str, Any]) -> str:
    """The rule that decides "a metric tracks perplexity" (:func:`tracks_perplexity`), with its
    threshold, multiplicity correction and null, in words."""
    m, d = _tested(sh["rho"]), sh.get("design", {})
    bound = ALPHA / max(m, 1)
    null = ("one permutation of the windows applied to every level (a window keeps its "
            "profile across the levels)" if d.get("null", "windows") == "windows" else
            "the documents permuted whole and the windows within each, one permutation "
            "applied to every level")
    return ("Which test decides: a metric is **reproduced** when its within-level rho (p1), "
            "its partial rho given the level (p2)"
            + (" and its partial rank correlation given the level and the model-free controls"
               " (p3)" if _controlled(sh) else "")
            + f" all have the expected sign with one-sided p below {bound:.4g} ({ALPHA:g} over "
            f"the {m} SVFlow metrics tested, Bonferroni). The p-values: (1 + #draws at least as "
            f"extreme) / (1 + {d.get('permutations', 'the')} draws) of the null that fits the "
            f"design: {null}.")


def headline_legend(summary: dict[str, Any]) -> list[str]:
    """The legend under the headline table: its columns, the rule behind each kind of
    verdict (with its threshold and multiplicity correction), and that the intervals shown
    beside a verdict are descriptions when they are not what decides it."""
    sh = summary["shuffle"]
    lines = ["Columns: *paper*, the paper's statement (for a metric, with the sign expected "
             "before the run); *ours*, what this run measured; *verdict*, by the rules below. "
             "Bracketed intervals are 95% bootstrap percentile intervals."]
    if "rho" in sh:
        lines.append(_rule(sh) + " The rho across levels and across (window, level) cells, "
                     "and their intervals, are **descriptions, not what decides**: perplexity "
                     "rises with the shuffle level by construction, so any metric monotone in "
                     "the level has |rho| near 1 across levels, and an interval far from 0 "
                     "beside \"not reproduced\" is not support. Details: the table of the "
                     "controlled statistics below.")
    lines.append(f"Depth: reproduced when the lower end of the deep/shallow ratio's 95% "
                 f"interval is above {DEPTH_BOUND:g} (each row on its own, no multiplicity "
                 "correction). Scaling: reproduced when, from c = 1 to the largest c, "
                 "KL(q_clean||q_shuf) grows by more than the factor c and the over-confidence's "
                 "95% intervals at the two ends do not overlap. \"description\": no test.")
    return lines


def _paragraphs(lines: list[str]) -> list[str]:
    """Paragraphs of Markdown, a blank line between each two."""
    return [x for paragraph in lines for x in ("", paragraph)][1:]


def legend(sh: dict[str, Any]) -> list[str]:
    """The legend of the table of the controlled statistics: its columns, which test decides,
    with which null and bound, and what the documents allow."""
    d = sh.get("design", {})
    lines = ["Columns: *sign*, the expected sign, fixed before the run; *within-level rho* "
             "(p1), *partial rho* given the level (p2)"
             + (", *given the controls* (p3)" if _controlled(sh) else "")
             + ": the statistics and their one-sided permutation p-values; *verdict*, by the "
             "rule below; *former null*, the former rule's verdict"
             + ("; *between documents*, a description" if "documents" in d else "") + ".",
             _rule(sh) + " p3 uses normal scores of the ranks within each level and "
             "permutes the metric's part orthogonal to the controls.",
             "The controls (the scored tokens' surprisal under unigram and bigram counts of the "
             "other Austen novels: no model) go through p1 and p2 at the same bound: a control "
             "that passes shows the rule alone cannot tell an SVFlow quantity from a property "
             "of the text, which is why p3 is required. \"former null\": the verdict of the "
             "former rule (p1 and p2 with each level's windows permuted separately, no "
             "control), miscalibrated under window effects; for comparison only."]
    if "documents" in d:
        D = d["documents"]
        lines.append(f"Documents: {D}. A test with the documents as units (the between-"
                     f"documents rho, a description here, exact over all {math.factorial(D)} "
                     f"pairings) cannot go below p = 1/{math.factorial(D)} = "
                     f"{d['smallest_document_p']:.4g}: "
                     + ("below the bound only for a perfect ranking of the documents; a claim "
                        "about documents (novels) in general needs more of them."
                        if d["document_claims_possible"] else
                        "never below the bound; a claim about documents needs more of them."))
    return lines


def _verdict_table(sh: dict[str, Any]) -> list[str]:
    m, controls = _tested(sh["rho"]), _controlled(sh)
    docs = "documents" in sh.get("design", {})
    lines = ["| metric | kind | sign | within-level rho | p1 | partial rho | p2 | given the "
             "controls | p3 | verdict | former null |" + (" between documents (p) |" if docs
                                                           else ""),
             "| --- " * (11 + docs) + "|"]
    for n, e in sh["rho"].items():
        lc = e["level_controlled"]
        b = e.get("between_documents")
        lines.append(
            f"| {n} | {_kind(n, e)} | {'+' if lc['sign'] > 0 else '-'} | "
            f"{_fmt(lc['stratified'], 2)} | {_fmt(lc['stratified_p'], 2)} | "
            f"{_fmt(lc['partial'], 2)} | {_fmt(lc['partial_p'], 2)} | "
            f"{_fmt(lc.get('controlled'), 2)} | {_fmt(lc.get('controlled_p'), 2)} | "
            f"{_verdict(n, e, m, controls)} | "
            f"{former_verdict(e, m) if _kind(n, e) == 'svflow' else ''} |"
            + (f" {_fmt(b['rho'], 2)} ({_fmt(b['p'], 2)}) |" if docs and b else
               (" |" if docs else "")))
    return lines + [""] + _paragraphs(legend(sh))


def write_markdown(out: Path, summary: dict[str, Any], figures: list[str]) -> None:
    sh, cfg, model = summary["shuffle"], summary["config"], summary["model"]
    t = summary["timings"]
    lines = [f"# svflow diagnose: {model['name']}", "", conclusion(summary), "",
             f"{model['layers']} layers, d = {model['d_model']}, {model['heads']} heads "
             f"({model['kv_heads']} KV), {'causal LM' if model['language_model'] else 'encoder'}"
             f". Text: {summary['text']['path']} ({summary['text']['tokens']} tokens). "
             f"{sh['windows']} windows of {cfg['context']} tokens, the last {cfg['scored']} "
             f"scored; shuffle levels {cfg['levels']} of the first {cfg['context'] - cfg['scored']}"
             f" positions, {cfg['permutations']} permutations each; seed {cfg['seed']}; "
             f"{cfg['bootstrap']} bootstrap resamples of the "
             f"{sh.get('bootstrap_unit', 'windows')} (95% percentile intervals)."
             f" Run time {t['total_s']:.0f} s (load {t['load_s']:.0f} s, shuffle study "
             f"{t['shuffle_s']:.0f} s, scaling {_fmt(t['scaling_s'])} s).", "",
             "Definitions: docs/theory.md, section 19.", "", "## Headline", "",
             "| paper | ours | verdict |", "| --- | --- | --- |"]
    lines += [f"| {r['statement']} | {r['ours']} | {r['verdict']} |" for r in headline(summary)]
    lines += [""] + _paragraphs(headline_legend(summary))
    if "task" in sh:
        tk = sh["task"]
        lines += ["", "## Task metrics per shuffle level", "",
                  "| level | perplexity | ECE | confidence | accuracy |",
                  "| --- | --- | --- | --- | --- |"]
        for k, lv in enumerate(sh["levels"]):
            lines.append(f"| {lv:g} | {tk['perplexity'][k]:.2f} {_ci(tk['perplexity_ci'][k])} | "
                         f"{tk['ece'][k]:.3f} {_ci(tk['ece_ci'][k])} | "
                         f"{tk['mean_confidence'][k]:.3f} | {tk['accuracy'][k]:.3f} |")
        lines += ["", f"ECE: {tk['ece_bins']} equal-mass bins over the scored tokens of a level."
                  f" Spearman rho of perplexity with the level: "
                  f"{tk['rho_perplexity_vs_level']:.2f}; of ECE: {tk['rho_ece_vs_level']:.2f}.",
                  "", "## Spearman rho across shuffle levels (layer-mean metric; descriptions: "
                  "perplexity rises with the level by construction)", "",
                  "| metric | rho with perplexity | rho with ECE | rho with per-window perplexity "
                  "(window x level cells) |", "| --- | --- | --- | --- |"]
        for n, e in sh["rho"].items():
            lines.append(f"| {n} | {e['perplexity']['rho']:.2f} {_ci(e['perplexity']['ci'])} | "
                         f"{e['ece']['rho']:.2f} {_ci(e['ece']['ci'])} | "
                         f"{e['perplexity_cells']['rho']:.2f} "
                         f"{_ci(e['perplexity_cells']['ci'])} |")
        lines += ["", "## Controlled for the shuffle level and the text (the verdicts rest on "
                  "these)", ""] + _verdict_table(sh)
    lines += ["", "## Depth sensitivity", "",
              "S_t = |mean over windows of (metric at the last level - clean)| / sd of the "
              "metric over all (window, level) cells of layer t; ratio = mean S over the deepest "
              "third / mean S over the shallowest third.", "",
              "The unnormalised ratio uses the mean absolute change itself (the metric's units)."
              " Layer-local rows shuffle the context of one layer only (the clean run's stream "
              "at the layer's input, its positions permuted): no upstream change is inherited.",
              "", "| metric | deep/shallow | 95% interval | unnormalised | 95% interval |",
              "| --- | --- | --- | --- | --- |"]
    depth_rows = [(n, e) for n, e in sh["depth"].items()] + [
        (f"{n} (layer-local)", e) for n, e in sh.get("depth_local", {}).items()]
    for n, e in depth_rows:
        lines.append(f"| {n} | {_fmt(e['deep_over_shallow'])} | {_ci(e['deep_over_shallow_ci'])}"
                     f" | {_fmt(e.get('raw_deep_over_shallow'))} | "
                     f"{_ci(e.get('raw_deep_over_shallow_ci', (None, None)))} |")
    sc = summary.get("scaling")
    if sc:
        lines += ["", f"## Concentration scaling (attention logits x c; {sc['windows']} windows,"
                  f" clean vs shuffled at level {sc['level']:g})", "",
                  "| c | perplexity | ECE | conf - acc | KL(q_clean\\|\\|q_shuf) | KL(q\\|\\|p) | "
                  "entropy | kappa_attn | E_q kappa |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sc["rows"]:
            lines.append(
                f"| {r['factor']:g} | {r['perplexity']:.2f} {_ci(r['perplexity_ci'])} | "
                f"{r['ece']:.3f} {_ci(r['ece_ci'])} | {r['overconfidence']:+.3f} "
                f"{_ci(r['overconfidence_ci'])} | {r['kl_clean']:.3f} {_ci(r['kl_clean_ci'])} | "
                f"{r['kl_q_p']:.3f} | {r['entropy']:.3f} | {r['kappa_attn']:.1f} | "
                f"{r['kappa_posterior']:.1f} |")
        if bands := sc.get("by_entropy_band"):
            factors = list(bands[0]["kl_clean"])
            lines += ["", "An intervention on this one model, whose outcome can depend on "
                      "how diffuse its heads are. Heads in thirds by their clean "
                      "attention entropy at c = 1, mean KL(q_clean||q_shuf):", "",
                      "| heads | entropy (nats) | " + " | ".join(f"c = {c}" for c in factors)
                      + " | growth |", "| --- | --- | " + "--- | " * len(factors) + "--- |"]
            for e in bands:
                lo, hi = e["entropy_range"]
                lines.append(f"| {e['band']} ({e['heads']}) | {lo:.2f}-{hi:.2f} | "
                             + " | ".join(f"{e['kl_clean'][c]:.3f}" for c in factors)
                             + f" | x{_fmt(e['growth'], 2)} |")
    lines += ["", "## Figures", ""] + [f"![{f}]({f})" for f in figures]
    if line := provenance(summary.get("environment")):
        lines += ["", line]
    write_text(out / "report.md", "\n".join(lines) + "\n")


def write_all(out: str | Path, summary: dict[str, Any]) -> Path:
    """``summary.json``, ``config.json``, the CSVs, the figures and ``report.md`` in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", summary["config"])
    summary = {**summary, "headline": headline(summary)}
    write_json(out / "summary.json", summary, indent=1)
    write_tables(out, summary)
    figures = write_figures(out, summary)
    write_markdown(out, summary, figures)
    return out
