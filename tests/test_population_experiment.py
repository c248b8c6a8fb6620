"""``experiments/diagnose_population.py`` refuses bad options (exit 2, naming the option) before
it trains anything."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("bad", "named"), [
    (["--steps", "100", "0"], "argument --steps: must be a positive integer"),
    (["--lr", "nan"], "argument --lr: must be a finite positive number"),
    (["--batch", "0"], "argument --batch"),
    (["--windows", "-2"], "argument --windows"),
    (["--seed", "-1"], "argument --seed: must be a non-negative integer"),
    (["--train-text", "no/such/file.txt"], "no such file"),
])
def test_bad_options_exit_2(tmp_path, bad, named):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    argv = ["--train-text", str(ROOT / "README.md"), "--out", str(tmp_path / "p"), *bad]
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "diagnose_population.py"),
                           *argv], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert named in proc.stderr
    assert not (tmp_path / "p").exists()
