"""``solve``: :func:`diffrax.diffeqsolve` on the sphere, with its inputs checked.

The problem is ``dy/dt = v(t, y, args)`` for ``t`` in ``[t0, t1]``, with ``y(t0) = y0`` a state
of unit rows (``| |y0_i| - 1 | <= sphere.unit_tolerance(dtype, d)``) and ``v`` tangent
(``y_i . v_i = 0``), so that the exact flow stays on ``(S^{d-1})^n``. :func:`solve` refuses what
would give a wrong answer without saying so:

* a solver whose steps leave the sphere (a bare ``diffrax.Heun()`` drifts off by ``~h^p``),
  unless asked for with ``off_sphere=True`` (:func:`stays_on_sphere` says which do not);
* a solver given fields it cannot take: two fields (a sequential or Macaron block) for a
  single-field solver, one field for a splitting;
* a state off the sphere, NaN, inconsistent step options, :class:`diffrax.BacksolveAdjoint`;
* a solve that stops before ``t1`` (``max_steps``, step-size control) or returns NaN: it raises
  :class:`SolveError` (a runtime error under ``jit``) instead of returning a wrong state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, get_origin

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from diffrax import RESULTS, AbstractSolver, AbstractTerm, AbstractWrappedSolver, MultiTerm, ODETerm
from jaxtyping import Array, ArrayLike, Float, PyTree

from svflow_jax import sphere

from .adjoint import ScanAdjoint, fixed_step_scan, step_times
from .splitting import AbstractSplitting

__all__ = ["SolveError", "solve", "stays_on_sphere", "time_value"]


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


# ---------------------------------------------------------------------------------------------
# The solver: does it stay on the sphere, can it take the terms?
# ---------------------------------------------------------------------------------------------


def stays_on_sphere(solver: AbstractSolver) -> bool:
    """Whether every step of ``solver`` maps the sphere to itself (what :func:`solve` requires
    unless ``off_sphere=True``).

    True for an :class:`AbstractSphereSolver` (Euler-type, Lie-group methods, ...), for
    ``Retracted(...)``, and for any solver whose class has a truthy class attribute
    ``stays_on_sphere``: a solver of your own written from scratch (subclassing
    :class:`diffrax.AbstractSolver` directly) declares it with
    ``stays_on_sphere: ClassVar[bool] = True``. A splitting (:class:`LieTrotter`,
    :class:`Strang`) stays on the sphere iff its sub-step does. Bare diffrax solvers do not:
    ``diffrax.Heun()`` leaves the sphere by ``~h^p`` per step.
    """
    if isinstance(solver, AbstractSplitting):
        return bool(getattr(type(solver), "stays_on_sphere", False)) and stays_on_sphere(
            solver.substep
        )
    return bool(getattr(type(solver), "stays_on_sphere", False))


def _name(solver: Any) -> str:
    """``Retracted(diffrax.Heun())``, ``LieTrotter(RetractedEuler())``, ...: for messages."""
    cls = type(solver)
    prefix = "diffrax." if cls.__module__.split(".")[0] == "diffrax" else ""
    if isinstance(solver, AbstractSplitting):
        return f"{cls.__name__}({_name(solver.substep)})"
    if isinstance(solver, AbstractWrappedSolver) and isinstance(
        getattr(solver, "solver", None), AbstractSolver
    ):
        return f"{prefix}{cls.__name__}({_name(solver.solver)})"
    return f"{prefix}{cls.__name__}()"


def _off_sphere_message(solver: AbstractSolver) -> str:
    name = _name(solver)
    if isinstance(solver, AbstractSplitting):
        inner = solver.substep
        while isinstance(inner, AbstractSplitting):
            inner = inner.substep
        fix = f"wrap its sub-step: {type(solver).__name__}(Retracted({_name(inner)}))"
    else:
        fix = f"wrap it as Retracted({name})"
    return (
        f"svflow_jax.solvers.solve: {name} does not stay on the sphere: its steps leave "
        "S^(d-1) (|y| drifts by ~h^p per step of a p-th order method) and nothing brings them "
        f"back. To solve on the sphere, {fix} (stages read on the sphere, output retracted, "
        "same order and error estimate), or pass off_sphere=True to integrate in R^d on "
        "purpose. A solver of your own whose steps map the sphere to itself subclasses "
        "svflow_jax.solvers.AbstractSphereSolver or sets the class attribute "
        "stays_on_sphere = True."
    )


def _takes_multiterm(solver: AbstractSolver) -> bool:
    """Whether the solver's ``term_structure`` is a :class:`diffrax.MultiTerm` (splittings,
    IMEX solvers) rather than one term."""
    structure = solver.term_structure
    origin = get_origin(structure) or structure
    return isinstance(origin, type) and issubclass(origin, MultiTerm)


def _check_terms_fit(solver: AbstractSolver, terms: PyTree[AbstractTerm]) -> None:
    """A clear ``ValueError`` when ``solver`` cannot take ``terms`` (instead of a TypeError
    about a tuple deep inside the step)."""
    name = _name(solver)
    two = isinstance(terms, MultiTerm)
    if two and not _takes_multiterm(solver):
        raise ValueError(
            f"svflow_jax.solvers.solve: {name} takes one field, but got {len(terms.terms)} "
            "(a tuple of fields or a diffrax.MultiTerm, e.g. the (attention, ffn) of a "
            "sequential or Macaron block). Split the block: "
            f"LieTrotter({name}) (sequential: attention, then FFN) or Strang({name}) (Macaron: "
            "half FFN, attention, half FFN); or use a parallel block, one field that sums the "
            "branches (e.g. flow.SumField(attention, ffn))."
        )
    if isinstance(solver, AbstractSplitting):
        if not two:
            raise ValueError(
                f"svflow_jax.solvers.solve: {name} splits a block of two fields and takes a "
                "tuple (field_a, field_b) (a diffrax.MultiTerm of two terms), but got one "
                f"field. For one field use the sub-step {_name(solver.substep)} directly."
            )
        if len(terms.terms) != 2:
            raise ValueError(
                f"svflow_jax.solvers.solve: {name} splits exactly two fields, got "
                f"{len(terms.terms)}"
            )


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _is_concrete(x) -> bool:
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jtu.tree_leaves(x))


def time_value(t, dtype):
    """A time for :func:`diffrax.diffeqsolve` with states of ``dtype``.

    A known float64 time is passed as a Python float: diffrax then checks it while tracing,
    instead of putting a runtime check (a host callback, which keeps a program out of JAX's
    persistent compilation cache) into the program. Other times are arrays of ``dtype``: a
    Python float would promote float32 states to float64 under ``jax_enable_x64``.
    """
    known = not isinstance(t, jax.core.Tracer) and np.ndim(t) == 0
    if known and jnp.dtype(dtype) == jnp.float64:
        return float(t)
    return jnp.asarray(t, dtype=dtype)


def _check(x: PyTree, bad, message: str, throw: bool = True) -> PyTree:
    """Raise ``ValueError(message)`` if ``bad``; under tracing, a runtime error instead (or
    nothing, with ``throw=False``)."""
    if _is_concrete(bad):
        if bool(bad):
            raise ValueError(message)
        return x
    return eqx.error_if(x, bad, message) if throw else x


def _as_terms(field) -> PyTree[AbstractTerm]:
    if isinstance(field, AbstractTerm):
        return field
    if isinstance(field, (tuple, list)):
        if len(field) < 2:
            raise ValueError(
                f"a tuple of fields is a block of several fields (e.g. (attention, ffn)) and "
                f"needs at least two, got {len(field)}; pass a single field by itself"
            )
        return MultiTerm(*(_as_terms(f) for f in field))
    if callable(field):
        return ODETerm(field)
    raise ValueError(
        "field must be a callable v(t, y, args), a diffrax term, or a tuple of them (for the "
        f"splitting solvers), got {type(field).__name__}"
    )


def _is_subsaveat(x) -> bool:
    return isinstance(x, diffrax.SubSaveAt)


# ---------------------------------------------------------------------------------------------
# The first step of an adaptive solve
# ---------------------------------------------------------------------------------------------


def initial_step(
    terms: PyTree, solver: AbstractSolver, t0, t1, y0: Array, args: PyTree,
    controller: diffrax.PIDController, with_slope: bool = False,
) -> Array | tuple[Array, Array]:
    """The first step of an adaptive solve, by Hairer, Norsett and Wanner's rule (Solving ODEs
    I, II.4), as torchdiffeq and SciPy choose it (with ``with_slope``: and ``f(t0, y0)``, which
    an FSAL solver then reuses as its first stage, as torchdiffeq does).

    With ``sc = atol + rtol |y0|``, ``d0 = |y0 / sc|``, ``d1 = |f0 / sc|`` (the controller's
    norm): a trial step ``h0 = 0.01 d0 / d1`` (``1e-6`` if either is below ``1e-5``), then
    ``d2 = |(f(t0 + h0, y0 + h0 f0) - f0) / sc| / h0`` and
    ``h1 = (0.01 / max(d1, d2))^(1 / q)`` (``q`` the solver's error order); the step is
    ``min(100 h0, h1, t1 - t0)``. Two field evaluations.

    diffrax computes the same rule only when its terms are a plain ``ODETerm``; the terms it
    sees inside ``diffeqsolve`` are wrapped, so it starts every adaptive solve at ``0.01``
    whatever the problem: on a unit-time attention flow at ``rtol = atol = 1e-6`` that cost one
    step more than torchdiffeq (4 instead of 3). With this rule, and ``f(t0, y0)`` handed to an
    FSAL solver as its first stage, ``Retracted(Dopri5())`` on the peer benchmark's attention
    flow (``n = 32, d = 64``) takes 20 field evaluations, as torchdiffeq's dopri5, with the same
    error against a tight reference (6.4e-7); diffrax's defaults took 25.
    """
    rtol, atol, norm = controller.rtol, controller.atol, controller.norm
    dtype = y0.dtype
    scale = atol + rtol * jnp.abs(y0)
    f0 = solver.func(terms, t0, y0, args)
    d0, d1 = norm(y0 / scale), norm(f0 / scale)
    small = (d0 < 1e-5) | (d1 < 1e-5)
    h0 = jnp.where(small, 1e-6, 0.01 * d0 / jnp.where(small, 1.0, d1)).astype(dtype)
    f1 = solver.func(terms, t0 + h0, y0 + h0 * f0, args)
    d2 = norm((f1 - f0) / scale) / h0
    largest = jnp.maximum(d1, d2)
    order = solver.error_order(terms)
    h1 = jnp.where(largest <= 1e-15, jnp.maximum(1e-6, h0 * 1e-3),
                   (0.01 / jnp.where(largest <= 1e-15, 1.0, largest)) ** (1.0 / order))
    step = jnp.minimum(jnp.minimum(100 * h0, h1), t1 - t0)
    if controller.dtmax is not None:
        step = jnp.minimum(step, controller.dtmax)
    return (step.astype(dtype), f0) if with_slope else step.astype(dtype)


def _fsal_state(solver, terms, t0, dt0, y0, args, f0):
    """The first solver state of an FSAL Runge-Kutta solver with its cached slope set to
    ``f0 = f(t0, y0)`` (already evaluated by :func:`initial_step`), so that the first step does
    not evaluate it again; ``None`` (diffrax's own state) for any other solver."""
    if not isinstance(solver, diffrax.AbstractRungeKutta):
        return None
    state = solver.init(terms, t0, t0 + dt0, y0, args)
    if not (isinstance(state, tuple) and len(state) == 2
            and jtu.tree_structure(state[1]) == jtu.tree_structure(f0)):
        return None
    return jnp.array(False), f0


# ---------------------------------------------------------------------------------------------
# solve
# ---------------------------------------------------------------------------------------------


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
    off_sphere: bool = False,
    throw: bool = True,
) -> diffrax.Solution:
    """Solve ``dy/dt = field(t, y, args)`` on the sphere from ``t0`` to ``t1 > t0``.

    A checked :func:`diffrax.diffeqsolve`:

    * ``field``: a callable ``v(t, y, args)`` (wrapped in :class:`diffrax.ODETerm`), a diffrax
      term, or a tuple of two or more of those (a :class:`diffrax.MultiTerm`, for
      :class:`LieTrotter` and :class:`Strang`). A single-field solver given a tuple, or a
      splitting given one field, raises ``ValueError`` saying what to use instead.
    * ``solver``: must stay on the sphere (:func:`stays_on_sphere`): an
      :class:`AbstractSphereSolver`, ``Retracted(any diffrax solver)``, a splitting of such
      sub-steps, or a class with ``stays_on_sphere = True``. A bare diffrax solver
      (``diffrax.Heun()``) leaves the sphere by ``~h^p`` and is refused unless
      ``off_sphere=True`` (integrate in ``R^d`` on purpose, e.g. to measure that drift).
    * ``y0``: floating array of shape ``(..., n, d)``, ``d >= 2``, finite, rows of unit norm
      (to :func:`svflow_jax.sphere.unit_tolerance`, ``32 sqrt(d) eps`` of its dtype).
    * Steps: exactly one of ``dt0 > 0`` (first/constant step), ``num_steps`` (that many equal
      steps ``(t1 - t0) / num_steps``: a depth-``num_steps`` Transformer; ``max_steps`` is then
      set to ``num_steps``), or an adaptive ``stepsize_controller`` with ``dt0=None``.
    * Times (``t0``, ``t1``, ``dt0``, ``SaveAt(ts=...)``) are cast to ``y0``'s dtype, so a
      float32 state stays float32 even under ``jax_enable_x64`` with Python-float times.
    * ``adjoint``: with ``num_steps`` (a Transformer's depth) and a save of ``t0`` / ``t1`` /
      every step, the default is :class:`ScanAdjoint` (one ``lax.scan`` of the steps,
      Runge-Kutta stages unrolled, each step recomputed once in the backward pass; memory one
      state per step, as the Transformer itself); otherwise
      :class:`diffrax.RecursiveCheckpointAdjoint` (checkpoints, memory ~ log(steps), each
      step recomputed several times: adaptive solves, dense output).
      ``ScanAdjoint(remat=policy)`` (with ``num_steps`` only) stores what a
      :mod:`jax.checkpoint_policies` policy names. :class:`diffrax.BacksolveAdjoint` is
      refused (it ignores the retraction).
    * ``saveat`` defaults to ``SaveAt(t1=True)``.

    Never returns a wrong state silently: if the solve hits ``max_steps`` or fails, it raises
    :class:`SolveError`, or, under ``jit``/``vmap``, a runtime error carrying the same message
    (via :func:`equinox.error_if`). Invalid inputs raise ``ValueError`` (runtime errors for
    value checks on traced inputs). ``throw=False`` drops the runtime checks from a traced
    program (they are host callbacks, which keep the program out of JAX's persistent
    compilation cache); the caller then checks ``sol.result`` and NaN itself. Eager calls
    always check.
    """
    if not isinstance(solver, AbstractSolver):
        raise ValueError(f"solver must be a diffrax.AbstractSolver, got {type(solver).__name__}")
    if not isinstance(off_sphere, bool):
        raise ValueError(f"off_sphere must be a bool, got {type(off_sphere).__name__}")
    terms = _as_terms(field)
    _check_terms_fit(solver, terms)
    if not off_sphere and not stays_on_sphere(solver):
        raise ValueError(_off_sphere_message(solver))

    # --- the state -------------------------------------------------------------------------
    y0 = jnp.asarray(y0)
    if not jnp.issubdtype(y0.dtype, jnp.floating):
        raise ValueError(f"y0 must be a floating-point array, got dtype {y0.dtype}")
    if y0.ndim < 1 or y0.shape[-1] < 2:
        raise ValueError(
            f"y0 must have shape (..., n, d) with d >= 2 (points of S^(d-1)), got {y0.shape}"
        )
    dtype, d = y0.dtype, y0.shape[-1]
    y0 = _check(y0, ~jnp.all(jnp.isfinite(y0)), "y0 contains NaN or inf", throw)
    tol = sphere.unit_tolerance(dtype, d)
    y0 = _check(
        y0,
        jnp.any(sphere.off_sphere(y0, tol)),
        f"the rows of y0 must be unit vectors (| |y0_i| - 1 | <= {tol:.1e} in {dtype}); "
        "normalise them first, e.g. with svflow_jax.sphere.retract",
        throw,
    )

    # --- times, in the state's dtype --------------------------------------------------------
    t0, t1 = time_value(t0, dtype), time_value(t1, dtype)
    if np.ndim(t0) != 0 or np.ndim(t1) != 0:
        raise ValueError("t0 and t1 must be scalars")
    y0 = _check(y0, jnp.logical_not(t1 > t0), "t1 must be greater than t0 (and both finite)",
                throw)

    solver_state = None  # diffrax's own, unless the first slope is already known (FSAL)
    if num_steps is not None:
        if dt0 is not None or stepsize_controller is not None:
            raise ValueError("give either num_steps or (dt0 and/or stepsize_controller), not both")
        if int(num_steps) < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps}")
        num_steps = int(num_steps)
        # Constant steps (t1 - t0) / num_steps land on t1 in exactly num_steps steps (diffrax
        # clips the last one to t1); unlike StepTo, no runtime check of the grid goes into
        # the program, so it stays cacheable.
        dt0 = (t1 - t0) / num_steps
        stepsize_controller = diffrax.ConstantStepSize()
        max_steps = num_steps
    else:
        if stepsize_controller is None:
            stepsize_controller = diffrax.ConstantStepSize()
        if dt0 is None and isinstance(stepsize_controller, diffrax.ConstantStepSize):
            raise ValueError(
                "no step size: give dt0 > 0, num_steps, or an adaptive stepsize_controller"
            )
        if dt0 is not None:
            dt0 = time_value(dt0, dtype)
            if np.ndim(dt0) != 0:
                raise ValueError("dt0 must be a scalar")
            y0 = _check(y0, jnp.logical_not(dt0 > 0), "dt0 must be positive (and finite)", throw)
        elif isinstance(stepsize_controller, diffrax.PIDController):
            dt0, f0 = initial_step(terms, solver, t0, t1, y0, args, stepsize_controller,
                                   with_slope=True)
            solver_state = _fsal_state(solver, terms, t0, dt0, y0, args, f0)
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
        adjoint = (ScanAdjoint() if num_steps is not None and _plain_saveat(saveat)
                   else diffrax.RecursiveCheckpointAdjoint())
    if isinstance(adjoint, ScanAdjoint) and num_steps is None:
        name = type(adjoint).__name__
        raise ValueError(
            f"{name} is for fixed-step solves: give num_steps (with an adaptive "
            "controller or dt0 it would run all max_steps iterations); for those use "
            "diffrax.RecursiveCheckpointAdjoint (the default)"
        )
    if isinstance(adjoint, diffrax.BacksolveAdjoint):
        raise ValueError(
            "BacksolveAdjoint solves the continuous adjoint in the ambient space and ignores the "
            "retraction; use diffrax.RecursiveCheckpointAdjoint (the default)"
        )

    if isinstance(adjoint, ScanAdjoint) and _plain_saveat(saveat):
        sol = _scan_solve(terms, solver, t0, t1, num_steps, y0, args, saveat, adjoint.remat)
    else:
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
            solver_state=solver_state,
            throw=False,
        )
    if throw or _is_concrete((sol.result, sol.ys)):  # throw=False: no callback in a program
        return _raise_if_failed(sol, int(max_steps))
    return sol


def _plain_saveat(saveat: diffrax.SaveAt) -> bool:
    """A save of ``t0``, ``t1`` and/or every step, no dense output, no ``ts``: what the fixed
    step scan of :class:`ScanAdjoint` returns without interpolating."""
    return (not saveat.dense and isinstance(saveat.subs, diffrax.SubSaveAt)
            and saveat.subs.ts is None)


def _scan_solve(terms, solver, t0, t1, num_steps: int, y0, args, saveat, remat,
                ) -> diffrax.Solution:
    """The fixed-step solve of :class:`ScanAdjoint` (:func:`fixed_step_scan`, stages
    unrolled), as the :class:`diffrax.Solution` :func:`diffrax.diffeqsolve` would return for
    the same ``SaveAt(t0=..., steps=..., t1=...)``."""
    sub = saveat.subs
    dtype = y0.dtype
    ys = fixed_step_scan(solver, terms, y0, t0, t1, num_steps, args, remat=remat,
                         save_steps=sub.steps)
    times, saved = [], []
    if sub.t0:
        times.append(jnp.asarray(t0, dtype)[None])
        saved.append(jtu.tree_map(lambda y: y[None], y0))
    if sub.steps:
        times.append(step_times(t0, t1, num_steps, dtype)[1:])
        saved.append(ys)
    if sub.t1 and not sub.steps:  # as diffrax: the last step's save is t1's
        times.append(jnp.asarray(t1, dtype)[None])
        saved.append(jtu.tree_map(lambda y: y[None], ys))
    ts = jnp.concatenate(times)
    states = jtu.tree_map(lambda *y: jnp.concatenate(y), *saved)
    values = jax.vmap(lambda t, y: sub.fn(t, y, args))(ts, states)
    return diffrax.Solution(
        t0=t0, t1=t1, ts=ts, ys=values, interpolation=None,
        stats={"num_steps": num_steps, "num_accepted_steps": num_steps,
               "num_rejected_steps": 0, "max_steps": num_steps},
        result=RESULTS.successful, solver_state=None, controller_state=None, made_jump=None,
        event_mask=None,
    )


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
