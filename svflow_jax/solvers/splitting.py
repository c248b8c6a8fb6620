"""Splittings of ``f = f_A + f_B``: the sequential and the Macaron Transformer blocks.

The two fields come as ``MultiTerm(term_A, term_B)`` (``solve`` builds it from a tuple
``(attention, ffn)``). With ``phi^X_h`` one step of a sphere solver on ``f_X`` alone:

* :class:`LieTrotter`: ``y1 = phi^B_h(phi^A_h(y0))``: attention sub-layer, then FFN sub-layer.
  Order 1 whatever the sub-step: the ``h^2`` term ``[f_A, f_B] h^2 / 2`` does not cancel.
* :class:`Strang`: ``y1 = phi^B_{h/2}(phi^A_h(phi^B_{h/2}(y0)))``, the Macaron block (half FFN,
  attention, half FFN). Symmetric, so order 2 when every sub-step is at least second order;
  with Euler sub-steps the sub-steps' own ``h^2`` errors remain: order 1.

Each sub-step covers the physical time interval it integrates (``[t0, t0 + h/2]``, ``[t0, t1]``,
``[t0 + h/2, t1]``), so time-dependent fields are read at the right times, and the sub-solver
restricts its terms to that interval itself (:func:`within_step`): on per-layer weights every
sub-step of a step inside layer ``l`` reads ``theta_l``.
"""

from __future__ import annotations

from typing import ClassVar

from diffrax import RESULTS, AbstractSolver, AbstractTerm, MultiTerm

from .base import AbstractSphereSolver

__all__ = ["AbstractSplitting", "LieTrotter", "Strang", "Swapped"]


class AbstractSplitting(AbstractSphereSolver):
    """Splitting of ``f = f_A + f_B`` given as ``MultiTerm(term_A, term_B)``.

    Each sub-step is one step of ``substep`` (any single-step solver that stays on the sphere:
    :class:`RetractedEuler`, :class:`GeodesicEuler`, ``Retracted(Heun())``, ...) on one term,
    over the physical time interval it covers (so time-dependent fields are read at the right
    times). The sub-solver is re-initialised for every sub-step (FSAL caches would be stale).
    No error estimate; dense output is :class:`RetractedLinearInterpolation` (a chord: local
    error ``O(h^2)``). A splitting stays on the sphere iff its sub-step does
    (:func:`svflow_jax.solvers.stays_on_sphere`).

    Subclasses implement ``order`` and ``step`` from :meth:`_sub` (one sub-step).
    """

    substep: AbstractSolver

    term_structure: ClassVar = MultiTerm[tuple[AbstractTerm, AbstractTerm]]

    def _sub(self, term, ta, tb, y, args):
        """One step of ``substep`` on ``term`` over ``[ta, tb]`` from ``y``: ``(y1, result)``."""
        state = self.substep.init(term, ta, tb, y, args)
        y1, _, _, _, result = self.substep.step(term, ta, tb, y, args, state, False)
        return y1, result


class LieTrotter(AbstractSplitting):
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
        result = RESULTS.where(result_a == RESULTS.successful, result_b, result_a)
        return y1, None, dict(y0=y0, y1=y1), None, result


class Strang(AbstractSplitting):
    """Strang splitting: half step of the SECOND term over ``[t0, t0 + h/2]``, full step of the
    FIRST over ``[t0, t1]``, half step of the SECOND over ``[t0 + h/2, t1]``.

    ``MultiTerm(attention, ffn)`` gives the Macaron block (half FFN, attention, half FFN).
    Order: ``min(2, order of the sub-step)``. With Euler sub-steps it is only first order: the
    ``h^2`` error ``-(A'A/2 + B'B/4 + dA/dt/2 + dB/dt/4) h^2`` does not cancel
    (docs/theory.md section 11);
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


def _swap(terms: MultiTerm) -> MultiTerm:
    first, second = terms.terms
    return MultiTerm(second, first)


class Swapped(AbstractSphereSolver):
    """A splitting with the roles of its two fields exchanged: on ``MultiTerm(attention, ffn)``,
    ``Swapped(Strang(s))`` is half attention, FFN, half attention (the other Strang ordering)
    and ``Swapped(LieTrotter(s))`` the FFN sub-layer before the attention sub-layer. The same
    method, the same order; the error constants (the commutator terms) differ."""

    splitting: AbstractSplitting

    term_structure: ClassVar = MultiTerm[tuple[AbstractTerm, AbstractTerm]]

    def order(self, terms):
        return self.splitting.order(_swap(terms))

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        return self.splitting.step(_swap(terms), t0, t1, y0, args, solver_state, made_jump)
