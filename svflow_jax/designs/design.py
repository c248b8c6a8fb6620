"""A layer design: a one-step solver read as a Transformer block.

A design is a :class:`LayerDesign`: a name, the solver whose step is one block on the sphere
(post-norm: the retraction ``R(y) = y / |y|`` is the Norm), optionally the same method in
``R^d`` for pre-norm stacks (``dy/dt = u(y / |y|)``, no retraction), and its cost. The solver is
any diffrax solver the project's sphere solvers accept: ``Retracted(any explicit Runge-Kutta
method)``, :class:`~svflow_jax.solvers.GeodesicEuler`, the Lie-group methods, the splittings
``LieTrotter`` / ``Strang`` (sequential / macaron blocks), or a user's subclass of
:class:`~svflow_jax.solvers.AbstractSphereSolver`.

Cost. One *field evaluation* is one attention sub-layer plus one FFN sub-layer (one full field
``v = v_A + v_F``). A splitting evaluates the two sub-layers separately; each counts for half an
evaluation, so Lie-Trotter costs 1 per step and Strang (F, A, F) 1.5. The counts are measured, not
declared: :func:`evaluations` runs the design's integration loop on a small rotation field and
counts the calls (FSAL stages reused from the previous step count once).

Write a design from a tableau, without editing the library::

    tableau = diffrax.ButcherTableau(c=np.array([2/3]), b_sol=np.array([1/4, 3/4]),
                                     b_error=np.array([0.0, 0.0]), a_lower=(np.array([2/3]),))
    ralston = from_tableau(tableau, "ralston", order=2)

or from a solver class: ``LayerDesign("mine", MySolver())``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
from diffrax import AbstractSolver, MultiTerm, ODETerm

from svflow_jax import sphere
from svflow_jax.solvers import (
    RK4,
    AbstractSplitting,
    CrouchGrossman3,
    GeodesicEuler,
    LieTrotter,
    Retracted,
    RetractedEuler,
    Strang,
    WithinStep,
    fixed_step_scan,
)

__all__ = [
    "LayerDesign",
    "from_tableau",
    "DESIGNS",
    "register_design",
    "get_design",
    "evaluations",
    "integrate",
    "CLASSICAL_RK4",
    "WithinStep",
]


@dataclasses.dataclass(frozen=True)
class LayerDesign:
    """A solver as a layer design.

    Attributes:
        name: a short name (``"euler"``, ``"rk4"``, ...).
        solver: the step on the sphere (post-norm stacks): stays on the sphere.
        ambient: the same method in ``R^d`` for pre-norm stacks (``None``: the design exists
            only on the sphere, e.g. geodesic and Lie-group steps).
        adaptive: a solver with an embedded error estimate that computes the same ``y1`` as
            ``solver`` (for adaptive depth with :class:`diffrax.PIDController`), or ``None``.
        description: one line for tables.
    """

    name: str
    solver: AbstractSolver
    ambient: AbstractSolver | None = None
    adaptive: AbstractSolver | None = None
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LayerDesign.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.solver, AbstractSolver):
            raise TypeError(
                f"design {self.name!r}: solver must be a diffrax solver instance (e.g. "
                f"Retracted(diffrax.Heun()) or RetractedEuler()), got {self.solver!r}"
            )

    @property
    def is_splitting(self) -> bool:
        """Whether a step takes the attention and FFN fields separately (a ``MultiTerm``)."""
        return isinstance(self.solver, AbstractSplitting)

    def solver_for(self, norm_position: str) -> AbstractSolver:
        """The solver of a post-norm (on the sphere) or pre-norm (in ``R^d``) stack."""
        if norm_position == "post":
            return self.solver
        if norm_position == "pre":
            if self.ambient is None:
                raise ValueError(
                    f"design {self.name!r} has no pre-norm form (its steps are rotations or "
                    "geodesics on the sphere); use norm_position='post'"
                )
            return self.ambient
        raise ValueError(f"norm_position must be 'post' or 'pre', got {norm_position!r}")


def _tableau_class(tableau: diffrax.ButcherTableau, name: str, order: int | None):
    """A diffrax explicit Runge-Kutta class with this tableau (made at run time)."""

    def method_order(self, terms):
        return order

    has_error = tableau.b_error is not None and bool(np.any(np.asarray(tableau.b_error) != 0))
    namespace = {
        "tableau": tableau,
        "interpolation_cls": diffrax.LocalLinearInterpolation,
        "order": method_order,
        "__module__": __name__,
        "__annotations__": {},
    }
    cls = type(f"Tableau_{name.replace('-', '_')}", (diffrax.AbstractERK,), namespace)
    return cls, has_error


def from_tableau(
    tableau: diffrax.ButcherTableau, name: str, *, order: int | None = None,
    description: str = "",
) -> LayerDesign:
    """The design of any explicit Butcher tableau: stages ``k_i = v(t + c_i h, R(y + h sum_j
    a_ij k_j))``, block ``y1 = R(y + h sum_i b_i k_i)`` (post-norm), or the same without ``R``
    (pre-norm). With a non-zero ``b_error`` the same method also serves adaptive depth."""
    if not isinstance(tableau, diffrax.ButcherTableau):
        raise TypeError(f"from_tableau needs a diffrax.ButcherTableau, got {type(tableau)}")
    cls, has_error = _tableau_class(tableau, name, order)
    return LayerDesign(
        name=name, solver=Retracted(cls()), ambient=WithinStep(cls()),
        adaptive=Retracted(cls()) if has_error else None,
        description=description or f"explicit Runge-Kutta tableau ({len(tableau.c) + 1} stages)",
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


def _builtin() -> list[LayerDesign]:
    rk4 = from_tableau(CLASSICAL_RK4, "rk4", order=4, description="classical RK4 block "
                       "(ODE Transformer)")
    rk4 = dataclasses.replace(rk4, adaptive=Retracted(RK4()))
    return [
        LayerDesign("euler", RetractedEuler(), WithinStep(diffrax.Euler()), None,
                    "post-norm layer R(x + h v), attention + FFN in parallel"),
        LayerDesign("heun", Retracted(diffrax.Heun()), WithinStep(diffrax.Heun()),
                    Retracted(diffrax.Heun()), "Heun block (RK2), embedded Euler estimate"),
        LayerDesign("midpoint", Retracted(diffrax.Midpoint()), WithinStep(diffrax.Midpoint()),
                    Retracted(diffrax.Midpoint()), "explicit midpoint block (RK2)"),
        rk4,
        LayerDesign("geodesic-euler", GeodesicEuler(), None, None,
                    "x <- exp_x(h v): a rotation instead of a Norm"),
        LayerDesign("crouch-grossman3", CrouchGrossman3(), None, None,
                    "three stages, each a product of plane rotations (order 3)"),
        LayerDesign("lie-trotter", LieTrotter(RetractedEuler()),
                    LieTrotter(WithinStep(diffrax.Euler())),
                    None, "sequential block: attention sub-layer then FFN sub-layer"),
        LayerDesign("strang", Strang(RetractedEuler()), Strang(WithinStep(diffrax.Euler())), None,
                    "macaron block: half FFN, attention, half FFN"),
    ]


DESIGNS: dict[str, LayerDesign] = {}


def register_design(design: LayerDesign, *, replace: bool = False) -> LayerDesign:
    """Adds ``design`` to :data:`DESIGNS` (a name may not be registered twice unless
    ``replace``)."""
    if design.name in DESIGNS and not replace:
        raise ValueError(f"a design named {design.name!r} is already registered")
    DESIGNS[design.name] = design
    return design


for _design in _builtin():
    register_design(_design)


def get_design(name: str | LayerDesign) -> LayerDesign:
    """A registered design by name, or ``"package.module:Attr"`` naming a :class:`LayerDesign`,
    a solver instance or class, or a :class:`diffrax.ButcherTableau`."""
    if isinstance(name, LayerDesign):
        return name
    if name in DESIGNS:
        return DESIGNS[name]
    if ":" not in name:
        raise ValueError(f"unknown design {name!r}; registered: {', '.join(DESIGNS)}; or give "
                         "package.module:Attr")
    import importlib

    module, attr = name.split(":", 1)
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import design {name!r}: {err}") from err
    if isinstance(obj, LayerDesign):
        return obj
    if isinstance(obj, diffrax.ButcherTableau):
        return from_tableau(obj, attr)
    if isinstance(obj, type) and issubclass(obj, AbstractSolver):
        obj = obj()
    if isinstance(obj, AbstractSolver):
        return LayerDesign(attr, obj)
    raise ValueError(f"{name!r} is not a LayerDesign, solver or ButcherTableau")


def integrate(
    solver: AbstractSolver, terms, y0, t0: float, t1: float, num_steps: int, *,
    remat: bool = True,
):
    """``num_steps`` equal steps of ``solver`` from ``t0`` to ``t1``: the stack's forward pass.

    :func:`svflow_jax.solvers.fixed_step_scan`: one ``lax.scan`` over the steps (compile time
    flat in depth), Runge-Kutta stages unrolled; with ``remat`` each step is rematerialised in
    the backward pass (``jax.checkpoint``), so gradient memory holds one state per step instead
    of every stage's activations, and each stage is evaluated once more. Step times are
    ``t0 + i (t1 - t0) / N`` in the state's dtype (no float64 promotion of a float32 model).
    """
    return fixed_step_scan(solver, terms, y0, t0, t1, num_steps, remat=remat)


def evaluations(design: LayerDesign, num_steps: int, norm_position: str = "post") -> float:
    """Field evaluations of a stack of ``num_steps`` blocks of ``design``, counted at run time
    on a small rotation field (one attention + one FFN = 1; a splitting's sub-layer = 1/2)."""
    calls = [0.0]
    weight = 0.5 if design.is_splitting else 1.0

    def bump():
        calls[0] += weight

    dtype = jnp.result_type(float)
    skew = jnp.asarray([[0.0, 0.7, -0.4], [-0.7, 0.0, 0.3], [0.4, -0.3, 0.0]], dtype)

    def field(t, y, args):
        jax.debug.callback(bump)
        return y @ skew.T

    term = MultiTerm(ODETerm(field), ODETerm(field)) if design.is_splitting else ODETerm(field)
    y0 = sphere.retract(jnp.asarray([[1.0, 0.3, -0.2], [0.1, -0.7, 0.5]], dtype))
    solver = design.solver_for(norm_position)
    jax.block_until_ready(integrate(solver, term, y0, 0.0, 1.0, num_steps, remat=False))
    jax.effects_barrier()
    return calls[0]


def design_names() -> list[str]:
    """The registered design names, in order."""
    return list(DESIGNS)


Factory = Callable[[], LayerDesign]
