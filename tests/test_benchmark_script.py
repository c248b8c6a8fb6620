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

    training = result["training"]  # svflow train's step, on the smoke test's tiny model
    # the recipe's step, and the same step with each other choice of what the backward recomputes
    remat = training["model"]["remat"]
    assert set(training["median_s"]) == {"forward", "gradient", "step"} | {
        f"step, remat={r}" for r in (True, "dots", False) if r != remat}
    assert training["flops"]["step"] == 3 * training["flops"]["forward"] > 0
    assert all(0 < v for v in training["fraction_of_f32_matmul"].values())
    assert training["tokens_per_s"] > 0 and training["model"]["design"] == "euler"
    assert {g["dtype"] for g in result["solve_gradient"]} == {"float32", "float64"}
    for g in result["solve_gradient"]:
        assert set(g["gflops"]) == {"solve", "solve_gradient"}
        assert g["flops"]["solve_gradient"] == 3 * g["flops"]["solve"]


def _benchmark_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_flop_counts_match_a_hand_count():
    """The training step's matmul flops on a small model, counted by hand: widths d = 8, two
    heads of 4, d_ff = 16, 3 blocks of one evaluation, vocabulary 10, 2 sequences of 4 tokens.
    Per evaluation and sequence: Q, K, V 3 x 2*4*8*8 = 1536, W_O 2*4*8*8 = 512, scores and
    P V 2 x 2*2*4^2*4 = 512, FFN 2 x 2*4*8*16 = 2048: 4608; the stack 2*3*4608 = 27648; the
    head 2 x 2*4*8*10 = 1280."""
    bench = _benchmark_module()
    model = bench.DesignConfig(d_model=8, n_heads=2, d_head=4, d_ff=16, num_steps=3,
                               num_anchors=3, vocab_size=10, context=4)
    assert bench.evaluation_flops(4, 8, 2, 4, 16) == 4608
    assert bench.lm_flops(model, 2, 4, 1) == {
        "forward": 28928, "step": 3 * 28928, "step_with_remat": 3 * 28928 + 27648}
    assert bench.lm_flops(model.replace(remat=False), 2, 4, 1)["step_with_remat"] == 3 * 28928
    assert bench.lm_flops(model, 2, 4, 4)["forward"] == 4 * 27648 + 1280  # e.g. RK4: 4 per step
    # the solve's gradient: three forward passes of the same stack (L = 3 layers, d_ff = 4 d)
    cfg = bench.make_config(8, 3, "float32")
    assert bench.solve_gradient_flops(4, cfg) == 3 * bench.forward_flops(4, cfg) == 3 * 3 * (
        1536 + 512 + 2 * 2 * 4 * 4**2 * 2 + 2 * 2 * 4 * 8 * 32)


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
