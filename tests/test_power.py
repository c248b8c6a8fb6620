"""experiments/power.py against simulation: the power of the paired t-test and of TOST is the
rejection rate of the very test on simulated normal differences (an independent computation:
the analytic values come from the noncentral t and a chi integral), and Holm's rule on both
sides of each of its thresholds."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import power  # noqa: E402

SIMS = 40_000  # binomial standard error of a rate p: sqrt(p (1 - p) / SIMS) <= 0.0025


def _simulated(delta, sigma, n, alpha, rng):
    d = rng.normal(delta, sigma, size=(SIMS, n))
    t = d.mean(1) / (d.std(1, ddof=1) / np.sqrt(n))
    return np.mean(np.abs(t) > stats.t.ppf(1 - alpha / 2, n - 1))


@pytest.mark.parametrize(("delta", "sigma", "n"), [(0.02, 0.018, 12), (0.02, 0.009, 3),
                                                   (0.0, 0.01, 5)])
def test_paired_t_power_is_the_simulated_rejection_rate(delta, sigma, n):
    rng = np.random.default_rng(0)
    alpha = 0.05 / 3
    expected = _simulated(delta, sigma, n, alpha, rng)
    ours = power.paired_t_power(delta, sigma, n, alpha)
    assert abs(ours - expected) <= 5 * np.sqrt(max(expected * (1 - expected), 1e-4) / SIMS)
    if delta == 0:  # the level itself
        assert ours == pytest.approx(alpha, rel=1e-9)


def test_seeds_for_power_is_the_first_n_that_reaches_the_target():
    n = power.seeds_for_power(0.02, 0.018, 0.05 / 3)
    assert power.paired_t_power(0.02, 0.018, n, 0.05 / 3) >= 0.8
    assert power.paired_t_power(0.02, 0.018, n - 1, 0.05 / 3) < 0.8


def test_tost_power_is_the_simulated_rate():
    rng = np.random.default_rng(1)
    n, sigma, margin, alpha = 8, 0.018, 0.02, 0.05
    d = rng.normal(0.005, sigma, size=(SIMS, n))
    se = d.std(1, ddof=1) / np.sqrt(n)
    c = stats.t.ppf(1 - alpha, n - 1)
    passed = ((d.mean(1) + margin) / se > c) & ((d.mean(1) - margin) / se < -c)
    expected = passed.mean()
    ours = power.tost_power(0.005, margin, sigma, n, alpha)
    assert abs(ours - expected) <= 5 * np.sqrt(expected * (1 - expected) / SIMS) + 1e-3


def test_holm_on_both_sides_of_its_thresholds():
    """Sorted p-values meet a / 3, a / 2 and a in turn; the first one kept keeps the rest."""
    a = 0.05
    assert power.holm([a / 3, a / 2, a], a) == [True, True, True]
    assert power.holm([a / 3 * 1.001, a / 2, a], a) == [False, False, False]
    assert power.holm([a / 3, a / 2 * 1.001, a], a) == [True, False, False]
    assert power.holm([a / 3, a / 2, a * 1.001], a) == [True, True, False]
    # the order of the input does not matter
    assert power.holm([a, a / 3, a / 2 * 1.001], a) == [False, True, False]
