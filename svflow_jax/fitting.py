"""Convergence orders: the least-squares slope of ``log err`` against ``log h``, with a 95%
interval.

``err ~ C h^p`` gives ``log err = p log h + log C``; the fitted ``p`` is the order. The standard
error of the slope is ``sqrt(SSR / (k - 2) / sum (log h - mean)^2)`` and the interval is
``p +- t_{0.975, k-2} se``, with the Student-t quantile computed exactly (:func:`t_quantile`).
Used by the claim measurements (:mod:`svflow_jax.claims`) and by ``svflow verify``
(:mod:`svflow_jax.claims.run`, which first keeps only the points of the asymptotic window).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np

__all__ = ["Fit", "fit_order", "t_quantile"]


def _t_central(theta: float, dof: int) -> float:
    """``P(|T| <= sqrt(dof) tan(theta))`` for Student's t with an integer ``dof`` (Abramowitz &
    Stegun 26.7.3-4, with ``c = cos(theta)``, ``s = sin(theta)``):

    * ``dof`` odd:  ``2/pi (theta + s c (1 + 2/3 c^2 + (2 4)/(3 5) c^4 + ...
      + (2 4 ... (dof - 3))/(3 5 ... (dof - 2)) c^(dof - 3)))``, just ``2 theta / pi`` for 1;
    * ``dof`` even: ``s (1 + 1/2 c^2 + (1 3)/(2 4) c^4 + ... + (1 3 ... (dof - 3))/(2 4 ...
      (dof - 2)) c^(dof - 2))``.
    """
    c2 = math.cos(theta) ** 2
    if dof % 2:
        term = total = 1.0
        for j in range(1, (dof - 3) // 2 + 1):  # term j: prod_{i<=j} 2i / (2i + 1) c^(2j)
            term *= 2 * j / (2 * j + 1) * c2
            total += term
        if dof == 1:
            total = 0.0
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)
    term = total = 1.0
    for j in range(1, (dof - 2) // 2 + 1):  # term j: prod_{i<=j} (2i - 1) / (2i) c^(2j)
        term *= (2 * j - 1) / (2 * j) * c2
        total += term
    return math.sin(theta) * total


def t_quantile(q: float, dof: int) -> float:
    """The quantile ``t`` with ``P(T <= t) = q`` of Student's t with ``dof`` (a positive
    integer) degrees of freedom, to double precision.

    ``T = sqrt(dof) tan(theta)`` maps ``theta in (-pi/2, pi/2)`` monotonically onto the real
    line, and ``P(|T| <= sqrt(dof) tan(theta))`` has the closed form of :func:`_t_central` for
    integer ``dof``; ``theta`` is found by bisection (60 halvings of ``pi / 2``: below one ulp).
    """
    if isinstance(dof, bool) or int(dof) != dof or dof < 1:
        raise ValueError(f"dof must be a positive integer, got {dof!r}")
    if not 0 < q < 1:
        raise ValueError(f"q must lie in (0, 1), got {q!r}")
    if q <= 0.5:
        return -t_quantile(1 - q, dof) if q < 0.5 else 0.0
    target, lo, hi = 2 * q - 1, 0.0, math.pi / 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _t_central(mid, int(dof)) < target else (lo, mid)
    return math.sqrt(dof) * math.tan(0.5 * (lo + hi))


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
    t = t_quantile(0.975, k - 2)
    return Fit(float(slope), float(slope - t * se), float(slope + t * se), k)
