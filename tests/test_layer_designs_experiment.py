"""``experiments/layer_designs.py --quick`` runs end to end and writes a consistent report; the
functions of its parts (``experiments/layer_designs/``) decide as documented."""

from __future__ import annotations

import csv
import importlib
import json
import math
import os

import numpy as np
import pytest
from scipy import stats
from scripts_for_tests import assert_refused, import_script, run_script


@pytest.mark.parametrize(("bad", "named"), [
    (["--seeds", "0"], "argument --seeds: must be a positive integer"),
    (["--steps", "x"], "argument --steps"),
    (["--designs", "euler", "nope"], "unknown design 'nope'"),
    (["--designs", "no_such_module:Thing"], "cannot import design"),
    (["--part", "recipe", "--arms", "nope"], "unknown arm 'nope'"),
    (["--part", "designs", "--arms", "euler post"], "only with --part recipe"),
])
def test_bad_options_exit_2_before_anything_is_written(tmp_path, bad, named):
    proc = run_script("layer_designs.py", "--quick", "--out", str(tmp_path / "ld"), *bad,
                      timeout=120)
    assert_refused(proc, named, tmp_path / "ld")


def test_quick_experiment_writes_the_report(tmp_path):
    out = tmp_path / "ld"
    proc = run_script("layer_designs.py", "--quick", "--part", "designs", "--out", str(out),
                      "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (out / "baseline").exists()  # the other part
    results = json.loads((out / "results.json").read_text())
    assert results["environment"]["cpu_count"] == os.cpu_count()
    rows = {r["design"]: r for r in results["austen"]}
    runs = [json.loads(path.read_text()) for path in (out / "runs").glob("*/*/summary.json")]
    assert runs and all(r["environment"]["cpu_count"] == os.cpu_count() for r in runs)
    assert list(rows) == ["euler post", "euler pre", "euler ngpt", "heun post", "heun pre",
                          "heun ngpt", "euler pre per-layer"]  # every norm, the baseline
    budget = results["settings"]["budget"]
    # equal compute and equal parameters, by construction and by count; nGPT's step adds its
    # rates, K anchors x (attention, FFN) x d
    s = results["settings"]
    assert {r["evaluations"] for r in rows.values()} == {budget}
    assert rows["euler pre"]["blocks"] == 2 * rows["heun pre"]["blocks"]
    residual = {r["parameters"] for arm, r in rows.items() if arm.split()[1:] in (["post"],
                                                                                 ["pre"])}
    assert len(residual) == 1
    shared = residual.pop()
    assert {r["parameters"] for arm, r in rows.items() if arm.endswith("ngpt")} == {
        shared + s["anchors"] * 2 * s["d_model"]}
    # the baseline: a Transformer of `budget` layers of their own weights, K = 2 anchors here
    per_anchor = (shared - rows["euler pre per-layer"]["parameters"]) // (s["anchors"] - budget)
    assert rows["euler pre per-layer"]["blocks"] == budget
    assert per_anchor == (4 * s["d_model"] * s["n_heads"] * s["d_head"]
                          + 2 * s["d_model"] * s["d_ff"])
    baseline = json.loads((out / "runs" / "austen" / "euler-pre-per-layer-seed0" /
                           "config.json").read_text())["model"]
    assert (baseline["weights"], baseline["num_anchors"], baseline["norm_position"]) == (
        "per_layer", budget, "pre")
    # each arm minus the baseline, paired by seed: mean and Student t half-width from the runs
    final = {(p.parent.name): json.loads(p.read_text())["final"]["val_bpc"]
             for p in (out / "runs" / "austen").glob("*/summary.json")}
    diffs = [final[f"heun-post-seed{k}"] - final[f"euler-pre-per-layer-seed{k}"] for k in (0, 1)]
    mean, half = rows["heun post"]["minus_baseline"]
    assert mean == pytest.approx(np.mean(diffs))
    assert half == pytest.approx(stats.t.ppf(0.975, 1) * np.std(diffs, ddof=1) / np.sqrt(2))
    assert rows["euler pre per-layer"]["minus_baseline"] is None
    # and decided at 1 - 0.05 / m, Bonferroni over the m arms compared with the baseline
    m = len(rows) - 1
    decided = rows["heun post"]["versus_baseline"]
    assert decided["comparisons"] == m and decided["level"] == pytest.approx(1 - 0.05 / m)
    wide = stats.t.ppf(1 - 0.05 / m / 2, 1) * np.std(diffs, ddof=1) / np.sqrt(2)
    assert decided["interval"][1] == pytest.approx(wide)
    assert decided["verdict"] == ("better" if mean + wide < 0 else "worse" if mean - wide > 0
                                  else "unresolved")
    assert rows["euler pre per-layer"]["versus_baseline"] is None
    # each arm at the grid's rate with the lowest loss of its short run (none collapses here)
    grid = results["settings"]["lr_grid"]
    for r in rows.values():
        sweep = r["lr_sweep"]
        assert list(sweep) == [f"{v:g}" for v in grid]
        assert r["lr"] == min(grid, key=lambda v: sweep[f"{v:g}"]["val_bpc"])
    tuned = json.loads((out / "runs" / "tune" / "heun-pre-lr0.01" / "config.json").read_text())
    assert tuned["model"]["norm_position"] == "pre" and tuned["lr"] == 0.01
    assert tuned["model"]["head_bias"] is True
    for r in rows.values():
        mean, half = r["val_bpc"]
        assert 0 < mean < 8.5 and math.isfinite(half)  # below log2(256) + a margin, 2 seeds
        assert [t["num_steps"] for t in r["transfer"].values()] == [
            max(1, round(f * r["blocks"])) for f in (0.5, 2.0, 4.0)]
        assert r["train_tokens_per_s"] > 0 and r["inference_tokens_per_s"] > 0
        assert len(r["collapse"]) == 2 and all(-1 <= c <= 1 for c in r["collapse"])
        assert r["collapsed"] == sum(c >= 0.99 for c in r["collapse"])
    adaptive = rows["heun post"]["adaptive"]
    assert adaptive and adaptive[0]["all_finished"] and adaptive[0]["evaluations"][0] >= 2
    assert rows["euler post"]["adaptive"] == []  # no embedded error estimate
    assert rows["heun pre"]["adaptive"] == []  # adaptive depth is on the sphere only
    assert rows["heun ngpt"]["adaptive"]
    ngpt = json.loads((out / "runs" / "tune" / "euler-ngpt-lr0.01" / "config.json").read_text())
    assert ngpt["model"]["update"] == "ngpt" and ngpt["model"]["norm_position"] == "post"
    assert 0 <= results["recall"][0]["accuracy"][0] <= 1
    memory = results["gradient_memory"]  # per added block: only the state with remat
    assert memory["remat"][1] - memory["remat"][0] < memory["no_remat"][1] - memory["no_remat"][0]
    report = (out / "report.md").read_text()
    assert "| euler post | 4 | 4 |" in report and "plain NNX TransformerLM" in report
    assert "## Learning-rate sweep" in report
    for name in ("validation_curves.png", "depth_transfer.png", "adaptive_depth.png"):
        assert (out / name).stat().st_size > 1000
    with open(out / "table.csv") as f:
        table = list(csv.DictReader(f))
    assert [row["design"] for row in table] == list(rows)
    assert all(len(row["final_state_cosine_per_seed"].split()) == 2 for row in table)
    # --report-only rewrites the report from the runs and keeps what the study measured
    # (throughput, gradient memory, run time) instead of timing this machine again
    again = run_script("layer_designs.py", "--quick", "--part", "designs", "--out", str(out),
                       "--no-progress", "--report-only")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "throughput" not in again.stdout
    rewritten = json.loads((out / "results.json").read_text())
    assert {k: v for k, v in rewritten.items() if k != "environment"} == {
        k: v for k, v in results.items() if k != "environment"}


def test_quick_baseline_part(tmp_path):
    """``--part baseline --quick``: the learning-rate sweep over the recipe's grid, the recipe,
    both recall tasks; the report and the figure; run again, it resumes (trains nothing)."""
    from svflow_jax.training.recipes import LR_GRID

    out = tmp_path / "ld"
    proc = run_script("layer_designs.py", "--quick", "--part", "baseline", "--out", str(out),
                      "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (out / "runs").exists()  # the other part
    base = out / "baseline"
    results = json.loads((base / "results.json").read_text())
    assert [row["lr"] for row in results["sweep"]] == list(LR_GRID)
    best = min(results["sweep"], key=lambda row: row["val_bpc"])["lr"]
    assert results["sweep_best_lr"] == best
    assert results["recipe_lr_is_sweep_best"] == (best == results["recipe"]["lr"])
    steps = [row[0] for row in results["curve"]]
    assert steps == sorted(steps) and steps[-1] == results["recipe"]["steps"]
    assert results["final_bpc"] == results["curve"][-1][3] and 0 < results["final_bpc"] < 8.5
    assert results["tokens_per_s"] > 0
    assert set(results["recall"]) == {"recall", "recall1"}
    assert all(0 <= r["val_accuracy"] <= 1 for r in results["recall"].values())
    report = (base / "report.md").read_text()
    assert f"| {results['recipe']['lr']:g} |" in report and "| recall1 |" in report
    assert (base / "curve.png").stat().st_size > 1000
    again = run_script("layer_designs.py", "--quick", "--part", "baseline", "--out", str(out),
                       "--no-progress")
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((base / "results.json").read_text())["final_bpc"] == results["final_bpc"]


def test_quick_depth_part(tmp_path):
    """``--part depth --quick``: Chebyshev weights trained at one depth and at two, evaluated at
    other depths with Richardson ratios; nothing of the other parts is written."""
    out = tmp_path / "ld"
    proc = run_script("layer_designs.py", "--quick", "--part", "depth", "--out", str(out),
                      "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (out / "baseline").exists() and not (out / "results.json").exists()
    results = json.loads((out / "depth" / "results.json").read_text())
    rows = results["rows"]
    assert [(r["design"], r["arm"]) for r in rows] == [
        ("euler", "one depth"), ("euler", "depths N and 2N"), ("euler", "per-layer weights")]
    multiples = results["settings"]["multiples"]
    for r in rows:
        assert len(r["richardson_ratios"]) == len(multiples) - 2
        assert set(r["val_bpc"]) == {"1", "0.5", "2"} and r["order"] == 1
        assert r["adaptive"] == []  # Euler has no error estimate to adapt with
    two = json.loads((out / "depth" / "euler-two-seed0" / "config.json").read_text())
    assert two["extra_depths"] == [2 * rows[0]["blocks"]] and two["model"]["weights"] == "chebyshev"
    base = json.loads((out / "depth" / "euler-perlayer-seed0" / "config.json").read_text())
    assert base["model"]["weights"] == "per_layer" and base["extra_depths"] == []
    assert base["model"]["num_anchors"] == rows[0]["blocks"]
    assert "Richardson ratios" in (out / "depth" / "report.md").read_text()


def _script():
    return import_script("layer_designs.py")


def _part(name: str):
    """A module of the study's package, ``experiments/layer_designs/<name>.py`` (importing the
    script puts the package on ``sys.path``)."""
    _script()
    return importlib.import_module(f"layer_designs.{name}")


def test_verdicts_against_the_baseline_can_fail():
    """The rule that ranks the designs against the trained baseline, on synthetic per-seed
    differences: a clear effect (-0.5 +- 0.01 over 3 seeds) is "better" and its mirror
    "worse"; the same mean scattered over the seeds (sd 0.5) and arms built to lack the effect
    are "unresolved"; and over 2000 families of 14 null arms x 3 seeds, the share of families
    with any decision (the family-wise error rate Bonferroni bounds by 0.05) is at most
    0.05 plus three binomial standard errors. The half-width is SciPy's Student t at
    1 - 0.05 / (2 m)."""
    decide = _part("common").versus_baseline
    rng = np.random.default_rng(0)
    clear = list(-0.5 + 0.01 * rng.standard_normal(3))
    scattered = list(-0.5 + 0.5 * rng.standard_normal(3))
    out = decide({"clear": clear, "mirror": [-v for v in clear], "scattered": scattered,
                  "one seed": [-0.5], "no runs": []})
    assert [out[a]["verdict"] for a in ("clear", "mirror", "scattered", "one seed")] == [
        "better", "worse", "unresolved", "unresolved"]
    assert "no runs" not in out and out["clear"]["comparisons"] == 4
    half = stats.t.ppf(1 - 0.05 / 8, 2) * np.std(clear, ddof=1) / np.sqrt(3)
    assert out["clear"]["interval"] == pytest.approx([np.mean(clear), half])
    families, arms = 2000, 14
    decided = 0
    for _ in range(families):
        null = decide({f"arm{i}": list(rng.standard_normal(3)) for i in range(arms)})
        decided += any(v["verdict"] != "unresolved" for v in null.values())
    rate = decided / families
    assert rate <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / families), rate


def _summary(seed, bpc, seconds_per_step, collapse=0.1):
    """A run_design summary whose validation curve is ``bpc(step)`` at steps 50 and 100, logged
    every 10 steps at ``seconds_per_step``."""
    history = [{"step": s, "tokens": 40 * s, "seconds": seconds_per_step * s}
               for s in range(10, 101, 10)]
    for row in history:
        if row["step"] % 50 == 0:
            row["val_bpc"] = bpc(row["step"])
    return {"seed": seed, "final": {"val_bpc": bpc(100)}, "history": history,
            "train_seconds": seconds_per_step * 100, "collapse": collapse,
            "parameters": 7, "lr": 1e-3}


def test_recipe_comparison_pairs_seeds_at_equal_steps_and_equal_time():
    """Designs at the recipe's size against the recipe, on synthetic curves with known
    answers: an arm twice as slow per step (its step and the recipe's timed side by side)
    reaches step 50 in the recipe's time (100 s), so its equal-time difference is its curve at
    50 minus the recipe's at 100 (read linearly between validations); the equal-steps
    difference is the final one; both decided at 1 - 0.05 / m with m = 4 (two arms, two
    comparisons each); an arm equal to the recipe up to noise of either sign is unresolved."""
    compare = _part("recipe").recipe_comparison
    noise = [0.004, -0.003, 0.001]
    recipe = {k: _summary(k, lambda s, k=k: 3.0 - s / 100 + 0.01 * k, 1.0) for k in range(3)}
    slow = {k: _summary(k, lambda s, k=k: 2.9 - s / 100 + 0.01 * k + noise[k], 2.0)
            for k in range(3)}
    null = {k: _summary(k, lambda s, k=k: 3.0 - s / 100 + 0.01 * k + noise[k], 1.0)
            for k in range(3)}
    speed = {"tokens_per_s": {arm: {"train_tokens_per_s": 40 / seconds} for arm, seconds in
                              (("recipe", 1.0), ("slow", 2.0), ("null", 1.0), ("one", 0.5))}}
    out = compare({"recipe": recipe, "slow": slow, "null": null}, "recipe", speed)
    v = out["verdicts"]
    assert list(v) == ["slow, equal steps", "slow, equal time", "null, equal steps",
                       "null, equal time"]
    steps = [-0.1 + n for n in noise]
    time = [(2.9 - 0.5 + n) - (3.0 - 1.0) for n in noise]  # arm at step 50, recipe at 100
    assert v["slow, equal steps"]["differences"] == pytest.approx(steps)
    assert v["slow, equal time"]["differences"] == pytest.approx(time)
    half = stats.t.ppf(1 - 0.05 / 8, 2) * np.std(steps, ddof=1) / np.sqrt(3)
    assert v["slow, equal steps"]["interval"] == pytest.approx([np.mean(steps), half])
    assert [x["verdict"] for x in v.values()] == ["better", "worse", "unresolved",
                                                 "unresolved"]
    assert all(x["comparisons"] == 4 for x in v.values())
    rows = {r["arm"]: r for r in out["arms"]}
    assert rows["slow"]["equal_time"] == {"seconds": 100.0, "step": 50.0,
                                          "baseline_step": 100.0}
    assert rows["slow"]["minutes"] == pytest.approx(200 / 60)
    assert rows["slow"]["tokens_per_s"] == pytest.approx(4000 / 200)
    assert rows["recipe"]["collapsed"] == 0 and "equal_time" not in rows["recipe"]
    # a collapsed seed is counted; one paired seed leaves the arm unresolved; an arm twice as
    # fast per step (timed side by side, whatever its run's own clock said) is read at its last
    # step against the recipe's at 50
    one = compare({"recipe": recipe, "one": {0: _summary(0, lambda s: 1.0, 1.0, 0.995)}},
                  "recipe", speed)
    assert {r["arm"]: r["collapsed"] for r in one["arms"]} == {"recipe": 0, "one": 1}
    assert one["arms"][1]["equal_time"] == {"seconds": 50.0, "step": 100.0,
                                            "baseline_step": 50.0}
    assert one["verdicts"]["one, equal time"]["differences"] == pytest.approx([1.0 - 2.5])
    assert {x["verdict"] for x in one["verdicts"].values()} == {"unresolved"}


def test_recipe_arms_with_weights_continuous_in_depth_are_refined():
    """An arm whose weights are continuous in depth is run at 1/2 (where that leaves a block),
    2, 4 and 8 times its blocks, with Richardson ratios at 1, 2, 4 and 8 times; a per-layer
    arm is not. The report's table gives each seed's values, the change from the trained
    depth, and the ratio ``2^p`` of the arm's method (RK4: 16)."""
    script = _part("recipe")
    from svflow_jax.training.recipes import recipe

    base = recipe("austen").resolved().model
    arms = script.RECIPE["arms"]
    assert script.refinement(base) == {"transfer_factors": ()}
    rk4 = base.replace(**arms["rk4 pre"]["model"])
    euler = base.replace(**arms["euler pre, linear weights"]["model"])
    assert script.refinement(rk4) == {"transfer_factors": (2.0, 4.0, 8.0),
                                      "richardson_multiples": (1, 2, 4, 8)}
    assert script.refinement(euler)["transfer_factors"] == (0.5, 2.0, 4.0, 8.0)

    speed = {"tokens_per_s": {arm: {"train_tokens_per_s": 40.0} for arm in ("recipe", "rk4 pre")}}
    runs = {"recipe": {0: _summary(0, lambda s: 2.0, 1.0)},
            "rk4 pre": {0: {**_summary(0, lambda s: 2.0, 1.0), "num_steps": 1,
                            "transfer": [{"factor": 2.0, "num_steps": 2, "bpc": 3.0,
                                          "loss": 2.1, "evaluations": 8}],
                            "richardson": {"ratios": [0.5, 1.25]}}}}
    results = script.recipe_comparison(runs, "recipe", speed)
    rows = {r["arm"]: r for r in results["arms"]}
    assert "refinement" not in rows["recipe"]
    assert rows["rk4 pre"]["refinement"] == {0: {
        "num_steps": 1, "val_bpc": 2.0, "ratios": [0.5, 1.25],
        "transfer": [{"factor": 2.0, "num_steps": 2, "bpc": 3.0}]}}
    results["settings"] = {"arms": arms, "recipe": recipe("austen").to_json()}
    lines = script._refinement_lines(results)
    assert lines[-1] == "| rk4 pre, 0 | 1: 2.000 | 2: 3.000 (+50.0%) | 0.50, 1.25 (16) |"
    assert script._refinement_lines({**results, "arms": [rows["recipe"]]}) == []


def test_recipe_arms_spend_the_recipes_evaluations_with_its_parameters():
    """Equal compute at the recipe's size: every arm of ``RECIPE`` spends the recipe's field
    evaluations per forward pass (counted at run time by ``solvers.evaluations``) with its
    parameters, up to the head's bias (256) and nGPT's rates (2 x 4 x 192); every design of the
    comparison but the two that cannot spend exactly 4 evaluations (Strang, Crouch-Grossman 3)
    has an arm."""
    from flax import nnx

    from svflow_jax import solvers
    from svflow_jax.designs import SolverLM
    from svflow_jax.training.compare import count_parameters
    from svflow_jax.training.recipes import recipe

    arms = _part("recipe").RECIPE["arms"]
    base = recipe("austen").resolved().model

    def cost(model):
        spent = solvers.evaluations(solvers.CATALOGUE[model.design], model.num_steps,
                                    model.norm_position)
        size = count_parameters(nnx.eval_shape(lambda: SolverLM(model, rngs=nnx.Rngs(0))))
        return spent, size

    spent, size = cost(base)
    assert spent == 4
    for arm, spec in arms.items():
        model = base.replace(**spec["model"])
        extra = 256 * model.head_bias + (2 * 4 * 192 if model.update == "ngpt" else 0)
        assert cost(model) == (spent, size + extra), arm
    designs = {base.replace(**spec["model"]).design for spec in arms.values()}
    assert set(_part("common").DEFAULT["designs"]) - designs == {"strang", "crouch-grossman3"}


def test_quick_recipe_part(tmp_path):
    """``--part recipe --quick``: the recipe and the post-norm arm at a CI size, 2 seeds; seed 0
    at every rate of the arm's grid, seed 1 at the rate with the lowest final loss; the
    comparison recomputed from the runs' own summaries; ``--report-only`` writes the same."""
    out = tmp_path / "ld"
    proc = run_script("layer_designs.py", "--quick", "--part", "recipe", "--out", str(out),
                      "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    part = out / "recipe"
    names = sorted(p.name for p in (part / "runs").iterdir())
    seed0 = {lr: json.loads((part / "runs" / f"euler-post-lr{lr}-seed0" / "summary.json")
                            .read_text()) for lr in ("0.002", "0.004")}
    best = min(seed0, key=lambda lr: seed0[lr]["final"]["val_bpc"])
    assert names == sorted(["recipe-lr0.002-seed0", "recipe-lr0.002-seed1",
                            "euler-post-lr0.002-seed0", "euler-post-lr0.004-seed0",
                            f"euler-post-lr{best}-seed1"])
    config = json.loads((part / "runs" / f"euler-post-lr{best}-seed1" / "config.json")
                        .read_text())
    assert (config["lr"], config["seed"]) == (float(best), 1)
    assert (config["model"]["norm_position"], config["model"]["head_bias"]) == ("post", True)
    results = json.loads((part / "results.json").read_text())
    summaries = {p.parent.name: json.loads(p.read_text())
                 for p in (part / "runs").glob("*/summary.json")}
    diffs = [summaries[f"euler-post-lr{best}-seed{k}"]["final"]["val_bpc"]
             - summaries[f"recipe-lr0.002-seed{k}"]["final"]["val_bpc"] for k in (0, 1)]
    v = results["verdicts"]["euler post, equal steps"]
    assert v["differences"] == pytest.approx(diffs) and v["comparisons"] == 2
    assert list(results["verdicts"]) == ["euler post, equal steps", "euler post, equal time"]
    rows = {r["arm"]: r for r in results["arms"]}
    assert rows["euler post"]["lr"] == float(best)
    assert rows["euler post"]["val_bpc"] == {
        str(k): summaries[f"euler-post-lr{best}-seed{k}"]["final"]["val_bpc"] for k in (0, 1)}
    assert [s["lr"] for s in results["sweep"]["euler post"]] == [0.002, 0.004]
    rate = {arm: r["train_tokens_per_s"] for arm, r in results["speed"]["tokens_per_s"].items()}
    assert set(rate) == {"recipe", "euler post"}
    assert rows["euler post"]["equal_time"]["step"] == pytest.approx(
        10 * min(1.0, rate["euler post"] / rate["recipe"]))
    report = (part / "report.md").read_text()
    assert "| euler post, equal steps |" in report and "m = 2 comparisons" in report
    # the legend directly under the verdict table
    assert report.split("| euler post, equal time |", 1)[1].split("\n", 2)[2].startswith(
        "*Legend.* Columns:") and f"1 - {_part('common').ALPHA:g}/m" in report
    assert (part / "curves.png").stat().st_size > 1000
    again = run_script("layer_designs.py", "--quick", "--part", "recipe", "--out", str(out),
                       "--no-progress", "--report-only")
    assert again.returncode == 0, again.stderr[-2000:]
    rewritten = json.loads((part / "results.json").read_text())
    assert {k: x for k, x in rewritten.items() if k != "environment"} == {
        k: x for k, x in results.items() if k != "environment"}
