"""The ``svflow verify`` pipeline: order fitting, determinism, the CLI end to end."""

import json
import math
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from svflow_jax import cli, verify


def test_fit_order_recovers_a_known_slope_and_interval():
    rng = np.random.default_rng(0)
    h = np.geomspace(1e-3, 1e-1, 8)
    exact = verify.fit_order(h, 3.0 * h**2.0)
    assert abs(exact["fitted_order"] - 2.0) < 1e-12
    assert exact["fit_points"] == 8
    # only h <= max_step enters the fit (coarse steps are pre-asymptotic)
    assert verify.fit_order(h, 3.0 * h**2.0, max_step=1e-2)["fit_points"] == 4
    noisy = verify.fit_order(h, 1e-3 * h * np.exp(0.05 * rng.standard_normal(8)))
    lo, hi = noisy["order_ci"]
    assert lo < 1.0 < hi and hi - lo < 0.2
    # points outside [floor, ceiling] are excluded: round-off plateau does not bend the fit
    plateau = verify.fit_order(h, np.maximum(1e1 * h**4, 1e-14))
    assert abs(plateau["fitted_order"] - 4.0) < 1e-9


def test_fit_order_with_too_few_points_is_nan_and_fails():
    fit = verify.fit_order([0.1, 0.05], [1e-14, 1e-15])
    assert math.isnan(fit["fitted_order"])
    assert not verify.order_passes("euler", fit["fitted_order"], 1)


def test_step_counts_are_distinct_and_span_two_decades():
    for first, last in verify.STEP_RANGES.values():
        counts = verify.step_counts(first, last)
        assert len(counts) == 8 and len(set(counts)) == 8
        assert counts[-1] / counts[0] >= 100


def test_sweep_is_deterministic_and_converges():
    problem = verify.smooth_problem(seed=3, n=3, d=5, anchors=3)
    reference = verify.reference_solution(problem)
    runs = [verify.convergence_sweep(problem, ["euler", "heun"], reference, repeats=1)
            for _ in range(2)]
    strip = lambda rows: [[{k: v for k, v in p.items() if k != "seconds"}  # noqa: E731
                           for p in r["points"]] for r in rows]
    assert strip(runs[0]) == strip(runs[1])
    assert [r["passed"] for r in runs[0]] == [True, True]
    # the same seed gives the same problem
    again = verify.smooth_problem(seed=3, n=3, d=5, anchors=3)
    np.testing.assert_array_equal(again.x0, problem.x0)


def test_exactness_rows_pass_in_float64():
    rows = verify.exactness_table(seed=1, n=3, d=4, layers=2)
    assert [r["variant"] for r in rows] == list(verify.EXACTNESS_VARIANTS)
    for r in rows:
        assert r["passed"] and r["max_abs_diff"] <= 1e-12, r


def test_exactness_tolerance_is_stated():
    assert verify.exactness_tolerance(jnp.float64, 8, 16) == 1e-12
    assert verify.exactness_tolerance(jnp.float32, 8, 16) == pytest.approx(
        64 * 8 * 2**-23 * 4)


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["verify", "--dim", "1"])
    assert err.value.code == 2
    assert "--dim must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        cli.main(["verify", "--help"])
    assert err.value.code == 0


def test_verify_quick_end_to_end(tmp_path):
    """The README's main job, in a fresh process (as a user runs it), on --quick."""
    out = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "svflow_jax", "verify", "--quick", "--out", str(out),
         "--no-progress"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] is True
    assert {"variant", "max_abs_diff", "tolerance", "passed"} <= set(summary["exactness"][0])
    assert len(summary["exactness"]) == 7
    solvers = {r["solver"] for r in summary["convergence"]}
    assert solvers == set(verify.SOLVERS)
    for row in summary["convergence"]:
        assert {"solver", "expected_order", "fitted_order", "order_ci", "passed"} <= set(row)
        assert len(row["points"]) >= 8
        assert row["max_norm_drift"] < 1e-12  # every retracted solve stays on the sphere
    for name in ["report.md", "config.json", "convergence.png", "work_precision.png",
                 "drift.png", "prenorm_vs_postnorm.png", "exactness.csv", "convergence.csv"]:
        assert (out / name).stat().st_size > 0, name
    assert "PASS" in (out / "report.md").read_text()


def test_sweep_cli_writes_one_json_per_solver_and_resumes(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--solvers", "euler", "heun", "--steps", "8", "64", "--num-sizes", "4",
            "--tokens", "3", "--dim", "4", "--repeats", "1", "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    first = json.loads((out / "heun.json").read_text())
    assert [p["num_steps"] for p in first["points"]] == [8, 16, 32, 64]
    assert abs(first["fitted_order"] - 2) < 0.15
    # resume: a finished solver is read back, not recomputed (its file is left untouched)
    mtime = (out / "heun.json").stat().st_mtime_ns
    assert cli.main(argv) == 0
    assert (out / "heun.json").stat().st_mtime_ns == mtime
    # another configuration in the same folder is refused rather than mixed in
    assert cli.main([*argv[:-3], "--seed", "5", "--out", str(out), "--no-progress"]) == 2
    assert cli.main(["sweep", "--solvers", "nope", "--out", str(tmp_path / "x")]) == 2
    capsys.readouterr()


def test_float32_runs_against_a_float64_reference():
    """float32 states, float64 reference; orders that round-off hides are 'unresolved'."""
    problem = verify.smooth_problem(seed=2, n=3, d=4, anchors=2, dtype=jnp.float32)
    reference = verify.reference_solution(problem)
    assert reference.dtype == jnp.float64
    rows = verify.convergence_sweep(problem, ["euler", "dopri8"], reference, repeats=1)
    euler, dopri8 = rows
    assert euler["resolved"] and euler["passed"]  # first order is visible above 1e-4
    # eighth order drops below float32's floor within a few steps: not a failure, not a pass
    assert not dopri8["resolved"] and dopri8["passed"] is None
    rows = verify.exactness_table(seed=1, n=3, d=4, layers=2, dtype=jnp.float32)
    assert all(r["passed"] and r["tolerance"] > 1e-6 for r in rows)
