"""A layer design: a method of the solver catalogue read as a Transformer block.

A design is a :class:`~svflow_jax.solvers.catalogue.Method`: its step on the sphere is a
post-norm block (the retraction ``R(y) = y / |y|`` is the Norm), its step in ``R^d`` a pre-norm
block (``dy/dt = u(y / |y|)``, no retraction), and its measured cost the block's field
evaluations. The solver is any diffrax solver the project's sphere solvers accept:
``Retracted(any explicit Runge-Kutta method)``, :class:`~svflow_jax.solvers.GeodesicEuler`, the
Lie-group methods, the splittings ``LieTrotter`` / ``Strang`` (sequential / macaron blocks), or
a user's subclass of :class:`~svflow_jax.solvers.AbstractSphereSolver`.

The designs are the methods of :data:`svflow_jax.solvers.catalogue.CATALOGUE`, named and
resolved by :func:`svflow_jax.solvers.catalogue.get`; a design built from a tableau
(:func:`from_tableau`) or a solver (``Method("mine", MySolver())``) and registered once
(:func:`svflow_jax.solvers.catalogue.register`) is known to every command.
"""

from __future__ import annotations

import jax
from diffrax import AbstractSolver

from svflow_jax.solvers import WithinStep, fixed_step_scan
from svflow_jax.solvers.catalogue import CLASSICAL_RK4, evaluations, from_tableau

__all__ = [
    "from_tableau",
    "evaluations",
    "integrate",
    "CLASSICAL_RK4",
    "WithinStep",
]


def integrate(
    solver: AbstractSolver, terms, y0, t0: float, t1: float, num_steps: int, *,
    remat: bool | str = True,
):
    """``num_steps`` equal steps of ``solver`` from ``t0`` to ``t1``: the stack's forward pass.

    :func:`svflow_jax.solvers.fixed_step_scan`: one ``lax.scan`` over the steps (compile time
    flat in depth), Runge-Kutta stages unrolled; with ``remat=True`` each step is
    rematerialised in the backward pass (``jax.checkpoint``), so gradient memory holds one
    state per step instead of every stage's activations, and each stage is evaluated once
    more; with ``remat="dots"`` the matrix products' results are stored and only the
    elementwise work between them is recomputed (``jax.checkpoint_policies.dots_saveable``:
    memory grows by every product's output per step, time is nearly that of no recomputation);
    ``False`` stores everything. Step times are ``t0 + i (t1 - t0) / N`` in the state's dtype
    (no float64 promotion of a float32 model).
    """
    policy = jax.checkpoint_policies.dots_saveable if remat == "dots" else bool(remat)
    return fixed_step_scan(solver, terms, y0, t0, t1, num_steps, remat=policy)

