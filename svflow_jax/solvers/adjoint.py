"""Fixed-step solves as one ``lax.scan``, and what their gradients keep: :class:`ScanAdjoint`
(the default of :func:`svflow_jax.solvers.solve` with ``num_steps``).

:func:`fixed_step_scan` runs ``N`` equal steps of any diffrax solver as one ``lax.scan`` over
``solver.step``, with the explicit Runge-Kutta solvers inside it rewritten by
:func:`unroll_stages` (the tableau's stages as straight-line code; an FSAL stage that only
serves an error estimate is not evaluated). It is what a Transformer is: ``N`` layers, no
step-size control, no dense output. Reverse mode then differentiates it in one of two ways
(:class:`ScanAdjoint` ``remat``):

* ``True`` (the default): every step is rematerialised (``jax.checkpoint``). The backward pass
  evaluates each stage once more; memory holds one state per step, like the Transformer's
  own backward pass with per-layer rematerialisation.
* a :mod:`jax.checkpoint_policies` policy: what it names is stored (``dots_saveable``: the
  matrix products), the rest (elementwise work) recomputed.

Why not diffrax's loop: :class:`diffrax.RecursiveCheckpointAdjoint` keeps a few checkpoints and
recomputes the steps between them, and the stages of a Runge-Kutta step are themselves a
checkpointed loop that recomputes them again. Counted at run time on the attention field
(``tests/test_stored_adjoint.py``), the gradient of ``Retracted(RK4())`` over 16 steps costs
240 field evaluations with diffrax's default adjoint, 195 with ``checkpoints=16`` and 128 with
:class:`ScanAdjoint` (64 forward, 64 again in the backward pass); ``RetractedEuler()``: 43, 32
and 32. Gradients agree to round-off.

Which one to use trades time against memory: ``ScanAdjoint()`` (the default) recomputes each
step once in the backward pass, and ``ScanAdjoint(remat=dots_saveable)`` keeps only the matrix
products. Storing every elementwise intermediate of every stage (the former ``StoredAdjoint``,
``ScanAdjoint(remat=False)``) was removed: it was slower than recomputing at every size and
dtype measured, with 20-30 times the memory. Times and memory against PyTorch's backprop,
measured by ``experiments/peer_benchmark.py``, are on the results page
``docs/results/peer-benchmark.md``.

Only fixed steps: :func:`solve` refuses these adjoints without ``num_steps``. With
``SaveAt(ts=...)`` or dense output, :func:`solve` runs diffrax's own loop (unrolled into a scan
of ``max_steps`` iterations, stages likewise, nothing recomputed) instead of the scan.
"""
from __future__ import annotations

from collections.abc import Callable

import diffrax
import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax import RESULTS, AbstractERK, AbstractRungeKutta, AbstractSolver, ButcherTableau
from jaxtyping import Array, PyTree

__all__ = ["ScanAdjoint", "fixed_step_scan", "fixed_step_loop", "unroll_stages"]


# ---------------------------------------------------------------------------------------------
# Fixed steps as one lax.scan, Runge-Kutta stages unrolled
# ---------------------------------------------------------------------------------------------


def _coefficients(tableau: ButcherTableau):
    """``(c, rows, b)`` as Python floats (weakly typed: a float32 state stays float32), with
    ``c[0] = 0`` and ``rows[i - 1]`` the coefficients of stage ``i``'s input."""
    c = [0.0] + [float(x) for x in tableau.c]
    rows = [[float(x) for x in row] for row in tableau.a_lower]
    return c, rows, [float(x) for x in tableau.b_sol]


def _needed_stages(tableau: ButcherTableau) -> list[int]:
    """The stages that the solution ``y1 = y0 + sum_i b_i k_i`` depends on, in order: a stage
    with ``b_i = 0`` that no needed stage reads (an FSAL stage, kept only for an error estimate
    or dense output) is not evaluated."""
    _, rows, b = _coefficients(tableau)
    needed = {i for i, bi in enumerate(b) if bi != 0.0}
    for i in range(len(b) - 1, 0, -1):
        if i in needed:
            needed |= {j for j, a in enumerate(rows[i - 1]) if a != 0.0}
    return sorted(needed)


def _unrollable(node) -> bool:
    # type(), not isinstance: Retracted forwards isinstance checks to its inner solver.
    return issubclass(type(node), AbstractERK) and isinstance(
        getattr(node, "tableau", None), ButcherTableau
    )


def _combine(y0: PyTree, terms: list[tuple[float, PyTree]]) -> PyTree:
    """``y0 + sum_j a_j k_j`` on PyTrees (the ``a_j`` Python floats)."""
    coefficients = [a for a, _ in terms]

    def leaf(y, *ks):
        return y + sum(a * k for a, k in zip(coefficients, ks, strict=True))

    return jtu.tree_map(leaf, y0, *(k for _, k in terms))


class _UnrolledERK(AbstractSolver):
    """An explicit diffrax Runge-Kutta solver with its stages written out one after the other
    (a Python loop: straight-line code in the program) instead of diffrax's checkpointed stage
    loop. Reverse mode then stores each stage's residuals and evaluates no stage again; stages
    with ``b_i = 0`` that nothing reads (FSAL) are skipped. For fixed steps only: no error
    estimate, no FSAL cache, linear dense output."""

    solver: AbstractERK
    interpolation_cls = diffrax.LocalLinearInterpolation

    @property
    def term_structure(self):
        return self.solver.term_structure

    def order(self, terms):
        return self.solver.order(terms)

    def init(self, terms, t0, t1, y0, args):
        return None

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        tableau = self.solver.tableau
        c, rows, b = _coefficients(tableau)
        control = terms.contr(t0, t1)
        ks: dict[int, PyTree] = {}
        for i in _needed_stages(tableau):
            yi = _combine(y0, [(a, ks[j]) for j, a in enumerate(rows[i - 1]) if a]) if i else y0
            ks[i] = terms.vf_prod(t0 + c[i] * (t1 - t0), yi, args, control)
        y1 = _combine(y0, [(b[i], k) for i, k in ks.items() if b[i]])
        return y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful

    def func(self, terms, t0, y0, args):
        return self.solver.func(terms, t0, y0, args)


def unroll_stages(solver: AbstractSolver) -> AbstractSolver:
    """``solver`` with every explicit diffrax Runge-Kutta solver inside it (a ``Retracted``'s
    inner solver, a splitting's sub-step, ...) replaced by the same tableau with its stages
    written out one after the other (:class:`_UnrolledERK`): for fixed steps, the same values
    to round-off, a smaller program (no stage loop) and a backward pass that stores the stages
    instead of recomputing them. Not for adaptive solves (no error estimate)."""
    return jtu.tree_map(lambda n: _UnrolledERK(n) if _unrollable(n) else n, solver,
                        is_leaf=_unrollable)


def step_times(t0, t1, num_steps: int, dtype) -> Array:
    """``t_i = t0 + i (t1 - t0) / num_steps`` for ``i = 0..num_steps`` in ``dtype``, with
    ``t_N = t1`` exactly: the grid of :func:`fixed_step_scan`."""
    t0, t1 = jnp.asarray(t0, dtype), jnp.asarray(t1, dtype)
    ts = t0 + ((t1 - t0) / num_steps) * jnp.arange(num_steps + 1, dtype=dtype)
    return ts.at[-1].set(t1)


def fixed_step_scan(
    solver: AbstractSolver,
    terms: PyTree,
    y0: PyTree[Array],
    t0,
    t1,
    num_steps: int,
    args: PyTree = None,
    *,
    remat: bool | Callable = False,
    save_steps: bool = False,
) -> PyTree[Array]:
    """``num_steps`` equal steps of ``solver`` from ``t0`` to ``t1``, as one ``lax.scan``.

    Step ``i`` covers ``[t_i, t_{i+1}]``, ``t_i = t0 + i (t1 - t0) / num_steps`` in the state's
    dtype (``t_N = t1`` exactly). Explicit diffrax Runge-Kutta solvers inside ``solver`` run
    with their stages unrolled, so reverse mode stores every stage's residuals and the backward
    pass evaluates no field (what PyTorch's autograd does; memory grows with
    ``num_steps x stages``). ``remat=True`` rematerialises each step instead
    (``jax.checkpoint``): the backward pass evaluates each step once more and memory holds one
    state per step. ``remat`` may also be a :mod:`jax.checkpoint_policies` policy: what it
    names is stored, the rest of each step recomputed (``dots_saveable``: the matrix products
    are stored, only elementwise work is redone). Compile time is flat in ``num_steps``.

    Returns ``y(t1)``, or with ``save_steps`` the states after every step, stacked on a
    leading axis of length ``num_steps``.
    """
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    ts = step_times(t0, t1, num_steps, jnp.result_type(*jtu.tree_leaves(y0)))
    solver = unroll_stages(solver)
    state = solver.init(terms, ts[0], ts[1], y0, args)

    def body(carry, i):
        y, state = carry
        y1, _, _, state, _ = solver.step(terms, ts[i], ts[i + 1], y, args, state, False)
        return (y1, state), (y1 if save_steps else None)

    if callable(remat):
        body = jax.checkpoint(body, policy=remat)
    elif remat:
        body = jax.checkpoint(body)
    (y, _), ys = jax.lax.scan(body, (y0, state), jnp.arange(num_steps))
    return ys if save_steps else y


@eqx.filter_jit
def fixed_step_loop(terms, solver: AbstractSolver, y0, t1: Array, num_steps: Array):
    """``y(t1)`` after ``num_steps`` equal steps of ``solver`` from ``y0`` at time 0: the
    solver's own ``init`` and ``step`` in a ``lax.fori_loop``, as a Transformer applies its
    layers. ``t1`` and ``num_steps`` are traced arrays, so one program serves every step size;
    forward only (no reverse mode through a loop of traced length): what a study or a probe
    runs at many depths, not a training stack (:func:`fixed_step_scan`)."""
    dt = t1 / num_steps.astype(t1.dtype)
    state = solver.init(terms, jnp.zeros_like(t1), dt, y0, None)

    def step(i, carry):
        y, state = carry
        t0 = i.astype(dt.dtype) * dt
        y, _, _, state, _ = solver.step(terms, t0, t0 + dt, y, None, state, False)
        return y, state

    return jax.lax.fori_loop(0, num_steps, step, (y0, state))[0]


# ---------------------------------------------------------------------------------------------
# ScanAdjoint
# ---------------------------------------------------------------------------------------------


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


class ScanAdjoint(diffrax.AbstractAdjoint):
    """Gradients of a fixed-step solve through one ``lax.scan`` of its steps, Runge-Kutta
    stages unrolled (:func:`fixed_step_scan`), with a choice of what the backward pass keeps.

    Pass it to :func:`svflow_jax.solvers.solve` as ``adjoint=ScanAdjoint(...)`` together with
    ``num_steps``:

    * ``remat=True`` (default): each step is rematerialised (``jax.checkpoint``); the backward
      pass evaluates every stage once more, memory holds one state per step;
    * ``remat=policy``, a :mod:`jax.checkpoint_policies` policy: what it names is stored, e.g.
      ``jax.checkpoint_policies.dots_saveable`` keeps the matrix products and recomputes only
      the elementwise work.

    Forward values are those of the default adjoint to round-off (the same steps, with
    ``t_i = t0 + i h`` and no FSAL reuse). With ``SaveAt(ts=...)`` or dense output the solve
    runs diffrax's own loop instead, stored (no recomputation, but about twice the memory and
    time of the scan). The module docstring says where its time and memory are measured.
    """

    remat: bool | Callable = True

    def __check_init__(self):
        if self.remat is False:
            raise ValueError(
                "ScanAdjoint(remat=False) (store every residual, recompute nothing) was removed: "
                "it was slower than the default remat=True at every size measured, with 20-30 "
                "times the memory; use the default, or remat=jax.checkpoint_policies."
                "dots_saveable to store the matrix products")

    def loop(
        self, *, solver, max_steps, throw, passed_solver_state, passed_controller_state,
        **kwargs,
    ):
        del throw, passed_solver_state, passed_controller_state
        if max_steps is None:
            raise ValueError(f"{type(self).__name__} needs a bounded number of steps (max_steps)")
        return self._loop(
            solver=_store_stages(solver),
            max_steps=max_steps,
            inner_while_loop=_stored_loop,
            outer_while_loop=_stored_loop,
            **kwargs,
        )
