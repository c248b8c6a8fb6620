"""Smoke test of ``experiments/benchmark.py``: it runs and writes the documented JSON.

Only the structure is checked, never a timing: timings on a shared machine are noise, which is
why the benchmark is a script run by hand. The script runs in a subprocess so that its
``jax_enable_x64`` switch and its compilations stay out of this test process.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
from scripts_for_tests import assert_refused, run_script

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "benchmark.py"

RUN_KEYS = {
    "n", "d", "L", "dtype", "median_s", "min_s", "samples_s", "compile_s", "ratios",
    "targets_met", "ratios_of_medians", "diagnostic_ratios", "flops", "gflops",
    "matmul_f32_side_by_side", "fraction_of_f32_matmul", "agreement",
}
CONTENDERS = {"transformer", "diffrax", "reference"}  # the ones with targets
TIMED = CONTENDERS | {"flow_scan"}  # plus the diagnostic


def test_benchmark_smoke_writes_documented_json(tmp_path):
    # The script's main() in a fresh interpreter, with the arguments of a command line.
    code = (
        f"import sys; sys.path.insert(0, {str(SCRIPT.parent)!r}); import benchmark; "
        f"benchmark.main(['--smoke', '--out', {str(tmp_path)!r}])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
        cwd=SCRIPT.parents[1],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    result = json.loads((tmp_path / "benchmark.json").read_text())
    assert {
        "schema", "created", "mode", "settings", "machine", "targets", "matmul", "runs",
        "compile_vs_depth", "summary",
    } <= set(result)
    assert result["mode"] == "smoke"
    assert {"versions", "devices", "cpu_count", "xla_flags"} <= set(result["machine"])
    assert result["machine"]["versions"]["jax"] == importlib.metadata.version("jax")
    assert result["matmul"]["float32"]["gflops"] > 0

    runs = result["runs"]
    assert {r["dtype"] for r in runs} == {"float32", "float64"}
    for run in runs:
        assert RUN_KEYS <= set(run)
        assert set(run["median_s"]) == TIMED
        assert set(run["compile_s"]) == TIMED
        assert set(run["ratios"]) == {"transformer/reference", "diffrax/reference"}
        assert all(isinstance(v, bool) for v in run["targets_met"].values())
        assert run["agreement"]["ok"], run["agreement"]  # the three compute the same function

    depth = result["compile_vs_depth"]
    assert depth["depths"] == [4, 8]
    for name in CONTENDERS:
        assert set(depth[name]) == {"4", "8"}
        assert depth[name]["8"]["total_s"] > 0
    assert set(depth["ratios"]) == CONTENDERS
    assert {"all_targets_met", "missed", "agreement_ok"} <= set(result["summary"])


@pytest.mark.parametrize(("bad", "named"), [
    (["--repeats", "0"], "argument --repeats: must be a positive integer"),
    (["--compile-repeats", "-1"], "argument --compile-repeats"),
    (["--min-sample", "0"], "argument --min-sample: must be a finite positive number"),
    (["--min-sample", "nan"], "argument --min-sample"),
    (["--seed", "-1"], "argument --seed: must be a non-negative integer"),
])
def test_bad_options_exit_2_before_timing(tmp_path, bad, named):
    proc = run_script("benchmark.py", "--out", str(tmp_path / "b"), *bad, timeout=120)
    assert_refused(proc, named, tmp_path / "b")
