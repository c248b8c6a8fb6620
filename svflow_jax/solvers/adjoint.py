"""Gradients of fixed-step solves that store the forward pass instead of recomputing it.

:class:`diffrax.RecursiveCheckpointAdjoint` (the default of :func:`svflow_jax.solvers.solve`)
keeps a few checkpoints of the state and recomputes the steps between them in the backward
pass. Even with ``checkpoints`` equal to the number of steps it recomputes every step once
more (its checkpointed loop stores the carry of each step, not the residuals inside it), and
the stages of a Runge-Kutta step are themselves a checkpointed loop that recomputes them.

:class:`StoredAdjoint` runs the same diffrax loop as a ``lax.scan`` of exactly ``max_steps``
iterations (equinox's ``bounded`` while loop with one level, no ``jax.checkpoint``), and the
Runge-Kutta stages likewise, so reverse mode stores every residual of every stage and the
backward pass evaluates no field at all: what PyTorch's autograd does. Measured on the
attention field (field evaluations counted at run time as ``tests/test_stored_adjoint.py`` does,
forward and backward together), ``Retracted(RK4())`` over 16 steps: 240 evaluations with the
default, 195 with ``checkpoints=16``, 65 stored (the 65 of the forward pass alone);
``RetractedEuler()``: 43, 32, 16. Gradients agree with the default to round-off.

The price is memory: every residual of every stage of every step is alive at the start of the
backward pass (XLA's compiled temporary memory for the RK4 gradient at ``n = 32, d = 64``,
64 steps, float64: about 1.1 MiB by default, 2.7 MiB with ``checkpoints = 64``, 105 MiB
stored; at ``n = d = 256``: 35 MiB, 88 MiB and 3.3 GiB, where PyTorch's backprop through the
same RK4 loop grows its peak RSS by 1.8-2.2 GiB). About half of it is diffrax's loop state
kept per stage (its Runge-Kutta stage buffer among it): the same RK4 written as a bare
``lax.scan`` over the steps needs 50 MiB at ``n = 32, d = 64``, not 105.

Measured time (``experiments/peer_benchmark.py``, idle 2-core CPU): storing was *slower* than
the default at every size (RK4 gradient at ``n = d = 256``: PyTorch / project 0.55 and 0.45 in
float32 / float64, against 0.80 and 0.86 for the default), because moving the stored stages
costs more than the recomputation it saves. The default
:class:`diffrax.RecursiveCheckpointAdjoint` therefore stays the default everywhere; this one is
for fields so expensive per evaluation that recomputation dominates.

Only for fixed steps: :func:`solve` refuses it without ``num_steps`` (an adaptive solve would
run all ``max_steps`` iterations).
"""

from __future__ import annotations

import diffrax
import equinox as eqx
import equinox.internal as eqxi
import jax.tree_util as jtu
from diffrax import AbstractRungeKutta

__all__ = ["StoredAdjoint"]


def _stored_loop(cond_fun, body_fun, init_val, *, max_steps, buffers=None, checkpoints=None):
    """A while loop of at most ``max_steps`` iterations, as one ``lax.scan`` of that length
    (each iteration a ``lax.cond`` on ``cond_fun``) without checkpointing: reverse mode stores
    every iteration's residuals."""
    del checkpoints
    return eqxi.while_loop(
        cond_fun, body_fun, init_val, max_steps=max_steps, buffers=buffers, kind="bounded",
        base=max(int(max_steps), 2),
    )


def _is_runge_kutta(node) -> bool:
    # type(), not isinstance: Retracted forwards isinstance checks to its inner solver.
    return issubclass(type(node), AbstractRungeKutta)


def _store_stages(solver):
    """Every diffrax Runge-Kutta solver inside ``solver`` (a ``Retracted``, a splitting, ...)
    with its stage loop stored too (``scan_kind="bounded"``, one level: no checkpoint)."""

    def fix(node):
        if _is_runge_kutta(node) and node.scan_kind is None:
            return eqx.tree_at(lambda s: s.scan_kind, node, "bounded", is_leaf=lambda x: x is None)
        return node

    return jtu.tree_map(fix, solver, is_leaf=_is_runge_kutta)


class StoredAdjoint(diffrax.AbstractAdjoint):
    """Reverse-mode gradients of a fixed-step solve that store the forward pass: no field is
    evaluated again in the backward pass (module docstring: counts, memory, when to use it).

    Pass it to :func:`svflow_jax.solvers.solve` as ``adjoint=StoredAdjoint()`` together with
    ``num_steps``. Forward values are those of the default adjoint (the same steps, run by
    a different loop); only the backward pass differs.
    """

    def loop(
        self, *, solver, max_steps, throw, passed_solver_state, passed_controller_state,
        **kwargs,
    ):
        del throw, passed_solver_state, passed_controller_state
        if max_steps is None:
            raise ValueError("StoredAdjoint needs a bounded number of steps (max_steps)")
        return self._loop(
            solver=_store_stages(solver),
            max_steps=max_steps,
            inner_while_loop=_stored_loop,
            outer_while_loop=_stored_loop,
            **kwargs,
        )
