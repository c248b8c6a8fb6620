"""Statistics of the diagnostics study, in NumPy: ranks, Spearman's rho, equal-mass ECE,
bootstrap resampling of windows and documents (with enough resamples for a Bonferroni-level
interval), rank association controlled for the shuffle level and for a model-free control
(within-level and partial Spearman with permutation p-values from a null that respects the
study's design: one permutation of the windows applied to every level, documents permuted
whole), and Spearman's rho across a few units (models) with a permutation p-value. Every
function is vectorised over leading axes (one row per bootstrap resample or permutation) and
deterministic (the draws come from a seeded ``default_rng``)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

_NORMAL = statistics.NormalDist()
# The family-wise level of the diagnostics' verdicts: each of m tests is held to ALPHA / m
# (Bonferroni).
ALPHA = 0.05

__all__ = ["rankdata", "spearman", "expected_calibration_error", "bootstrap_indices",
           "cluster_bootstrap_indices", "percentile_interval", "bonferroni_resamples",
           "one_sided_p", "spearman_permutation_p", "spearman_exact_p", "design_permutations",
           "within_strata_spearman_exact_p",
           "smallest_p", "LevelControlled", "level_controlled_spearman", "ALPHA"]


def rankdata(a: np.ndarray) -> np.ndarray:
    """Ranks ``1..n`` along the last axis, ties given their average rank (as
    ``scipy.stats.rankdata(method="average")``); vectorised over the leading axes."""
    a = np.asarray(a, np.float64)
    n = a.shape[-1]
    order = np.argsort(a, axis=-1, kind="stable")
    s = np.take_along_axis(a, order, -1)
    pos = np.broadcast_to(np.arange(n), a.shape)
    new_run = np.ones(a.shape, bool)
    new_run[..., 1:] = s[..., 1:] != s[..., :-1]
    # first and last sorted position of each element's run of equal values
    first = np.maximum.accumulate(np.where(new_run, pos, 0), axis=-1)
    end_run = np.ones(a.shape, bool)
    end_run[..., :-1] = new_run[..., 1:]
    last = np.flip(np.minimum.accumulate(np.flip(np.where(end_run, pos, n - 1), -1), -1), -1)
    ranks = np.empty(a.shape)
    np.put_along_axis(ranks, order, 0.5 * (first + last) + 1.0, -1)
    return ranks


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


def bonferroni_resamples(alpha: float, comparisons: int, beyond: int = 40) -> int:
    """The bootstrap resamples needed for a two-sided percentile interval at level
    ``1 - alpha / comparisons`` to have ``beyond`` resamples past each end:
    ``ceil(beyond / (alpha / (2 comparisons)))`` (e.g. 14,400 for 0.05 over 9 at 40 beyond;
    1000 resamples leave 2.8 beyond each end, and the interval's ends are then two or three
    order statistics)."""
    if not 0 < alpha < 1 or comparisons < 1 or beyond < 1:
        raise ValueError(f"need 0 < alpha < 1, comparisons >= 1, beyond >= 1; got {alpha}, "
                         f"{comparisons}, {beyond}")
    return math.ceil(beyond * 2 * comparisons / alpha - 1e-9)


def _check_test(sign: int, permutations: int) -> None:
    """The direction (+1 or -1) and the number of draws of a permutation test."""
    if sign not in (-1, 1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}")
    if isinstance(permutations, bool) or not isinstance(permutations, int) or permutations < 1:
        raise ValueError(f"permutations must be a positive integer, got {permutations!r}")


def one_sided_p(observed: float, null: np.ndarray, sign: int) -> float:
    """``(1 + #{sign * null >= sign * observed}) / (1 + draws)``: the permutation p-value in
    the direction ``sign`` (``+1``: large values are extreme), the observed statistic counted
    as one of the draws, ties with it counted as extreme (to ``1e-12``, rounding). NaN for a
    NaN statistic; NaN draws (a constant permuted side) count as not extreme."""
    if not np.isfinite(observed):
        return float("nan")
    null = np.asarray(null, np.float64)
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
    return rho, one_sided_p(rho, null, sign)


def spearman_exact_p(a: np.ndarray, b: np.ndarray, sign: int) -> tuple[float, float]:
    """``(rho, p)`` as :func:`spearman_permutation_p`, with every one of the ``n!`` pairings
    (``n <= 8``): ``p = #{sign * rho_pi >= sign * rho} / n!``, the identity among them, so the
    smallest attainable p is ``1 / n!`` (1/720 for 6 documents)."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape or not 3 <= len(a) <= 8:
        raise ValueError(f"a and b must be vectors of the same length in [3, 8], got {a.shape} "
                         f"and {b.shape}")
    _check_test(sign, 1)
    rho = float(spearman(a, b))
    if not np.isfinite(rho):
        return rho, float("nan")
    perms = np.array(list(itertools.permutations(range(len(a)))))
    null = spearman(a[perms], b)
    return rho, float(np.sum(sign * null >= sign * rho - 1e-12) / len(perms))


def within_strata_spearman_exact_p(a: np.ndarray, b: np.ndarray, strata: Sequence[Any],
                                   sign: int) -> tuple[float, float]:
    """``(rho_w, p)``: the association of ``a`` and ``b`` WITHIN strata (e.g. models of one
    size), and its exact one-sided permutation p-value in the direction ``sign``.

    ``rho_w`` is the correlation of the within-stratum centred ranks: in each stratum ``s``
    the ranks ``r_a``, ``r_b`` among its units, minus their stratum mean, pooled over the
    strata, ``sum r_a r_b / sqrt(sum r_a^2 sum r_b^2)`` (1 when every stratum orders ``a`` as
    ``b``; a difference between strata, such as size, adds nothing). The null permutes ``a``
    within each stratum, every combination (``prod_s n_s!``, at most 10^5): ``p = #{sign
    rho_pi >= sign rho_w} / prod n_s!``, the identity among them; the smallest attainable p is
    ``1 / prod n_s!`` (1/216 for three strata of three). NaN when no stratum varies on both
    sides."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    labels = list(strata)
    if a.ndim != 1 or a.shape != b.shape or len(labels) != len(a):
        raise ValueError(f"a, b and strata must be vectors of one length, got {a.shape}, "
                         f"{b.shape} and {len(labels)}")
    _check_test(sign, 1)
    groups = [np.flatnonzero([x == s for x in labels]) for s in dict.fromkeys(labels)]
    if math.prod(math.factorial(len(g)) for g in groups) > 100_000:
        raise ValueError("too many within-strata permutations for an exact test (> 1e5)")

    def centred(v: np.ndarray, g: np.ndarray) -> np.ndarray:
        r = rankdata(v[g])
        return r - r.mean()

    ra = [centred(a, g) for g in groups]
    rb = [centred(b, g) for g in groups]
    denom = math.sqrt(sum(float(x @ x) for x in ra) * sum(float(y @ y) for y in rb))
    if denom == 0:
        return float("nan"), float("nan")
    orders = [list(itertools.permutations(range(len(g)))) for g in groups]
    null = np.array([sum(float(x[list(p)] @ y) for x, y, p in zip(ra, rb, combo, strict=True))
                     for combo in itertools.product(*orders)]) / denom
    rho = sum(float(x @ y) for x, y in zip(ra, rb, strict=True)) / denom
    return rho, float(np.sum(sign * null >= sign * rho - 1e-12) / len(null))


def smallest_p(units: int) -> float:
    """The smallest p-value any permutation test over ``units`` exchangeable units can give:
    ``1 / units!`` (a full permutation; 1/720 for 6 documents)."""
    return 1.0 / math.factorial(units)


def design_permutations(windows: int, draws: int, seed: int | Sequence[int],
                        groups: np.ndarray | None = None) -> np.ndarray:
    """``(draws, windows)`` permutations of the windows for a null that respects the design
    (``default_rng(seed)``); each row is applied to every shuffle level at once, so a window
    keeps its profile across the levels (the same scored tokens at every level).

    Without ``groups``: uniform permutations of the windows (exchangeable windows). With
    ``groups`` (each window's document, equal sizes): the documents are permuted whole and the
    windows within each document permuted (slot ``j`` of document ``g`` receives window
    ``sigma_g(j)`` of document ``pi(g)``), the null of exchangeable documents with exchangeable
    windows inside each, which holds under document effects as well as window effects."""
    rng = np.random.default_rng(seed)
    if groups is None:
        return np.argsort(rng.random((draws, windows)), axis=-1)
    groups = np.asarray(groups)
    if groups.shape != (windows,):
        raise ValueError(f"groups must have one entry per window ({windows}), got "
                         f"{groups.shape}")
    names, sizes = np.unique(groups, return_counts=True)
    if len(set(sizes.tolist())) != 1:
        raise ValueError(f"the groups must have equal sizes, got "
                         f"{dict(zip(names.tolist(), sizes.tolist(), strict=True))}")
    members = np.stack([np.flatnonzero(groups == g) for g in names])  # (G, S)
    G, S = members.shape
    docs = np.argsort(rng.random((draws, G)), axis=-1)  # (B, G)
    within = np.argsort(rng.random((draws, G, S)), axis=-1)  # (B, G, S)
    out = np.empty((draws, windows), np.int64)
    out[:, members.ravel()] = members[docs[..., None], within].reshape(draws, -1)
    return out


@dataclasses.dataclass(frozen=True)
class LevelControlled:
    """Rank association of a metric with a target that the shuffle level (and a control)
    cannot explain.

    ``stratified``: Spearman's rho across windows computed within each level, averaged over the
    levels (equal weights). ``partial``: Spearman's rho of the metric and the target over all
    ``(window, level)`` cells, partialled on the level as a category (the ranks, pooled over the
    cells, minus their level mean; the correlation of those residuals). Both are about 0 for a
    metric that depends on the level alone, however strongly. ``controlled``: the partial rank
    correlation given the level AND a control: the normal scores of the ranks within each level
    (:func:`_within_level_scores`) of metric and target, each less its least-squares projection
    on the control's, correlated over all cells (NaN without a control). Normal scores rather
    than the ranks themselves: the rank of a sum is not linear in the rank of one of its terms,
    so a linear partial of the ranks leaves part of a shared dependence on the control (in
    simulation, 12% of studies below 0.05 when metric and target depend only on the control,
    against 6% with normal scores, which are linear in Gaussian data).

    ``*_p``: one-sided permutation p-values in the direction ``sign`` (``+1``: the metric rises
    with the target), ``(1 + #{sign * null >= sign * observed}) / (1 + permutations)``, from
    ``permutations`` draws of :func:`design_permutations` (``null``: ``"windows"`` or
    ``"documents"``), each applied to every level at once; for ``controlled`` the metric's
    residual given the control is permuted and projected off the control again (Freedman and
    Lane's scheme, for a correlation). ``former_*_p``: the null used before, which shuffled
    the metric among the windows of each level separately; it breaks every window's profile
    across the levels, so a window effect in metric and target, even independent ones, looks
    like association (reported for comparison, never a verdict)."""

    stratified: float
    stratified_p: float
    partial: float
    partial_p: float
    controlled: float
    controlled_p: float
    sign: int
    permutations: int
    null: str
    former_stratified_p: float
    former_partial_p: float

    def to_dict(self) -> dict[str, float | int | str]:
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


def _within_level_scores(a: np.ndarray) -> np.ndarray:
    """``(K, W)`` normal scores of ``a (W, K)`` among the windows of each level: ``Phi^-1(r /
    (W + 1))`` of the average ranks ``r`` (van der Waerden's scores; centred by symmetry)."""
    r = rankdata(np.asarray(a, np.float64).T)
    return np.vectorize(_NORMAL.inv_cdf)(r / (r.shape[-1] + 1))


def _stratified(rm: np.ndarray, rt: np.ndarray) -> np.ndarray:
    """Mean over levels of the within-level Spearman rho; ``rm (..., K, W)``, ``rt (K, W)``
    normalised within-level ranks (levels where either side is constant are skipped)."""
    ok = (np.abs(rm).sum(-1) > 0) & (np.abs(rt).sum(-1) > 0)
    rho = (rm * rt).sum(-1)
    with np.errstate(invalid="ignore"):
        return np.where(ok.any(-1), (rho * ok).sum(-1) / np.maximum(ok.sum(-1), 1), np.nan)


def _partial(em: np.ndarray, et: np.ndarray, basis: np.ndarray | None = None) -> np.ndarray:
    """Correlation of level-residual ranks ``em (..., K, W)`` with ``et (K, W)``; with an
    orthonormal ``basis (C, K W)`` of controls (to which ``et`` is orthogonal), of ``em``'s part
    orthogonal to them."""
    num = (em * et).sum((-2, -1))
    full = (em * em).sum((-2, -1))
    mm = full
    if basis is not None:
        mm = full - ((em.reshape(*em.shape[:-2], 1, -1) * basis).sum(-1) ** 2).sum(-1)
    den = np.sqrt(np.maximum(mm, 0.0) * (et * et).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 1e-12 * np.sqrt(full * (et * et).sum()),
                        num / np.where(den > 0, den, 1.0), np.nan)


def _basis(controls: np.ndarray) -> np.ndarray:
    """An orthonormal basis ``(C', K W)`` of the span of ``controls (C, K, W)``."""
    flat = controls.reshape(len(controls), -1).T  # (K W, C)
    q, r = np.linalg.qr(flat)
    keep = np.abs(np.diag(r)) > 1e-10 * max(1.0, float(np.abs(r).max(initial=0.0)))
    return q[:, keep].T


def _off(e: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """``e (K, W)`` less its least-squares projection on the span of ``basis``."""
    return e - (basis.T @ (basis @ e.ravel())).reshape(e.shape)


def level_controlled_spearman(metric: np.ndarray, target: np.ndarray, sign: int,
                              permutations: int = 2000, seed: int = 0,
                              groups: np.ndarray | None = None,
                              control: np.ndarray | None = None) -> LevelControlled:
    """:class:`LevelControlled` statistics of ``metric (W, K)`` against ``target (W, K)``
    (windows by levels; the target is per-window, e.g. the log-perplexity of each window's
    scored tokens at each level), with ``control (W, K)`` or ``(C, W, K)`` (several controls)
    for the controlled rho and ``groups`` (each window's document) for the null over
    documents.

    A permutation of the windows moves whole rows of the ranks (the within-level ranks and the
    level-mean ranks are unchanged as sets), so the nulls permute the rows of the ranks once
    (vectorised over draws). The design null's draws come from ``default_rng([seed, 1])``, the
    former null's from ``default_rng(seed)`` (as before)."""
    metric = np.asarray(metric, np.float64)
    target = np.asarray(target, np.float64)
    if metric.ndim != 2 or metric.shape != target.shape:
        raise ValueError(f"metric and target must both be (windows, levels), got "
                         f"{metric.shape} and {target.shape}")
    if control is not None:
        control = np.asarray(control, np.float64)
        control = control[None] if control.ndim == 2 else control
        if control.shape[1:] != metric.shape:
            raise ValueError(f"control must be (windows, levels) {metric.shape} or (controls, "
                             f"windows, levels), got {control.shape}")
    _check_test(sign, permutations)
    W, K = metric.shape
    rm, rt = _within_level_ranks(metric), _within_level_ranks(target)
    em, et = _level_residual_ranks(metric), _level_residual_ranks(target)
    strat, part = float(_stratified(rm, rt)), float(_partial(em, et))
    # the former null: each level's windows permuted separately
    perm = np.argsort(np.random.default_rng(seed).random((permutations, K, W)), axis=-1)
    former_s = _stratified(np.take_along_axis(rm[None], perm, -1), rt)
    former_p = _partial(np.take_along_axis(em[None], perm, -1), et)
    # the design null: one permutation of the windows, the same at every level
    joint = design_permutations(W, permutations, [seed, 1], groups)
    null_s = _stratified(np.moveaxis(rm[:, joint], 1, 0), rt)
    null_p = _partial(np.moveaxis(em[:, joint], 1, 0), et)
    controlled, controlled_p = float("nan"), float("nan")
    if control is not None:
        basis = _basis(np.stack([_within_level_scores(c) for c in control]))
        xm = _off(_within_level_scores(metric), basis)
        xt = _off(_within_level_scores(target), basis)
        controlled = float(_partial(xm, xt, basis))
        null_c = _partial(np.moveaxis(xm[:, joint], 1, 0), xt, basis)
        controlled_p = one_sided_p(controlled, null_c, sign)
    return LevelControlled(
        stratified=strat, stratified_p=one_sided_p(strat, null_s, sign), partial=part,
        partial_p=one_sided_p(part, null_p, sign), controlled=controlled,
        controlled_p=controlled_p, sign=sign, permutations=permutations,
        null="windows" if groups is None else "documents",
        former_stratified_p=one_sided_p(strat, former_s, sign),
        former_partial_p=one_sided_p(part, former_p, sign))
