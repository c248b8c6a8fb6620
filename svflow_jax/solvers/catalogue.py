"""The solver catalogue: one record per method name, read by every command and study.

A :class:`Method` says everything the project knows about one numerical method:

* ``solver``: its step on the sphere (a post-norm block: the retraction ``R(y) = y / |y|`` is
  the Norm);
* ``ambient``: the same method in ``R^d`` (a pre-norm block, ``dy/dt = u(y / |y|)`` stepped
  without a retraction; the drift study), or ``None`` when the method exists only on the
  sphere (geodesic and Lie-group steps);
* ``adaptive``: a solver with an embedded error estimate that computes the same ``y1`` (adaptive
  depth with :class:`diffrax.PIDController`), or ``None``;
* ``order``: the global order ``p`` of its error ``O(h^p)`` on a smooth field;
* :attr:`Method.evaluations_per_step`: its cost, *measured* by running it (:func:`evaluations`);
  one field evaluation is one attention plus one FFN sub-layer; a splitting evaluates them
  separately, each sub-layer half an evaluation, so Lie-Trotter costs 1 per step and Strang
  (F, A, F) 1.5;
* ``step_range``, ``num_sizes``: its step-size sweep over ``[0, T]`` (``num_sizes`` step counts,
  geometric, from ``step_range[0]`` to ``step_range[1]``);
* ``description``: one line for tables and claims.

:data:`CATALOGUE` holds the records in order; :func:`register` adds one; :func:`get` returns a
registered record or builds one from ``"package.module:Attr"`` (:func:`import_path`: the one
parser of such paths; the current working directory is searched first, as uvicorn does), where
``Attr`` is a :class:`Method`, a :class:`diffrax.ButcherTableau`, a solver class, a
zero-argument factory or a solver instance. ``svflow verify``, ``sweep``, ``train``,
``inspect``, the experiments and the notebooks all read this one table, so a method registered
once (or named by its path) is known to every command.

Write a method from a tableau, without editing the library::

    tableau = diffrax.ButcherTableau(c=np.array([2/3]), b_sol=np.array([1/4, 3/4]),
                                     b_error=np.array([0.0, 0.0]), a_lower=(np.array([2/3]),))
    register(from_tableau(tableau, "ralston"))   # order 2 read from the tableau
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import sys
import threading
from fractions import Fraction
from typing import Any

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
from diffrax import AbstractSolver, MultiTerm, ODETerm

from ..method_table import no_prenorm_form
from .adjoint import fixed_step_loop, unroll_stages
from .euler import GeodesicEuler, RetractedEuler
from .lie_group import RKMK4, CrouchGrossman3
from .runge_kutta import RK4, Retracted, WithinStep
from .solve import _name, stays_on_sphere
from .splitting import AbstractSplitting, LieTrotter, Strang

__all__ = [
    "Method",
    "CATALOGUE",
    "register",
    "get",
    "names",
    "methods",
    "import_path",
    "from_tableau",
    "tableau_order",
    "evaluations",
    "count_evaluations",
    "CLASSICAL_RK4",
]


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


@dataclasses.dataclass(frozen=True)
class Method:
    """One numerical method: its steps on the sphere and in ``R^d``, order, cost and sweep.

    Attributes:
        name: a short name (``"euler"``, ``"rk4"``, ...); no ``":"`` (import paths have one).
        solver: the step on the sphere (post-norm stacks); must stay on the sphere.
        ambient: the same method in ``R^d`` for pre-norm stacks and the drift study (``None``:
            the method exists only on the sphere).
        adaptive: a solver with an embedded error estimate computing the same ``y1``, or
            ``None``.
        description: one line for tables and claims.
        order: the global order on a smooth field; ``None`` reads ``solver.order(None)`` (a
            splitting has no order without its terms: give it).
        cost: field evaluations of a step after the first, if declared; ``None`` (the
            default) measures them on first use (:attr:`evaluations_per_step`).
        step_range: first and last number of steps over ``[0, T]`` of a sweep.
        num_sizes: step counts of a sweep (>= 3 to fit an order).
    """

    name: str
    solver: AbstractSolver
    ambient: AbstractSolver | None = None
    adaptive: AbstractSolver | None = None
    description: str = ""
    order: int | None = None
    cost: float | None = None
    step_range: tuple[int, int] = (4, 400)
    num_sizes: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a Method's name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.solver, AbstractSolver):
            raise TypeError(
                f"method {self.name!r}: solver must be a diffrax solver instance (e.g. "
                f"Retracted(diffrax.Heun()) or RetractedEuler()), got {self.solver!r}")
        for field in ("ambient", "adaptive"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, AbstractSolver):
                raise TypeError(f"method {self.name!r}: {field} must be a diffrax solver "
                                f"instance or None, got {value!r}")
        if self.order is None and not self.is_splitting:
            try:
                object.__setattr__(self, "order", self.solver.order(None))
            except Exception:  # noqa: BLE001 - a solver whose order needs its terms
                pass
        if self.order is not None and not _positive_int(self.order):
            raise ValueError(f"method {self.name!r}: order must be a positive int, got "
                             f"{self.order!r}")
        if self.cost is not None and (isinstance(self.cost, bool) or not self.cost > 0):
            raise ValueError(f"method {self.name!r}: cost must be a positive number, got "
                             f"{self.cost!r}")
        if not _positive_int(self.num_sizes):
            raise ValueError(f"method {self.name!r}: num_sizes must be a positive int, got "
                             f"{self.num_sizes!r}")
        try:
            first, last = self.step_range
        except (TypeError, ValueError):
            first = last = None
        if not (_positive_int(first) and _positive_int(last) and first < last):
            raise ValueError(f"method {self.name!r}: step_range must be (first, last) with "
                             f"1 <= first < last, got {self.step_range!r}")

    @property
    def is_splitting(self) -> bool:
        """Whether a step takes the attention and FFN fields separately (a ``MultiTerm``)."""
        return isinstance(self.solver, AbstractSplitting)

    @property
    def block(self) -> str:
        """The Transformer block of the step: ``"parallel"`` (one field ``v_A + v_F``),
        ``"sequential"`` (Lie-Trotter) or ``"macaron"`` (Strang)."""
        if isinstance(self.solver, Strang):
            return "macaron"
        return "sequential" if isinstance(self.solver, LieTrotter) else "parallel"

    @functools.cached_property
    def evaluations_per_step(self) -> float:
        """Field evaluations of a step after the first (an FSAL stage reused from the previous
        step counts once): ``cost`` if declared, else measured with :func:`evaluations`."""
        if self.cost is not None:
            return self.cost
        per_step = evaluations(self, 2) - evaluations(self, 1)
        return int(per_step) if float(per_step).is_integer() else per_step

    @functools.cached_property
    def _evaluation_counts(self) -> dict[tuple[int, str], float]:
        """:func:`evaluations` of this method, by ``(num_steps, norm_position)``: each count
        runs (and compiles) a small program, and the method is immutable."""
        return {}

    def solver_for(self, norm_position: str) -> AbstractSolver:
        """The solver of a post-norm (on the sphere) or pre-norm (in ``R^d``) stack."""
        if norm_position == "post":
            return self.solver
        if norm_position == "pre":
            if self.ambient is None:
                raise ValueError(no_prenorm_form(self.name))
            return self.ambient
        raise ValueError(f"norm_position must be 'post' or 'pre', got {norm_position!r}")


# ---------------------------------------------------------------------------------------------
# Cost: one probe
# ---------------------------------------------------------------------------------------------


def evaluations(method: Method | AbstractSolver, num_steps: int,
                norm_position: str = "post") -> float:
    """Field evaluations of ``num_steps`` steps of ``method`` (a stack of ``num_steps``
    blocks), counted at run time on a small rotation field ``v(t, x) = S x`` (``S`` skew, two
    tokens in ``d = 3``): one attention + one FFN = 1, a splitting's sub-layer = 1/2.

    The count is taken with :func:`jax.debug.callback` in the field, inside a loop over the
    steps (:func:`_probe`), with the explicit Runge-Kutta stages written out as
    :func:`~svflow_jax.solvers.fixed_step_scan` runs them (:func:`unroll_stages`), so a stage
    evaluated inside a loop counts once per iteration and an FSAL stage reused from the
    previous step counts once. The number of steps is a traced value: one program per solver
    serves every count (a program with a host callback is never written to the compilation
    cache, so it is compiled in every process). A :class:`Method`'s counts are kept (it is
    immutable): each is measured once per process."""
    if isinstance(method, Method):
        counts = method._evaluation_counts
        key = (num_steps, norm_position)
        if key not in counts:
            counts[key] = evaluations(method.solver_for(norm_position), num_steps)
        return counts[key]
    if not _positive_int(num_steps):
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    solver = method
    field = _probe_half if isinstance(solver, AbstractSplitting) else _probe_full
    term = MultiTerm(ODETerm(field), ODETerm(field)) if isinstance(
        solver, AbstractSplitting) else ODETerm(field)
    dtype = np.dtype(jnp.result_type(float))
    y0 = _PROBE_Y0 / np.linalg.norm(_PROBE_Y0, axis=-1, keepdims=True)
    with _PROBE_LOCK:  # one count at a time: the callbacks add to one module-level counter
        _PROBE_CALLS[0] = 0.0
        jax.block_until_ready(_probe(unroll_stages(solver), term, y0.astype(dtype),
                                     np.asarray(1.0, dtype), np.asarray(num_steps)))
        jax.effects_barrier()
        return _PROBE_CALLS[0]


# The probe's field, its start and its counter: module-level, so that the program of a solver
# is the same object for every number of steps (a new callback function would be a new program).
_PROBE_SKEW = np.asarray([[0.0, 0.7, -0.4], [-0.7, 0.0, 0.3], [0.4, -0.3, 0.0]])
_PROBE_Y0 = np.asarray([[1.0, 0.3, -0.2], [0.1, -0.7, 0.5]])
_PROBE_CALLS = [0.0]
_PROBE_LOCK = threading.Lock()


def _bump_full() -> None:
    _PROBE_CALLS[0] += 1.0


def _bump_half() -> None:
    _PROBE_CALLS[0] += 0.5


def _probe_full(t, y, args):
    jax.debug.callback(_bump_full)
    return y @ _PROBE_SKEW.T.astype(y.dtype)


def _probe_half(t, y, args):  # a splitting's sub-layer: half an evaluation
    jax.debug.callback(_bump_half)
    return y @ _PROBE_SKEW.T.astype(y.dtype)


def _probe(solver, terms, y0, t1, num_steps):
    """``num_steps`` (traced) equal steps of ``solver`` over ``[0, t1]``."""
    return fixed_step_loop(terms, solver, y0, t1, num_steps)


def count_evaluations(solver: AbstractSolver) -> float:
    """Field evaluations of ``solver`` in one step after the first: ``evaluations(solver, 2)
    - evaluations(solver, 1)``."""
    per_step = evaluations(solver, 2) - evaluations(solver, 1)
    return int(per_step) if float(per_step).is_integer() else per_step


# ---------------------------------------------------------------------------------------------
# Butcher tableaus
# ---------------------------------------------------------------------------------------------


def tableau_order(tableau: diffrax.ButcherTableau, tol: float = 1e-12) -> int:
    """The order (up to 4) of an explicit tableau, from its order conditions (Butcher):
    ``sum b = 1``; ``b.c = 1/2``; ``b.c^2 = 1/3``, ``b.Ac = 1/6``; ``b.c^3 = 1/4``,
    ``b.(c*Ac) = 1/8``, ``b.Ac^2 = 1/12``, ``b.AAc = 1/24``. A method of order 5 or more reads
    as 4: declare its order (``from_tableau(..., order=p)``)."""
    c = np.concatenate([[0.0], np.asarray(tableau.c, np.float64)])
    s = len(c)
    a = np.zeros((s, s))
    for i, row in enumerate(tableau.a_lower, start=1):
        a[i, : len(row)] = np.asarray(row, np.float64)
    b = np.asarray(tableau.b_sol, np.float64)
    ac = a @ c
    conditions = [
        [(b.sum(), 1)],
        [(b @ c, Fraction(1, 2))],
        [(b @ c**2, Fraction(1, 3)), (b @ ac, Fraction(1, 6))],
        [(b @ c**3, Fraction(1, 4)), (b @ (c * ac), Fraction(1, 8)),
         (b @ (a @ c**2), Fraction(1, 12)), (b @ (a @ ac), Fraction(1, 24))],
    ]
    order = 0
    for level in conditions:
        if not all(abs(value - float(target)) <= tol for value, target in level):
            break
        order += 1
    return order


def _tableau_class(tableau: diffrax.ButcherTableau, name: str, order: int):
    """A diffrax explicit Runge-Kutta class with this tableau (made at run time); dense output
    is the cubic Hermite interpolant of the end states and the first and last stages (as for
    diffrax's Heun)."""

    def method_order(self, terms):
        return order

    namespace = {
        "tableau": tableau,
        "interpolation_cls": diffrax.ThirdOrderHermitePolynomialInterpolation.from_k,
        "order": method_order,
        "__module__": __name__,
        "__annotations__": {},
    }
    slug = "".join(ch if ch.isalnum() else "_" for ch in name)
    return type(f"Tableau_{slug}", (diffrax.AbstractERK,), namespace)


def from_tableau(
    tableau: diffrax.ButcherTableau, name: str, *, order: int | None = None,
    description: str = "", **sweep: Any,
) -> Method:
    """The method of any explicit Butcher tableau: stages ``k_i = v(t + c_i h, R(y + h sum_j
    a_ij k_j))``, step ``y1 = R(y + h sum_i b_i k_i)`` on the sphere, the same without ``R`` in
    ``R^d``. ``order`` defaults to :func:`tableau_order`. With a non-zero ``b_error`` the same
    method also serves adaptive depth. ``sweep``: ``step_range``, ``num_sizes``."""
    if not isinstance(tableau, diffrax.ButcherTableau):
        raise TypeError(f"from_tableau needs a diffrax.ButcherTableau, got {type(tableau)}")
    order = tableau_order(tableau) if order is None else order
    if not _positive_int(order):
        raise ValueError(f"tableau {name!r}: order must be a positive int, got {order!r}")
    cls = _tableau_class(tableau, name, order)
    has_error = tableau.b_error is not None and bool(np.any(np.asarray(tableau.b_error) != 0))
    return Method(
        name=name, solver=Retracted(cls()), ambient=WithinStep(cls()),
        adaptive=Retracted(cls()) if has_error else None, order=order,
        description=description or f"explicit Runge-Kutta tableau ({len(tableau.c) + 1} stages)",
        **sweep,
    )


# Kutta's classical method without the FSAL stage: four evaluations per step, as a block.
# (svflow_jax.solvers.RK4 is the same method with an embedded third-order estimate that costs a
# fifth, FSAL stage; it serves adaptive depth.)
CLASSICAL_RK4 = diffrax.ButcherTableau(
    c=np.array([1 / 2, 1 / 2, 1.0]),
    b_sol=np.array([1 / 6, 1 / 3, 1 / 3, 1 / 6]),
    b_error=np.zeros(4),
    a_lower=(np.array([1 / 2]), np.array([0.0, 1 / 2]), np.array([0.0, 0.0, 1.0])),
)


# ---------------------------------------------------------------------------------------------
# The catalogue
# ---------------------------------------------------------------------------------------------

CATALOGUE: dict[str, Method] = {}


def register(method: Method, *, replace: bool = False) -> Method:
    """Adds ``method`` to :data:`CATALOGUE` under ``method.name`` and returns it.

    ``ValueError`` if the name is already registered (unless ``replace=True``) or contains
    ``":"`` (reserved for import paths, see :func:`get`)."""
    if not isinstance(method, Method):
        raise ValueError(f"register takes a Method, got "
                         f"{type(method).__name__}")
    if ":" in method.name:
        raise ValueError(f"a registered name may not contain ':' (import paths do), got "
                         f"{method.name!r}")
    if method.name in CATALOGUE and not replace:
        raise ValueError(f"a method named {method.name!r} is already registered; pass "
                         "replace=True to replace it")
    if method.order is None:
        raise ValueError(f"method {method.name!r}: give its order (it cannot be read from "
                         "solver.order(None))")
    CATALOGUE[method.name] = method
    return method


def names(*, splitting: bool | None = None, ambient: bool | None = None) -> list[str]:
    """The registered names, in order; ``splitting`` / ``ambient`` keep only the methods that
    are (``True``) or are not (``False``) splittings / have an ``R^d`` form."""
    return [m.name for m in methods(splitting=splitting, ambient=ambient)]


def methods(*, splitting: bool | None = None, ambient: bool | None = None) -> list[Method]:
    """The registered methods, in order, filtered as in :func:`names`."""
    return [m for m in CATALOGUE.values()
            if (splitting is None or m.is_splitting == splitting)
            and (ambient is None or (m.ambient is not None) == ambient)]


def _known() -> str:
    return ", ".join(CATALOGUE)


def import_path(path: str, what: str = "object") -> Any:
    """The object named by ``"package.module:Attr"`` (``Attr`` may be dotted).

    The current working directory is searched first (it is put at the front of ``sys.path``
    while the module is imported, as uvicorn and gunicorn do), so ``my_solvers:SSPRK3`` finds
    ``./my_solvers.py`` without ``PYTHONPATH``. Any failure, including a module that raises
    ``SystemExit`` on import, is a ``ValueError`` saying what went wrong (``what``: the thing
    asked for, for the message)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{path!r}: an import path 'package.module:Attr' needs both a module "
                         "and an attribute")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        obj = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import {what} {path!r}: no module {module_name!r} ({error}; "
                         "looked in the current folder and sys.path)") from error
    except (Exception, SystemExit) as error:
        raise ValueError(f"{path!r}: importing module {module_name!r} raised "
                         f"{type(error).__name__}: {error}") from error
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as error:
            raise ValueError(f"{path!r}: module {module_name!r} has no attribute "
                             f"{attr!r}") from error
    return obj


def get(name: str | Method, what: str = "method") -> Method:
    """The :class:`Method` of a registered name, or of an import path ``"package.module:Attr"``
    (:func:`import_path`).

    ``Attr`` may be a :class:`Method` (returned as is), a :class:`diffrax.ButcherTableau`
    (:func:`from_tableau`), a solver class or zero-argument factory, or a solver instance; the
    solver must stay on the sphere (wrap a diffrax solver as ``Retracted(...)``). Its record
    then has ``name = name`` (the path), the order ``solver.order(None)``, the measured cost,
    the first line of ``Attr``'s docstring as description, the default sweep, and the inner
    solver of ``Retracted(inner)`` as ``ambient``. Anything else raises ``ValueError`` naming
    the registered methods; ``what`` names the thing asked for in messages (``"solver"``,
    ``"design"``)."""
    if isinstance(name, Method):
        return name
    if not isinstance(name, str):
        raise ValueError(f"a {what} name must be a string, got {type(name).__name__}")
    if name in CATALOGUE:
        return CATALOGUE[name]
    if ":" not in name:
        raise ValueError(f"unknown {what} {name!r}: registered methods are {_known()}; or give "
                         "an import path 'package.module:Attr'")
    try:
        return _from_object(import_path(name, what), name)
    except ValueError as error:
        raise ValueError(f"{error}. Registered methods are {_known()}; an import path "
                         "'package.module:Attr' names a Method, a ButcherTableau, a solver "
                         "class or a zero-argument factory returning a diffrax.AbstractSolver") \
            from error


def _from_object(obj: Any, path: str) -> Method:
    """A :class:`Method` from what an import path names (see :func:`get`)."""
    if isinstance(obj, Method):
        return obj
    if isinstance(obj, diffrax.ButcherTableau):
        return from_tableau(obj, path)
    doc_source = type(obj) if isinstance(obj, AbstractSolver) else obj
    if isinstance(obj, AbstractSolver):
        solver = obj
    elif callable(obj):
        try:
            solver = obj()
        except (Exception, SystemExit) as error:
            raise ValueError(f"{path!r}: calling it with no arguments failed "
                             f"({type(error).__name__}: {error})") from error
    else:
        raise ValueError(f"{path!r}: {type(obj).__name__} is neither a Method nor a solver")
    if isinstance(solver, Method):
        return solver
    if not isinstance(solver, AbstractSolver):
        raise ValueError(f"{path!r}: it returned a {type(solver).__name__}, not a "
                         "diffrax.AbstractSolver")
    if not stays_on_sphere(solver):
        raise ValueError(f"{path!r}: {_name(solver)} does not stay on the sphere; wrap it as "
                         f"Retracted({_name(solver)}) in a factory")
    try:
        order = solver.order(None)
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{path!r}: its order cannot be read from solver.order(None) "
                         f"({type(error).__name__}: {error}); register a Method instead") \
            from error
    if not _positive_int(order):
        raise ValueError(f"{path!r}: solver.order(None) must be a positive int, got {order!r}; "
                         "register a Method with its order instead")
    doc = (inspect.getdoc(doc_source) or "").strip()
    method = Method(name=path, solver=solver,
                    ambient=solver.solver if isinstance(solver, Retracted) else None,
                    description=doc.splitlines()[0] if doc else "", order=order)
    try:
        method.evaluations_per_step  # noqa: B018 - measured now, so a failure is reported here
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{path!r}: one step on a single field failed "
                         f"({type(error).__name__}: {error}); a method named by its path takes "
                         "one field (register a Method for a splitting)") from error
    return method


# First and last number of steps of each sweep (8 sizes, geometric, >= 2 decades). Higher
# orders start coarser so that their errors stay above round-off over the sweep; an
# eighth-order method falls from its asymptotic regime (~1e-6) to the reference's error (~1e-14)
# within one decade of h, so only a few points enter the fit; it and Tsit5 get denser sweeps
# (16 and 12 sizes) for their narrow usable window, and Dopri8 starts at 12 steps (below that
# its error is pre-asymptotic: the slope from 8 to 11 steps is 6.5 on the test flow).
def _builtin() -> list[Method]:
    def rk(name: str, solver: AbstractSolver, description: str, **kw: Any) -> Method:
        return Method(name, Retracted(solver), WithinStep(solver), kw.pop("adaptive", None),
                      description, **kw)

    rk4 = from_tableau(CLASSICAL_RK4, "rk4", order=4, description="retracted classical "
                       "Runge-Kutta (the ODE-Transformer RK4 block)")
    return [
        Method("euler", RetractedEuler(), WithinStep(diffrax.Euler()), None,
               "retracted Euler: the post-norm Transformer layer R(x + h v), attention + FFN "
               "in parallel", step_range=(4, 512)),
        rk("heun", diffrax.Heun(), "retracted Heun (explicit trapezoid, RK2), embedded Euler "
           "estimate", adaptive=Retracted(diffrax.Heun())),
        rk("midpoint", diffrax.Midpoint(), "retracted explicit midpoint (RK2)",
           adaptive=Retracted(diffrax.Midpoint())),
        dataclasses.replace(rk4, adaptive=Retracted(RK4())),
        rk("tsit5", diffrax.Tsit5(), "retracted Tsitouras 5(4)", num_sizes=12,
           adaptive=Retracted(diffrax.Tsit5())),
        rk("dopri8", diffrax.Dopri8(), "retracted Dormand-Prince 8(7)", step_range=(12, 800),
           num_sizes=16, adaptive=Retracted(diffrax.Dopri8())),
        Method("geodesic-euler", GeodesicEuler(), None, None,
               "Euler along great circles (exponential map): a rotation instead of a Norm",
               step_range=(4, 512)),
        Method("crouch-grossman3", CrouchGrossman3(), None, None,
               "Crouch-Grossman Lie-group method: three stages, each a product of plane "
               "rotations"),
        Method("rkmk4", RKMK4(), None, None,
               "Runge-Kutta-Munthe-Kaas: RK4 in the Lie algebra so(d) (5 x 5 exponentials)",
               step_range=(4, 200)),
        Method("lie-trotter", LieTrotter(RetractedEuler()),
               LieTrotter(WithinStep(diffrax.Euler())), None,
               "sequential block (attention sub-layer then FFN sub-layer): Lie-Trotter of "
               "retracted Euler steps", order=1),
        Method("strang", Strang(RetractedEuler()), Strang(WithinStep(diffrax.Euler())), None,
               "macaron block (half FFN, attention, half FFN): Strang with Euler sub-steps, "
               "only first order (its h^2 terms do not cancel)", order=1),
        Method("strang-heun", Strang(Retracted(diffrax.Heun())),
               Strang(WithinStep(diffrax.Heun())), None,
               "Strang splitting with retracted Heun sub-steps", order=2),
        Method("strang-midpoint", Strang(Retracted(diffrax.Midpoint())),
               Strang(WithinStep(diffrax.Midpoint())), None,
               "Strang splitting with retracted midpoint sub-steps", order=2),
    ]


for _method in _builtin():
    register(_method)
del _method
