"""The solver registry: one list of named sphere solvers for ``svflow verify``, ``svflow sweep``
and the notebooks.

A :class:`SolverSpec` says how to build a solver that stays on the sphere, the order ``p`` its
global error ``O(h^p)`` should show on a smooth field, and its cost: field evaluations per
step, i.e. sub-layers per block (for an FSAL method, a step after the first: its first stage
is the previous step's last). A sweep over ``[0, T]`` uses ``num_sizes`` step counts from
``step_range[0]`` to ``step_range[1]``. ``unretracted`` builds the same method in ``R^d``, for
the drift study; ``None`` means the method is on the sphere by construction (geodesic and
Lie-group steps).

:data:`SOLVERS` holds the registered specs, in order; :func:`register` adds one (a name may
not be registered twice unless ``replace=True``); :func:`get_solver` returns a registered spec
or imports one from ``"package.module:Attr"``, where ``Attr`` is a :class:`SolverSpec`, a
solver class, a zero-argument factory returning a solver, or a solver instance. The order of
an imported solver is ``solver.order(None)``; its evaluations per step are counted by running
one step after the first on a small rotation field (:func:`count_evaluations`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable

import diffrax
import jax
import jax.numpy as jnp
from diffrax import AbstractSolver, ODETerm

from svflow_jax import sphere

from .euler import GeodesicEuler, RetractedEuler
from .lie_group import RKMK4, CrouchGrossman3
from .runge_kutta import RK4, Retracted
from .solve import _name, stays_on_sphere

__all__ = ["SolverSpec", "SOLVERS", "register", "get_solver", "count_evaluations"]


@dataclasses.dataclass(frozen=True)
class SolverSpec:
    """A named solver: how to build it, its theoretical order, its cost per step, its sweep.

    * ``make()``: a new solver that stays on the sphere;
    * ``expected_order``: the global order on a smooth field;
    * ``evaluations_per_step``: field evaluations of a step after the first (FSAL counted once);
    * ``step_range``: first and last number of steps over ``[0, T]`` in a sweep, with
      ``num_sizes`` step counts between them;
    * ``unretracted()``: the same method in ``R^d`` (drift study), or None if the method is on
      the sphere by construction.
    """

    name: str
    make: Callable[[], diffrax.AbstractSolver]
    expected_order: int
    evaluations_per_step: int
    step_range: tuple[int, int] = (4, 400)
    num_sizes: int = 8
    description: str = ""
    unretracted: Callable[[], diffrax.AbstractSolver] | None = None

    def __post_init__(self):
        def positive_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 1

        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"SolverSpec.name must be a non-empty string, got {self.name!r}")
        if not callable(self.make):
            raise ValueError(f"SolverSpec {self.name!r}: make must be callable")
        if self.unretracted is not None and not callable(self.unretracted):
            raise ValueError(f"SolverSpec {self.name!r}: unretracted must be callable or None")
        for field in ("expected_order", "evaluations_per_step", "num_sizes"):
            if not positive_int(getattr(self, field)):
                raise ValueError(f"SolverSpec {self.name!r}: {field} must be a positive int, "
                                 f"got {getattr(self, field)!r}")
        first, last = self.step_range
        if not (positive_int(first) and positive_int(last) and first < last):
            raise ValueError(f"SolverSpec {self.name!r}: step_range must be (first, last) with "
                             f"1 <= first < last, got {self.step_range!r}")


SOLVERS: dict[str, SolverSpec] = {}


def register(spec: SolverSpec, *, replace: bool = False) -> SolverSpec:
    """Adds ``spec`` to :data:`SOLVERS` under ``spec.name`` and returns it.

    ``ValueError`` if the name is already registered (unless ``replace=True``) or contains
    ``":"`` (reserved for import paths, see :func:`get_solver`).
    """
    if not isinstance(spec, SolverSpec):
        raise ValueError(f"register takes a SolverSpec, got {type(spec).__name__}")
    if ":" in spec.name:
        raise ValueError(f"a registered name may not contain ':' (import paths do), got "
                         f"{spec.name!r}")
    if spec.name in SOLVERS and not replace:
        raise ValueError(f"a solver named {spec.name!r} is already registered; pass "
                         "replace=True to replace it")
    SOLVERS[spec.name] = spec
    return spec


def _known() -> str:
    return ", ".join(SOLVERS)


def get_solver(name: str) -> SolverSpec:
    """The :class:`SolverSpec` of a registered name, or of an import path
    ``"package.module:Attr"``.

    ``Attr`` (dots allowed: ``"module:Class.attribute"``) may be a :class:`SolverSpec` (returned
    as is), a solver class or zero-argument factory, or a solver instance; the solver must stay
    on the sphere (wrap a diffrax solver as ``Retracted(...)``). Its spec then has
    ``name = name`` (the path), ``expected_order = solver.order(None)``,
    ``evaluations_per_step = count_evaluations(solver)``, the first line of ``Attr``'s
    docstring as description, the default sweep, and ``unretracted`` the inner solver when
    it is ``Retracted(inner)``. Anything else raises ``ValueError`` naming the registered
    solvers.
    """
    if not isinstance(name, str):
        raise ValueError(f"a solver name must be a string, got {type(name).__name__}")
    if name in SOLVERS:
        return SOLVERS[name]
    if ":" not in name:
        raise ValueError(f"unknown solver {name!r}: registered solvers are {_known()}; or give "
                         "an import path 'package.module:Attr'")
    return _from_path(name)


def _from_path(path: str) -> SolverSpec:
    module_name, _, attr = path.partition(":")

    def fail(why: str) -> ValueError:
        return ValueError(f"solver {path!r}: {why}. Registered solvers are {_known()}; an "
                          "import path 'package.module:Attr' names a SolverSpec, a solver class "
                          "or a zero-argument factory returning a diffrax.AbstractSolver")

    if not module_name or not attr:
        raise fail("an import path needs both a module and an attribute")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as error:
        raise fail(f"cannot import module {module_name!r} ({error})") from error
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as error:
            raise fail(f"module {module_name!r} has no attribute {attr!r}") from error

    if isinstance(obj, SolverSpec):
        return obj
    if isinstance(obj, AbstractSolver):
        instance = obj

        def make():
            return instance

        doc_source = type(obj)
    elif callable(obj):
        make, doc_source = obj, obj  # pyright: ignore[reportAssignmentType]  (a factory)
    else:
        raise fail(f"{type(obj).__name__} is neither a SolverSpec nor a solver")
    try:
        solver = make()
    except Exception as error:
        raise fail(f"calling it with no arguments failed ({type(error).__name__}: {error})") \
            from error
    if not isinstance(solver, AbstractSolver):
        raise fail(f"it returned a {type(solver).__name__}, not a diffrax.AbstractSolver")
    if not stays_on_sphere(solver):
        raise fail(f"{_name(solver)} does not stay on the sphere; wrap it as "
                   f"Retracted({_name(solver)}) in a factory")
    try:
        order = solver.order(None)
    except Exception as error:
        raise fail(f"its order cannot be read from solver.order(None) "
                   f"({type(error).__name__}: {error}); register a SolverSpec instead") from error
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise fail(f"solver.order(None) must be a positive int, got {order!r}; register a "
                   "SolverSpec with its expected order instead")
    try:
        evaluations = count_evaluations(solver)
    except Exception as error:
        raise fail(f"one step on a single field failed ({type(error).__name__}: {error}); "
                   "the registry holds single-field solvers") from error
    doc = inspect.getdoc(doc_source) or ""
    unretracted = None  # pyright: ignore[reportAssignmentType]  (or the def below)
    if isinstance(solver, Retracted):
        def unretracted():
            return make().solver

    return SolverSpec(name=path, make=make, expected_order=order,
                      evaluations_per_step=evaluations,
                      description=doc.strip().splitlines()[0] if doc.strip() else "",
                      unretracted=unretracted)


def count_evaluations(solver: AbstractSolver) -> int:
    """Field evaluations of ``solver`` in one step after the first.

    Runs ``init``, a first step and a second step on ``v(t, x) = S x`` (``S`` skew, two tokens
    in ``d = 3``) and counts, at run time, the field evaluations of the second step (an FSAL
    solver reuses the first step's last stage). The count is taken with
    :func:`jax.debug.callback`, so stages evaluated inside a loop count once per iteration.
    """
    calls = 0

    def bump():
        nonlocal calls
        calls += 1

    dtype = jnp.result_type(float)
    skew = jnp.asarray([[0.0, 0.7, -0.4], [-0.7, 0.0, 0.3], [0.4, -0.3, 0.0]], dtype)

    def field(t, y, args):
        jax.debug.callback(bump)
        return y @ skew.T

    term = ODETerm(field)
    y0 = sphere.retract(jnp.asarray([[1.0, 0.3, -0.2], [0.1, -0.7, 0.5]], dtype))
    t0, t1, t2 = (jnp.asarray(t, dtype) for t in (0.0, 0.1, 0.2))
    state = solver.init(term, t0, t1, y0, None)
    y1, _, _, state, _ = solver.step(term, t0, t1, y0, None, state, False)
    jax.effects_barrier()
    calls = 0
    jax.block_until_ready(solver.step(term, t1, t2, y1, None, state, False)[0])
    jax.effects_barrier()
    return calls


def _erk_evaluations(solver) -> int:
    """Evaluations per step of a diffrax explicit Runge-Kutta solver, from its tableau: one per
    stage, less one for FSAL."""
    tableau = solver.tableau
    return len(tableau.a_lower) + 1 - (1 if tableau.fsal else 0)


# First and last number of steps of each solver's sweep (8 sizes, geometric, >= 2 decades).
# Higher orders start coarser so that their errors stay above round-off over the sweep; an
# eighth-order method falls from its asymptotic regime (~1e-6) to the reference's error
# (~1e-14) within one decade of h, so only a few points enter the fit; it and Tsit5 get denser
# sweeps (16 and 12 sizes) for their narrow usable window, and Dopri8 starts at 12 steps (below
# that its error is pre-asymptotic: the slope from 8 to 11 steps is 6.5 on the test flow).
for _spec in [
    SolverSpec("euler", RetractedEuler, 1, 1, (4, 512), 8,
               "retracted Euler: the post-norm Transformer layer", diffrax.Euler),
    SolverSpec("heun", lambda: Retracted(diffrax.Heun()), 2, 2, (4, 400), 8,
               "retracted Heun (explicit trapezoid)", diffrax.Heun),
    SolverSpec("midpoint", lambda: Retracted(diffrax.Midpoint()), 2, 2, (4, 400), 8,
               "retracted explicit midpoint", diffrax.Midpoint),
    SolverSpec("rk4", lambda: Retracted(RK4()), 4, _erk_evaluations(RK4()), (4, 400), 8,
               "retracted classical Runge-Kutta (ODE-Transformer RK4 block)", RK4),
    SolverSpec("tsit5", lambda: Retracted(diffrax.Tsit5()), 5,
               _erk_evaluations(diffrax.Tsit5()), (4, 400), 12, "retracted Tsitouras 5(4)",
               diffrax.Tsit5),
    SolverSpec("dopri8", lambda: Retracted(diffrax.Dopri8()), 8,
               _erk_evaluations(diffrax.Dopri8()), (12, 800), 16,
               "retracted Dormand-Prince 8(7)", diffrax.Dopri8),
    SolverSpec("geodesic-euler", GeodesicEuler, 1, 1, (4, 512), 8,
               "Euler along great circles (exponential map)"),
    SolverSpec("crouch-grossman3", CrouchGrossman3, 3, len(CrouchGrossman3.c), (4, 400), 8,
               "Crouch-Grossman Lie-group method (rotations only)"),
    SolverSpec("rkmk4", RKMK4, 4, 4, (4, 200), 8,
               "Runge-Kutta-Munthe-Kaas: RK4 in the Lie algebra so(d) (matrix exponentials)"),
]:
    register(_spec)
del _spec
