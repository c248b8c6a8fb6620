"""``experiments/diagnose_population.py`` refuses bad options (exit 2, naming the option) before
it trains anything."""

import pytest
from scripts_for_tests import assert_refused, run_script


@pytest.mark.parametrize(("bad", "named"), [
    (["--steps", "0"], "argument --steps: must be a positive integer"),
    (["--lr", "nan"], "argument --lr: must be a finite positive number"),
    (["--batch", "0"], "argument --batch"),
    (["--windows", "-2"], "argument --windows"),
    (["--windows", "8"], "argument --windows: must be a multiple of 6"),
    (["--seeds", "-1"], "argument --seeds: must be a non-negative integer"),
    (["--sizes", "huge"], "argument --sizes: invalid choice"),
    (["--level", "0"], "argument --level: must be a number in (0, 1]"),
    (["--held-out", "0.9"], "argument --held-out"),
    (["--sizes", "d32-L1", "--seeds", "0", "1"], "at least 3 models"),
])
def test_bad_options_exit_2(tmp_path, bad, named):
    proc = run_script("diagnose_population.py", "--out", str(tmp_path / "p"), *bad, timeout=120)
    assert_refused(proc, named, tmp_path / "p")
