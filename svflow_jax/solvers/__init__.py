"""Diffrax solvers that stay on the sphere.

A Transformer layer ``x <- R(x + h v_t(x))`` (``R(y) = y / |y|``) is one step of the retracted
forward-Euler method for the ODE ``dx/dt = v_t(x)`` on ``S^{d-1}`` (docs/theory.md sections 8, 9).
This package provides that step and its higher-order relatives as real
:class:`diffrax.AbstractSolver` subclasses, so they work with :func:`diffrax.diffeqsolve`,
every :class:`diffrax.SaveAt`, step-size controllers and
:class:`diffrax.RecursiveCheckpointAdjoint`.

The state is an array of shape ``(..., n, d)`` whose rows (tokens) are unit vectors (any PyTree
of such arrays works for the retraction-based solvers). A vector field ``v(t, X, args)``
returns, per row, a vector tangent at that row.

Solvers (global order on a smooth field in brackets), one family per module:

* :mod:`.euler`: :class:`RetractedEuler` ``y1 = R(y0 + h f(t0, y0))``: the Transformer layer
  [1]; :class:`GeodesicEuler` ``y1 = exp_{y0}(h f(t0, y0))``: Euler along great circles [1];
  :class:`VariableStepRetractedEuler`: the standard post-norm layer ``R(y + h u)`` with an
  unprojected branch, a retracted Euler step with ``h' = h / (1 + h y.u)`` [1].
* :mod:`.runge_kutta`: :class:`Retracted` wraps ANY diffrax solver (Heun [2], Midpoint [2],
  :class:`RK4` [4], Tsit5 [5], Dopri5 [5], Dopri8 [8], ...) keeping its order, its error
  estimate (adaptive stepping) and its dense output, all retracted onto the sphere.
* :mod:`.lie_group`: :class:`CrouchGrossman3` [3]: each stage freezes the so(d) generator of
  every token and acts on the sphere by rotations (write another Crouch-Grossman method by
  subclassing :class:`AbstractCrouchGrossman` with its tableau); :class:`RKMK4` [4]:
  Runge-Kutta-Munthe-Kaas with the classical RK4 tableau (its exponentials act in the span of
  ``y0`` and the four stage values: ``5 x 5`` matrices per token, never ``d x d``).
* :mod:`.splitting`: :class:`LieTrotter`, :class:`Strang`, :class:`Swapped`: splittings of a
  :class:`diffrax.MultiTerm` of two fields (attention block then FFN block; Macaron block) with
  any single-step sphere solver as sub-step.
* :mod:`._interpolation`: dense output on the sphere; :mod:`.base`:
  :class:`AbstractSphereSolver` (subclass it to write a layer design) and :func:`within_step`.

Per-layer weights: every solver reads its terms through :func:`within_step`, so all stages of a
step inside layer ``l`` read that layer's weights ``theta_l`` (a stage at ``c = 1`` would
otherwise read layer ``l + 1``, making every method first order); steps aligned with the layers
keep the method's order.

:func:`solve` (:mod:`.solve`) wraps :func:`diffrax.diffeqsolve` with input validation
(a solver that leaves the sphere, fields the solver cannot take, a state off the sphere, ...)
and an error (never a silently wrong state) when the solve fails, e.g. by running out of
``max_steps``. :mod:`.catalogue` names the methods (:data:`CATALOGUE`, :class:`Method`,
``catalogue.get``): one record per method, read by every ``svflow`` command and the notebooks.

Adjoints: use :class:`diffrax.RecursiveCheckpointAdjoint` (the default), which differentiates
the discrete steps themselves, recomputing them from checkpoints, or, for fixed-step solves,
:class:`ScanAdjoint` (:mod:`.adjoint`, the default with ``num_steps``), one ``lax.scan`` whose
steps are each recomputed once in the backward pass.
:class:`diffrax.BacksolveAdjoint` solves the continuous adjoint ODE backwards in the ambient
space and does not know about the retraction: its gradients are not those of the retracted
discretisation, so :func:`solve` refuses it.
"""

from ._interpolation import (
    GeodesicInterpolation,
    RetractedInterpolation,
    RetractedLinearInterpolation,
)
from .adjoint import ScanAdjoint, fixed_step_scan, unroll_stages
from .base import AbstractSphereSolver, within_step
from .catalogue import (
    CATALOGUE,
    Method,
    count_evaluations,
    evaluations,
    from_tableau,
    import_path,
    register,
)
from .euler import GeodesicEuler, RetractedEuler, VariableStepRetractedEuler
from .lie_group import RKMK4, AbstractCrouchGrossman, CrouchGrossman3
from .runge_kutta import RK4, Retracted, WithinStep
from .solve import SolveError, solve, stays_on_sphere
from .splitting import AbstractSplitting, LieTrotter, Strang, Swapped

__all__ = [
    "AbstractSphereSolver",
    "RetractedEuler",
    "GeodesicEuler",
    "VariableStepRetractedEuler",
    "Retracted",
    "RK4",
    "WithinStep",
    "AbstractCrouchGrossman",
    "CrouchGrossman3",
    "RKMK4",
    "AbstractSplitting",
    "LieTrotter",
    "Strang",
    "Swapped",
    "RetractedLinearInterpolation",
    "GeodesicInterpolation",
    "RetractedInterpolation",
    "within_step",
    "SolveError",
    "ScanAdjoint",
    "fixed_step_scan",
    "unroll_stages",
    "solve",
    "stays_on_sphere",
    "Method",
    "CATALOGUE",
    "from_tableau",
    "evaluations",
    "import_path",
    "register",
    "count_evaluations",
]
