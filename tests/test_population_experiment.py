"""``experiments/diagnose_population.py`` refuses bad options (exit 2, naming the option) before
it trains anything."""

import pytest
from scripts_for_tests import ROOT, assert_refused, run_script


@pytest.mark.parametrize(("bad", "named"), [
    (["--steps", "100", "0"], "argument --steps: must be a positive integer"),
    (["--lr", "nan"], "argument --lr: must be a finite positive number"),
    (["--batch", "0"], "argument --batch"),
    (["--windows", "-2"], "argument --windows"),
    (["--seed", "-1"], "argument --seed: must be a non-negative integer"),
    (["--train-text", "no/such/file.txt"], "no such file"),
])
def test_bad_options_exit_2(tmp_path, bad, named):
    proc = run_script("diagnose_population.py", "--train-text", str(ROOT / "README.md"),
                      "--out", str(tmp_path / "p"), *bad, timeout=120)
    assert_refused(proc, named, tmp_path / "p")
