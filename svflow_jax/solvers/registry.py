"""Former name of the solver catalogue (:mod:`svflow_jax.solvers.catalogue`), kept so that
existing imports work: :data:`SOLVERS` is :data:`~.catalogue.CATALOGUE`, :func:`get_solver` is
:func:`~.catalogue.get`, and :func:`SolverSpec` builds a :class:`~.catalogue.Method` from the
former arguments (a factory ``make`` and ``unretracted`` instead of solver instances)."""

from __future__ import annotations

from collections.abc import Callable

import diffrax

from .catalogue import CATALOGUE, Method, count_evaluations, get, register

__all__ = ["SolverSpec", "SOLVERS", "register", "get_solver", "count_evaluations"]

SOLVERS = CATALOGUE


def get_solver(name: str | Method) -> Method:
    """:func:`~.catalogue.get`, naming what was asked for a solver in messages."""
    return get(name, what="solver")



def SolverSpec(  # noqa: N802 - the former class name, kept as a constructor
    name: str,
    make: Callable[[], diffrax.AbstractSolver],
    expected_order: int,
    evaluations_per_step: float,
    step_range: tuple[int, int] = (4, 400),
    num_sizes: int = 8,
    description: str = "",
    unretracted: Callable[[], diffrax.AbstractSolver] | None = None,
) -> Method:
    """A :class:`~.catalogue.Method` from the former ``SolverSpec`` fields: ``make()`` is its
    step on the sphere, ``unretracted()`` its step in ``R^d``, ``evaluations_per_step`` its
    declared cost."""
    if not callable(make):
        raise ValueError(f"SolverSpec {name!r}: make must be callable")
    if unretracted is not None and not callable(unretracted):
        raise ValueError(f"SolverSpec {name!r}: unretracted must be callable or None")
    if isinstance(expected_order, bool) or not isinstance(expected_order, int):
        raise ValueError(f"SolverSpec {name!r}: expected_order must be a positive int, got "
                         f"{expected_order!r}")
    return Method(name, make(), None if unretracted is None else unretracted(), None,
                  description, order=expected_order, cost=evaluations_per_step,
                  step_range=step_range, num_sizes=num_sizes)
