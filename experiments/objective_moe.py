"""Does a MoE language model collapse without balancing while attention stays healthy, and do
the population KL and J_var prevent collapse as well as the Switch loss?

Run::

    python experiments/objective_moe.py [--out results/objective_moe] [--quick] [--seeds 5]
        [--gate switch] [--coefs 0.01 0.1 1.0] [--sweep-top-ks 1]

Byte-level causal pre-norm language models on Jane Austen (train: *Pride and Prejudice*;
validation: *Persuasion*), ``d = 64``, 2 layers, 4 heads, GELU experts of width 64, context 64,
batch 16, AdamW with warm-up and cosine decay (:mod:`svflow_jax.objective.train`):

* MoE, 8 experts, top-1 and top-2 routing, each trained with (a) no balancing ``none``,
  (b) the Switch auxiliary loss ``switch`` (coefficient ``--coef``, 0.01), (c) the population
  KL ``popkl`` and (d) ``jvar``, each at every coefficient of ``--coefs`` (0.01, 0.1, 1; with
  ``--sweep-top-ks`` only those top-k run them all, the others the first);
* the plain Transformer (dense GELU FFN of width 128: attention is the only posterior), with
  no regulariser (``none``, the "attention-only" control) and with ``jvar`` (part 4);
* the attention control ``dense qk-sg``: the plain Transformer whose queries and keys read the
  token states through a stop-gradient (``TransformerConfig.qk_stop_gradient``: the same
  function, ``W_Q``/``W_K`` still trained, but the posterior sends the tokens no gradient), with
  no regulariser.

Every run is evaluated at step 0, every ``eval_every`` steps and at the end on the validation
text: loss, ECE, expert usage entropy / maximum load / dead experts per layer, router and
attention entropies, J_var per branch and the gradient coupling of posterior and scores by
three proxies (global cosine, per-token cosine, the posterior path's share of the gradient;
``docs/theory.md``, section 20). Table intervals: 95% Student t over seeds. The report also
gives, per arm, the first evaluated step at which the attention entropy is measurably below
step 0's (one-sided 95% t upper bound of ``H_t - H_0`` below 0; descriptive).

Verdicts (:func:`verdicts`): every statement is decided by one-sided Student-t bounds over
seeds (paired by seed where two arms are compared) at level ``1 - ALPHA / m``, Bonferroni over
all ``m`` decisions, against thresholds and directions fixed in this file before any run; a
decision with one seed is undecided. With the default (renormalised) gate, top-1 arms are
trained and tabled but not counted: their routing weight is exactly 1, so no task gradient
reaches the router and they cannot test the mechanism. ``--gate switch`` scales each selected
expert by its softmax probability (the Switch Transformer's gate), so a top-1 router is trained
by the task and its arms are counted. "Attention trains stably" needs attention to have left its
initialisation (its entropy fell from step 0) as well as not collapsed. "As good as Switch" is
decided at every coefficient (each counted in ``m``) and reproduced if some coefficient passes
all its decisions. The coupling is decided by the global and by the per-token cosine. "Stable
because of the coupling" is decided by the control: its attention entropy minus the plain
Transformer's, paired by seed, must have an upper bound below 0.

Outputs in ``--out``: ``config.json``, ``runs.jsonl`` (every run's history and environment;
an interrupted experiment resumes from it), ``curves.csv`` (one row per run, step and layer),
``final.csv`` (one row per run), ``table.csv`` and ``summary.json`` (per arm, with intervals
and verdicts), ``report.md`` and PNG figures.

Sizes: the default with ``--gate switch`` (5 seeds of 120 steps, 19 arms, 95 runs) took 26.5
minutes of wall time on 2 CPU cores shared with other jobs (load average 2-6); with
``--sweep-top-ks 1`` (75 runs) 21.2 minutes of it. ``--quick`` (CI) trains top-1 only, 1
seed, 12 steps, the coefficient 0.01, d = 32, 16 validation sequences (seven runs; the smoke
test runs two of them for 2 steps, about 15 s on an idle machine).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from svflow_jax.atomic import append_line, dumps, read_jsonl, write_json, write_text  # noqa: E402
from svflow_jax.cli.types import positive_int  # noqa: E402 (no JAX yet)

N_EXPERTS = 8  # experts of every MoE arm

SWEPT = ("popkl", "jvar")  # the MoE regularisers run at every coefficient of --coefs

DEFAULT = dict(seeds=5, steps=120, top_ks=[1, 2], gate="renormalised",
               methods=["none", "switch", "popkl", "jvar"], dense_methods=["none", "jvar"],
               control_methods=["none"], eval_every=50, eval_sequences=64, coef=0.01,
               coefs=[0.01, 0.1, 1.0], sweep_top_ks=None,
               d_model=64, n_layers=2, n_heads=4, d_ff=64, dense_d_ff=128, context=64,
               batch_size=16, lr=3e-3, warmup=30)
QUICK = dict(DEFAULT, seeds=1, steps=12, top_ks=[1], coefs=[0.01], eval_every=6,
             eval_sequences=16,
             d_model=32, d_ff=32, dense_d_ff=64, context=32, batch_size=8, warmup=2)

# The paper's statements (our reading), each decided by a criterion on the final numbers.
STATEMENTS = {
    "moe_collapses": "Without balancing, a MoE router collapses onto a few experts.",
    "attention_healthy": "Multi-head attention trains stably with no regulariser (its "
                         "posterior does not collapse).",
    "popkl_as_switch": "The population KL KL(E_x q(e|x) || pi) prevents collapse as well as the "
                       "Switch auxiliary loss.",
    "jvar_as_switch": "J_var prevents collapse as well as the Switch auxiliary loss.",
    "coupling": "Attention's posterior and score gradients are strongly coupled through the "
                "shared tokens; a MoE router's and its experts' are not.",
    "coupling_causal": "Attention trains stably because of that coupling: cut the posterior's "
                       "gradient to the tokens (queries and keys read them through a "
                       "stop-gradient) and attention collapses (its entropy falls below the "
                       "coupled model's).",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/objective_moe", help="output folder")
    p.add_argument("--quick", action="store_true", help="tiny CI run")
    p.add_argument("--seeds", type=positive_int, help="seeds per arm (default 5; quick 1)")
    p.add_argument("--steps", type=positive_int, help="optimiser steps per run (default 120)")
    p.add_argument("--top-ks", type=positive_int, nargs="+",
                   help=f"MoE top-k values, at most {N_EXPERTS} (default 1 2)")
    p.add_argument("--gate", choices=("renormalised", "switch"),
                   help="the MoE routers' gate: renormalised over the top-k (default; a top-1 "
                   "router then gets no task gradient and top-1 arms are not counted) or switch "
                   "(the softmax probability scales the expert, as in the Switch Transformer; "
                   "top-1 arms are counted)")
    p.add_argument("--methods", nargs="+", help="MoE methods (default none switch popkl jvar)")
    p.add_argument("--dense-methods", nargs="*", help="plain Transformer methods (default "
                   "none jvar; give none to skip the dense runs: --dense-methods)")
    p.add_argument("--control-methods", nargs="*", help="methods of the attention control, the "
                   "plain Transformer with queries and keys through a stop-gradient (default "
                   "none; give none to skip it: --control-methods)")
    p.add_argument("--coef", type=float, help="coefficient of the Switch loss and of the plain "
                   "Transformer's J_var (default 0.01)")
    p.add_argument("--coefs", type=float, nargs="+", help="coefficients at which the MoE "
                   "population KL and J_var each run (default 0.01 0.1 1.0; quick 0.01)")
    p.add_argument("--sweep-top-ks", type=positive_int, nargs="+", help="the top-k values "
                   "that run every coefficient of --coefs; the others run only the first "
                   "(default: every top-k)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the report from runs.jsonl without training")
    args = p.parse_args(argv)
    if args.top_ks and max(args.top_ks) > N_EXPERTS:
        p.error(f"--top-ks: each must be at most the {N_EXPERTS} experts, got {args.top_ks}")
    if args.coef is not None and not (math.isfinite(args.coef) and args.coef >= 0):
        p.error("--coef must be a finite number >= 0")
    if args.coefs is not None and not all(math.isfinite(c) and c >= 0 for c in args.coefs):
        p.error("--coefs must be finite numbers >= 0")
    return args


def settings(args) -> dict:
    s = dict(QUICK if args.quick else DEFAULT)
    for name in ("seeds", "steps", "top_ks", "gate", "methods", "dense_methods",
                 "control_methods", "coef", "coefs", "sweep_top_ks"):
        v = getattr(args, name)
        if v is not None:
            s[name] = v
    dense = s["dense_methods"] + s["control_methods"]
    bad = [m for m in s["methods"] + dense if m not in ("none", "switch", "popkl", "jvar")]
    if bad or any(m in ("switch", "popkl") for m in dense):
        print(f"error: unknown or unsupported methods {bad or dense}", file=sys.stderr)
        raise SystemExit(2)
    s["eval_every"] = min(s["eval_every"], s["steps"])
    return s


def run_configs(s: dict):
    from svflow_jax.objective.train import RunConfig
    common = dict(d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"],
                  context=s["context"], batch_size=s["batch_size"], steps=s["steps"],
                  lr=s["lr"], warmup=s["warmup"], eval_every=s["eval_every"],
                  eval_sequences=s["eval_sequences"])
    sweep = s["top_ks"] if s.get("sweep_top_ks") is None else s["sweep_top_ks"]
    out = []
    for seed in range(s["seeds"]):  # seed-major: a partial run has every arm at seed 0
        for k in s["top_ks"]:
            for m in s["methods"]:
                coefs = ([s["coef"]] if m not in SWEPT
                         else s["coefs"] if k in sweep else s["coefs"][:1])
                out += [RunConfig(ffn="moe", n_experts=N_EXPERTS, top_k=k, method=m, seed=seed,
                                  gate=s["gate"], d_ff=s["d_ff"], coef=c, **common)
                        for c in coefs]
        for control, methods in ((False, s["dense_methods"]), (True, s["control_methods"])):
            out += [RunConfig(ffn="gelu", method=m, seed=seed, d_ff=s["dense_d_ff"],
                              coef=s["coef"], qk_stop_gradient=control, **common)
                    for m in methods]
    return out


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------

CONTROL = "dense qk-sg"  # the plain Transformer, queries and keys through a stop-gradient


def arm(cfg: dict) -> str:
    """The arm's name: ``moe top-k / method`` (``popkl``/``jvar`` with their coefficient),
    ``dense / method`` or, for the stop-gradient control, ``dense qk-sg / method``."""
    if cfg["ffn"] == "moe":
        coef = f" {cfg['coef']:g}" if cfg["method"] in SWEPT else ""
        return f"moe top-{cfg['top_k']} / {cfg['method']}{coef}"
    return (CONTROL if cfg.get("qk_stop_gradient") else "dense") + f" / {cfg['method']}"


def _nanmean(values) -> float:
    """Mean of the finite entries (NaN if none, without a warning)."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else math.nan


COUPLING = ("cos", "token_cos", "post_share")  # the proxies of svflow_jax.objective.mechanism


def scalars(row: dict, cfg: dict) -> dict:
    """Per-run scalars of one evaluation row (layer means)."""
    out = {k: row[k] for k in ("val_loss", "val_bpc", "ece")}
    n_ctx_h = row["attn_entropy_uniform"]
    out["attn_entropy"] = float(np.mean(row["attn_entropy"]))
    out["attn_entropy_norm"] = out["attn_entropy"] / n_ctx_h
    out["attn_j_var"] = float(np.mean(row["attn_j_var"]))
    for p in COUPLING:
        if f"coupling_attn_{p}" in row:
            out[f"coupling_attn_{p}"] = _nanmean(row[f"coupling_attn_{p}"])
    if cfg["ffn"] == "moe":
        E = cfg["n_experts"]
        out["usage_entropy_norm"] = float(np.mean(row["usage_entropy"])) / math.log(E)
        out["max_load"] = float(np.mean(row["max_load"]))
        out["dead"] = float(np.mean(row["dead"]))
        out["router_entropy_norm"] = float(np.mean(row["router_entropy"])) / math.log(E)
        out["moe_j_var"] = float(np.mean(row["moe_j_var"]))
        for p in COUPLING:
            if f"coupling_ffn_{p}" in row:
                out[f"coupling_ffn_{p}"] = _nanmean(row[f"coupling_ffn_{p}"])
        out["coupling_ffn_ratio"] = _nanmean(row["coupling_ffn_norm_ratio"])
    return out


MEASURES = ["usage_entropy_norm", "max_load", "dead", "router_entropy_norm", "attn_entropy_norm",
            "val_bpc", "ece", "attn_j_var", "moe_j_var",
            *[f"coupling_{b}_{p}" for b in ("attn", "ffn") for p in COUPLING]]


def aggregate(runs: list[dict]) -> dict:
    from svflow_jax.training.compare import interval
    arms: dict[str, list[dict]] = {}
    for r in runs:
        arms.setdefault(arm(r["config"]), []).append(scalars(r["final"], r["config"]))
    table = {}
    for name, rows in arms.items():
        table[name] = {"seeds": len(rows)}
        for m in MEASURES:
            vals = [r[m] for r in rows if m in r]
            if vals:
                mean, half = interval(vals)
                table[name][m] = {"mean": mean, "half": half, "values": vals}
    return table


ALPHA = 0.05  # family-wise error rate of all the verdicts' decisions together (Bonferroni)
MARGIN = 0.05  # non-inferiority margin of "as well as Switch", in normalised usage entropy
ATTENTION_FLOOR = 0.25  # "no collapse": attention entropy above this share of the uniform's


def per_seed(runs: list[dict], row: str = "final") -> dict[tuple[str, int], dict]:
    """``{(arm, seed): scalars}`` of every run's final evaluation (``row="first"``: its step-0
    evaluation, before any training)."""
    out = {}
    for r in runs:
        values = r["final"] if row == "final" else r["history"][0]
        out[(arm(r["config"]), r["config"]["seed"])] = scalars(values, r["config"])
    return out


def decision(what: str, values: list[float], side: str, threshold: float) -> dict:
    """One decision from the per-seed ``values`` (paired differences or values): its one-sided
    Student-t bound at level ``1 - ALPHA / m`` (filled in by :func:`decide`) must lie above
    (``side="above"``) or below the ``threshold`` fixed before the run."""
    v = [float(x) for x in values if math.isfinite(x)]
    return {"what": what, "values": v, "side": side, "threshold": threshold}


def decide(decisions: list[dict]) -> None:
    """Fills in each decision's ``mean``, ``bound`` and ``passed`` (``None`` with fewer than 2
    seeds), Bonferroni over all ``m`` decisions: bound ``mean -+ t_{1 - ALPHA/m, n-1} s /
    sqrt(n)``."""
    from svflow_jax.fitting import t_quantile

    m = len(decisions)
    for d in decisions:
        v = np.asarray(d["values"])
        d["comparisons"] = m
        d["mean"] = float(v.mean()) if v.size else math.nan
        if v.size < 2:
            d["bound"], d["passed"] = math.nan, None
            continue
        half = t_quantile(1 - ALPHA / m, v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
        d["bound"] = d["mean"] - half if d["side"] == "above" else d["mean"] + half
        d["passed"] = bool(d["bound"] > d["threshold"] if d["side"] == "above"
                           else d["bound"] < d["threshold"])


def _paired(by: dict, a: str, b: str, measure: str) -> list[float]:
    """``b - a`` of ``measure`` per seed where both arms ran."""
    seeds = sorted(s for (n, s) in by if n == a and (b, s) in by)
    return [by[(b, s)][measure] - by[(a, s)][measure] for s in seeds]


def _verdict(decisions: list[dict]) -> bool | None:
    passed = [d["passed"] for d in decisions]
    if not decisions or any(p is None for p in passed):
        return None
    return all(passed)


def _coefs(runs: list[dict], k: int, method: str) -> list[float]:
    """The coefficients at which ``moe top-k / method`` ran."""
    return sorted({r["config"]["coef"] for r in runs if r["config"]["ffn"] == "moe"
                   and r["config"]["top_k"] == k and r["config"]["method"] == method})


def verdicts(runs: list[dict], top_ks: list[int], gate: str = "renormalised") -> dict:
    """Each statement's criterion, its decisions (per-seed values, one-sided bound at the
    Bonferroni-adjusted level, threshold) and ``reproduced`` (True/False/None), every threshold
    and expected direction fixed here, before any run. With the renormalised gate, top-1 arms
    cannot test the routing mechanism (the renormalised top-1 weight is 1: no task gradient
    reaches the router) and are left out of the MoE decisions; with the Switch gate they count.

    "As good as Switch" is decided at every coefficient the population KL / J_var ran at (each
    coefficient's decisions count in ``m``); it is reproduced if every decision of some
    coefficient passes (``passing_coefs``), not reproduced if every coefficient is decided and
    none passes. The coupling is decided by two proxies (the global and the per-token cosine of
    :mod:`svflow_jax.objective.mechanism`), each with the same thresholds; the attention
    control (``dense qk-sg``) is left out of it (its posterior path carries no gradient)."""
    final, first = per_seed(runs), per_seed(runs, "first")
    routed = [k for k in top_ks if k >= 2 or gate == "switch"]
    counted = "every top-k" if gate == "switch" else "top-k >= 2"
    plan: dict[str, list[dict]] = {}
    plan["moe_collapses"] = [decision(
        f"top-{k}: H(f)/log E of switch - none (paired by seed)",
        _paired(final, f"moe top-{k} / none", f"moe top-{k} / switch", "usage_entropy_norm"),
        "above", 0.0) for k in routed]
    dense = sorted(s for (n, s) in final if n == "dense / none")
    plan["attention_healthy"] = [
        decision("dense / none: attention entropy (share of uniform), final - step 0",
                 [final[("dense / none", s)]["attn_entropy_norm"]
                  - first[("dense / none", s)]["attn_entropy_norm"] for s in dense],
                 "below", 0.0),
        decision("dense / none: attention entropy (share of uniform), final",
                 [final[("dense / none", s)]["attn_entropy_norm"] for s in dense],
                 "above", ATTENTION_FLOOR)]
    by_coef: dict[str, dict[float, list[dict]]] = {}
    for key, method in (("popkl_as_switch", "popkl"), ("jvar_as_switch", "jvar")):
        plan[key], by_coef[key] = [], {}
        for k in routed:
            for c in _coefs(runs, k, method):
                name = f"moe top-{k} / {method} {c:g}"
                ds = [decision(f"top-{k}, coef {c:g}: H(f)/log E of {method} - switch (paired "
                               "by seed)", _paired(final, f"moe top-{k} / switch", name,
                                                   "usage_entropy_norm"), "above", -MARGIN),
                      decision(f"top-{k}, coef {c:g}: dead experts per layer with {method}",
                               [v["dead"] for (n, _), v in final.items() if n == name],
                               "below", 1.0)]
                plan[key] += ds
                by_coef[key].setdefault(c, []).extend(ds)
    seeds = sorted({s for (_, s) in final})
    plan["coupling"] = []
    for proxy, label in (("cos", "cosine"), ("token_cos", "per-token cosine")):
        attn = [_nanmean([v[f"coupling_attn_{proxy}"] for (n, t), v in final.items()
                          if t == s and not n.startswith(CONTROL)]) for s in seeds]
        moe = [_nanmean([v[f"coupling_ffn_{proxy}"] for (n, t), v in final.items()
                         if t == s and any(n.startswith(f"moe top-{k} ") for k in routed)])
               for s in seeds]
        plan["coupling"] += [
            decision(f"attention coupling {label} (mean over arms, per seed)", attn, "above",
                     0.5),
            decision(f"MoE ({counted}) coupling {label}, per seed", moe, "above", -0.1),
            decision(f"MoE ({counted}) coupling {label}, per seed", moe, "below", 0.1)]
    plan["coupling_causal"] = [decision(
        f"attention entropy (share of uniform) of {CONTROL} / none - dense / none (paired by "
        "seed)", _paired(final, "dense / none", f"{CONTROL} / none", "attn_entropy_norm"),
        "below", 0.0)]
    decide([d for ds in plan.values() for d in ds])
    as_switch = (f"at some coefficient: not worse than Switch by more than {MARGIN} (lower "
                 "bound of the paired difference) and < 1 dead expert per layer (upper bound), "
                 "for every counted top-k")
    criteria = {
        "moe_collapses": "without balancing the routing is less balanced than with the Switch "
                         f"loss: the paired difference's lower bound > 0, {counted}",
        "attention_healthy": "the plain Transformer's attention has left its initialisation "
                             "(entropy fell: upper bound < 0) and has not collapsed (lower "
                             f"bound > {ATTENTION_FLOOR} of the uniform posterior's entropy)",
        "popkl_as_switch": as_switch,
        "jvar_as_switch": as_switch,
        "coupling": "by the global and the per-token gradient cosine of section 20 (each "
                    "proxy): attention's lower bound > 0.5 and the MoE router's bounds inside "
                    "(-0.1, 0.1)",
        "coupling_causal": "the control's attention entropy is below the coupled model's: "
                           "upper bound of the paired difference < 0",
    }
    out = {key: {"criterion": criteria[key], "decisions": ds, "reproduced": _verdict(ds)}
           for key, ds in plan.items()}
    for key, per in by_coef.items():
        each = {c: _verdict(ds) for c, ds in per.items()}
        passing = [c for c, v in each.items() if v]
        out[key]["passing_coefs"] = passing
        out[key]["reproduced"] = (True if passing else None if not each
                                  or any(v is None for v in each.values()) else False)
    return out


def leaves_initialisation(runs: list[dict], name: str) -> dict:
    """When the attention of arm ``name`` leaves its initialisation: for every evaluated step
    ``t > 0``, the per-seed differences ``H_t - H_0`` of the attention entropy (share of the
    uniform posterior's), their mean and one-sided 95% Student-t upper bound (descriptive, not
    counted in the verdicts' ``m``); ``step`` is the first ``t`` whose bound is below 0 (None
    if none is, or with fewer than 2 seeds)."""
    from svflow_jax.fitting import t_quantile

    per_step: dict[int, list[float]] = {}
    for r in runs:
        if arm(r["config"]) != name:
            continue
        h = [scalars(row, r["config"])["attn_entropy_norm"] for row in r["history"]]
        for row, value in zip(r["history"][1:], h[1:], strict=True):
            per_step.setdefault(row["step"], []).append(value - h[0])
    steps, found = [], None
    for t in sorted(per_step):
        v = np.asarray(per_step[t])
        bound = (float(v.mean() + t_quantile(0.95, v.size - 1) * v.std(ddof=1)
                       / math.sqrt(v.size)) if v.size >= 2 else math.nan)
        steps.append({"step": t, "mean": float(v.mean()), "upper": bound, "seeds": int(v.size)})
        if found is None and bound < 0:
            found = t
    return {"arm": name, "step": found, "steps": steps}


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------

def write_csvs(out: Path, runs: list[dict]) -> None:
    from svflow_jax.reporting import write_csv

    rows = []
    for r in runs:
        cfg = r["config"]
        for h in r["history"]:
            L = len(h["attn_entropy"])
            for layer in range(L):
                row = {"arm": arm(cfg), "seed": cfg["seed"], "step": h["step"], "layer": layer,
                       "val_loss": h["val_loss"], "val_bpc": h["val_bpc"], "ece": h["ece"],
                       "train_loss": h["train_loss"], "train_reg": h["train_reg"]}
                for k, v in h.items():
                    if isinstance(v, list) and k != "load":
                        row[k] = v[layer]
                if "load" in h:
                    row.update({f"load_{e}": x for e, x in enumerate(h["load"][layer])})
                rows.append(row)
    write_csv(out / "curves.csv", rows)
    write_csv(out / "final.csv", [{"arm": arm(r["config"]), "seed": r["config"]["seed"],
                                   "seconds": r["seconds"], **scalars(r["final"], r["config"])}
                                  for r in runs])


def figures(out: Path, runs: list[dict]) -> list[str]:
    import warnings

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from svflow_jax.reporting import save_figure

    warnings.filterwarnings("ignore", "Mean of empty slice")
    warnings.filterwarnings("ignore", "No artists with labels")
    names = []
    curves: dict[str, dict[int, list]] = {}
    for r in runs:
        for h in r["history"]:
            curves.setdefault(arm(r["config"]), {}).setdefault(h["step"], []).append(
                scalars(h, r["config"]))

    def plot(measure, title, fname, only_moe=False):
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, by_step in sorted(curves.items()):
            if only_moe and not name.startswith("moe"):
                continue
            steps = sorted(by_step)
            ys = [np.nanmean([s.get(measure, np.nan) for s in by_step[t]]) for t in steps]
            if np.isfinite(ys).any():
                ax.plot(steps, ys, marker="o", ms=3, label=name,
                        ls="-" if "top-1" in name else "--" if "top-2" in name else ":")
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.legend(fontsize=7)
        save_figure(fig, out / fname)
        names.append(fname)

    plot("usage_entropy_norm", "expert usage entropy H(f) / log E (mean over layers, seeds)",
         "usage_entropy.png", only_moe=True)
    plot("max_load", "max load E max_e f_e (mean over layers, seeds)", "max_load.png",
         only_moe=True)
    plot("attn_entropy_norm", "attention entropy / uniform's (mean over layers, seeds)",
         "attn_entropy.png")
    plot("coupling_attn_cos", "coupling cos(g_post, g_score): attention", "coupling_attn.png")
    plot("coupling_ffn_cos", "coupling cos(g_post, g_score): MoE (top-2; top-1 undefined)",
         "coupling_moe.png", only_moe=True)
    plot("val_bpc", "validation bits per character", "val_bpc.png")
    return names


def fmt(entry, digits=3):
    if not entry:
        return "-"
    m, h = entry["mean"], entry["half"]
    if math.isnan(m):
        return "n/a"
    return f"{m:.{digits}f}" + ("" if math.isnan(h) else f" ± {h:.{digits}f}")


TABLE_COLS = [("usage_entropy_norm", "H(f)/log E"), ("max_load", "max load"),
              ("dead", "dead/layer"), ("router_entropy_norm", "router H/log E"),
              ("attn_entropy_norm", "attn H/H_unif"), ("val_bpc", "val bpc"), ("ece", "ECE"),
              ("coupling_attn_cos", "cos attn"), ("coupling_attn_token_cos", "token cos attn"),
              ("coupling_attn_post_share", "share attn"), ("coupling_ffn_cos", "cos MoE"),
              ("coupling_ffn_token_cos", "token cos MoE"),
              ("coupling_ffn_post_share", "share MoE")]


def markdown_table(table: dict) -> str:
    lines = ["| arm | seeds | " + " | ".join(c for _, c in TABLE_COLS) + " |",
             "|---|---|" + "---|" * len(TABLE_COLS)]
    for name, row in table.items():
        lines.append(f"| {name} | {row['seeds']} | "
                     + " | ".join(fmt(row.get(m)) for m, _ in TABLE_COLS) + " |")
    return "\n".join(lines)


def verdict_lines(v: dict) -> str:
    m = next((d["comparisons"] for e in v.values() for d in e["decisions"]), 0)
    lines = ["| paper's statement (our reading) | criterion | decisions: mean, bound vs "
             "threshold (seeds) | verdict |", "|---|---|---|---|"]
    for key, text in STATEMENTS.items():
        e = v[key]
        word = {True: "reproduced", False: "not reproduced", None: "undecided"}[e["reproduced"]]
        parts = [f"{d['what']}: {d['mean']:.3f}, {'lower' if d['side'] == 'above' else 'upper'}"
                 f" {d['bound']:.3f} {'>' if d['side'] == 'above' else '<'} "
                 f"{d['threshold']:g}? ({len(d['values'])})" for d in e["decisions"]]
        if "passing_coefs" in e:
            word += " (passing coefficients: " + (", ".join(
                f"{c:g}" for c in e["passing_coefs"]) or "none") + ")"
        lines.append(f"| {text} | {e['criterion']} | {'; '.join(parts) or 'no arm'} | "
                     f"**{word}** |")
    lines += ["", f"*Legend.* Columns: the paper's statement as we read it; the criterion "
              f"that decides it; each decision's mean over seeds, its one-sided Student-t bound "
              f"(lower when the mean must lie above the threshold, upper when below), the "
              f"threshold, and the number of seeds; the verdict. Which test decides: every "
              f"decision's bound at level 1 - {ALPHA}/{m} ({m} decisions, Bonferroni) on the "
              f"right side of its threshold; a decision with fewer than 2 seeds is undecided."]
    return "\n".join(lines)


def paired_differences(runs: list[dict], a: str, b: str, measures: list[str]) -> dict:
    """``b - a`` per seed (runs of the two arms at the same seed), mean and 95% t interval."""
    from svflow_jax.training.compare import interval
    by = {}
    for r in runs:
        by.setdefault((arm(r["config"]), r["config"]["seed"]), scalars(r["final"], r["config"]))
    seeds = sorted(s for (n, s) in by if n == a and (b, s) in by)
    out = {}
    for m in measures:
        d = _paired(by, a, b, m)
        if d:
            mean, half = interval(d)
            out[m] = {"mean": mean, "half": half, "values": d, "seeds": seeds}
    return out


REG_MEASURES = ["val_bpc", "ece", "attn_j_var", "attn_entropy_norm", "coupling_attn_cos"]


def write_report(out: Path, s: dict, runs: list[dict], quick: bool, seconds: float) -> dict:
    from svflow_jax.environment import environment
    from svflow_jax.reporting import write_csv

    methods = ("none", "switch", "popkl", "jvar")
    runs = sorted(runs, key=lambda r: (r["config"]["ffn"] != "moe", r["config"].get("top_k") or 0,
                                       bool(r["config"].get("qk_stop_gradient")),
                                       methods.index(r["config"]["method"]),
                                       r["config"]["coef"], r["config"]["seed"]))  # arm order
    table = aggregate(runs)
    v = verdicts(runs, s["top_ks"], s.get("gate", "renormalised"))
    write_csvs(out, runs)
    write_csv(out / "table.csv", [{"arm": n, "seeds": r["seeds"],
                                   **{m: r[m]["mean"] for m in MEASURES if m in r},
                                   **{m + "_half": r[m]["half"] for m in MEASURES if m in r}}
                                  for n, r in table.items()])
    figs = figures(out, runs)
    reg = paired_differences(runs, "dense / none", "dense / jvar", REG_MEASURES)
    leave = [leaves_initialisation(runs, name) for name in table]
    summary = {"settings": s, "quick": quick, "runs": len(runs), "seconds": seconds,
               "run_seconds": [r["seconds"] for r in runs], "table": table, "verdicts": v,
               "jvar_regulariser_dense": reg, "attention_leaves_initialisation": leave,
               "environment": environment()}
    leave_lines = ["| arm | first step with H_t - H_0 < 0 (upper bound) | H_t - H_0 per evaluated "
                   "step: mean (upper bound) |", "|---|---|---|"] + [
        f"| {e['arm']} | {e['step'] if e['step'] is not None else 'never'} | "
        + "; ".join(f"{x['step']}: {x['mean']:+.3f} ({x['upper']:+.3f})" for x in e["steps"])
        + " |" for e in leave]
    reg_lines = ["| measure | dense/jvar - dense/none (per seed, mean ± 95% t) | seeds |",
                 "|---|---|---|"] + [f"| {m} | {fmt(e, 4)} | {len(e['values'])} |"
                                     for m, e in reg.items()]
    write_json(out / "summary.json", summary, indent=1)
    scale = "QUICK (CI smoke scale: numbers are not evidence)" if quick else "default"
    text = [
        "# The hybrid objective and MoE stability", "",
        f"Scale: **{scale}**; {len(runs)} runs, {s['steps']} steps each, seeds {s['seeds']}; "
        f"MoE gate: {s.get('gate', 'renormalised')}; Switch loss coefficient {s['coef']:g}, "
        f"population KL and J_var at {', '.join(f'{c:g}' for c in s.get('coefs', [s['coef']]))}"
        f" (top-k {s.get('sweep_top_ks') or s['top_ks']}; other top-k the first only); "
        f"{sum(r['seconds'] for r in runs) / 60:.1f} min of training and evaluation (sum over "
        "runs). Final evaluation on *Persuasion* "
        f"({s['eval_sequences']} windows of {s['context']} bytes). Intervals: 95% Student t "
        "over seeds (none with one seed).", "",
        "## Result table (final step, means over layers)", "", markdown_table(table), "",
        "H(f)/log E: entropy of the fraction of routing slots per expert, 1 = balanced; max load: "
        "E max_e f_e (1 = balanced, E = total collapse); dead: experts with f_e < 0.01/E; router "
        "H: mean entropy of the dense router posterior; attn H/H_unif: mean attention entropy "
        "over the uniform causal posterior's; cos: coupling of posterior and score gradients "
        "(section 20 of docs/theory.md), global and per token; share: the posterior path's "
        "share <g_post, g> / |g|^2 of the squared gradient at the shared representation. "
        f"{CONTROL}: the plain Transformer with queries and keys through a stop-gradient.", "",
        "## The paper's statements", "", verdict_lines(v), "",
        "## When attention leaves its initialisation", "",
        "Attention entropy (share of the uniform posterior's) at each evaluation minus step 0's, "
        "per seed; one-sided 95% t upper bound over seeds (descriptive, not in m).", "",
        *leave_lines, "",
        "## J_var as a regulariser of the plain Transformer", "",
        f"Coefficient {s['coef']}; paired by seed (same initial weights and batches). attn_j_var "
        "is svflow diagnose's kl_q_p read on every validation token.", "", *reg_lines, "",
        "## Figures", "", *[f"![{f}]({f})" for f in figs], "",
    ]
    write_text(out / "report.md", "\n".join(text))
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    from svflow_jax.xla_settings import use_project_flags

    use_project_flags(quick=args.quick)  # before JAX starts; a user's XLA_FLAGS win
    s = settings(args)  # option errors before the (slow) imports
    from tqdm.auto import tqdm

    from svflow_jax.environment import environment
    from svflow_jax.objective.train import train_run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", {"settings": s, "argv": sys.argv[1:]}, indent=1)
    log = out / "runs.jsonl"
    done = read_jsonl(log, repair=True)  # a run cut short by a kill is dropped and redone
    start = time.perf_counter()
    if not args.report_only:
        configs = run_configs(s)
        have = {json.dumps(r["config"], sort_keys=True) for r in done}
        todo = [c for c in configs if json.dumps(c.to_json(), sort_keys=True) not in have]
        bar = tqdm(total=len(todo) * s["steps"], disable=args.no_progress, unit="step",
                   desc="objective_moe")
        for cfg in todo:
            bar.set_postfix_str(cfg.name)
            result = train_run(cfg, progress=bar.update)
            record = dumps({**result.to_json(), "environment": environment()})
            append_line(log, record)
            done.append(json.loads(record))
        bar.close()
    if not done:
        print("error: no runs to report", file=sys.stderr)
        return 2
    summary = write_report(out, s, done, args.quick, time.perf_counter() - start)
    print(f"wrote {out / 'report.md'}")
    for key, e in summary["verdicts"].items():
        print(f"  {key}: {e['reproduced']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
