"""``experiments/peer_benchmark.py``: argument checks, the project's side alone (no torch), and,
where torch and torchdiffeq are installed (the ``peer`` extra; CI does not install them), a
``--quick`` run against them that must agree before it times anything.

Only structure and agreement are checked, never a timing. The script runs in subprocesses (its
workers), so its ``jax_enable_x64`` switch and compilations stay out of this process.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "peer_benchmark.py"
sys.path.insert(0, str(SCRIPT.parent))
import peer_benchmark  # noqa: E402

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "torchdiffeq"))


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--rounds", "0"], "--rounds must be >= 1, got 0"),
     (["--dtypes", "float16"], "--dtypes must be among ('float32', 'float64'), got ['float16']"),
     (["--cases", "nope"], "got ['nope']"),
     (["--min-sample", "-1"], "--min-sample must be >= 0, got -1.0"),
     (["--dtypes", ""], "--dtypes must be among ('float32', 'float64'), got []"),
     (["--sizes", "8x6"], "--sizes"),
     (["--sizes", "8"], "--sizes"),
     (["--sizes", "ax16"], "--sizes"),
     (["--sizes", "2x8x16x4"], "--sizes"),
     (["--sizes", "8x16:3"], "--sizes"),
     (["--sizes", "0x8x16"], "--sizes"),
     (["--device", "tpu"], "--device"),
     (["--tf32"], "--tf32")],
)
def test_bad_arguments_are_refused(argv, named, capsys):
    with pytest.raises(SystemExit, match="^2$"):  # SystemExit's text is its code
        peer_benchmark.parse_args(argv)
    assert named in capsys.readouterr().err


def test_arguments_defaults():
    args = peer_benchmark.parse_args(["--quick"])
    assert args.dtypes == ["float32", "float64"] and args.cases == list(peer_benchmark.CASES)
    assert args.device == "cpu" and not args.tf32
    assert set(peer_benchmark.GRADIENT_CASES) <= set(peer_benchmark.CASES)
    assert peer_benchmark.parse_args(["--sizes", "8x16,32x64"]).sizes == [(1, 8, 16, 4),
                                                                         (1, 32, 64, 4)]
    assert peer_benchmark.parse_args(["--sizes", "8x1024x1024:16"]).sizes == [
        peer_benchmark.LARGE]


def test_gpu_arguments():
    """On a GPU the torch.compile peer joins the default cases; TF32 only when asked."""
    args = peer_benchmark.parse_args(["--device", "cuda"])
    assert args.cases == list(peer_benchmark.ALL_CASES) and not args.tf32
    assert "fwd_rk4_compiled" in args.cases and "fwd_rk4_compiled" not in peer_benchmark.CASES
    assert peer_benchmark.parse_args(["--device", "cuda", "--tf32"]).tf32
    assert peer_benchmark.LARGE == (8, 1024, 1024, 16)


def test_workers_compute_on_the_chosen_device(monkeypatch):
    """The JAX worker's backend follows --device whatever the caller's JAX_PLATFORMS; the
    torch worker's environment is the caller's."""
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert peer_benchmark.worker_env("jax", "cuda")["JAX_PLATFORMS"] == "cuda"
    assert peer_benchmark.worker_env("jax", "cpu")["JAX_PLATFORMS"] == "cpu"
    assert peer_benchmark.worker_env("torch", "cuda")["JAX_PLATFORMS"] == "cpu"
    flags = peer_benchmark.worker_env("jax", "cpu", "--xla_cpu_use_xnnpack=true")["XLA_FLAGS"]
    assert flags.endswith("--xla_cpu_use_xnnpack=true")


def test_a_failed_case_is_reported_not_compared():
    out = {"fwd_rk4/y": np.ones(3)}
    agree = peer_benchmark.agreement(out, out, "float32", ["fwd_rk4", "grad_rk4"],
                                     failed={"grad_rk4": {"torch": "OutOfMemoryError: ..."}})
    assert agree["fwd_rk4"] == {"relative_error": 0.0, "tolerance": 1e-4, "ok": True}
    assert agree["grad_rk4"]["ok"] is False and "torch" in agree["grad_rk4"]["failed"]


def _run(tmp_path, *argv) -> dict:
    code = (
        f"import sys; sys.path.insert(0, {str(SCRIPT.parent)!r}); import peer_benchmark; "
        f"peer_benchmark.main({[*argv, '--out', str(tmp_path)]!r})"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=1200, cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "peer_benchmark.md").read_text().startswith("Peer benchmark")
    return json.loads((tmp_path / "peer_benchmark.json").read_text())


def test_project_side_alone_runs_without_torch(tmp_path):
    """Today's size and a batched one with other heads (the large size's shape, scaled down)."""
    cases = ["fwd_rk4", "grad_rk4", "train_step", "fwd_rk4_compiled"]
    result = _run(tmp_path, "--quick", "--jax-only", "--dtypes", "float32", "--rounds", "1",
                  "--cases", ",".join(cases), "--sizes", "8x16,2x8x16:2")
    assert [(r["batch"], r["heads"]) for r in result["runs"]] == [(1, 4), (2, 2)]
    assert result["device"] == "cpu" and result["workers"]["jax"]["device"] == "cpu:0"
    for run in result["runs"]:
        assert set(run["cases"]) == set(cases)
        for case in cases:
            assert run["cases"][case]["median_s"]["jax"] > 0
        assert run["cases"]["grad_rk4"]["memory"]["jax"]["xla_temp_bytes"] > 0
    batched = np.load(tmp_path / "outputs_jax_b2_n8_d16_h2_float32.npz")["fwd_rk4/y"]
    assert batched.shape == (2, 8, 16)
    assert np.allclose(np.linalg.norm(batched, axis=-1), 1, atol=1e-5)  # on the sphere


@pytest.mark.skipif(not HAVE_TORCH, reason="torch and torchdiffeq not installed (pip install "
                    "-e '.[peer]'); CI does not install them")
def test_quick_against_torch_agrees_and_writes_ratios(tmp_path):
    result = _run(tmp_path, "--quick", "--dtypes", "float64", "--rounds", "1", "--no-memory")
    assert result["summary"]["agreement_ok"], result["runs"]
    assert {"torch", "torchdiffeq", "jax"} <= set(result["versions"])
    (run,) = result["runs"]
    for case, entry in run["cases"].items():
        assert entry["agreement"]["ok"], (case, entry["agreement"])
        assert entry["ratio_torch_over_project"] > 0


PEER_GOLDEN = Path(__file__).parent / "golden" / "peer"


@pytest.mark.parametrize("dtype", peer_benchmark.DTYPES)
def test_project_agrees_with_stored_torch_outputs(dtype):
    """Every agreement case of the peer benchmark, at its ``--quick`` size, against PyTorch's
    and torchdiffeq's outputs stored in ``tests/golden/peer`` (``experiments/make_peer_golden.py``;
    torch 2.13.0, torchdiffeq 0.2.5), with the benchmark's own tolerances: runs without torch."""
    provenance = json.loads((PEER_GOLDEN / "provenance.json").read_text())
    assert provenance["cases"] == list(peer_benchmark.CASES)
    with np.load(PEER_GOLDEN / "inputs.npz") as f:
        inputs = dict(f)
    with np.load(PEER_GOLDEN / f"torch_{dtype}.npz") as f:
        theirs = dict(f)
    cases, outputs = peer_benchmark.jax_cases(inputs, dtype, provenance["steps"],
                                              provenance["layers"], provenance["tol"])
    ours = {}
    for case in provenance["cases"]:  # fwd_rk4_compiled is fwd_rk4 on the project's side
        fn, args = cases[case]
        for name, a in outputs(case, fn(*args)).items():
            ours[f"{case}/{name}"] = a
    assert sorted(ours) == sorted(theirs)
    agree = peer_benchmark.agreement(ours, theirs, dtype)
    for case, entry in agree.items():
        print(f"FIGURE | peer agreement {dtype} | {case} | {entry['relative_error']:.2e} "
              f"(tolerance {entry['tolerance']:.0e})")
    assert all(entry["ok"] for entry in agree.values()), agree
    # two implementations, not one: the fixed-step float64 cases agree to round-off, not bits
    assert max(agree[c]["relative_error"] for c in ("fwd_rk4", "grad_rk4", "train_step")) > 0
