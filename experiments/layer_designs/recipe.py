"""``--part recipe`` (only when named): designs at the size of ``svflow train``'s recipe.

Each arm is paired by seed with the recipe itself, at equal steps and at equal time (from
training steps timed side by side, so runs may share a busy machine), in ``recipe/``. A run
takes as long as the recipe (the results page ``docs/results/layer-designs.md`` has the times),
so ``--arms`` and ``--seeds`` split :data:`RECIPE` into pieces (``--arms "lie-trotter post"
--seeds 1``: the recipe and one arm's two rates at seed 0), and a later call with more seeds or
arms reuses every finished run; an arm with weights continuous in depth is also run at 1/2 to 8
times its blocks, with Richardson ratios (:func:`refinement`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import numpy as np

from svflow_jax.atomic import write_json, write_text

from .common import ALPHA, fmt, quick_recipe, tuned_lr, validation_curve, versus_baseline

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
        base = quick_recipe(base)
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
            c = np.array(validation_curve(s["history"], "val_bpc"), float)
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
                     f"{fmt(row['interval'])} | "
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
        "", "Each arm minus the recipe, paired by seed, at equal steps and at equal time:", "",
        "| comparison | differences per seed | mean | half-width | verdict |",
        "|---|---|---|---|---|"]
    for name, v in verdicts.items():
        mean, half = v["interval"]
        half_text = "-" if half != half else f"{half:.3f}"
        lines.append(f"| {name} | " + " ".join(f"{d:+.3f}" for d in v["differences"])
                     + f" | {mean:+.3f} | {half_text} | {v['verdict']} |")
    lines += [
        "", f"*Legend.* Columns: the arm's validation bits per character minus the recipe's, "
        f"per seed, their mean, and the half-width of their interval. Equal time: the "
        f"training steps of the two models timed side by side, {speed['rounds']} "
        f"alternating rounds, median: the slower arm read at the step it reaches in the time "
        f"the faster takes for all of them. Which test decides: two-sided Student-t intervals "
        f"at level 1 - {ALPHA:g}/m, Bonferroni over the m = {m_count} comparisons, the sign "
        f"fixed before the runs: **better** if the interval lies below 0 (fewer bits), "
        f"**worse** above, else **unresolved**.", "",
        f"The side-by-side timings: {timed[:1].lower()}{timed[1:]}"]
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
