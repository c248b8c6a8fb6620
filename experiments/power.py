"""Power of a paired comparison of trained models, and the seed count it implies.

A comparison of two arms trained on the same seeds (the same batches and initial weights per
seed) is decided by the paired differences ``d_s``, ``s = 1..n``: a two-sided Student-t test at
level ``alpha``, ``|mean(d)| / (sd(d) / sqrt(n)) > t(1 - alpha/2, n - 1)``. When the true mean
difference is ``delta`` and the differences' standard deviation ``sigma``, the statistic follows
a noncentral t with ``n - 1`` degrees of freedom and noncentrality ``delta sqrt(n) / sigma``, so

    power(n) = P(|T'| > t_crit) = 1 - F'(t_crit) + F'(-t_crit),

``F'`` its distribution function (``scipy.stats.nct``). :func:`seeds_for_power` is the smallest
``n >= 2`` whose power reaches the target. :func:`tost_power` is the power of the two one-sided
tests of equivalence within ``(-margin, margin)`` when the true difference is ``delta``.

Run as a script it prints the table of ``docs/results/layer-designs-preregistration.md``::

    python experiments/power.py
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from scipy import stats

__all__ = ["paired_t_power", "seeds_for_power", "tost_power", "holm"]


def paired_t_power(delta: float, sigma: float, n: int, alpha: float) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` with ``n`` pairs (module
    docstring)."""
    if n < 2 or sigma <= 0 or not 0 < alpha < 1:
        raise ValueError(f"need n >= 2, sigma > 0 and 0 < alpha < 1, got {n}, {sigma}, {alpha}")
    df = n - 1
    crit = stats.t.ppf(1 - alpha / 2, df)
    nc = delta * math.sqrt(n) / sigma
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def seeds_for_power(delta: float, sigma: float, alpha: float, target: float = 0.8,
                    most: int = 1000) -> int:
    """The smallest number of seeds whose :func:`paired_t_power` reaches ``target``."""
    for n in range(2, most + 1):
        if paired_t_power(delta, sigma, n, alpha) >= target:
            return n
    raise ValueError(f"no n <= {most} reaches power {target}")


def tost_power(delta: float, margin: float, sigma: float, n: int, alpha: float) -> float:
    """Power of TOST (both one-sided t-tests at level ``alpha``) to conclude ``|mean| <
    margin`` when the true mean difference is ``delta``: ``P(t_low > c and t_high < -c)``,
    ``t_low = (mean + margin) / se``, ``t_high = (mean - margin) / se``, computed by
    integrating over the sample standard deviation (chi distribution) the normal probability of
    the mean's window."""
    if n < 2 or sigma <= 0 or margin <= 0:
        raise ValueError("need n >= 2, sigma > 0 and margin > 0")
    df = n - 1
    c = stats.t.ppf(1 - alpha, df)
    se = sigma / math.sqrt(n)
    # s = sigma sqrt(chi2_df / df); given s the test passes when |mean| < margin - c s/sqrt(n)
    q = np.linspace(1e-6, 1 - 1e-6, 20001)
    s = sigma * np.sqrt(stats.chi2.ppf(q, df) / df)
    half = margin - c * s / math.sqrt(n)
    p = np.where(half > 0, stats.norm.cdf((half - delta) / se) - stats.norm.cdf((-half - delta)
                                                                                 / se), 0.0)
    return float(np.mean(p))


def holm(p_values: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down rejections: sorted ascending, the k-th smallest (k = 0, 1, ...) is
    rejected while ``p <= alpha / (m - k)``; once one is kept, all larger ones are kept."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    reject = [False] * m
    for k, i in enumerate(order):
        if p_values[i] > alpha / (m - k):
            break
        reject[i] = True
    return reject


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delta", type=float, default=0.02,
                        help="the smallest difference that matters, bits per character")
    parser.add_argument("--alpha", type=float, default=0.05 / 3,
                        help="the level of each primary test (Holm's first step over 3)")
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.009, 0.011, 0.018, 0.03],
                        help="standard deviations of the paired differences over seeds")
    args = parser.parse_args(argv)
    print(f"delta = {args.delta}, alpha = {args.alpha:.4f} (two-sided)")
    print("| sigma | seeds for power 0.8 | power at 3 seeds | power at 5 seeds | at 8 |")
    print("|---|---|---|---|---|")
    for sigma in args.sigmas:
        n = seeds_for_power(args.delta, sigma, args.alpha)
        print(f"| {sigma} | {n} | {paired_t_power(args.delta, sigma, 3, args.alpha):.2f} | "
              f"{paired_t_power(args.delta, sigma, 5, args.alpha):.2f} | "
              f"{paired_t_power(args.delta, sigma, 8, args.alpha):.2f} |")


if __name__ == "__main__":
    main()
