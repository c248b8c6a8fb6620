"""Convergence-order fits (:mod:`svflow_jax.fitting`): the exact Student-t quantile against
SciPy's ``scipy.stats.t.ppf``, and the slope's 95% interval against ``scipy.stats.linregress``."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats

from svflow_jax.fitting import fit_order, t_quantile

DOFS = [*range(1, 121), 150, 200, 333, 1000]
QS = [0.005, 0.025, 0.5, 0.6, 0.9, 0.95, 0.975, 0.995, 0.9995]


@pytest.mark.parametrize("q", QS)
def test_t_quantile_is_scipys(q):
    """Within the method's own error of SciPy's quantile: the central probability, a sum of
    about dof/2 positive terms with a few roundings each, is off by at most (2 dof + 10) eps,
    which moves the quantile by that over dP/dt = 2 f(t) (f the density); 60 halvings of
    pi/2 leave theta within pi/2 2^-61, which moves t = sqrt(dof) tan(theta) by
    sqrt(dof) (1 + t^2/dof) times that; tan and sqrt round to a few eps |t| (measured: at
    most 0.16 of this bound, 2.7e-13 relative)."""
    dofs = np.asarray(DOFS)
    ours = np.array([t_quantile(q, dof) for dof in DOFS])
    expected = scipy.stats.t.ppf(q, dofs)
    eps = np.finfo(np.float64).eps
    bound = ((2 * dofs + 10) * eps / (2 * scipy.stats.t.pdf(expected, dofs))
             + np.sqrt(dofs) * (1 + expected**2 / dofs) * np.pi / 2 * 2.0**-61
             + 4 * eps * np.abs(expected))
    assert np.all(np.abs(ours - expected) <= bound), np.max(np.abs(ours - expected) / bound)


def test_t_quantile_beyond_the_old_table():
    """Above 30 degrees of freedom the quantile is not the normal's 1.960 (t(0.975, 31) =
    2.0395); it tends to it."""
    assert t_quantile(0.975, 31) == pytest.approx(2.039513446396408, rel=1e-12)
    assert t_quantile(0.975, 31) > t_quantile(0.975, 1000) > scipy.stats.norm.ppf(0.975)


@pytest.mark.parametrize(("q", "dof", "message"), [
    (0.975, 0, "dof must be a positive integer, got 0"),
    (0.975, 2.5, "dof must be a positive integer, got 2.5"),
    (0.975, True, "dof must be a positive integer, got True"),
    (1.0, 3, r"q must lie in \(0, 1\), got 1.0"),
    (float("nan"), 3, r"q must lie in \(0, 1\), got nan"),
])
def test_t_quantile_refuses_bad_arguments(q, dof, message):
    with pytest.raises(ValueError, match=message):
        t_quantile(q, dof)


@pytest.mark.parametrize("k", [3, 5, 12, 33])
def test_interval_is_the_t_interval_of_the_least_squares_slope(k):
    rng = np.random.default_rng(k)
    h = np.geomspace(1e-3, 1e-1, k)
    e = 3.0 * h**2 * np.exp(0.05 * rng.standard_normal(k))
    fit = fit_order(h, e)
    ref = scipy.stats.linregress(np.log(h), np.log(e))
    half = scipy.stats.t.ppf(0.975, k - 2) * ref.stderr
    assert fit.points == k
    np.testing.assert_allclose([fit.slope, fit.low, fit.high],
                               [ref.slope, ref.slope - half, ref.slope + half], rtol=1e-10)


@pytest.mark.parametrize("n", [2, 3, 5, 12, 40])
def test_interval_over_seeds_is_scipys_t_interval(n):
    """``training.compare.interval`` (the intervals over seeds of the experiments) against
    ``scipy.stats.t.interval``, at 95% and at a Bonferroni-adjusted level; NaNs dropped."""
    from svflow_jax.training.compare import interval

    v = np.random.default_rng(n).normal(size=n)
    for level in (0.95, 1 - 0.05 / 8):
        mean, half = interval(np.append(v, np.nan), level)
        lo, hi = scipy.stats.t.interval(level, n - 1, loc=v.mean(), scale=scipy.stats.sem(v))
        assert mean == pytest.approx(v.mean(), abs=1e-15)
        assert half == pytest.approx((hi - lo) / 2, rel=1e-10)
