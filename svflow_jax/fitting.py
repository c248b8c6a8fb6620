"""Convergence orders: the least-squares slope of ``log err`` against ``log h``, with a 95%
interval.

``err ~ C h^p`` gives ``log err = p log h + log C``; the fitted ``p`` is the order. The standard
error of the slope is ``sqrt(SSR / (k - 2) / sum (log h - mean)^2)`` and the interval is
``p +- t_{0.975, k-2} se`` (Student-t quantile from a table; the normal 1.960 beyond 30 degrees
of freedom). Used by the claim measurements (:mod:`svflow_jax.claims`) and by ``svflow verify``
(:mod:`svflow_jax.verify`, which first keeps only the points of the asymptotic window).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

__all__ = ["Fit", "fit_order"]

# Two-sided 95% Student-t quantiles t_{0.975, df}, df = 1..30 (standard table values).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclasses.dataclass(frozen=True)
class Fit:
    """A fitted slope of ``log err`` against ``log h`` and its 95% confidence interval."""

    slope: float
    low: float
    high: float
    points: int

    def __str__(self) -> str:
        return f"{self.slope:.3f} [{self.low:.3f}, {self.high:.3f}]"


def fit_order(steps: Iterable[float], errors: Iterable[float]) -> Fit:
    """Least-squares line ``log err = p log h + c`` through all points; ``p`` is the order.

    Needs ``k >= 3`` points with positive finite errors (two points give a slope but no
    interval).
    """
    h, e = np.asarray(list(steps), float), np.asarray(list(errors), float)
    if h.shape != e.shape:
        raise ValueError(f"{h.size} steps but {e.size} errors")
    if not (np.all(np.isfinite(e)) and np.all(e > 0)):
        raise ValueError(f"every error must be positive and finite to fit an order, got {e}")
    k = h.size
    if k < 3:
        raise ValueError(f"a slope with a confidence interval needs >= 3 points, got {k}")
    x, y = np.log(h), np.log(e)
    slope, intercept = np.polyfit(x, y, 1)
    residual = y - (slope * x + intercept)
    se = math.sqrt(float(residual @ residual) / (k - 2) / float(((x - x.mean()) ** 2).sum()))
    t = _T975[k - 3] if k - 2 <= len(_T975) else 1.960
    return Fit(float(slope), float(slope - t * se), float(slope + t * se), k)
