"""Dense output that stays on the sphere.

A step from ``y0`` at ``t0`` to ``y1`` at ``t1`` is interpolated at ``s = (t - t0) / (t1 - t0)``:

* :class:`RetractedLinearInterpolation`: the retracted chord ``y(t) = R((1 - s) y0 + s y1)``,
  ``R(y) = y / |y|``: on the sphere, equal to the step values at both ends, local error
  ``O(h^2)``. It traces the geodesic from ``y0`` to ``y1`` (at a non-uniform speed).
* :class:`GeodesicInterpolation`: ``y(t) = exp_{y0}(s w)`` with ``w = h f(t0, y0)``, the great
  circle that a geodesic Euler step follows, at constant speed ``|w| / h``.
* :class:`RetractedInterpolation`: ``t -> R(p(t))`` for any diffrax interpolant ``p`` (Hermite,
  the Runge-Kutta polynomials built from the stages). ``p`` is ``O(h^q)`` close to the ambient
  solution, which lies on the unit sphere to that order, so ``R(p)`` keeps the accuracy and is
  exactly on the sphere.

Increments ``evaluate(ta, tb)`` are differences of two such points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax import AbstractLocalInterpolation
from jaxtyping import Array, PyTree

from svflow_jax import sphere

__all__ = [
    "RetractedLinearInterpolation",
    "GeodesicInterpolation",
    "RetractedInterpolation",
]


def _rescale(t0, t, t1) -> Array:
    """``(t - t0) / (t1 - t0)``, equal to 0 (with zero gradients) when ``t0 == t1``."""
    same = t0 == t1
    return jnp.where(same, 0.0, t - t0) / jnp.where(same, 1.0, t1 - t0)


class RetractedLinearInterpolation(AbstractLocalInterpolation):
    """Retracted chord ``y(t) = R((1 - s) y0 + s y1)``, ``s = (t - t0) / (t1 - t0)``.

    Dense output with local error ``O(h^2)`` that lies on the sphere and matches the step
    values at both ends. Well defined as long as ``y1 != -y0`` (always, for steps that rotate
    by less than pi). It traces the geodesic from ``y0`` to ``y1`` at a non-uniform speed.
    """

    t0: Array
    t1: Array
    y0: PyTree[Array]
    y1: PyTree[Array]

    def evaluate(self, t0, t1=None, left: bool = True) -> PyTree[Array]:
        del left
        if t1 is not None:
            return jtu.tree_map(jnp.subtract, self.evaluate(t1), self.evaluate(t0))
        s = _rescale(self.t0, t0, self.t1)
        return jtu.tree_map(
            lambda a, b: sphere.retract(a + s.astype(a.dtype) * (b - a)), self.y0, self.y1
        )


class GeodesicInterpolation(AbstractLocalInterpolation):
    """Great-circle dense output of :class:`GeodesicEuler`: ``y(t) = exp_{y0}(s w)``.

    ``w = h f(t0, y0)`` is the step's tangent increment, so this is exactly the path the
    geodesic Euler step follows (constant speed ``|w| / h``).
    """

    t0: Array
    t1: Array
    y0: Array
    w: Array

    def evaluate(self, t0, t1=None, left: bool = True) -> Array:
        del left
        if t1 is not None:
            return self.evaluate(t1) - self.evaluate(t0)
        s = _rescale(self.t0, t0, self.t1)
        return sphere.exp_map(self.y0, s.astype(self.w.dtype) * self.w)


class RetractedInterpolation(AbstractLocalInterpolation):
    """Any diffrax local interpolation, retracted: ``t -> R(inner(t))``.

    Used by :class:`Retracted` for the wrapped solver's dense output (Hermite, the
    Runge-Kutta-specific polynomials built from the stages ``k``, ...). The inner interpolant
    is ``O(h^q)`` close to the ambient solution, which lies on the unit sphere to that order,
    so the retraction keeps the accuracy and puts every value exactly on the sphere.
    """

    inner: AbstractLocalInterpolation

    @property
    def t0(self):
        return self.inner.t0

    @property
    def t1(self):
        return self.inner.t1

    def evaluate(self, t0, t1=None, left: bool = True) -> PyTree[Array]:
        if t1 is not None:
            return jtu.tree_map(
                jnp.subtract, self.evaluate(t1, left=left), self.evaluate(t0, left=left)
            )
        return jtu.tree_map(sphere.retract, self.inner.evaluate(t0, left=left))


@dataclasses.dataclass(frozen=True)
class _RetractedInterpolationFactory:
    """``interpolation_cls`` of :class:`Retracted`: builds the inner interpolation, retracted.

    diffrax calls ``interpolation_cls(t0=..., t1=..., **dense_info)`` and stores the callable as
    a static field, so it must be hashable and compare equal across calls (a frozen dataclass
    keyed on the inner callable is).
    """

    inner_cls: Callable[..., AbstractLocalInterpolation]

    def __call__(self, *, t0, t1, **dense_info) -> RetractedInterpolation:
        return RetractedInterpolation(inner=self.inner_cls(t0=t0, t1=t1, **dense_info))
