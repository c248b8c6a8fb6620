"""Statistics of the diagnostics study, in NumPy: ranks, Spearman's rho, equal-mass ECE,
bootstrap resampling of windows. Every function is vectorised over leading axes (one row per
bootstrap resample) and deterministic (the resamples come from a seeded ``default_rng``)."""

from __future__ import annotations

import numpy as np

__all__ = ["rankdata", "spearman", "expected_calibration_error", "bootstrap_indices",
           "percentile_interval"]


def rankdata(a: np.ndarray) -> np.ndarray:
    """Ranks ``1..n`` along the last axis, ties given their average rank (as
    ``scipy.stats.rankdata(method="average")``)."""
    a = np.asarray(a, np.float64)
    order = np.argsort(a, axis=-1, kind="stable")
    sorted_a = np.take_along_axis(a, order, -1)
    n = a.shape[-1]
    ranks_sorted = np.broadcast_to(np.arange(1, n + 1, dtype=np.float64), a.shape).copy()
    # average the ranks within each run of equal values
    flat_s = sorted_a.reshape(-1, n)
    flat_r = ranks_sorted.reshape(-1, n)
    for row in range(flat_s.shape[0]):
        s = flat_s[row]
        start = 0
        for k in range(1, n + 1):
            if k == n or s[k] != s[start]:
                if k - start > 1:
                    flat_r[row, start:k] = 0.5 * (start + 1 + k)
                start = k
    ranks = np.empty_like(flat_r)
    np.put_along_axis(ranks, order.reshape(-1, n), flat_r, -1)
    return ranks.reshape(a.shape)


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rho along the last axis: Pearson's correlation of the average ranks. NaN when
    either side is constant."""
    ra, rb = rankdata(a), rankdata(b)
    ra = ra - ra.mean(-1, keepdims=True)
    rb = rb - rb.mean(-1, keepdims=True)
    den = np.sqrt((ra * ra).sum(-1) * (rb * rb).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (ra * rb).sum(-1) / np.where(den > 0, den, 1.0), np.nan)


def expected_calibration_error(
    confidence: np.ndarray, correct: np.ndarray, bins: int = 10
) -> np.ndarray:
    """ECE of top-1 predictions with ``bins`` equal-mass bins along the last axis.

    Tokens are sorted by confidence and split into ``bins`` consecutive groups of sizes
    differing by at most one (``np.array_split``); ``ECE = sum_b (n_b / N) |acc_b - conf_b|``.
    """
    conf = np.asarray(confidence, np.float64)
    corr = np.asarray(correct, np.float64)
    n = conf.shape[-1]
    if not 1 <= bins <= n:
        raise ValueError(f"bins must be in [1, {n}] (the number of tokens), got {bins}")
    order = np.argsort(conf, axis=-1, kind="stable")
    conf = np.take_along_axis(conf, order, -1)
    corr = np.take_along_axis(corr, np.broadcast_to(order, corr.shape) if corr.shape == conf.shape
                              else order, -1)
    total = np.zeros(conf.shape[:-1])
    for idx in np.array_split(np.arange(n), bins):
        gap = np.abs(corr[..., idx].mean(-1) - conf[..., idx].mean(-1))
        total = total + len(idx) / n * gap
    return total


def bootstrap_indices(n: int, resamples: int, seed: int) -> np.ndarray:
    """``(resamples, n)`` indices drawn with replacement (``default_rng(seed)``)."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The ``level`` percentile interval of the finite samples (NaN, NaN if none)."""
    s = np.asarray(samples, np.float64).ravel()
    s = s[np.isfinite(s)]
    if s.size == 0:
        return (float("nan"), float("nan"))
    a = (1 - level) / 2
    lo, hi = np.quantile(s, [a, 1 - a])
    return (float(lo), float(hi))
