"""Diffrax solvers that stay on the sphere.

A Transformer layer ``x <- R(x + h v_t(x))`` (``R(y) = y / |y|``) is one step of the retracted
forward-Euler method for the ODE ``dx/dt = v_t(x)`` on ``S^{d-1}`` (SVFLOW.md sections 5, 6).
This module provides that step and its higher-order relatives as real
:class:`diffrax.AbstractSolver` subclasses, so they work with :func:`diffrax.diffeqsolve`,
every :class:`diffrax.SaveAt`, step-size controllers and
:class:`diffrax.RecursiveCheckpointAdjoint`.

The state is an array of shape ``(..., n, d)`` whose rows (tokens) are unit vectors (any PyTree
of such arrays works for the retraction-based solvers). A vector field ``v(t, X, args)``
returns, per row, a vector tangent at that row.

Solvers (global order on a smooth field in brackets):

* :class:`RetractedEuler`  ``y1 = R(y0 + h f(t0, y0))``: the Transformer layer [1].
* :class:`GeodesicEuler`   ``y1 = exp_{y0}(h f(t0, y0))``: Euler along great circles [1].
* :class:`Retracted`       wraps ANY diffrax solver (Heun [2], Midpoint [2], :class:`RK4` [4],
  Tsit5 [5], Dopri5 [5], Dopri8 [8], ...) keeping its order, its error estimate (adaptive
  stepping) and its dense output, all retracted onto the sphere.
* :class:`CrouchGrossman3` a Lie-group method: each stage freezes the so(d) generator of every
  token and acts on the sphere by rotations [3].
* :class:`RKMK4`           Runge-Kutta-Munthe-Kaas with the classical RK4 tableau [4] (dense
  ``d x d`` matrix exponentials: a reference method for small ``d``).
* :class:`LieTrotter`, :class:`Strang`: splittings of a :class:`diffrax.MultiTerm` of two
  fields (attention block then FFN block; Macaron block) with any single-step sphere solver as
  sub-step.

:func:`solve` wraps :func:`diffrax.diffeqsolve` with input validation and an error (never a
silently wrong state) when the solve fails, e.g. by running out of ``max_steps``.

Adjoints: use :class:`diffrax.RecursiveCheckpointAdjoint` (the default), which differentiates
the discrete steps themselves. :class:`diffrax.BacksolveAdjoint` solves the continuous adjoint
ODE backwards in the ambient space and does not know about the retraction: its gradients are
not those of the retracted discretisation, so :func:`solve` refuses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import jax.tree_util as jtu
import numpy as np
from diffrax import (
    RESULTS,
    AbstractLocalInterpolation,
    AbstractSolver,
    AbstractTerm,
    AbstractWrappedSolver,
    ButcherTableau,
    MultiTerm,
    ODETerm,
)
from jaxtyping import Array, ArrayLike, Float, PyTree

from svflow_jax import sphere

__all__ = [
    "AbstractSphereSolver",
    "RetractedEuler",
    "GeodesicEuler",
    "Retracted",
    "RK4",
    "CrouchGrossman3",
    "RKMK4",
    "LieTrotter",
    "Strang",
    "RetractedLinearInterpolation",
    "GeodesicInterpolation",
    "RetractedInterpolation",
    "SolveError",
    "solve",
]

# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _retract_tree(y: PyTree[Array]) -> PyTree[Array]:
    """``R`` applied to every leaf (each leaf is an array of unit rows)."""
    return jtu.tree_map(sphere.retract, y)


def _rescale(t0, t, t1) -> Array:
    """``(t - t0) / (t1 - t0)``, equal to 0 (with zero gradients) when ``t0 == t1``."""
    same = t0 == t1
    return jnp.where(same, 0.0, t - t0) / jnp.where(same, 1.0, t1 - t0)


def _axpy(a: ArrayLike, x: PyTree[Array], y: PyTree[Array]) -> PyTree[Array]:
    """``y + a x`` on PyTrees."""
    return jtu.tree_map(lambda xi, yi: yi + a * xi, x, y)


# ---------------------------------------------------------------------------------------------
# Dense output that stays on the sphere
# ---------------------------------------------------------------------------------------------


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
        return _retract_tree(self.inner.evaluate(t0, left=left))


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


# ---------------------------------------------------------------------------------------------
# Retracted Euler, geodesic Euler
# ---------------------------------------------------------------------------------------------


class AbstractSphereSolver(AbstractSolver):
    """Base of the single-step solvers here: one term, no solver state, no error estimate.

    Subclasses implement ``order`` and ``step``; dense output defaults to
    :class:`RetractedLinearInterpolation`. Subclass it to write a new layer design in a few
    lines (``step`` returns ``y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful``).
    """

    term_structure: ClassVar = AbstractTerm
    interpolation_cls: ClassVar[Callable[..., AbstractLocalInterpolation]] = (
        RetractedLinearInterpolation
    )

    def init(self, terms, t0, t1, y0, args) -> None:
        return None

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)


class RetractedEuler(AbstractSphereSolver):
    """Retracted forward Euler: ``y1 = R(y0 + h f(t0, y0))``, ``R(y) = y / |y|`` per row.

    This is one post-norm Transformer layer (SVFLOW.md section 5). Order 1. No error estimate
    (use fixed steps). Dense output: :class:`RetractedLinearInterpolation`.
    """

    def order(self, terms) -> int:
        return 1

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        control = terms.contr(t0, t1)
        increment = terms.vf_prod(t0, y0, args, control)
        y1 = _retract_tree(jtu.tree_map(jnp.add, y0, increment))
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
        control = terms.contr(t0, t1)
        w = sphere.project_tangent(y0, terms.vf_prod(t0, y0, args, control))
        y1 = sphere.exp_map(y0, w)
        return y1, None, dict(y0=y0, w=w), None, RESULTS.successful


# ---------------------------------------------------------------------------------------------
# Retracted(any diffrax solver)
# ---------------------------------------------------------------------------------------------


class _RetractedTerm(AbstractTerm):
    """``vf(t, y, args) = term.vf(t, R(y), args)``: the field read at the retracted state.

    For a tangent field ``f`` (``y . f(R(y)) = 0``) the ambient ODE ``y' = f(t, R(y))``
    conserves ``|y|`` and, on ``|y| = 1``, is the spherical flow. Any solver of order ``p``
    applied to it is ``O(h^{p+1})`` close to a point of the unit sphere after one step, so
    retracting its output keeps order ``p``.
    """

    term: AbstractTerm

    def vf(self, t, y, args):
        return self.term.vf(t, _retract_tree(y), args)

    def contr(self, t0, t1, **kwargs):
        return self.term.contr(t0, t1, **kwargs)

    def prod(self, vf, control):
        return self.term.prod(vf, control)

    def vf_prod(self, t, y, args, control):
        return self.term.vf_prod(t, _retract_tree(y), args, control)

    def is_vf_expensive(self, t0, t1, y, args) -> bool:
        return self.term.is_vf_expensive(t0, t1, y, args)


def _retract_terms(terms: PyTree[AbstractTerm]) -> PyTree[AbstractTerm]:
    """Wraps every term; a :class:`MultiTerm` keeps its structure (IMEX solvers inspect it)."""

    def wrap(term):
        if isinstance(term, MultiTerm):
            return MultiTerm(*(wrap(t) for t in term.terms))
        return _RetractedTerm(term)

    return jtu.tree_map(wrap, terms, is_leaf=lambda x: isinstance(x, AbstractTerm))


class Retracted(AbstractWrappedSolver):
    """Adds the retraction ``R(y) = y / |y|`` to any diffrax solver.

    * the vector field is evaluated at retracted states: ``vf(t, y) = f(t, R(y))``, so every
      Runge-Kutta stage is read on the sphere (SVFLOW.md section 6: "stage states retracted");
    * the step output is retracted: ``y1 = R(inner_step(y0))``;
    * dense output (``SaveAt(ts=...)``, ``SaveAt(dense=True)``) is the inner interpolation,
      retracted (:class:`RetractedInterpolation`).

    The inner solver's order is kept (see :class:`_RetractedTerm`), and so is its error
    estimate, which is a valid local error estimate of the ambient solve; hence adaptive
    stepping with :class:`diffrax.PIDController` works as for the inner solver. FSAL solvers
    (Tsit5, Dopri5, ...) stay consistent: the cached ``f(t1, y1)`` is ``f(t1, R(y1))``, which is
    exactly the field at the retracted next state.

    ``isinstance`` checks (adaptive, implicit, ...) are forwarded to the inner solver.
    """

    solver: AbstractSolver

    @property
    def term_structure(self):
        return self.solver.term_structure

    @property
    def interpolation_cls(self):  # pyright: ignore
        return _RetractedInterpolationFactory(self.solver.interpolation_cls)

    @property
    def term_compatible_contr_kwargs(self):
        return self.solver.term_compatible_contr_kwargs

    def order(self, terms):
        return self.solver.order(terms)

    def strong_order(self, terms):
        return self.solver.strong_order(terms)

    def error_order(self, terms):
        return self.solver.error_order(terms)

    def init(self, terms, t0, t1, y0, args):
        return self.solver.init(_retract_terms(terms), t0, t1, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        y1, y_error, dense_info, solver_state, result = self.solver.step(
            _retract_terms(terms), t0, t1, y0, args, solver_state, made_jump
        )
        # dense_info keeps the ambient values: the interpolation retracts them, and at t1 it
        # gives R(y1_ambient), the value returned here, so dense output is continuous.
        return _retract_tree(y1), y_error, dense_info, solver_state, result

    def func(self, terms, t0, y0, args):
        return self.solver.func(_retract_terms(terms), t0, y0, args)


_rk4_tableau = ButcherTableau(
    a_lower=(
        np.array([1 / 2]),
        np.array([0.0, 1 / 2]),
        np.array([0.0, 0.0, 1.0]),
        np.array([1 / 6, 1 / 3, 1 / 3, 1 / 6]),
    ),
    b_sol=np.array([1 / 6, 1 / 3, 1 / 3, 1 / 6, 0.0]),
    # Embedded third-order solution b_hat = (1/6, 1/3, 1/3, 0, 1/6), which uses the FSAL stage
    # f(t1, y1); b_error = b_sol - b_hat, i.e. err = h (f(t1, z4) - f(t1, y1)) / 6.
    b_error=np.array([0.0, 0.0, 0.0, 1 / 6, -1 / 6]),
    c=np.array([1 / 2, 1 / 2, 1.0, 1.0]),
)


class RK4(diffrax.AbstractERK):
    """The classical fourth-order Runge-Kutta method (Kutta 1901), as a diffrax ERK.

    Stages ``c = (0, 1/2, 1/2, 1)``, weights ``b = (1/6, 1/3, 1/3, 1/6)``. A fifth, FSAL stage
    ``f(t1, y1)`` (free after the first step) provides an embedded third-order solution
    ``b_hat = (1/6, 1/3, 1/3, 0, 1/6)`` for adaptive stepping and the exact end-point slope for
    the cubic Hermite dense output. Use it on the sphere as ``Retracted(RK4())``.
    """

    tableau: ClassVar[ButcherTableau] = _rk4_tableau
    interpolation_cls: ClassVar[Callable[..., AbstractLocalInterpolation]] = (
        diffrax.ThirdOrderHermitePolynomialInterpolation.from_k
    )

    def order(self, terms) -> int:
        return 4


# ---------------------------------------------------------------------------------------------
# Lie-group methods
# ---------------------------------------------------------------------------------------------


class _AbstractCrouchGrossman(AbstractSphereSolver):
    """Explicit Crouch-Grossman method for the action of SO(d) on each token's sphere.

    With ``k_j = h f(t0 + c_j h, Y_j)``, stage ``j`` freezes, per token, the generator
    ``Omega_j = (k_j Y_j^T - Y_j k_j^T) / h`` of so(d), which moves ``Y_j`` with velocity
    ``f(Y_j)``, and acts on points by ``exp(h a Omega_j) y = plane_rotation(Y_j, a k_j, y)``:

        Y_i = exp(h a_{i,i-1} Omega_{i-1}) ... exp(h a_{i1} Omega_1) y0
        y1  = exp(h b_s Omega_s) ... exp(h b_1 Omega_1) y0

    Every factor is a rotation, so the states stay on the sphere exactly (up to round-off).
    No error estimate; dense output is :class:`RetractedLinearInterpolation` (a chord: local
    error ``O(h^2)``).
    The state must be a single array.
    """

    a_lower: ClassVar[tuple[tuple[float, ...], ...]]
    b: ClassVar[tuple[float, ...]]
    c: ClassVar[tuple[float, ...]]
    method_order: ClassVar[int]

    def order(self, terms) -> int:
        return self.method_order

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        control = terms.contr(t0, t1)
        h = t1 - t0
        stages: list[Array] = []
        incs: list[Array] = []
        for i, ci in enumerate(self.c):  # static, a handful of stages
            coeffs = self.a_lower[i - 1] if i > 0 else ()
            y = _compose_rotations(y0, stages, incs, coeffs)
            stages.append(y)
            incs.append(terms.vf_prod(t0 + ci * h, y, args, control))
        # Rotations keep |y| = 1 exactly; the retraction only stops round-off accumulating.
        y1 = sphere.retract(_compose_rotations(y0, stages, incs, self.b))
        return y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful


def _compose_rotations(y0, stages, incs, coeffs) -> Array:
    """``exp(a_m Omega_m) ... exp(a_1 Omega_1) y0``: the first factor acts first."""
    y = y0
    for a, x, k in zip(coeffs, stages, incs, strict=False):
        if a != 0.0:
            y = sphere.plane_rotation(x, a * k, y)
    return y


class CrouchGrossman3(_AbstractCrouchGrossman):
    """Three-stage, third-order Crouch-Grossman method (Crouch & Grossman 1993, as given by
    Owren & Marthinsen 1999):

        c = (0, 3/4, 17/24),  a21 = 3/4,  a31 = 119/216,  a32 = 17/108,
        b = (13/51, -2/3, 24/17).

    Third order for general (non-commuting) frozen flows; verified numerically in
    ``tests/test_solvers.py``.
    """

    a_lower: ClassVar = ((3 / 4,), (119 / 216, 17 / 108))
    b: ClassVar = (13 / 51, -2 / 3, 24 / 17)
    c: ClassVar = (0.0, 3 / 4, 17 / 24)
    method_order: ClassVar[int] = 3


def _generator(x: Array, k: Array) -> Array:
    """so(d) element ``k x^T - x k^T`` per row (shape ``(..., d, d)``); it maps ``x`` to ``k``
    when ``k`` is tangent at ``x``."""
    k = sphere.project_tangent(x, k)
    outer = k[..., :, None] * x[..., None, :]
    return outer - jnp.swapaxes(outer, -1, -2)


def _bracket(a: Array, b: Array) -> Array:
    return a @ b - b @ a


def _act(u: Array, y: Array) -> Array:
    """``exp(u) y`` per row, with a dense ``d x d`` matrix exponential."""
    return sphere.retract(jnp.einsum("...ij,...j->...i", jsl.expm(u), y))


class RKMK4(AbstractSphereSolver):
    """Runge-Kutta-Munthe-Kaas method with the classical RK4 tableau.

    Per token, ``xi(t, y) = f(t, y) y^T - y f(t, y)^T`` in so(d) (``xi(y) y = f(y)``). The
    Lie-algebra increments solve ``u' = dexp_u^{-1}(xi(exp(u) y0))``; with the RK4 tableau it
    is enough to keep the commutators below (Munthe-Kaas 1999; Hairer, Lubich & Wanner,
    *Geometric Numerical Integration*, IV.8):

        k1 = h xi(t0,       y0)
        k2 = h xi(t0 + h/2, exp(k1/2) y0)
        k3 = h xi(t0 + h/2, exp(k2/2 - [k1, k2]/8) y0)
        k4 = h xi(t0 + h,   exp(k3) y0)
        y1 = exp((k1 + 2 k2 + 2 k3 + k4)/6 - [k1, k4]/12) y0

    Order 4 (verified numerically in the tests). Uses dense ``d x d`` matrix exponentials per
    token: ``O(n d^3)`` per stage, a reference method for small ``d``. The re-normalisation
    after each action only removes round-off. The state must be a single array.
    """

    def order(self, terms) -> int:
        return 4

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        control = terms.contr(t0, t1)
        h = t1 - t0

        def xi(t, y):
            return _generator(y, terms.vf_prod(t, y, args, control))

        k1 = xi(t0, y0)
        k2 = xi(t0 + 0.5 * h, _act(0.5 * k1, y0))
        k3 = xi(t0 + 0.5 * h, _act(0.5 * k2 - _bracket(k1, k2) / 8, y0))
        k4 = xi(t1, _act(k3, y0))
        u = (k1 + 2 * k2 + 2 * k3 + k4) / 6 - _bracket(k1, k4) / 12
        y1 = _act(u, y0)
        return y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful


# ---------------------------------------------------------------------------------------------
# Splittings
# ---------------------------------------------------------------------------------------------


class _AbstractSplitting(AbstractSphereSolver):
    """Splitting of ``f = f_A + f_B`` given as ``MultiTerm(term_A, term_B)``.

    Each sub-step is one step of ``substep`` (any single-step solver that stays on the sphere:
    :class:`RetractedEuler`, :class:`GeodesicEuler`, ``Retracted(Heun())``, ...) on one term,
    over the physical time interval it covers (so time-dependent fields are read at the right
    times). The sub-solver is re-initialised for every sub-step (FSAL caches would be stale).
    No error estimate; dense output is :class:`RetractedLinearInterpolation` (a chord: local
    error ``O(h^2)``).
    """

    substep: AbstractSolver

    term_structure: ClassVar = MultiTerm[tuple[AbstractTerm, AbstractTerm]]

    def _sub(self, term, ta, tb, y, args):
        state = self.substep.init(term, ta, tb, y, args)
        y1, _, _, _, result = self.substep.step(term, ta, tb, y, args, state, False)
        return y1, result


class LieTrotter(_AbstractSplitting):
    """Lie-Trotter splitting: a full step of the FIRST term, then a full step of the SECOND.

    ``MultiTerm(attention, ffn)`` gives the standard Transformer block (attention sub-layer then
    FFN sub-layer, each a retracted Euler step with ``substep=RetractedEuler()``). Order 1,
    whatever the sub-step.
    """

    def order(self, terms) -> int:
        return 1

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        term_a, term_b = terms.terms
        y, result_a = self._sub(term_a, t0, t1, y0, args)
        y1, result_b = self._sub(term_b, t0, t1, y, args)
        result = diffrax.RESULTS.where(result_a == RESULTS.successful, result_b, result_a)
        return y1, None, dict(y0=y0, y1=y1), None, result


class Strang(_AbstractSplitting):
    """Strang splitting: half step of the SECOND term over ``[t0, t0 + h/2]``, full step of the
    FIRST over ``[t0, t1]``, half step of the SECOND over ``[t0 + h/2, t1]``.

    ``MultiTerm(attention, ffn)`` gives the Macaron block (half FFN, attention, half FFN).
    Order: ``min(2, order of the sub-step)``. With Euler sub-steps it is only first order: the
    ``h^2`` error ``-(A'A/2 + B'B/4 + dA/dt/2 + dB/dt/4) h^2`` does not cancel (SVFLOW.md 5);
    second-order sub-steps (``Retracted(Heun())``, ``Retracted(Midpoint())``) give order 2.
    """

    def order(self, terms):
        term_a, term_b = terms.terms
        orders = [self.substep.order(term_a), self.substep.order(term_b)]
        if any(o is None for o in orders):
            return None
        return min(2, *orders)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        term_a, term_b = terms.terms
        tm = t0 + 0.5 * (t1 - t0)
        y, r1 = self._sub(term_b, t0, tm, y0, args)
        y, r2 = self._sub(term_a, t0, t1, y, args)
        y1, r3 = self._sub(term_b, tm, t1, y, args)
        result = RESULTS.where(r1 == RESULTS.successful, r2, r1)
        result = RESULTS.where(result == RESULTS.successful, r3, result)
        return y1, None, dict(y0=y0, y1=y1), None, result


# ---------------------------------------------------------------------------------------------
# solve
# ---------------------------------------------------------------------------------------------


class SolveError(RuntimeError):
    """A solve that did not reach ``t1``, or produced NaN: its state would be wrong."""


_MAX_STEPS_MSG = (
    "svflow_jax.solvers.solve: the solver hit max_steps={} before reaching t1; the state "
    "would be wrong. Increase max_steps, use a larger dt0, or loosen the step-size "
    "controller's tolerances."
)
_NAN_MSG = (
    "svflow_jax.solvers.solve: the solution contains NaN; the vector field (or its parameters) "
    "produced NaN/inf along the way."
)
_FAILED_MSG = (
    "svflow_jax.solvers.solve: the solve failed before reaching t1 (diffrax result: {}); the "
    "state would be wrong. Check the vector field for NaN/inf and the step-size controller."
)


def _is_concrete(x) -> bool:
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jtu.tree_leaves(x))


def _unit_tolerance(dtype, d: int) -> float:
    """Allowed ``| |y| - 1 |`` for a point of the sphere in ``dtype``.

    ``y / |y|`` rounded to ``dtype`` has ``| |y| - 1 |`` of order ``sqrt(d) eps``; we allow 32
    times that (float64, d = 64: 5.7e-14; float32, d = 768: 1.1e-4), which still rejects any
    unnormalised input (e.g. the radius-sqrt(d) sphere of RMSNorm) by orders of magnitude.
    """
    return 32.0 * float(np.sqrt(d)) * float(jnp.finfo(dtype).eps)


def _check(x: PyTree, bad, message: str) -> PyTree:
    """Raise ``ValueError(message)`` if ``bad``; under tracing, a runtime error instead."""
    if _is_concrete(bad):
        if bool(bad):
            raise ValueError(message)
        return x
    return eqx.error_if(x, bad, message)


def _as_terms(field) -> PyTree[AbstractTerm]:
    if isinstance(field, AbstractTerm):
        return field
    if isinstance(field, (tuple, list)):
        return MultiTerm(*(_as_terms(f) for f in field))
    if callable(field):
        return ODETerm(field)
    raise ValueError(
        "field must be a callable v(t, y, args), a diffrax term, or a tuple of them (for the "
        f"splitting solvers), got {type(field).__name__}"
    )


def solve(
    field: Callable[..., Any] | AbstractTerm | tuple,
    y0: Float[ArrayLike, "*batch n d"],
    t0: float | Float[ArrayLike, ""],
    t1: float | Float[ArrayLike, ""],
    *,
    solver: AbstractSolver,
    dt0: float | Float[ArrayLike, ""] | None = None,
    num_steps: int | None = None,
    saveat: diffrax.SaveAt | None = None,
    stepsize_controller: diffrax.AbstractStepSizeController | None = None,
    max_steps: int = 4096,
    adjoint: diffrax.AbstractAdjoint | None = None,
    args: PyTree = None,
) -> diffrax.Solution:
    """Solve ``dy/dt = field(t, y, args)`` on the sphere from ``t0`` to ``t1 > t0``.

    A checked :func:`diffrax.diffeqsolve`:

    * ``field``: a callable ``v(t, y, args)`` (wrapped in :class:`diffrax.ODETerm`), a diffrax
      term, or a tuple of those (a :class:`diffrax.MultiTerm`, for :class:`LieTrotter` and
      :class:`Strang`).
    * ``y0``: floating array of shape ``(..., n, d)``, ``d >= 2``, finite, rows of unit norm
      (to ``32 sqrt(d) eps`` of its dtype).
    * Steps: exactly one of ``dt0 > 0`` (first/constant step), ``num_steps`` (that many equal
      steps, ``diffrax.StepTo``: a depth-``num_steps`` Transformer; ``max_steps`` is then set
      to ``num_steps``), or an adaptive ``stepsize_controller`` with ``dt0=None``.
    * Times (``t0``, ``t1``, ``dt0``, ``SaveAt(ts=...)``) are cast to ``y0``'s dtype, so a
      float32 state stays float32 even under ``jax_enable_x64`` with Python-float times.
    * ``adjoint`` defaults to :class:`diffrax.RecursiveCheckpointAdjoint`;
      :class:`diffrax.BacksolveAdjoint` is refused (it ignores the retraction).
    * ``saveat`` defaults to ``SaveAt(t1=True)``.

    Never returns a wrong state silently: if the solve hits ``max_steps`` or fails, it raises
    :class:`SolveError`, or, under ``jit``/``vmap``, a runtime error carrying the same message
    (via :func:`equinox.error_if`). Invalid inputs raise ``ValueError`` (runtime errors for
    value checks on traced inputs).
    """
    if not isinstance(solver, AbstractSolver):
        raise ValueError(f"solver must be a diffrax.AbstractSolver, got {type(solver).__name__}")
    terms = _as_terms(field)

    # --- the state -------------------------------------------------------------------------
    y0 = jnp.asarray(y0)
    if not jnp.issubdtype(y0.dtype, jnp.floating):
        raise ValueError(f"y0 must be a floating-point array, got dtype {y0.dtype}")
    if y0.ndim < 1 or y0.shape[-1] < 2:
        raise ValueError(
            f"y0 must have shape (..., n, d) with d >= 2 (points of S^(d-1)), got {y0.shape}"
        )
    dtype, d = y0.dtype, y0.shape[-1]
    y0 = _check(y0, ~jnp.all(jnp.isfinite(y0)), "y0 contains NaN or inf")
    tol = _unit_tolerance(dtype, d)
    y0 = _check(
        y0,
        sphere.norm_drift(y0) > tol,
        f"the rows of y0 must be unit vectors (| |y0_i| - 1 | <= {tol:.1e} in {dtype}); "
        "normalise them first, e.g. with svflow_jax.sphere.retract",
    )

    # --- times, in the state's dtype --------------------------------------------------------
    t0 = jnp.asarray(t0, dtype=dtype)
    t1 = jnp.asarray(t1, dtype=dtype)
    if t0.ndim != 0 or t1.ndim != 0:
        raise ValueError("t0 and t1 must be scalars")
    y0 = _check(y0, ~(t1 > t0), "t1 must be greater than t0 (and both finite)")

    if num_steps is not None:
        if dt0 is not None or stepsize_controller is not None:
            raise ValueError("give either num_steps or (dt0 and/or stepsize_controller), not both")
        if int(num_steps) < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps}")
        num_steps = int(num_steps)
        stepsize_controller = diffrax.StepTo(ts=jnp.linspace(t0, t1, num_steps + 1))
        max_steps = num_steps
    else:
        if stepsize_controller is None:
            stepsize_controller = diffrax.ConstantStepSize()
        if dt0 is None and isinstance(stepsize_controller, diffrax.ConstantStepSize):
            raise ValueError(
                "no step size: give dt0 > 0, num_steps, or an adaptive stepsize_controller"
            )
        if dt0 is not None:
            dt0 = jnp.asarray(dt0, dtype=dtype)
            if dt0.ndim != 0:
                raise ValueError("dt0 must be a scalar")
            y0 = _check(y0, ~(dt0 > 0), "dt0 must be positive (and finite)")
    if int(max_steps) < 1:
        raise ValueError(f"max_steps must be a positive integer, got {max_steps}")

    if saveat is None:
        saveat = diffrax.SaveAt(t1=True)
    saveat = eqx.tree_at(
        lambda s: [
            sub.ts for sub in jtu.tree_leaves(s.subs, is_leaf=_is_subsaveat) if sub.ts is not None
        ],
        saveat,
        replace_fn=lambda ts: jnp.asarray(ts, dtype=dtype),
    )

    if adjoint is None:
        adjoint = diffrax.RecursiveCheckpointAdjoint()
    if isinstance(adjoint, diffrax.BacksolveAdjoint):
        raise ValueError(
            "BacksolveAdjoint solves the continuous adjoint in the ambient space and ignores the "
            "retraction; use diffrax.RecursiveCheckpointAdjoint (the default)"
        )

    sol = diffrax.diffeqsolve(
        terms,
        solver,
        t0,
        t1,
        dt0,
        y0,
        args=args,
        saveat=saveat,
        stepsize_controller=stepsize_controller,
        adjoint=adjoint,
        max_steps=int(max_steps),
        throw=False,
    )
    return _raise_if_failed(sol, int(max_steps))


def _is_subsaveat(x) -> bool:
    return isinstance(x, diffrax.SubSaveAt)


def _raise_if_failed(sol: diffrax.Solution, max_steps: int) -> diffrax.Solution:
    """Raise unless the solve succeeded and its saved values are NaN-free (eagerly, or at run
    time under tracing).

    diffrax pads unused output slots with ``inf``, never NaN, so a NaN in ``sol.ys`` means the
    field produced one (fixed-step solvers do not notice it themselves).
    """
    result = sol.result
    leaves = [x for x in jtu.tree_leaves(sol.ys) if jnp.issubdtype(x.dtype, jnp.inexact)]
    has_nan = jnp.any(jnp.stack([jnp.any(jnp.isnan(x)) for x in leaves])) if leaves else False
    max_steps_msg = _MAX_STEPS_MSG.format(max_steps)
    if _is_concrete((result, has_nan)):
        if result == RESULTS.max_steps_reached:
            raise SolveError(max_steps_msg)
        if result != RESULTS.successful:
            raise SolveError(_FAILED_MSG.format(RESULTS[result]))
        if bool(has_nan):
            raise SolveError(_NAN_MSG)
        return sol
    failed = result != RESULTS.successful
    other_failure = failed & (result != RESULTS.max_steps_reached)
    # Under vmap the largest index over the batch picks the message, so members that do not
    # raise get the lowest index (0, shared with max_steps) and never mask a failure.
    index = jnp.where(other_failure, 2, jnp.where(has_nan, 1, 0))
    msgs = [max_steps_msg, _NAN_MSG, _FAILED_MSG.format("see diffrax.RESULTS")]
    return eqx.branched_error_if(sol, failed | has_nan, index, msgs)
