"""``--part designs`` and ``--part ngpt``: which solver makes the best Transformer layer,
for the same compute?

Every design (a solver read as a block, :mod:`svflow_jax.designs`) is trained as a byte-level
language model on Jane Austen (validation on *Persuasion*, a held-out novel, in bits per
character) with the same

* **compute**: a forward pass spends the same number of field evaluations (one attention + one
  FFN = 1; default budget 12: 12 Euler / geodesic-Euler / Lie-Trotter blocks, 6 Heun or midpoint
  blocks, 3 RK4 blocks, 4 Crouch-Grossman-3 blocks, 8 Strang (macaron) blocks);
* **parameters**: continuous-in-depth weights, ``K = 4`` anchors interpolated linearly on
  ``[0, T]``, ``T = 12`` (so the Euler block has the standard residual step ``h = 1``);
* **training**: AdamW, warm-up + cosine, clipping, batch 16 x 64 bytes, the same batches for
  every design at a given seed; at least 3 seeds each (intervals: 95% Student t over seeds);
* **norm position**: every design post-norm (on the sphere) and pre-norm (the form real models
  use) where it has that form (the rotation and geodesic designs are post-norm only); the head
  has a bias started at the log unigram frequencies (``head_bias``: without it post-norm
  stacks collapse, see ``docs/results/layer-designs.md``);
* **a trained baseline**: the arms of ``baselines`` (default ``euler pre``) also run with per-layer
  weights, ``N`` blocks of their own weights (``"euler pre per-layer"``: the pre-norm Transformer
  of ``svflow train``'s recipe at this width), at the same compute, with more parameters;
* **learning rate** tuned per arm: each rate of ``lr_grid`` (1e-3, 3e-3, 1e-2) for
  ``tune_steps`` (150) at seed 0; the arm trains at the rate with the lowest validation loss
  among its runs that did not collapse.

Then each trained model is evaluated at 1/2, 2 and 4 times its number of blocks (**depth
transfer**); the designs with an embedded error estimate (Heun, midpoint, RK4) are run with
diffrax's PID controller at several tolerances (**adaptive depth**: evaluations per input
against loss); and the training and inference throughput (tokens/s) of each design is timed
side by side with a plain NNX TransformerLM of the same width with 12 layers (the same compute).
A second, small task where depth matters (two-hop associative recall, accuracy) compares the
designs of ``recall_designs`` (none by default: no design learns it at this size, see
``docs/results/baseline.md``).

Sizes (default): ``d = 64``, 4 heads of 16, FFN 128, context 64, 400 optimiser steps, 3 seeds,
8 designs in 14 arms (design x norm position) and the baseline arm, 45 tuning runs of 150
steps. ``--quick`` (CI): ``d = 16``, two designs post-norm, pre-norm and with nGPT's step,
2 seeds, 12 steps, budget 4.

``--part ngpt`` runs the same comparison for the sequential (Lie-Trotter) and parallel (Euler)
blocks on the sphere with the residual step against nGPT's normalised step
(``DesignConfig.update="ngpt"``: normalised branches, learned per-dimension rates), in ``ngpt/``.

Outputs in ``--out``: ``config.json``, ``runs/tune/<design>-<norm>-lr<lr>/`` and
``runs/austen/<design>-<norm>-seed<k>/`` (each run's config, metrics, checkpoints, summary: an
interrupted experiment resumes), ``results.json``, ``table.csv``, ``report.md`` and PNG
figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import numpy as np

from svflow_jax.atomic import write_json, write_text

from .common import ALPHA, arm_config, arm_model, arms, fmt, tune_run, tuned_lr, versus_baseline

#: ``--part ngpt``: nGPT's normalised step against the residual step on the sphere, in the
#: sequential block (nGPT's own) and the parallel one
NGPT = dict(designs=["lie-trotter", "euler"], norms=["post", "ngpt"], baselines=[],
            recall_designs=[])


NGPT_QUICK = dict(designs=["lie-trotter"], norms=["post", "ngpt"], baselines=[],
                  recall_designs=[])


def run_designs(out: Path, s: dict, *, report_only: bool = False,
                progress: bool = True) -> dict:
    """The comparison of the module docstring for the arms of ``s`` (:func:`arms`): the
    learning-rate sweep, the seeds, throughput and gradient memory; writes ``results.json``,
    ``table.csv``, ``report.md`` and the figures in ``out`` and returns the results."""
    from svflow_jax.designs import DesignConfig
    from svflow_jax.environment import environment
    from svflow_jax.training import TrainConfig
    from svflow_jax.training.compare import (
        count_parameters,
        equal_compute_steps,
        gradient_memory,
        interval,
        plain_transformer,
        run_design,
        throughput,
    )

    out.mkdir(parents=True, exist_ok=True)
    saved = out / "config.json"
    # runs live in per-design, per-seed folders; the last two only concern the report
    lists = ("designs", "seeds", "recall_designs", "throughput_repeats", "memory_depths")
    if saved.exists():
        before = {k: v for k, v in json.loads(saved.read_text()).items() if k not in lists}
        if before != {k: v for k, v in s.items() if k not in lists}:
            raise SystemExit(f"{out} holds an experiment with other settings; use a new --out")
    write_json(saved, s)
    start = time.perf_counter()

    model = DesignConfig(d_model=s["d_model"], n_heads=s["n_heads"], d_head=s["d_head"],
                         d_ff=s["d_ff"], context=s["context"], weights="linear",
                         num_anchors=s["anchors"], duration=s["duration"],
                         head_bias=s["head_bias"])
    base = TrainConfig(model=model, task="austen", steps=s["steps"], batch_size=s["batch_size"],
                       warmup=max(1, s["steps"] // 20), eval_every=s["eval_every"],
                       eval_sequences=s["eval_sequences"], log_every=s["eval_every"])
    tune_base = dataclasses.replace(base, steps=s["tune_steps"],
                                    warmup=max(1, s["tune_steps"] // 20),
                                    eval_every=s["tune_steps"], log_every=s["tune_steps"])
    plan = equal_compute_steps(list(dict.fromkeys(
        s["designs"] + [arm.split()[0] for arm in s["baselines"]])), s["budget"])

    def summary_or_none(folder: Path):
        path = folder / "summary.json"
        return json.loads(path.read_text()) if path.exists() else None

    tuning, lrs = {}, {}
    for arm in arms(s):  # the learning rate per arm: each rate of the grid, seed 0, short run
        for lr in s["lr_grid"]:
            folder = out / "runs" / "tune" / f"{arm.replace(' ', '-')}-lr{lr:g}"
            run = summary_or_none(folder)
            if run is None and not report_only:
                print(f"[{time.perf_counter() - start:6.0f}s] tune {arm} lr {lr:g}", flush=True)
                run = tune_run(tune_base, arm, lr, folder, plan, progress)
            if run is not None:
                tuning[(arm, lr)] = run
        if any(key[0] == arm for key in tuning):
            lrs[arm] = tuned_lr(s, tuning, arm)
    runs = {}
    for seed in range(s["seeds"]):  # seed-major: an interrupted run has every arm at seed 0
        for arm in lrs:
            design = arm.split()[0]
            folder = out / "runs" / "austen" / f"{arm.replace(' ', '-')}-seed{seed}"
            run = summary_or_none(folder)
            if run is None and not report_only:
                print(f"[{time.perf_counter() - start:6.0f}s] austen {arm} seed {seed} "
                      f"({plan[design]} blocks, lr {lrs[arm]:g})", flush=True)
                run = run_design(arm_config(base, arm, plan[design], lrs[arm]), design,
                                 plan[design], seed,
                                 folder, rtols=s["rtols"], progress=progress)
            if run is not None:
                runs[(arm, seed)] = run

    recall_plan = equal_compute_steps(s["recall_designs"], s["budget"])
    recall_base = dataclasses.replace(base, task="recall", steps=s["recall_steps"],
                                      warmup=max(1, s["recall_steps"] // 20),
                                      eval_every=max(1, s["recall_steps"] // 4), lr=3e-3)
    recall = {}
    for seed in range(s["seeds"]):
        for design in s["recall_designs"]:
            folder = out / "runs" / "recall" / f"{design}-seed{seed}"
            if report_only:
                if (folder / "summary.json").exists():
                    recall[(design, seed)] = json.loads((folder / "summary.json").read_text())
                continue
            print(f"[{time.perf_counter() - start:6.0f}s] recall {design} seed {seed}",
                  flush=True)
            recall[(design, seed)] = run_design(recall_base, design, recall_plan[design], seed,
                                                folder, transfer_factors=(),
                                                progress=progress)

    # --report-only keeps what the study measured besides the runs: throughput, gradient
    # memory and its run time (a report rewritten later would otherwise time another machine)
    previous = (json.loads((out / "results.json").read_text())
                if report_only and (out / "results.json").exists() else None)
    if previous is not None:
        rates = ("train_tokens_per_s", "inference_tokens_per_s")
        speed = {r["design"]: {k: r[k] for k in rates} for r in previous["austen"]}
        speed["transformer"] = previous["transformer"]
        memory = previous["gradient_memory"]
    else:
        print(f"[{time.perf_counter() - start:6.0f}s] throughput", flush=True)
        from flax import nnx

        from svflow_jax.designs import SolverLM

        resolved = base.resolved().model
        models = {arm: SolverLM(arm_model(resolved, arm, plan[arm.split()[0]]),
                                rngs=nnx.Rngs(0)) for arm in lrs}
        plain = models["transformer"] = plain_transformer(resolved, int(s["budget"]))
        speed = throughput(models, s["batch_size"], s["context"], s["throughput_repeats"])
        speed["transformer"]["parameters"] = count_parameters(plain)

        print(f"[{time.perf_counter() - start:6.0f}s] gradient memory", flush=True)
        memory_design = "rk4" if "rk4" in plan else s["designs"][0]
        memory = {"design": memory_design, **gradient_memory(
            resolved.replace(design=memory_design), s["memory_depths"], s["batch_size"])}

    results = summarise(s, plan, runs, recall, speed, interval, lrs, tuning)
    results["gradient_memory"] = memory
    results["seconds"] = (previous["seconds"] if previous is not None
                          else time.perf_counter() - start)
    results["environment"] = environment()
    write_json(out / "results.json", results)
    write_table(out, results)
    figures(out, s, runs, interval)
    write_report(out, s, results)
    print(f"[{results['seconds']:6.0f}s] wrote {out / 'report.md'}", flush=True)
    return results


def summarise(s, plan, runs, recall, speed, interval, lrs, tuning) -> dict:
    from svflow_jax.training.compare import COLLAPSED

    # each arm is paired by seed (the same initial batches) with the first baseline arm
    baseline = f"{s['baselines'][0]} per-layer" if s["baselines"] else None
    rows = []
    for arm in lrs:
        design = arm.split()[0]
        seeds = [runs[(arm, k)] for k in range(s["seeds"]) if (arm, k) in runs]
        if not seeds:
            continue
        bpc = interval([r["final"]["val_bpc"] for r in seeds])
        transfer = {}
        for i, t in enumerate(seeds[0]["transfer"]):
            transfer[str(t["factor"])] = {"num_steps": t["num_steps"], "bpc": interval(
                [r["transfer"][i]["bpc"] for r in seeds])}
        adaptive = []
        for i, a in enumerate(seeds[0]["adaptive"]):
            adaptive.append({"rtol": a["rtol"],
                             "evaluations": interval([r["adaptive"][i]["evaluations"]
                                                      for r in seeds]),
                             "loss": interval([r["adaptive"][i]["loss"] for r in seeds]),
                             "all_finished": all(r["adaptive"][i]["all_finished"]
                                                 for r in seeds)})
        collapse = [r.get("collapse", math.nan) for r in seeds]
        pairs = [runs[(arm, k)]["final"]["val_bpc"] - runs[(baseline, k)]["final"]["val_bpc"]
                 for k in range(s["seeds"])
                 if arm != baseline and (arm, k) in runs and (baseline, k) in runs]
        sweep = {f"{lr:g}": {"val_bpc": tuning[(arm, lr)]["final"].get("val_bpc", math.nan),
                             "collapse": tuning[(arm, lr)]["collapse"],
                             "diverged_at": tuning[(arm, lr)].get("diverged_at")}
                 for lr in s["lr_grid"] if (arm, lr) in tuning}
        rows.append({"design": arm, "blocks": plan[design], "seeds": len(seeds),
                     "lr": lrs[arm], "lr_sweep": sweep,
                     "evaluations": seeds[0]["evaluations"], "parameters": seeds[0]["parameters"],
                     "val_bpc": bpc, "transfer": transfer, "adaptive": adaptive,
                     "minus_baseline": interval(pairs) if pairs else None,
                     "pairs": pairs,
                     "collapse": collapse,
                     "collapsed": sum(c >= COLLAPSED for c in collapse),
                     "train_seconds": interval([r["train_seconds"] for r in seeds]),
                     **speed[arm]})
    decided = versus_baseline({r["design"]: r.pop("pairs") for r in rows})
    for r in rows:
        r["versus_baseline"] = decided.get(r["design"])
    recall_rows = []
    for design in s["recall_designs"]:
        seeds = [recall[(design, k)] for k in range(s["seeds"]) if (design, k) in recall]
        if not seeds:
            continue
        recall_rows.append({"design": design, "blocks": seeds[0]["num_steps"],
                            "seeds": len(seeds),
                            "accuracy": interval([r["final"]["val_accuracy"] for r in seeds])})
    return {"settings": s, "austen": rows, "recall": recall_rows,
            "transformer": speed["transformer"]}


def _comparisons(results: dict) -> int:
    return next((r["versus_baseline"]["comparisons"] for r in results["austen"]
                 if r.get("versus_baseline")), 0)


def _transfer_words(row) -> str:
    parts = []
    for factor, t in row["transfer"].items():
        parts.append(f"{float(factor):g}x ({t['num_steps']}): {t['bpc'][0]:.2f}")
    return "; ".join(parts)


def _versus_columns(v: dict | None) -> dict:
    """The Bonferroni decision against the baseline as table columns (empty for the baseline)."""
    if v is None:
        return {"versus_baseline": "", "versus_baseline_halfwidth": "",
                "versus_baseline_level": ""}
    return {"versus_baseline": v["verdict"], "versus_baseline_halfwidth": v["interval"][1],
            "versus_baseline_level": v["level"]}


def _versus_words(v: dict | None) -> str:
    return "" if v is None else f"; **{v['verdict']}** (± {v['interval'][1]:.3f})"


def write_table(out: Path, results: dict) -> None:
    from svflow_jax.reporting import write_csv

    write_csv(out / "table.csv", [
        {"design": r["design"], "blocks": r["blocks"], "evaluations": r["evaluations"],
         "parameters": r["parameters"], "val_bpc_mean": r["val_bpc"][0],
         "val_bpc_halfwidth95": r["val_bpc"][1],
         "minus_baseline_mean": "" if r["minus_baseline"] is None else r["minus_baseline"][0],
         "minus_baseline_halfwidth95": ("" if r["minus_baseline"] is None
                                        else r["minus_baseline"][1]),
         **_versus_columns(r.get("versus_baseline")),
         "lr": r["lr"],
         "final_state_cosine_per_seed": " ".join(f"{c:.3f}" for c in r["collapse"]),
         "collapsed_seeds": r["collapsed"], "transfer": _transfer_words(r),
         "train_seconds_mean": round(r["train_seconds"][0], 1),
         "train_tokens_per_s": round(r["train_tokens_per_s"]),
         "inference_tokens_per_s": round(r["inference_tokens_per_s"])}
        for r in results["austen"]])


def figures(out: Path, s, runs, interval) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from svflow_jax.reporting import save_figure

    labels = list(dict.fromkeys(key[0] for key in runs))  # the arms, in run order
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for design in labels:
        keys = [(design, k) for k in range(s["seeds"]) if (design, k) in runs]
        if not keys:
            continue
        curves = [[(h["step"], h["seconds"], h["val_bpc"]) for h in runs[key]["history"]
                   if "val_bpc" in h] for key in keys]
        arr = np.array(curves)  # (seeds, evals, 3)
        mean = arr[..., 2].mean(0)
        half = np.array([interval(arr[:, j, 2])[1] for j in range(arr.shape[1])])
        half = np.nan_to_num(half)
        for ax, x in ((axes[0], arr[0, :, 0]), (axes[1], arr[..., 1].mean(0))):
            ax.plot(x, mean, label=design)
            ax.fill_between(x, mean - half, mean + half, alpha=0.2)
    axes[0].set_xlabel("optimiser step")
    axes[1].set_xlabel("wall-clock seconds (mean over seeds)")
    for ax in axes:
        ax.set_ylabel("validation bits per character")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"equal compute: {s['budget']} field evaluations per forward pass")
    save_figure(fig, out / "validation_curves.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for design in labels:
        rows = [runs[(design, k)] for k in range(s["seeds"]) if (design, k) in runs]
        if not rows:
            continue
        factors = [1.0] + [t["factor"] for t in rows[0]["transfer"]]
        vals = [[r["final"]["val_bpc"]] + [t["bpc"] for t in r["transfer"]] for r in rows]
        order = np.argsort(factors)
        ax.plot(np.array(factors)[order], np.mean(vals, 0)[order], "o-", label=design)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("blocks / trained blocks")
    ax.set_ylabel("validation bits per character")
    ax.set_title("depth transfer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, out / "depth_transfer.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for design in labels:
        a = runs[(design, 0)]["adaptive"] if (design, 0) in runs else []
        for row in a:
            ax.scatter(row["per_input_evaluations"], np.array(row["per_input_loss"]) / np.log(2),
                       s=8, alpha=0.5, label=f"{design} rtol={row['rtol']:g}")
    ax.set_xlabel("field evaluations used (per input sequence)")
    ax.set_ylabel("bits per character of the sequence")
    ax.set_title("adaptive depth (PID controller, seed 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, out / "adaptive_depth.png")


def write_report(out: Path, s, results) -> None:
    from svflow_jax.training.compare import COLLAPSED

    ngpt = ("; ngpt: nGPT's normalised step on the sphere, normalised branches and learned "
            "per-dimension rates" if "ngpt" in s["norms"] else "")

    lines = [
        "# Layer designs at equal compute",
        "",
        f"Byte-level Jane Austen (train: five novels, validation: *Persuasion*). "
        f"Width {s['d_model']}, {s['n_heads']} heads of {s['d_head']}, FFN {s['d_ff']}, "
        f"context {s['context']}, {s['anchors']} weight anchors (linear in depth on "
        f"[0, {s['duration']:g}]), {s['steps']} AdamW steps of {s['batch_size']} sequences, "
        f"{s['seeds']} seeds; {s['budget']} field evaluations per forward pass; head bias "
        f"{'on' if s['head_bias'] else 'off'}. Every design in each norm position it has "
        f"(post-norm: on the sphere; pre-norm: the form real models use{ngpt}), each at its "
        f"own peak "
        f"learning rate: the best of {', '.join(f'{v:g}' for v in s['lr_grid'])} after "
        f"{s['tune_steps']} steps at seed 0. Intervals: 95% Student t over seeds. Total run "
        f"time {results['seconds']:.0f} s.",
        "",
        f"Baseline: {', '.join(f'`{arm} per-layer`' for arm in s['baselines']) or 'none'} "
        f"(N blocks of their own weights: a Transformer, the same compute, more parameters); "
        f"each arm's difference from it is paired by seed (the same initial batches), 95% "
        f"Student t, and decided at level 1 - {ALPHA:g}/m, Bonferroni over the m = "
        f"{_comparisons(results)} arms compared: **better** (the interval below 0: fewer "
        f"bits, the sign fixed before the run), **worse** (above 0) or **unresolved**, with "
        f"the Bonferroni half-width.",
        "",
        f"Collapse: the mean cosine between a sequence's final token states, per seed; a "
        f"seed at {COLLAPSED} or above has collapsed (every token at one point) and its "
        f"design is not ranked. Wall-clock: mean seconds of a training run (same steps).",
        "",
        "| design | blocks | evaluations | parameters | peak lr | seeds | val. bits/char | "
        "minus the baseline, paired by seed | final-state cosine per seed | depth transfer "
        "(bits/char at blocks) | train s | train tok/s | inference tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["austen"]:
        bpc = fmt(r["val_bpc"])
        if r["collapsed"]:
            bpc = f"collapsed ({r['collapsed']} of {r['seeds']} seeds): {bpc}"
        cosines = " ".join(f"{c:.2f}" for c in r["collapse"])
        paired = ("-" if r["minus_baseline"] is None else fmt(r["minus_baseline"])
                  + _versus_words(r.get("versus_baseline")))
        lines.append(f"| {r['design']} | {r['blocks']} | {r['evaluations']:g} | "
                     f"{r['parameters']} | {r['lr']:g} | {r['seeds']} | {bpc} | {paired} | "
                     f"{cosines} | "
                     f"{_transfer_words(r)} | {r['train_seconds'][0]:.0f} | "
                     f"{r['train_tokens_per_s']:.0f} | {r['inference_tokens_per_s']:.0f} |")
    t = results["transformer"]
    lines += [
        f"| plain NNX TransformerLM ({s['budget']} layers) | {s['budget']} | {s['budget']} | "
        f"{t['parameters']} | - | - | - | - | - | - | - | {t['train_tokens_per_s']:.0f} | "
        f"{t['inference_tokens_per_s']:.0f} |",
        "",
        "![validation curves](validation_curves.png)",
        "",
        f"## Learning-rate sweep ({s['tune_steps']} steps, seed 0)",
        "",
        "Validation bits per character (final-state cosine) at each peak learning rate; the "
        "chosen rate is the lowest loss among the runs that did not collapse.",
        "",
        "| design | " + " | ".join(f"{v:g}" for v in s["lr_grid"]) + " |",
        "|---|" + "---|" * len(s["lr_grid"]),
    ]
    for r in results["austen"]:
        cells = []
        for v in s["lr_grid"]:
            t = r["lr_sweep"].get(f"{v:g}")
            if t is None:
                cells.append("-")
            elif t["diverged_at"] is not None:
                cells.append(f"diverged at step {t['diverged_at']}")
            else:
                cells.append(f"{t['val_bpc']:.3f} ({t['collapse']:.2f})")
        lines.append(f"| {r['design']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Adaptive depth",
        "",
        "| design | rtol | mean evaluations per input | val. loss (nats) | all finished |",
        "|---|---|---|---|---|",
    ]
    for r in results["austen"]:
        for a in r["adaptive"]:
            lines.append(f"| {r['design']} | {a['rtol']:g} | {fmt(a['evaluations'], 1)} | "
                         f"{fmt(a['loss'])} | {a['all_finished']} |")
    m = results["gradient_memory"]
    lines += ["", "## Gradient memory against depth", "",
              "Temporary memory of the compiled gradient program (XLA's memory analysis, MiB; "
              f"design {m['design']}, batch {s['batch_size']} x {s['context']}):", "",
              "| blocks | " + " | ".join(f"{d:g}" for d in m["depths"]) + " |",
              "|---|" + "---|" * len(m["depths"]),
              "| rematerialised (default) | " + " | ".join(f"{v:.1f}" for v in m["remat"]) + " |",
              "| not rematerialised | " + " | ".join(f"{v:.1f}" for v in m["no_remat"]) + " |"]
    lines += ["", "![adaptive depth](adaptive_depth.png)", "",
              "![depth transfer](depth_transfer.png)", "",
              "## Two-hop associative recall (accuracy on held-out problems)", "",
              "| design | blocks | seeds | accuracy |", "|---|---|---|---|"]
    for r in results["recall"]:
        lines.append(f"| {r['design']} | {r['blocks']} | {r['seeds']} | "
                     f"{fmt(r['accuracy'])} |")
    if not results["recall"]:
        lines[-2:] = ["Not run (no `recall_designs` in the settings)."]
    write_text(out / "report.md", "\n".join(lines) + "\n")
