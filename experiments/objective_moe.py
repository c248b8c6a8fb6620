"""Does a MoE language model collapse without balancing while attention stays healthy, and do
the population KL and J_var prevent collapse as well as the Switch loss?

Run::

    python experiments/objective_moe.py [--out results/objective_moe] [--quick] [--seeds 3]

Byte-level causal pre-norm language models on Jane Austen (train: *Pride and Prejudice*;
validation: *Persuasion*), ``d = 64``, 2 layers, 4 heads, GELU experts of width 64, context 64,
batch 16, AdamW with warm-up and cosine decay (:mod:`svflow_jax.objective.train`):

* MoE, 8 experts, top-1 and top-2 routing, each trained with (a) no balancing ``none``,
  (b) the Switch auxiliary loss ``switch``, (c) the population KL ``popkl``, (d) ``jvar``,
  every regulariser with the coefficient 0.01;
* the plain Transformer (dense GELU FFN of width 128: attention is the only posterior), with
  no regulariser (``none``, the "attention-only" control) and with ``jvar`` (part 4).

Every run is evaluated every ``eval_every`` steps on the validation text: loss, ECE, expert
usage entropy / maximum load / dead experts per layer, router and attention entropies, J_var
per branch and the gradient coupling of posterior and scores (``docs/theory.md``, section 20).
Intervals: 95% Student t over seeds.

Outputs in ``--out``: ``config.json``, ``runs.jsonl`` (every run's history and environment;
an interrupted experiment resumes from it), ``curves.csv`` (one row per run, step and layer),
``final.csv`` (one row per run), ``table.csv`` and ``summary.json`` (per arm, with intervals
and verdicts), ``report.md`` and PNG figures.

Sizes: the default (3 seeds, 120 steps, 30 runs) took 19.7 minutes on 2 CPU cores shared with
four other jobs (load average 6-9), so it fits the 45-minute budget with room; ``--steps 240``
should fit 45 minutes on 2 idle cores by extrapolation (not run). ``--quick`` (CI) trains top-1
only, 1 seed, 12 steps, d = 32, 16 validation sequences (72 s at load average 6, all six
runs; the smoke test runs two of them for 2 steps).
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
from svflow_jax.cli_types import positive_int  # noqa: E402 (no JAX yet)

N_EXPERTS = 8  # experts of every MoE arm

DEFAULT = dict(seeds=3, steps=120, top_ks=[1, 2], methods=["none", "switch", "popkl", "jvar"],
               dense_methods=["none", "jvar"], eval_every=50, eval_sequences=64, coef=0.01,
               d_model=64, n_layers=2, n_heads=4, d_ff=64, dense_d_ff=128, context=64,
               batch_size=16, lr=3e-3, warmup=30)
QUICK = dict(DEFAULT, seeds=1, steps=12, top_ks=[1], eval_every=6, eval_sequences=16,
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
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/objective_moe", help="output folder")
    p.add_argument("--quick", action="store_true", help="tiny CI run")
    p.add_argument("--seeds", type=positive_int, help="seeds per arm (default 3; quick 1)")
    p.add_argument("--steps", type=positive_int, help="optimiser steps per run (default 120)")
    p.add_argument("--top-ks", type=positive_int, nargs="+",
                   help=f"MoE top-k values, at most {N_EXPERTS} (default 1 2)")
    p.add_argument("--methods", nargs="+", help="MoE methods (default none switch popkl jvar)")
    p.add_argument("--dense-methods", nargs="*", help="plain Transformer methods (default "
                   "none jvar; give none to skip the dense runs: --dense-methods)")
    p.add_argument("--coef", type=float, help="regulariser coefficient (default 0.01)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--report-only", action="store_true",
                   help="rewrite the report from runs.jsonl without training")
    args = p.parse_args(argv)
    if args.top_ks and max(args.top_ks) > N_EXPERTS:
        p.error(f"--top-ks: each must be at most the {N_EXPERTS} experts, got {args.top_ks}")
    if args.coef is not None and not (math.isfinite(args.coef) and args.coef >= 0):
        p.error("--coef must be a finite number >= 0")
    return args


def settings(args) -> dict:
    s = dict(QUICK if args.quick else DEFAULT)
    for name in ("seeds", "steps", "top_ks", "methods", "dense_methods", "coef"):
        v = getattr(args, name)
        if v is not None:
            s[name] = v
    bad = [m for m in s["methods"] + s["dense_methods"]
           if m not in ("none", "switch", "popkl", "jvar")]
    if bad or any(m in ("switch", "popkl") for m in s["dense_methods"]):
        print(f"error: unknown or unsupported methods {bad or s['dense_methods']}", file=sys.stderr)
        raise SystemExit(2)
    s["eval_every"] = min(s["eval_every"], s["steps"])
    return s


def run_configs(s: dict):
    from svflow_jax.objective.train import RunConfig
    common = dict(d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"],
                  context=s["context"], batch_size=s["batch_size"], steps=s["steps"],
                  lr=s["lr"], warmup=s["warmup"], eval_every=s["eval_every"],
                  eval_sequences=s["eval_sequences"], coef=s["coef"])
    out = []
    for seed in range(s["seeds"]):  # seed-major: a partial run has every arm at seed 0
        for k in s["top_ks"]:
            for m in s["methods"]:
                out.append(RunConfig(ffn="moe", n_experts=N_EXPERTS, top_k=k, method=m, seed=seed,
                                     d_ff=s["d_ff"], **common))
        for m in s["dense_methods"]:
            out.append(RunConfig(ffn="gelu", method=m, seed=seed, d_ff=s["dense_d_ff"], **common))
    return out


# ---------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------

def arm(cfg: dict) -> str:
    return (f"moe top-{cfg['top_k']}" if cfg["ffn"] == "moe" else "dense") + f" / {cfg['method']}"


def scalars(row: dict, cfg: dict) -> dict:
    """Per-run scalars of one evaluation row (layer means)."""
    out = {k: row[k] for k in ("val_loss", "val_bpc", "ece")}
    n_ctx_h = row["attn_entropy_uniform"]
    out["attn_entropy"] = float(np.mean(row["attn_entropy"]))
    out["attn_entropy_norm"] = out["attn_entropy"] / n_ctx_h
    out["attn_j_var"] = float(np.mean(row["attn_j_var"]))
    out["coupling_attn_cos"] = float(np.nanmean(row["coupling_attn_cos"]))
    if cfg["ffn"] == "moe":
        E = cfg["n_experts"]
        out["usage_entropy_norm"] = float(np.mean(row["usage_entropy"])) / math.log(E)
        out["max_load"] = float(np.mean(row["max_load"]))
        out["dead"] = float(np.mean(row["dead"]))
        out["router_entropy_norm"] = float(np.mean(row["router_entropy"])) / math.log(E)
        out["moe_j_var"] = float(np.mean(row["moe_j_var"]))
        c = np.asarray(row["coupling_ffn_cos"], float)
        out["coupling_ffn_cos"] = float(np.nanmean(c)) if np.isfinite(c).any() else float("nan")
        out["coupling_ffn_ratio"] = float(np.nanmean(row["coupling_ffn_norm_ratio"]))
    return out


MEASURES = ["usage_entropy_norm", "max_load", "dead", "router_entropy_norm", "attn_entropy_norm",
            "val_bpc", "ece", "attn_j_var", "moe_j_var", "coupling_attn_cos", "coupling_ffn_cos"]


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


def _get(table, name, m):
    return table.get(name, {}).get(m, {}).get("mean", float("nan"))


def verdicts(table: dict, top_ks: list[int]) -> dict:
    """Each statement's criterion, the numbers it read and ``reproduced`` (True/False/None)."""
    out = {}
    collapse = {}
    for k in top_ks:
        h, dead = _get(table, f"moe top-{k} / none", "usage_entropy_norm"), _get(
            table, f"moe top-{k} / none", "dead")
        collapse[k] = None if math.isnan(h) else bool(h < 0.75 or dead >= 1)
    known = [v for v in collapse.values() if v is not None]
    out["moe_collapses"] = {
        "criterion": "no balancing: mean normalised usage entropy H(f)/log E < 0.75 or >= 1 "
                     "dead expert per layer (mean over seeds), for every top-k",
        "numbers": {f"top-{k}": {"usage_entropy_norm": _get(table, f"moe top-{k} / none",
                                                            "usage_entropy_norm"),
                                 "dead": _get(table, f"moe top-{k} / none", "dead")}
                    for k in top_ks},
        "reproduced": (all(known) if known else None)}
    a = _get(table, "dense / none", "attn_entropy_norm")
    out["attention_healthy"] = {
        "criterion": "plain Transformer, no regulariser: mean attention entropy >= 0.25 of the "
                     "uniform posterior's (no head collapse on average) and finite loss",
        "numbers": {"attn_entropy_norm": a, "val_bpc": _get(table, "dense / none", "val_bpc")},
        "reproduced": None if math.isnan(a) else bool(a >= 0.25)}
    for key, method in (("popkl_as_switch", "popkl"), ("jvar_as_switch", "jvar")):
        res, nums = [], {}
        for k in top_ks:
            hs = _get(table, f"moe top-{k} / switch", "usage_entropy_norm")
            hm = _get(table, f"moe top-{k} / {method}", "usage_entropy_norm")
            dm = _get(table, f"moe top-{k} / {method}", "dead")
            nums[f"top-{k}"] = {"switch": hs, method: hm, f"{method}_dead": dm}
            if not (math.isnan(hs) or math.isnan(hm)):
                res.append(bool(hm >= hs - 0.05 and dm < 1))
        out[key] = {"criterion": f"{method}'s mean normalised usage entropy >= Switch's - 0.05 "
                                 "and < 1 dead expert per layer, for every top-k",
                    "numbers": nums, "reproduced": all(res) if res else None}
    ca = [_get(table, name, "coupling_attn_cos") for name in table]
    cf = [_get(table, name, "coupling_ffn_cos") for name in table if name.startswith("moe")]
    ca, cf = np.asarray(ca, float), np.asarray(cf, float)
    ca_m = float(np.nanmean(ca)) if np.isfinite(ca).any() else float("nan")
    cf_m = float(np.nanmean(cf)) if np.isfinite(cf).any() else float("nan")
    out["coupling"] = {
        "criterion": "final coupling cosine, mean over arms and layers: attention > 0.5 and "
                     "abs(MoE) < 0.1 (top-1 MoE: the renormalised weight is exactly 1, no router "
                     "gradient from the loss at all, cosine undefined)",
        "numbers": {"attention": ca_m, "moe": cf_m},
        "reproduced": (None if math.isnan(ca_m) else bool(ca_m > 0.5 and (
            math.isnan(cf_m) or abs(cf_m) < 0.1)))}
    return out


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------

def write_csvs(out: Path, runs: list[dict]) -> None:
    from svflow_jax.tables import write_csv

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
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        names.append(fname)

    plot("usage_entropy_norm", "expert usage entropy H(f) / log E (mean over layers, seeds)",
         "usage_entropy.png", only_moe=True)
    plot("max_load", "max load E max_e f_e (mean over layers, seeds)", "max_load.png",
         only_moe=True)
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
              ("coupling_attn_cos", "cos attn"), ("coupling_ffn_cos", "cos MoE")]


def markdown_table(table: dict) -> str:
    lines = ["| arm | seeds | " + " | ".join(c for _, c in TABLE_COLS) + " |",
             "|---|---|" + "---|" * len(TABLE_COLS)]
    for name, row in table.items():
        lines.append(f"| {name} | {row['seeds']} | "
                     + " | ".join(fmt(row.get(m)) for m, _ in TABLE_COLS) + " |")
    return "\n".join(lines)


def verdict_lines(v: dict) -> str:
    lines = ["| paper's statement (our reading) | criterion | measured | verdict |",
             "|---|---|---|---|"]
    for key, text in STATEMENTS.items():
        e = v[key]
        word = {True: "reproduced", False: "not reproduced", None: "undecided"}[e["reproduced"]]
        nums = json.dumps(e["numbers"], default=lambda x: round(x, 3))
        nums = json.dumps(json.loads(nums, parse_float=lambda s: round(float(s), 3)))
        lines.append(f"| {text} | {e['criterion']} | `{nums}` | **{word}** |")
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
        d = [by[(b, s)][m] - by[(a, s)][m] for s in seeds]
        if d:
            mean, half = interval(d)
            out[m] = {"mean": mean, "half": half, "values": d, "seeds": seeds}
    return out


REG_MEASURES = ["val_bpc", "ece", "attn_j_var", "attn_entropy_norm", "coupling_attn_cos"]


def write_report(out: Path, s: dict, runs: list[dict], quick: bool, seconds: float) -> dict:
    from svflow_jax.environment import environment
    from svflow_jax.tables import write_csv

    table = aggregate(runs)
    v = verdicts(table, s["top_ks"])
    write_csvs(out, runs)
    write_csv(out / "table.csv", [{"arm": n, "seeds": r["seeds"],
                                   **{m: r[m]["mean"] for m in MEASURES if m in r},
                                   **{m + "_half": r[m]["half"] for m in MEASURES if m in r}}
                                  for n, r in table.items()])
    figs = figures(out, runs)
    reg = paired_differences(runs, "dense / none", "dense / jvar", REG_MEASURES)
    summary = {"settings": s, "quick": quick, "runs": len(runs), "seconds": seconds,
               "run_seconds": [r["seconds"] for r in runs], "table": table, "verdicts": v,
               "jvar_regulariser_dense": reg, "environment": environment()}
    reg_lines = ["| measure | dense/jvar - dense/none (per seed, mean ± 95% t) | seeds |",
                 "|---|---|---|"] + [f"| {m} | {fmt(e, 4)} | {len(e['values'])} |"
                                     for m, e in reg.items()]
    write_json(out / "summary.json", summary, indent=1)
    scale = "QUICK (CI smoke scale: numbers are not evidence)" if quick else "default"
    text = [
        "# The hybrid objective and MoE stability", "",
        f"Scale: **{scale}**; {len(runs)} runs, {s['steps']} steps each, seeds {s['seeds']}; "
        f"{sum(r['seconds'] for r in runs) / 60:.1f} min of training and evaluation (sum over "
        "runs). Final evaluation on *Persuasion* "
        f"({s['eval_sequences']} windows of {s['context']} bytes). Intervals: 95% Student t "
        "over seeds (none with one seed).", "",
        "## Result table (final step, means over layers)", "", markdown_table(table), "",
        "H(f)/log E: entropy of the fraction of routing slots per expert, 1 = balanced; max load: "
        "E max_e f_e (1 = balanced, E = total collapse); dead: experts with f_e < 0.01/E; router "
        "H: mean entropy of the dense router posterior; attn H/H_unif: mean attention entropy "
        "over the uniform causal posterior's; cos: coupling of posterior and score gradients "
        "(section 20 of docs/theory.md).", "",
        "## The paper's statements", "", verdict_lines(v), "",
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
