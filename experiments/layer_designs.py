"""Which solver makes the best Transformer layer, for the same compute?

Run::

    python experiments/layer_designs.py [--part baseline|depth|designs|ngpt|recipe]
        [--out results/layer_designs] [--quick] [--seeds 3] [--arms ARM ...]

``--part baseline`` (33 minutes on 2 CPU cores, measured) tunes and trains the baseline that
``svflow train`` runs by default (:mod:`svflow_jax.training.recipes`): a short learning-rate
sweep (each rate of ``LR_GRID`` for a fifth of the recipe's steps, on its own warm-up + cosine
schedule), the full recipe at the recipe's rate (the report says whether the sweep agrees), and
the recipe's model on two-hop and one-hop associative recall; it writes
``baseline/report.md``, ``baseline/results.json`` and ``baseline/curve.png`` (validation bits
per character against minutes and tokens, with tokens per second). ``--part depth`` asks
whether a trained stack is a convergent discretisation of one flow (:func:`run_depth`: Euler and
Heun with Chebyshev weights, trained at one depth or at two, evaluated at 1/2 to 8 times the
blocks with Richardson ratios of the final states, and with adaptive depth at several
tolerances; ``depth/report.md``). ``--part designs`` is
the comparison below; ``--part ngpt`` the same comparison for the sequential (Lie-Trotter) and
parallel (Euler) blocks on the sphere with the residual step against nGPT's normalised step
(``DesignConfig.update="ngpt"``: normalised branches, learned per-dimension rates), in
``ngpt/``; without ``--part`` these four run. ``--part recipe`` (:func:`run_recipe`, only
when named) trains designs at the size of the recipe itself, each paired by seed with it at
equal steps and at equal time (from training steps timed side by side, so runs may share a
busy machine), in ``recipe/``: every run takes 18-23 minutes on 2 idle CPU cores (about 18
hours for the 54 runs of :data:`RECIPE`), so ``--arms`` and ``--seeds`` split it into pieces
(``--arms "lie-trotter post" --seeds 1``: the recipe and one arm's two rates at seed 0,
about an hour), and a later call with more seeds or arms reuses every finished run; an arm
with weights continuous in depth is also run at 1/2 to 8 times its blocks, with Richardson
ratios (:func:`refinement`, a minute or two per run).

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

**Collapse** (the mean cosine between a sequence's final token states, per seed) is measured
for every run; a seed at 0.99 or above is reported as collapsed and its arm is not ranked.

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
steps. ``--quick`` (CI):
``d = 16``, two designs post-norm, pre-norm and with nGPT's step, 2 seeds, 12 steps, budget 4:
under 2 minutes.

Outputs in ``--out``: ``config.json``, ``runs/tune/<design>-<norm>-lr<lr>/`` and
``runs/austen/<design>-<norm>-seed<k>/`` (each run's config, metrics, checkpoints, summary: an
interrupted experiment resumes), ``results.json``,
``table.csv``, ``report.md`` and PNG figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from svflow_jax.atomic import write_json, write_text  # noqa: E402
from svflow_jax.cli.types import positive_int  # noqa: E402 (no JAX: flags are set in main)

DEFAULT = dict(
    designs=["euler", "heun", "midpoint", "rk4", "geodesic-euler", "crouch-grossman3",
             "lie-trotter", "strang"],
    budget=12, seeds=3, steps=400, d_model=64, n_heads=4, d_head=16, d_ff=128, context=64,
    anchors=4, duration=12.0, batch_size=16, eval_every=50, eval_sequences=128,
    norms=["post", "pre"], baselines=["euler pre"], head_bias=True,
    lr_grid=[1e-3, 3e-3, 1e-2], tune_steps=150,
    rtols=[1e-1, 3e-2, 1e-2], recall_designs=[], recall_steps=300, throughput_repeats=5,
    memory_depths=[2, 8, 32],
)
QUICK = dict(
    designs=["euler", "heun"], budget=4, seeds=2, steps=12, d_model=16, n_heads=2, d_head=8,
    d_ff=32, context=16, anchors=2, duration=4.0, batch_size=8, eval_every=12,
    eval_sequences=16, norms=["post", "pre", "ngpt"], baselines=["euler pre"], head_bias=True,
    lr_grid=[3e-3, 1e-2],
    tune_steps=4, rtols=[1e-1], recall_designs=["euler"], recall_steps=4,
    throughput_repeats=2, memory_depths=[2, 8],
)


#: ``--part ngpt``: nGPT's normalised step against the residual step on the sphere, in the
#: sequential block (nGPT's own) and the parallel one
NGPT = dict(designs=["lie-trotter", "euler"], norms=["post", "ngpt"], baselines=[],
            recall_designs=[])
NGPT_QUICK = dict(designs=["lie-trotter"], norms=["post", "ngpt"], baselines=[],
                  recall_designs=[])


def arms(s) -> list[str]:
    """``"<design> <norm>"`` for every design and norm of ``s["norms"]`` it has: ``post``
    (on the sphere), ``pre`` (the rotation and geodesic designs have no pre-norm form) or
    ``ngpt`` (nGPT's normalised step on the sphere, :func:`arm_model`)."""
    from svflow_jax.solvers import catalogue

    out = []
    for design in s["designs"]:
        for norm in s["norms"]:
            try:
                catalogue.get(design).solver_for("post" if norm == "ngpt" else norm)
            except ValueError:
                continue
            out.append(f"{design} {norm}")
    return out + [f"{arm} per-layer" for arm in s["baselines"]]


def arm_model(model, arm: str, blocks: int):
    """The :class:`~svflow_jax.designs.DesignConfig` ``model`` with the arm's design and norm
    (``post``/``pre`` with the residual update, ``ngpt`` post-norm with nGPT's step) and
    ``blocks`` blocks; a ``per-layer`` arm has ``blocks`` layers of its own weights."""
    design, norm, *rest = arm.split()
    if norm == "ngpt":
        model = model.replace(design=design, norm_position="post", update="ngpt")
    else:
        model = model.replace(design=design, norm_position=norm, update="residual")
    if rest == ["per-layer"]:
        model = model.replace(weights="per_layer", num_anchors=blocks)
    return model.replace(num_steps=blocks)


def arm_config(base, arm: str, blocks: int, lr: float | None = None):
    """``base`` with the arm's model (:func:`arm_model`) and learning rate."""
    config = dataclasses.replace(base, model=arm_model(base.model, arm, blocks))
    return config if lr is None else dataclasses.replace(config, lr=lr)


def tuned_lr(s, tuning: dict, arm: str) -> float:
    """The grid's rate with the lowest validation loss after the short run, among the runs that
    did not collapse (all collapsed: the lowest loss anyway; the report shows them)."""
    from svflow_jax.training.compare import COLLAPSED

    rows = []
    for lr in s["lr_grid"]:
        if (arm, lr) in tuning:
            run = tuning[(arm, lr)]
            bpc = run["final"].get("val_bpc", math.nan)
            rows.append((not run["collapse"] < COLLAPSED, bpc if math.isfinite(bpc) else math.inf,
                         lr))
    return min(rows)[2]


def tune_run(base, arm: str, lr: float, folder: Path, plan: dict, progress: bool) -> dict:
    """One short run of the learning-rate sweep; a diverged run is recorded as such (and not
    retried on resume)."""
    from svflow_jax.training.compare import run_design
    from svflow_jax.training.loop import TrainingDiverged

    design = arm.split()[0]
    try:
        return run_design(arm_config(base, arm, plan[design], lr), design, plan[design], 0,
                          folder,
                          transfer_factors=(), progress=progress)
    except TrainingDiverged as err:
        summary = {"design": design, "seed": 0, "final": {}, "collapse": math.nan,
                   "diverged_at": err.step}
        write_json(folder / "summary.json", summary)
        return summary


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["baseline", "depth", "designs", "ngpt", "recipe"],
                   help="run one part only (default: the first four; recipe only when "
                   "named)")
    p.add_argument("--out", default="results/layer_designs", help="output folder")
    p.add_argument("--quick", action="store_true", help="tiny CI run (< 2 minutes)")
    p.add_argument("--seeds", type=positive_int, help="seeds per design (default 3; quick 2)")
    p.add_argument("--steps", type=positive_int,
                   help="optimiser steps per run (default 400; quick 12)")
    p.add_argument("--designs", nargs="+", help="designs to compare (default: all eight)")
    p.add_argument("--arms", nargs="+", metavar="ARM",
                   help="--part recipe: the arms to train besides the recipe (default: all; "
                   "quoted names of RECIPE's arms)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: write the report from the runs already in --out "
                   "(over the seeds each design has; throughput is measured)")
    return p.parse_args(argv)


def settings(args) -> dict:
    s = dict(QUICK if args.quick else DEFAULT)
    for name in ("seeds", "steps", "designs"):
        if getattr(args, name) is not None:
            s[name] = getattr(args, name)
    return s


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.arms is not None and args.part != "recipe":
        print(f"{Path(__file__).name}: error: --arms: only with --part recipe", file=sys.stderr)
        return 2
    unknown = [arm for arm in args.arms or () if arm not in RECIPE["arms"]]
    if unknown:
        print(f"{Path(__file__).name}: error: --arms: unknown arm {unknown[0]!r} (one of "
              f"{', '.join(map(repr, RECIPE['arms']))})", file=sys.stderr)
        return 2
    from svflow_jax.xla_settings import use_project_flags

    use_project_flags(quick=args.quick)  # before JAX starts; a user's XLA_FLAGS win
    from svflow_jax.solvers import catalogue

    s = settings(args)
    try:  # before anything is written or compiled
        for name in s["designs"]:
            catalogue.get(name, what="design")
    except ValueError as err:
        print(f"{Path(__file__).name}: error: --designs: {err}", file=sys.stderr)
        return 2
    recipe_part = dict(RECIPE_QUICK if args.quick else RECIPE)
    if args.arms is not None:
        recipe_part["arms"] = {arm: spec for arm, spec in RECIPE["arms"].items()
                               if arm == RECIPE["baseline"] or arm in args.arms}
    if args.seeds is not None:
        recipe_part["seeds"] = args.seeds
    if args.part in (None, "baseline") and not args.report_only:
        run_baseline(Path(args.out) / "baseline", quick=args.quick,
                     progress=not args.no_progress)
    if args.part in (None, "depth") and not args.report_only:
        run_depth(Path(args.out) / "depth", s, DEPTH_QUICK if args.quick else DEPTH,
                  progress=not args.no_progress)
    progress = not args.no_progress
    if args.part in (None, "designs"):
        run_designs(Path(args.out), s, report_only=args.report_only, progress=progress)
    if args.part in (None, "ngpt"):
        ngpt = {**s, **(NGPT_QUICK if args.quick else NGPT)}
        if args.designs is not None:
            ngpt["designs"] = args.designs
        run_designs(Path(args.out) / "ngpt", ngpt, report_only=args.report_only,
                    progress=progress)
    if args.part == "recipe":
        run_recipe(Path(args.out) / "recipe", recipe_part, quick=args.quick,
                   report_only=args.report_only, progress=progress)
    return 0


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


# ---------------------------------------------------------------------------- depth


#: the depth part: weights smooth in depth (Chebyshev path through the anchors), trained at
#: the budget's blocks N alone ("one depth") or at N and ``extra`` N at once ("two depths",
#: TrainConfig.extra_depths), then run at other block counts
DEPTH = dict(designs=["euler", "heun"], norm="post", seeds=3, steps=400, lr=3e-3, extra=2,
             factors=[0.5, 2.0, 4.0, 8.0], multiples=[1, 2, 4, 8],
             rtols=[0.1, 0.03, 0.01, 0.003])
DEPTH_QUICK = dict(designs=["euler"], norm="post", seeds=2, steps=6, lr=3e-3, extra=2,
                   factors=[0.5, 2.0], multiples=[1, 2, 4], rtols=[0.1])


def run_depth(out: Path, s: dict, d: dict, *, progress: bool = True) -> dict:
    """Is a trained stack a convergent discretisation of one flow? Each design of ``d`` with
    Chebyshev weights, trained at one depth and at two, then: validation at ``factors`` times
    the blocks, and the Richardson ratios of its final states at ``multiples`` (``2^p`` for a
    discretisation of order ``p``). Writes ``results.json`` and ``report.md`` in ``out``."""
    from svflow_jax.designs import DesignConfig
    from svflow_jax.solvers import catalogue
    from svflow_jax.training import TrainConfig
    from svflow_jax.training.compare import equal_compute_steps, interval, run_design

    start = time.perf_counter()
    plan = equal_compute_steps(d["designs"], s["budget"])
    model = DesignConfig(d_model=s["d_model"], n_heads=s["n_heads"], d_head=s["d_head"],
                         d_ff=s["d_ff"], context=s["context"], weights="chebyshev",
                         num_anchors=s["anchors"], duration=s["duration"],
                         norm_position=d["norm"], head_bias=s["head_bias"])
    base = TrainConfig(model=model, task="austen", steps=d["steps"], batch_size=s["batch_size"],
                       lr=d["lr"], warmup=max(1, d["steps"] // 20), eval_every=s["eval_every"],
                       eval_sequences=s["eval_sequences"], log_every=s["eval_every"])
    # extra depth multiple per arm; None: the per-layer baseline (N layers of their own weights)
    arms = (("one depth", 0), (f"depths N and {d['extra']}N", d["extra"]),
            ("per-layer weights", None))
    runs = {}
    for seed in range(d["seeds"]):
        for design in d["designs"]:
            n = plan[design]
            for arm, extra in arms:
                kind = {0: "one", None: "perlayer"}.get(extra, "two")
                folder = out / f"{design}-{kind}-seed{seed}"
                print(f"[{time.perf_counter() - start:6.0f}s] depth {design} {arm} seed {seed}",
                      flush=True)
                if extra is None:
                    config = dataclasses.replace(base, model=base.model.replace(
                        weights="per_layer", num_anchors=n))
                else:
                    config = dataclasses.replace(base, extra_depths=(extra * n,) if extra else ())
                runs[(design, arm, seed)] = run_design(
                    config, design, n, seed, folder, transfer_factors=d["factors"],
                    richardson_multiples=d["multiples"], rtols=d["rtols"], progress=progress)
    rows = []
    for design in d["designs"]:
        for arm, _ in arms:
            seeds = [runs[(design, arm, k)] for k in range(d["seeds"])]
            one = [r["final"]["val_bpc"] for r in seeds]
            at = {"1": interval(one)}
            change = {}
            for i, f in enumerate(d["factors"]):
                vals = [r["transfer"][i]["bpc"] for r in seeds]
                at[f"{f:g}"] = interval(vals)
                change[f"{f:g}"] = interval([100 * (v / o - 1) for v, o in zip(vals, one,
                                                                                strict=True)])
            ratios = np.array([r["richardson"]["ratios"] for r in seeds])
            rows.append({"design": design, "arm": arm, "blocks": plan[design],
                         "parameters": seeds[0]["parameters"],
                         "order": catalogue.get(design).order, "val_bpc": at,
                         "change_percent": change,
                         "richardson_ratios": [interval(ratios[:, j])
                                               for j in range(ratios.shape[1])],
                         "collapse": [r["collapse"] for r in seeds],
                         "adaptive": [{"rtol": a["rtol"],
                                       "evaluations": interval([r["adaptive"][i]["evaluations"]
                                                                for r in seeds]),
                                       "bpc": interval([r["adaptive"][i]["loss"] / math.log(2)
                                                        for r in seeds])}
                                      for i, a in enumerate(seeds[0]["adaptive"])],
                         "train_seconds": interval([r["train_seconds"] for r in seeds])})
    results = {"settings": {**d, "budget": s["budget"]}, "rows": rows,
               "seconds": time.perf_counter() - start}
    write_json(out / "results.json", results)
    _depth_report(out, s, d, results)
    return results


def _depth_report(out: Path, s: dict, d: dict, results: dict) -> None:
    m = d["multiples"]
    lines = [
        "# A trained stack as a discretisation of its flow", "",
        f"Width {s['d_model']}, Chebyshev weights through {s['anchors']} anchors on [0, "
        f"{s['duration']:g}], {d['norm']}-norm, head bias {'on' if s['head_bias'] else 'off'}, "
        f"{d['steps']} AdamW steps at peak {d['lr']:g}, {d['seeds']} seeds (95% Student t "
        f"intervals). Trained at N blocks (the budget of {s['budget']} evaluations), or at N and "
        f"{d['extra']}N at once (the loss is their mean: {1 + d['extra']} times the training "
        f"compute), against the per-layer baseline (N blocks of their own weights, the standard "
        f"Transformer, trained at N). Validation bits per character at multiples of N, its "
        f"change against N in percent, and the Richardson ratios e_k / e_(k+1) of the final "
        f"states, e_k = RMS |y(m_k N) - y(m_(k+1) N)| over m = "
        f"{', '.join(f'{v:g}' for v in m)}: a convergent discretisation of order p has "
        f"ratios near 2^p. Run time {results['seconds']:.0f} s.",
        "",
        "| design (order) | training | N | parameters | " + " | ".join(
            f"bpc at {f:g}N (change)" for f in [1.0, *d["factors"]]) + " | Richardson ratios | "
        "final-state cosine | train s |",
        "|---|---|---|---|" + "---|" * (len(d["factors"]) + 1) + "---|---|---|",
    ]
    for r in results["rows"]:
        cells = [_fmt(r["val_bpc"]["1"])]
        for f in d["factors"]:
            key = f"{f:g}"
            cells.append(f"{_fmt(r['val_bpc'][key])} ({r['change_percent'][key][0]:+.1f}%)")
        ratios = ", ".join(_fmt(x, 2) for x in r["richardson_ratios"])
        cosine = " ".join(f"{c:.2f}" for c in r["collapse"])
        lines.append(f"| {r['design']} ({r['order']}) | {r['arm']} | {r['blocks']} | "
                     f"{r['parameters']} | "
                     + " | ".join(cells) + f" | {ratios} | {cosine} | "
                     f"{r['train_seconds'][0]:.0f} |")
    lines += ["", "Adaptive depth (diffrax's PID controller on the embedded error estimate, "
              "per input sequence): mean evaluations and bits per character at each tolerance.",
              "", "| design | training | rtol | evaluations | bits/char |", "|---|---|---|---|---|"]
    for r in results["rows"]:
        for a in r["adaptive"]:
            lines.append(f"| {r['design']} | {r['arm']} | {a['rtol']:g} | "
                         f"{_fmt(a['evaluations'], 1)} | {_fmt(a['bpc'])} |")
    write_text(out / "report.md", "\n".join(lines) + "\n")


# ---------------------------------------------------------------------------- the baseline


def _quick_recipe(config):
    """A CI-sized version of a recipe (same code paths, seconds to run)."""
    model = config.model.replace(d_model=16, n_heads=2, d_head=8, d_ff=32, num_steps=2,
                                 num_anchors=2, duration=2.0, context=16)
    return dataclasses.replace(config, model=model, steps=10, batch_size=4, warmup=1,
                               eval_every=5, eval_sequences=8, checkpoint_every=0)


def _curve(history, key):
    """``(step, tokens, seconds, value)`` of the validation rows."""
    return [(h["step"], h["tokens"], h["seconds"], h[key]) for h in history if key in h]


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
        base = _quick_recipe(base)
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
    curve = _curve(full.history, "val_bpc")
    tokens, seconds = full.history[-1]["tokens"], full.history[-1]["seconds"]
    recall = {}
    for task in ("recall", "recall1"):
        config = recipe(task)
        if quick:
            config = _quick_recipe(config)
        print(f"[{time.perf_counter() - start:6.0f}s] {task}: {config.steps} steps", flush=True)
        r = train(config, out / task, progress=progress)
        recall[task] = {"steps": config.steps, "lr": config.lr,
                        "val_accuracy": r.final["val_accuracy"], "seconds": r.seconds,
                        "curve": _curve(r.history, "val_accuracy")}
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


#: family-wise error rate of the verdicts against the baseline together (Bonferroni over arms)
ALPHA = 0.05


def versus_baseline(pairs: dict[str, list[float]], alpha: float = ALPHA) -> dict[str, dict]:
    """Each arm against the trained baseline from its per-seed differences ``arm - baseline``
    (validation bits per character, paired by seed): the two-sided Student-t interval at level
    ``1 - alpha / m``, Bonferroni over the ``m`` arms compared, decides ``better`` (below 0:
    fewer bits, the sign fixed before the run), ``worse`` (above 0) or ``unresolved`` (it
    holds 0, or fewer than 2 seeds)."""
    from svflow_jax.training.compare import interval

    m = sum(1 for v in pairs.values() if v)
    level = 1 - alpha / max(m, 1)
    out = {}
    for arm, values in pairs.items():
        if not values:
            continue
        mean, half = interval(values, level)
        verdict = ("better" if mean + half < 0 else "worse" if mean - half > 0
                   else "unresolved") if half == half else "unresolved"
        out[arm] = {"interval": [mean, half], "level": level, "comparisons": m,
                    "verdict": verdict}
    return out


# ---------------------------------------------------------------------------- the recipe's size


#: ``--part recipe``: designs at the size of ``svflow train``'s recipe (width 192, 4 layers of
#: their own weights, 4 field evaluations per forward pass, 1800 steps of 32 x 128 bytes), each
#: paired by seed with the recipe itself. An arm is the recipe's model with ``model``'s fields
#: changed, trained at each peak rate of ``lrs`` (``None``: the recipe's rate) at seed 0, for the
#: recipe's full length, and at the best of them for the other seeds. ``recipe + head bias`` is
#: the null: a change built to leave the loss where it is. The one-evaluation designs keep the
#: recipe's four layers of weights; the two-stage (Heun, midpoint: 2 blocks) and four-stage (RK4:
#: 1 block) designs spend the same 4 evaluations with the same parameters as 4 anchors linear in
#: depth, and ``euler pre, linear weights`` is the recipe on that weight path, the control that
#: separates the path from the design. Strang (1.5 evaluations a block) and Crouch-Grossman 3
#: (3) cannot spend exactly 4, so they are compared only in ``--part designs`` (budget 12).
_GRID = [2e-3, 4e-3]
_LINEAR = dict(weights="linear", num_anchors=4)
RECIPE = dict(seeds=3, baseline="recipe", arms={
    "recipe": dict(model={}, lrs=None),
    "recipe + head bias": dict(model=dict(head_bias=True), lrs=None),
    "euler post": dict(model=dict(norm_position="post", head_bias=True), lrs=_GRID),
    "lie-trotter post": dict(model=dict(design="lie-trotter", norm_position="post",
                                        head_bias=True), lrs=_GRID),
    "lie-trotter ngpt": dict(model=dict(design="lie-trotter", norm_position="post",
                                        update="ngpt", head_bias=True), lrs=_GRID),
    "lie-trotter pre": dict(model=dict(design="lie-trotter", head_bias=True), lrs=_GRID),
    "geodesic-euler post": dict(model=dict(design="geodesic-euler", norm_position="post",
                                           head_bias=True), lrs=_GRID),
    **{f"{design} {norm}": dict(model=dict(design=design, norm_position=norm, num_steps=blocks,
                                           head_bias=True, **_LINEAR), lrs=_GRID)
       for design, blocks in (("heun", 2), ("midpoint", 2), ("rk4", 1))
       for norm in ("pre", "post")},
    "euler pre, linear weights": dict(model=dict(head_bias=True, **_LINEAR), lrs=_GRID),
})
RECIPE_QUICK = dict(seeds=2, baseline="recipe", arms={
    arm: RECIPE["arms"][arm] for arm in ("recipe", "euler post")})


#: an arm whose weights are continuous in depth is also run at these multiples of its trained
#: blocks (a half only where that leaves a block), and its final states compared at
#: ``REFINE_MULTIPLES`` (Richardson ratios), on the validation sequences
REFINE_FACTORS = (0.5, 2.0, 4.0, 8.0)
REFINE_MULTIPLES = (1, 2, 4, 8)


def refinement(model) -> dict:
    """``run_design``'s depth measurements for a model of the recipe's size (a
    :class:`~svflow_jax.designs.DesignConfig`): none for per-layer weights (their blocks are
    not samples of one field), else :data:`REFINE_FACTORS` and :data:`REFINE_MULTIPLES`."""
    if model.weights == "per_layer":
        return {"transfer_factors": ()}
    return {"transfer_factors": tuple(f for f in REFINE_FACTORS if f * model.num_steps >= 1),
            "richardson_multiples": REFINE_MULTIPLES}


def _slug(arm: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", arm.lower()).strip("-")


def run_recipe(out: Path, r: dict, *, quick: bool = False, report_only: bool = False,
               progress: bool = True) -> dict:
    """The arms of ``r`` (:data:`RECIPE`) at the recipe's size, seed-major (an interrupted
    part has every arm at seed 0 first); each run in ``out/runs/<arm>-lr<lr>-seed<k>/`` resumes
    from its checkpoints, and a finished one is read back. ``report_only``: train nothing.
    Writes ``results.json``, ``report.md`` and ``curves.png`` (:func:`recipe_comparison`)."""
    from svflow_jax.environment import environment
    from svflow_jax.training.compare import run_design
    from svflow_jax.training.recipes import recipe

    base = recipe("austen")
    if quick:
        base = _quick_recipe(base)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs: dict[str, dict[int, dict]] = {arm: {} for arm in r["arms"]}
    sweep: dict[str, dict[float, dict]] = {arm: {} for arm in r["arms"]}
    for seed in range(r["seeds"]):
        for arm, spec in r["arms"].items():
            if seed == 0:
                grid = spec["lrs"] or [base.lr]
            elif sweep[arm]:
                grid = [_chosen_lr(arm, sweep[arm])]
            else:
                continue
            for lr in grid:
                folder = out / "runs" / f"{_slug(arm)}-lr{lr:g}-seed{seed}"
                if not (folder / "summary.json").exists():
                    if report_only:
                        continue
                    print(f"[{time.perf_counter() - start:6.0f}s] {arm}, lr {lr:g}, seed "
                          f"{seed}", flush=True)
                config = dataclasses.replace(base, lr=lr, model=base.model.replace(
                    **spec["model"]))
                summary = {**run_design(config, config.model.design, config.model.num_steps,
                                        seed, folder, progress=progress,
                                        **refinement(config.model)),
                           "lr": lr}
                if seed == 0:
                    sweep[arm][lr] = summary
                else:
                    runs[arm][seed] = summary
            if seed == 0 and sweep[arm]:
                runs[arm][0] = sweep[arm][_chosen_lr(arm, sweep[arm])]
    runs = {a: v for a, v in runs.items() if v}
    speed = _recipe_speed(out, base, {arm: r["arms"][arm] for arm in runs}, quick)
    results = recipe_comparison(runs, r["baseline"], speed)
    results["speed"] = speed
    results["settings"] = {"seeds": r["seeds"], "baseline": r["baseline"],
                           "arms": r["arms"], "recipe": base.to_json()}
    results["sweep"] = {arm: [{"lr": lr, "val_bpc": s["final"]["val_bpc"],
                               "collapse": s["collapse"]} for lr, s in sorted(d.items())]
                        for arm, d in sweep.items() if d}
    results["environment"] = environment()
    write_json(out / "results.json", results)
    _recipe_figure(out, runs)
    _recipe_report(out, results)
    print(f"[{time.perf_counter() - start:6.0f}s] wrote {out / 'report.md'}", flush=True)
    return results


def _recipe_speed(out: Path, base, arms: dict[str, dict], quick: bool) -> dict:
    """Training and inference tokens/s of each arm's model, timed side by side
    (:func:`~svflow_jax.training.compare.throughput`), kept in ``out/speed.json`` with the
    machine it was measured on and measured again when the arms change."""
    from flax import nnx

    from svflow_jax.designs import SolverLM
    from svflow_jax.environment import environment
    from svflow_jax.training.compare import throughput

    path = out / "speed.json"
    if path.exists():
        kept = json.loads(path.read_text())
        if set(kept["tokens_per_s"]) == set(arms):
            return kept
    rounds = 2 if quick else 5
    print(f"training and inference steps of {len(arms)} arms, timed side by side "
          f"({rounds} rounds)", flush=True)
    model = base.resolved().model
    models = {arm: SolverLM(model.replace(**spec["model"]), rngs=nnx.Rngs(0))
              for arm, spec in arms.items()}
    speed = {"tokens_per_s": throughput(models, base.batch_size, model.context, rounds),
             "rounds": rounds, "environment": environment()}
    write_json(path, speed)
    return speed


def _chosen_lr(arm: str, by_lr: dict[float, dict]) -> float:
    """:func:`tuned_lr` over an arm's seed-0 runs (rate -> summary)."""
    return tuned_lr({"lr_grid": list(by_lr)}, {(arm, lr): s for lr, s in by_lr.items()}, arm)


def _at(history: list[dict], x_key: str, x: float, y_key: str) -> float:
    """``y_key`` at ``x`` (linear between the rows that have both keys)."""
    rows = [h for h in history if x_key in h and y_key in h]
    return float(np.interp(x, [h[x_key] for h in rows], [h[y_key] for h in rows]))


def recipe_comparison(runs: dict[str, dict[int, dict]], baseline: str, speed: dict,
                      alpha: float = ALPHA) -> dict:
    """Each arm of ``runs`` (arm -> seed -> :func:`~svflow_jax.training.compare.run_design`
    summary) against ``baseline``, paired by seed, in validation bits per character:

    * **equal steps**: the final validations;
    * **equal time**: with ``s`` the seconds of one training step (``speed["tokens_per_s"]``,
      arm -> :func:`~svflow_jax.training.compare.throughput`'s rates, timed side by side),
      ``T = N min(s_arm, s_baseline)`` for ``N`` steps, each arm is read at step ``T / s``: the
      slower one at ``N s_faster / s_slower``, the faster at ``N``. Each seed's validation
      curve is read at that step (linear between validations).

    All comparisons together are decided by :func:`versus_baseline` (Bonferroni over them);
    an arm with one paired seed is ``unresolved``."""
    from svflow_jax.training.compare import COLLAPSED, interval

    rows, pairs = [], {}
    base = runs.get(baseline, {})
    for arm, seeds in runs.items():
        first, some = seeds.get(0), next(iter(seeds.values()))
        rate = speed["tokens_per_s"][arm]["train_tokens_per_s"]
        final = {k: s["final"]["val_bpc"] for k, s in sorted(seeds.items())}
        row = {"arm": arm, "lr": some["lr"], "val_bpc": final,
               "interval": interval(list(final.values())),
               "collapse": {k: s["collapse"] for k, s in sorted(seeds.items())},
               "collapsed": sum(s["collapse"] >= COLLAPSED for s in seeds.values()),
               "parameters": some["parameters"],
               "minutes": first["train_seconds"] / 60 if first else None,
               "tokens_per_s": rate}
        refined = {k: {"num_steps": s["num_steps"], "val_bpc": s["final"]["val_bpc"],
                       "transfer": [{key: t[key] for key in ("factor", "num_steps", "bpc")}
                                    for t in s["transfer"]],
                       "ratios": (s.get("richardson") or {}).get("ratios")}
                   for k, s in sorted(seeds.items()) if s.get("transfer")}
        if refined:
            row["refinement"] = refined
        rows.append(row)
        if arm == baseline:
            continue
        paired = sorted(set(seeds) & set(base))
        pairs[f"{arm}, equal steps"] = [final[k] - base[k]["final"]["val_bpc"]
                                        for k in paired]
        if paired:
            last = some["history"][-1]  # N steps, their tokens
            base_rate = speed["tokens_per_s"][baseline]["train_tokens_per_s"]
            fastest = max(rate, base_rate)
            step = {arm: last["step"] * rate / fastest,
                    baseline: last["step"] * base_rate / fastest}
            row["equal_time"] = {"seconds": last["tokens"] / fastest, "step": step[arm],
                                 "baseline_step": step[baseline]}
            pairs[f"{arm}, equal time"] = [
                _at(seeds[k]["history"], "step", step[arm], "val_bpc")
                - _at(base[k]["history"], "step", step[baseline], "val_bpc") for k in paired]
    verdicts = versus_baseline(pairs, alpha)
    for name, values in pairs.items():
        if name in verdicts:
            verdicts[name]["differences"] = values
    return {"arms": rows, "verdicts": verdicts}


def _recipe_figure(out: Path, runs: dict[str, dict[int, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from svflow_jax.reporting import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for i, (arm, seeds) in enumerate(runs.items()):
        color = f"C{i}"
        for k, s in sorted(seeds.items()):
            c = np.array(_curve(s["history"], "val_bpc"), float)
            axes[0].plot(c[:, 0], c[:, 3], "o-", color=color, ms=3, lw=1,
                         label=arm if k == min(seeds) else None)
            if k == 0:
                axes[1].plot(c[:, 2] / 60, c[:, 3], "o-", color=color, ms=3, label=arm)
    axes[0].set_xlabel("optimiser step (every seed)")
    axes[1].set_xlabel("wall-clock minutes (seed 0)")
    for ax in axes:
        ax.set_ylabel("validation bits per character (Persuasion)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("designs at the recipe's size, paired by seed with the recipe")
    save_figure(fig, out / "curves.png")


def _equal_time_words(t: dict | None) -> str:
    return "-" if t is None else f"{t['step']:.0f} / {t['baseline_step']:.0f}"


def _recipe_report(out: Path, results: dict) -> None:
    from svflow_jax.reporting import provenance
    from svflow_jax.training.compare import COLLAPSED

    rc, m = results["settings"]["recipe"], results["settings"]["recipe"]["model"]
    lines = [
        "# Designs at the recipe's size", "",
        f"Every arm is the recipe's model (width {m['d_model']}, {m['n_heads']} heads of "
        f"{m['d_head']}, FFN {m['d_ff']}, {m['num_steps']} layers of their own weights, "
        f"context {m['context']}) with its own changes, trained like the recipe ({rc['steps']} "
        f"AdamW steps of {rc['batch_size']} sequences, warm-up {rc['warmup']}, weight decay "
        f"{rc['weight_decay']:g}) at its peak learning rate: the best at seed 0 of its grid, "
        f"each rate trained for the full length (so seed 0 is the best of its rates). Seeds "
        f"share batches and initial weights across arms. {provenance(results['environment'])}",
        "", "| arm | peak lr | parameters | val. bits/char per seed | mean (95% t) | "
        "final-state cosine per seed | minutes (seed 0, as run) | train tok/s (side by side) "
        "| equal time: the arm's step / the recipe's |",
        "|---|---|---|---|---|---|---|---|---|"]
    for row in results["arms"]:
        bpc = " ".join(f"{v:.3f}" for v in row["val_bpc"].values())
        if row["collapsed"]:
            bpc = f"collapsed ({row['collapsed']} seeds, cosine >= {COLLAPSED}): {bpc}"
        minutes = "-" if row["minutes"] is None else f"{row['minutes']:.1f}"
        tps = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.0f}"
        lines.append(f"| {row['arm']} | {row['lr']:g} | {row['parameters']} | {bpc} | "
                     f"{_fmt(row['interval'])} | "
                     + " ".join(f"{c:.3f}" for c in row["collapse"].values())
                     + f" | {minutes} | {tps} | {_equal_time_words(row.get('equal_time'))} |")
    lines += ["", "Seed 0 at each rate of the arm's grid (validation bits per character, "
              "final-state cosine):", "", "| arm | runs |", "|---|---|"]
    for arm, sweep in results["sweep"].items():
        lines.append(f"| {arm} | " + "; ".join(
            f"{s['lr']:g}: {s['val_bpc']:.3f} ({s['collapse']:.3f})" for s in sweep) + " |")
    verdicts, speed = results["verdicts"], results["speed"]
    m_count = next(iter(verdicts.values()))["comparisons"] if verdicts else 0
    timed = provenance(speed["environment"]) or "not recorded."
    lines += [
        "", f"Each arm minus the recipe, paired by seed, at equal steps and at equal time "
        f"(the training steps of the two models timed side by side, {speed['rounds']} "
        f"alternating rounds, median: the slower arm read at the step it reaches in the time "
        f"the faster takes for all of them). Two-sided Student-t intervals at level "
        f"1 - {ALPHA:g}/m, Bonferroni over the m = {m_count} comparisons, the sign fixed "
        f"before the runs: **better** if the interval lies below 0 (fewer bits), **worse** "
        f"above, else **unresolved**.", "",
        f"The side-by-side timings: {timed[:1].lower()}{timed[1:]}", "",
        "| comparison | differences per seed | mean | half-width | verdict |",
        "|---|---|---|---|---|"]
    for name, v in verdicts.items():
        mean, half = v["interval"]
        half_text = "-" if half != half else f"{half:.3f}"
        lines.append(f"| {name} | " + " ".join(f"{d:+.3f}" for d in v["differences"])
                     + f" | {mean:+.3f} | {half_text} | {v['verdict']} |")
    lines += _refinement_lines(results)
    lines += ["", "![validation curves](curves.png)"]
    write_text(out / "report.md", "\n".join(lines) + "\n")


def _refinement_lines(results: dict) -> list[str]:
    """The table of the arms with weights continuous in depth, run at other numbers of
    blocks (:func:`refinement`); none when no arm has them."""
    from svflow_jax.solvers import catalogue

    arms = [row for row in results["arms"] if row.get("refinement")]
    if not arms:
        return []
    lines = [
        "", "Refined: each trained model whose weights are continuous in depth run at other "
        "numbers of blocks (the same weights, a step `h = T / blocks`), validation bits per "
        "character and the change from the trained depth; the Richardson ratios "
        "`e_k / e_(k+1)` of the final states at "
        + ", ".join(map(str, REFINE_MULTIPLES)) + " times the blocks, "
        "`e_k = RMS |y(m_k N) - y(m_(k+1) N)|`, approach `2^p` for a discretisation of one "
        "flow by a method of order `p`.", "",
        "| arm, seed | trained blocks: bits/char | other blocks: bits/char (change) | "
        "Richardson ratios (`2^p`) |", "|---|---|---|---|"]
    settings = results["settings"]
    for row in arms:
        order = catalogue.get(settings["arms"][row["arm"]]["model"].get(
            "design", settings["recipe"]["model"]["design"])).order
        for seed, r in row["refinement"].items():
            other = "; ".join(f"{t['num_steps']}: {t['bpc']:.3f} "
                              f"({100 * (t['bpc'] / r['val_bpc'] - 1):+.1f}%)"
                              for t in r["transfer"])
            ratios = ("-" if not r["ratios"] else ", ".join(f"{x:.2f}" for x in r["ratios"]))
            lines.append(f"| {row['arm']}, {seed} | {r['num_steps']}: {r['val_bpc']:.3f} | "
                         f"{other} | {ratios} ({2 ** order if order else '-'}) |")
    return lines


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


def _fmt(pair, digits=3) -> str:
    mean, half = pair
    if half != half:  # NaN
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


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
        bpc = _fmt(r["val_bpc"])
        if r["collapsed"]:
            bpc = f"collapsed ({r['collapsed']} of {r['seeds']} seeds): {bpc}"
        cosines = " ".join(f"{c:.2f}" for c in r["collapse"])
        paired = ("-" if r["minus_baseline"] is None else _fmt(r["minus_baseline"])
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
            lines.append(f"| {r['design']} | {a['rtol']:g} | {_fmt(a['evaluations'], 1)} | "
                         f"{_fmt(a['loss'])} | {a['all_finished']} |")
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
                     f"{_fmt(r['accuracy'])} |")
    if not results["recall"]:
        lines[-2:] = ["Not run (no `recall_designs` in the settings)."]
    write_text(out / "report.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
