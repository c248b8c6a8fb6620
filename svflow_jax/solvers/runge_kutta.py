"""Any diffrax solver on the sphere, by retraction; the classical RK4 tableau.

:class:`Retracted` runs a solver of order ``p`` on the ambient ODE ``y' = f(t, R(y))``,
``R(y) = y / |y|`` per row, and retracts its output. For a tangent field (``y . f(R(y)) = 0``)
that ODE conserves ``|y|``, and on ``|y| = 1`` it is the spherical flow, so one step from a
point of the sphere is ``O(h^{p+1})`` close to the exact flow ``x`` (a point of the sphere), and
``|R(y) - x| <= 2 |y - x|`` (``R`` moves ``y`` by its distance to the sphere, at most
``|y - x|``): the order stays ``p``. The stages are read on the sphere
(docs/theory.md section 8: stage states retracted), the error estimate is the inner solver's
(adaptive stepping works unchanged) and the dense output is the inner interpolant, retracted.

:class:`RK4` is Kutta's classical method as a diffrax explicit Runge-Kutta method:

    c = (0, 1/2, 1/2, 1),  a21 = 1/2, a32 = 1/2, a43 = 1,  b = (1/6, 1/3, 1/3, 1/6),

with an FSAL fifth stage ``f(t1, y1)`` that gives the embedded third-order solution
``b_hat = (1/6, 1/3, 1/3, 0, 1/6)`` and the end-point slope of the cubic Hermite dense output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import diffrax
import jax.tree_util as jtu
import numpy as np
from diffrax import (
    AbstractLocalInterpolation,
    AbstractSolver,
    AbstractTerm,
    AbstractWrappedSolver,
    ButcherTableau,
    MultiTerm,
)
from jaxtyping import PyTree

from ._interpolation import _RetractedInterpolationFactory
from .base import _retract_tree, within_step

__all__ = ["Retracted", "RK4", "WithinStep"]


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


class WithinStep(AbstractWrappedSolver):
    """Any diffrax solver, with every stage of a step reading the weights of the layer the
    step covers (:func:`within_step`); nothing else changes (no retraction).

    For ambient ODEs with per-layer weights, such as a pre-norm stack's ``dy/dt = F_t(y)``:
    a stage at ``c = 1`` of a step aligned with layer ``l`` then reads ``theta_l``, not
    ``theta_{l+1}``, and the solver keeps its order on that ODE. As in :class:`Retracted`, an
    FSAL cache is discarded (``made_jump=True``) whenever the terms were restricted.
    """

    solver: AbstractSolver

    @property
    def term_structure(self):
        return self.solver.term_structure

    @property
    def interpolation_cls(self):  # pyright: ignore
        return self.solver.interpolation_cls

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
        return self.solver.init(terms, t0, t1, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        terms, restricted = within_step(terms, t0, t1)
        if restricted:
            made_jump = True
        return self.solver.step(terms, t0, t1, y0, args, solver_state, made_jump)

    def func(self, terms, t0, y0, args):
        return self.solver.func(terms, t0, y0, args)


class Retracted(WithinStep):
    """Adds the retraction ``R(y) = y / |y|`` to any diffrax solver.

    * the vector field is evaluated at retracted states: ``vf(t, y) = f(t, R(y))``, so every
      Runge-Kutta stage is read on the sphere (docs/theory.md section 8: stage states retracted);
    * the step output is retracted: ``y1 = R(inner_step(y0))``;
    * dense output (``SaveAt(ts=...)``, ``SaveAt(dense=True)``) is the inner interpolation,
      retracted (:class:`RetractedInterpolation`).

    The inner solver's order is kept (see :class:`_RetractedTerm`), and so is its error
    estimate, which is a valid local error estimate of the ambient solve; hence adaptive
    stepping with :class:`diffrax.PIDController` works as for the inner solver. FSAL solvers
    (Tsit5, Dopri5, ...) stay consistent: the cached ``f(t1, y1)`` is ``f(t1, R(y1))``, which is
    exactly the field at the retracted next state.

    Per-layer weights: every step reads its terms through :func:`within_step`, so all stages of
    a step inside layer ``l`` use ``theta_l``. The FSAL cache ``f(t1, y1)`` of the previous step
    was then read with the previous layer's weights, so whenever the terms were restricted the
    inner solver is told ``made_jump=True`` and re-evaluates its first stage: on a
    piecewise-constant field an FSAL solver costs one more evaluation per step (Tsit5: 7
    instead of 6, :class:`RK4`: 5 instead of 4). Continuous paths are not restricted and cost
    nothing extra.

    ``isinstance`` checks (adaptive, implicit, ...) are forwarded to the inner solver. (A
    :class:`WithinStep` that also retracts: the order, term structure and contr kwargs are
    the inner solver's.)
    """

    stays_on_sphere: ClassVar[bool] = True

    @property
    def interpolation_cls(self):  # pyright: ignore
        return _RetractedInterpolationFactory(self.solver.interpolation_cls)

    def init(self, terms, t0, t1, y0, args):
        return self.solver.init(_retract_terms(terms), t0, t1, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        terms, restricted = within_step(terms, t0, t1)
        if restricted:  # an FSAL cache holds the previous step's weights: do not reuse it
            made_jump = True
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
