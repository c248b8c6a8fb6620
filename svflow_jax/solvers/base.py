"""The base of the single-step sphere solvers, and the small tree helpers they share.

A state is a PyTree of arrays of shape ``(..., n, d)`` whose rows (tokens) are unit vectors, a
point of ``(S^{d-1})^n``. A vector field ``v(t, X, args)`` returns, per row, a vector tangent
at that row. The solvers here advance ``dX/dt = v_t(X)`` by steps that map the sphere to itself:
``R(y) = y / |y|`` per row (the retraction, what a normalisation layer does), the exponential
map, or rotations.

Which weights a step reads. A field whose parameters are a path ``theta(t)`` (see
:mod:`svflow_jax.flow.paths`) is read by every stage at ``theta(t0 + c_i h)``. For per-layer
weights (piecewise constant in ``t``, right-continuous) a stage at ``c = 1`` of the step over
layer ``l`` would read layer ``l + 1``: an ``O(h)`` error per layer boundary, first order for
every method. So each solver's ``step`` first calls :func:`within_step`, which replaces every
node of the terms that has a ``within_step(t0, t1)`` method (a parameter path) by what that
method returns for the step: per-layer weights give every stage of a step inside layer ``l``
the weights ``theta_l``; continuous paths are returned unchanged. The check is duck-typed: this
package never imports :mod:`svflow_jax.flow`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax import AbstractLocalInterpolation, AbstractSolver, AbstractTerm
from jaxtyping import Array, PyTree

from svflow_jax import sphere

from ._interpolation import RetractedLinearInterpolation

__all__ = ["AbstractSphereSolver", "within_step"]


def _retract_tree(y: PyTree[Array]) -> PyTree[Array]:
    """``R`` applied to every leaf (each leaf is an array of unit rows)."""
    return jtu.tree_map(sphere.retract, y)


def _add_tree(y: PyTree[Array], increment: PyTree[Array]) -> PyTree[Array]:
    """``y + increment`` on PyTrees."""
    return jtu.tree_map(jnp.add, y, increment)


def _has_within_step(node) -> bool:
    return callable(getattr(node, "within_step", None))


def within_step(terms: PyTree, t0, t1) -> tuple[PyTree, bool]:
    """``terms`` as read by the stages of one step over ``[t0, t1]``, and whether that changed
    anything.

    Every node of the ``terms`` pytree that has a ``within_step`` method (duck typing: a
    :class:`svflow_jax.flow.paths.ParameterPath` inside a field inside an ``ODETerm``) is
    replaced by ``node.within_step(t0, t1)``. The second value is a static Python bool: True
    iff some node returned a new object (the identity, ``return self``, counts as unchanged),
    e.g. per-layer weights. :class:`Retracted` then tells an FSAL inner solver that the field
    changed between steps (``made_jump=True``), so it re-evaluates its first stage.

    Only what the pytree exposes is seen: a field captured in a closure (``lambda t, y, args:
    field.drift(t, y)``) keeps reading its path at the stage times; wrap it in an
    ``equinox.Module`` (or use a bound method of the field, which is a pytree) instead.
    """
    changed = False

    def restrict(node):
        nonlocal changed
        if not _has_within_step(node):
            return node
        new = node.within_step(t0, t1)
        if new is not node:
            changed = True
        return new

    restricted = jtu.tree_map(restrict, terms, is_leaf=_has_within_step)
    return restricted, changed


class AbstractSphereSolver(AbstractSolver):
    """Base of the single-step solvers here: one term, no solver state, no error estimate.

    Subclasses implement ``order`` and ``step``; dense output defaults to
    :class:`RetractedLinearInterpolation`. Subclass it to write a new layer design in a few
    lines::

        def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
            terms, _ = within_step(terms, t0, t1)   # the weights of the layer this step covers
            ...                                     # y1 on the sphere
            return y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful

    ``stays_on_sphere = True`` (a class attribute) tells :func:`svflow_jax.solvers.solve` that
    the steps map the sphere to itself; a subclass whose steps do not sets it to False.
    """

    term_structure: ClassVar = AbstractTerm
    interpolation_cls: ClassVar[Callable[..., AbstractLocalInterpolation]] = (
        RetractedLinearInterpolation
    )
    stays_on_sphere: ClassVar[bool] = True

    def init(self, terms, t0, t1, y0, args) -> None:
        return None

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)
