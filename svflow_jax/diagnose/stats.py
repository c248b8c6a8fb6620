"""Statistics of the diagnostics study, in NumPy: ranks, Spearman's rho, equal-mass ECE,
bootstrap resampling of windows, and rank association controlled for the shuffle level
(within-level and partial Spearman with permutation p-values), and Spearman's rho across a few
units (models) with a permutation p-value. Every function is vectorised
over leading axes (one row per bootstrap resample) and deterministic (the resamples come from a
seeded ``default_rng``)."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["rankdata", "spearman", "expected_calibration_error", "bootstrap_indices",
           "cluster_bootstrap_indices", "percentile_interval", "spearman_permutation_p",
           "LevelControlled", "level_controlled_spearman"]


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


def cluster_bootstrap_indices(groups: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """``(resamples, n)`` window indices of a bootstrap over groups (documents): each
    resample draws the groups with replacement (``default_rng(seed)``) and takes all windows of
    each drawn group, in group order. The groups must have equal sizes (so every resample has
    ``n`` windows)."""
    groups = np.asarray(groups)
    names, sizes = np.unique(groups, return_counts=True)
    if len(set(sizes.tolist())) != 1:
        counts = dict(zip(names.tolist(), sizes.tolist(), strict=True))
        raise ValueError(f"the groups must have equal sizes, got {counts}")
    members = np.stack([np.flatnonzero(groups == g) for g in names])  # (G, size)
    drawn = np.random.default_rng(seed).integers(0, len(names), size=(resamples, len(names)))
    return members[drawn].reshape(resamples, -1)


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The ``level`` percentile interval of the finite samples (NaN, NaN if none)."""
    s = np.asarray(samples, np.float64).ravel()
    s = s[np.isfinite(s)]
    if s.size == 0:
        return (float("nan"), float("nan"))
    a = (1 - level) / 2
    lo, hi = np.quantile(s, [a, 1 - a])
    return (float(lo), float(hi))


def _check_test(sign: int, permutations: int) -> None:
    """The direction (+1 or -1) and the number of draws of a permutation test."""
    if sign not in (-1, 1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}")
    if isinstance(permutations, bool) or not isinstance(permutations, int) or permutations < 1:
        raise ValueError(f"permutations must be a positive integer, got {permutations!r}")


def _one_sided_p(observed: float, null: np.ndarray, sign: int) -> float:
    """``(1 + #{sign * null >= sign * observed}) / (1 + draws)`` (NaN for a NaN statistic)."""
    if not np.isfinite(observed):
        return float("nan")
    return float((1 + np.sum(sign * null >= sign * observed - 1e-12)) / (1 + null.size))


def spearman_permutation_p(a: np.ndarray, b: np.ndarray, sign: int, permutations: int = 2000,
                           seed: int = 0) -> tuple[float, float]:
    """``(rho, p)``: Spearman's rho of the vectors ``a`` and ``b`` (one value per unit, e.g. per
    model) and its one-sided permutation p-value in the direction ``sign`` (``+1``: ``a`` rises
    with ``b``). The null permutes ``a`` among the units (``permutations`` uniform draws,
    ``default_rng(seed)``); since rho depends on the ranks only, the ranks are permuted once,
    ``p = (1 + #{sign * null >= sign * rho}) / (1 + permutations)`` (at least ``1 / (1 +
    permutations)``; with ``n`` units no test can go below about ``1 / n!``). NaN when either
    side is constant."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape or len(a) < 3:
        raise ValueError(f"a and b must be vectors of the same length >= 3, got {a.shape} and "
                         f"{b.shape}")
    _check_test(sign, permutations)
    rho = float(spearman(a, b))
    if not np.isfinite(rho):
        return rho, float("nan")
    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    perm = np.argsort(np.random.default_rng(seed).random((permutations, len(a))), axis=-1)
    null = (ra[perm] * rb).sum(-1) / np.sqrt((ra * ra).sum() * (rb * rb).sum())
    return rho, _one_sided_p(rho, null, sign)


@dataclasses.dataclass(frozen=True)
class LevelControlled:
    """Rank association of a metric with a target that the shuffle level cannot explain.

    ``stratified``: Spearman's rho across windows computed within each level, averaged over the
    levels (equal weights). ``partial``: Spearman's rho of the metric and the target over all
    ``(window, level)`` cells, partialled on the level as a category (the ranks, pooled over the
    cells, minus their level mean; the correlation of those residuals). Both are about 0 for a
    metric that depends on the level alone, however strongly. ``*_p``: one-sided permutation
    p-values in the direction ``sign`` (``+1``: the metric rises with the target), from
    ``permutations`` draws that shuffle the metric among the windows of each level separately
    (which keeps every level's values and so every level effect), ``(1 + #{null >= observed})
    / (1 + permutations)``."""

    stratified: float
    stratified_p: float
    partial: float
    partial_p: float
    sign: int
    permutations: int

    def to_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def _within_level_ranks(a: np.ndarray) -> np.ndarray:
    """``(K, W)`` ranks of ``a (W, K)`` among the windows of each level, centred and scaled to
    unit norm (rows with no spread are zero)."""
    r = rankdata(np.asarray(a, np.float64).T)
    r = r - r.mean(-1, keepdims=True)
    n = np.sqrt((r * r).sum(-1, keepdims=True))
    return np.where(n > 0, r / np.where(n > 0, n, 1.0), 0.0)


def _level_residual_ranks(a: np.ndarray) -> np.ndarray:
    """``(K, W)`` ranks of ``a (W, K)`` pooled over all cells, minus their level mean."""
    a = np.asarray(a, np.float64)
    r = rankdata(a.ravel()).reshape(a.shape).T
    return r - r.mean(-1, keepdims=True)


def _stratified(rm: np.ndarray, rt: np.ndarray) -> np.ndarray:
    """Mean over levels of the within-level Spearman rho; ``rm (..., K, W)``, ``rt (K, W)``
    normalised within-level ranks (levels where either side is constant are skipped)."""
    ok = (np.abs(rm).sum(-1) > 0) & (np.abs(rt).sum(-1) > 0)
    rho = (rm * rt).sum(-1)
    with np.errstate(invalid="ignore"):
        return np.where(ok.any(-1), (rho * ok).sum(-1) / np.maximum(ok.sum(-1), 1), np.nan)


def _partial(em: np.ndarray, et: np.ndarray) -> np.ndarray:
    """Correlation of level-residual ranks ``em (..., K, W)`` with ``et (K, W)``."""
    num = (em * et).sum((-2, -1))
    den = np.sqrt((em * em).sum((-2, -1)) * (et * et).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def level_controlled_spearman(metric: np.ndarray, target: np.ndarray, sign: int,
                              permutations: int = 2000, seed: int = 0) -> LevelControlled:
    """:class:`LevelControlled` statistics of ``metric (W, K)`` against ``target (W, K)``
    (windows by levels; the target is per-window, e.g. the log-perplexity of each window's
    scored tokens at each level).

    Permuting the metric among the windows of one level leaves that level's within-level ranks
    and level-mean ranks unchanged as sets, so the null distributions are computed by permuting
    the rows of the ranks once (vectorised over draws)."""
    metric = np.asarray(metric, np.float64)
    target = np.asarray(target, np.float64)
    if metric.ndim != 2 or metric.shape != target.shape:
        raise ValueError(f"metric and target must both be (windows, levels), got "
                         f"{metric.shape} and {target.shape}")
    _check_test(sign, permutations)
    W, K = metric.shape
    rm, rt = _within_level_ranks(metric), _within_level_ranks(target)
    em, et = _level_residual_ranks(metric), _level_residual_ranks(target)
    strat, part = float(_stratified(rm, rt)), float(_partial(em, et))
    rng = np.random.default_rng(seed)
    perm = np.argsort(rng.random((permutations, K, W)), axis=-1)
    null_s = _stratified(np.take_along_axis(rm[None], perm, -1), rt)
    null_p = _partial(np.take_along_axis(em[None], perm, -1), et)

    return LevelControlled(stratified=strat, stratified_p=_one_sided_p(strat, null_s, sign),
                           partial=part, partial_p=_one_sided_p(part, null_p, sign), sign=sign,
                           permutations=permutations)
