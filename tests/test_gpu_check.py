"""``experiments/gpu_check.sh``, the first thing to run on a GPU: its steps and its refusal of bad
arguments, checked on a CPU through its dry run (the checks themselves need a GPU)."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "gpu_check.sh"


def _run(*args, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=SCRIPT.parents[1])


def test_dry_run_lists_the_checks_in_order(tmp_path):
    proc = _run("--dry-run", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    steps = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert list(steps) == ["gpu", "verify-quick", "verify", "peer-large", "train"]
    assert "default_backend() == 'gpu'" in steps["gpu"]
    assert "svflow_jax verify --quick" in steps["verify-quick"]
    assert "svflow_jax verify --no-progress" in steps["verify"]
    assert "--device cuda --sizes 8x1024x1024:16" in steps["peer-large"]
    assert "svflow_jax train --steps" in steps["train"]
    assert all(str(tmp_path / "out") in command for name, command in steps.items()
               if name != "gpu")
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@pytest.mark.parametrize("args", [["--bad"], ["a", "b"]])
def test_bad_arguments_exit_2(args):
    proc = _run(*args)
    assert proc.returncode == 2 and "usage:" in proc.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine would run "
                    "every check")
def test_without_a_gpu_it_stops_at_the_first_step_and_fails(tmp_path):
    proc = _run(str(tmp_path))
    assert proc.returncode == 1
    status = (tmp_path / "status.tsv").read_text().splitlines()
    assert status[0] == "step\tstatus\tseconds" and status[1].startswith("gpu\t")
    assert len(status) == 2  # nothing ran on the CPU in the GPU's place
    assert (tmp_path / "summary.txt").exists()
