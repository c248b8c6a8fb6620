"""First-order steps on the sphere: the post-norm Transformer layer and its relatives.

With ``h = t1 - t0``, ``f = f(t0, y0)`` tangent at ``y0`` and ``R(y) = y / |y|`` per row:

* :class:`RetractedEuler`: ``y1 = R(y0 + h f)``, one post-norm Transformer layer
  (docs/theory.md section 9). ``|y0 + h f|^2 = 1 + h^2 |f|^2``, so
  ``y1 = exp_{y0}(h f) + O(h^3)``: local error ``O(h^2)``, order 1.
* :class:`GeodesicEuler`: ``y1 = exp_{y0}(h f) = cos(h|f|) y0 + sin(h|f|) f / |f|``, Euler along
  the great circle. Order 1.
* :class:`VariableStepRetractedEuler`: the *standard* post-norm layer ``R(y + h u)`` with an
  unprojected branch ``u``. Since ``y + h u = (1 + h y.u) y + h P_y u``, it is the retracted
  Euler step along the tangent field ``P_y u`` with the per-token step
  ``h' = h / (1 + h y.u) = h + O(h^2)`` whenever ``1 + h y.u > 0``: order 1, same ODE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from diffrax import RESULTS

from svflow_jax import sphere

from ._interpolation import GeodesicInterpolation
from .base import AbstractSphereSolver, _add_tree, _retract_tree, within_step

__all__ = ["RetractedEuler", "GeodesicEuler", "VariableStepRetractedEuler"]


class RetractedEuler(AbstractSphereSolver):
    """Retracted forward Euler: ``y1 = R(y0 + h f(t0, y0))``, ``R(y) = y / |y|`` per row.

    This is one post-norm Transformer layer (docs/theory.md section 9). Order 1. No error estimate
    (use fixed steps). Dense output: :class:`RetractedLinearInterpolation`.
    """

    def order(self, terms) -> int:
        return 1

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        terms, _ = within_step(terms, t0, t1)
        control = terms.contr(t0, t1)
        increment = terms.vf_prod(t0, y0, args, control)
        y1 = _retract_tree(_add_tree(y0, increment))
        return y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful


class GeodesicEuler(AbstractSphereSolver):
    """Geodesic Euler: ``y1 = exp_{y0}(h f(t0, y0))``, following the great circle.

    Order 1. The state must be a single array. Dense output: :class:`GeodesicInterpolation`
    (the same great circle).
    """

    interpolation_cls: ClassVar[Callable[..., GeodesicInterpolation]] = GeodesicInterpolation

    def order(self, terms) -> int:
        return 1

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        terms, _ = within_step(terms, t0, t1)
        control = terms.contr(t0, t1)
        w = sphere.project_tangent(y0, terms.vf_prod(t0, y0, args, control))
        y1 = sphere.exp_map(y0, w)
        return y1, None, dict(y0=y0, w=w), None, RESULTS.successful


class VariableStepRetractedEuler(AbstractSphereSolver):
    """Retracted Euler with a per-token step: ``y1 = R(y0 + h' P_y u)``, ``h' = h/(1 + h y.u)``.

    The term must return the *unprojected* drift ``u`` (``VectorField.drift``). This is the
    standard post-norm layer ``R(y + h u)`` written as a step along the tangent field: since
    ``y + h u = (1 + h y.u) y + h P_y u``, the two are equal whenever ``1 + h y.u > 0``. The
    radial part of ``u`` only rescales the step, ``h' = h + O(h^2)``: first order, same ODE.

    Where ``1 + h y.u <= 0`` the point ``y + h u`` lies in the half-space ``z . y <= 0`` and the
    layer returns the antipode of any step along the sphere: no retracted Euler step describes
    it. The solver then raises (also under ``jit``) instead of returning a wrong state; with
    ``check=False`` it returns NaN for those tokens instead (no runtime check in the compiled
    program, so the program can go to the persistent compilation cache; the caller must look
    for NaN).
    """

    check: bool = eqx.field(default=True, static=True)

    def order(self, terms) -> int:
        return 1

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        terms, _ = within_step(terms, t0, t1)
        h = t1 - t0
        u = terms.vf(t0, y0, args)
        radial = sphere.dot(y0, u)
        factor = 1 + h * radial
        y1 = sphere.retract(y0 + (h / factor) * sphere.project_tangent(y0, u))
        if not self.check:
            y1 = jnp.where(factor > 0, y1, jnp.nan)
            return y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful
        y1 = eqx.error_if(
            y1, jnp.any(factor <= 0),
            "standard post-norm step with 1 + h x.u <= 0: x + h u crossed the origin, so the "
            "layer is not a retracted Euler step of the flow (the step h is too large)",
        )
        return y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful
