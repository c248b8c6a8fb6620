"""Adaptive depth: at evaluation, the stack chooses its number of blocks per sequence.

A model with continuous-in-depth weights defines the flow ``dy/dt = v_t(y)`` on ``[0, T]`` for
any step size. A design whose solver has an embedded error estimate (``Method.adaptive``:
Heun with its Euler estimate, midpoint, RK4 with its FSAL third-order estimate, a user's
tableau with ``b_error``) is run by :func:`diffrax.diffeqsolve` with a
:class:`diffrax.PIDController`: a step is accepted when the estimate ``e`` satisfies
``|e|_RMS <= 1`` in units of ``atol + rtol |y|``, and the next step size follows the PID rule.
Each sequence of the batch gets its own solve (``vmap``), hence its own number of steps; the
field evaluations it used are ``e_0 + e_step * (accepted + rejected steps)``, with ``e_0`` and
``e_step`` counted at run time on a small field (:func:`step_costs`).

A post-norm stack is solved on the sphere (the pair retracted), a pre-norm one in ``R^d`` (the
same pair without the retraction, on the field ``u_t(y / |y|)``). A design without an estimate
(Euler) is run by another design's pair on the same field (``method``): a model that is a
discretisation of its flow has one limit, which every convergent method approaches.

A solve that runs out of ``max_steps`` is reported (``ok = False``), never silently used.
"""

from __future__ import annotations

import dataclasses

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..next_token import next_token_nll
from ..solvers import WithinStep, catalogue
from ..solvers.catalogue import Method
from .design import evaluations
from .model import SolverLM

__all__ = ["AdaptiveResult", "adaptive_evaluate", "step_costs"]


def step_costs(design: Method) -> tuple[float, float]:
    """``(e_0, e_step)``: evaluations of a solve of ``N`` steps with the design's adaptive
    solver are ``e_0 + e_step N``."""
    if design.adaptive is None:
        raise ValueError(f"design {design.name!r} has no embedded error estimate (set "
                         "Method.adaptive, or give the tableau a b_error)")
    probe = dataclasses.replace(design, solver=design.adaptive)
    one, two = evaluations(probe, 1), evaluations(probe, 2)
    return one - (two - one), two - one


@dataclasses.dataclass
class AdaptiveResult:
    """Per input sequence: ``loss`` (mean nats per scored token), ``steps`` (accepted +
    rejected), ``evaluations``, ``ok`` (the controller finished within ``max_steps``)."""

    loss: np.ndarray
    steps: np.ndarray
    evaluations: np.ndarray
    ok: np.ndarray
    rtol: float


def adaptive_evaluate(
    model: SolverLM, inputs, targets, weights, *, rtol: float, atol: float | None = None,
    max_steps: int = 256, batch_size: int = 16, method: str | Method | None = None,
) -> AdaptiveResult:
    """Runs ``model`` on each sequence with the PID controller at tolerance ``rtol``
    (``atol`` defaults to ``rtol``; post-norm states are unit vectors) and scores it.
    ``method``: the design whose embedded pair runs the solve (default: the model's own),
    for example ``"heun"`` (Heun with its Euler estimate) for a model trained as Euler."""
    config = model.config
    design = config.layer_design if method is None else catalogue.get(method)
    if config.weights == "per_layer":
        raise ValueError("adaptive depth needs continuous-in-depth weights (linear or "
                         "chebyshev): per-layer weights jump at the layer boundaries")
    if design.is_splitting != config.layer_design.is_splitting:
        raise ValueError(f"method {design.name!r} and the model's design "
                         f"{config.layer_design.name!r} do not integrate the same terms (one is "
                         "a splitting)")
    e0, e_step = step_costs(design)
    solver = design.adaptive
    if config.norm_position == "pre" and isinstance(solver, WithinStep):
        solver = WithinStep(solver.solver)  # the same pair in R^d: no retraction
    atol = rtol if atol is None else atol
    graphdef, state = nnx.split(model)
    T = float(config.duration)

    @jax.jit
    def run(state, tokens, targets, weights):
        m = nnx.merge(graphdef, state)
        terms = m.terms()

        def one(tok):
            y0 = m.initial_state(tok)
            dtype = y0.dtype
            sol = diffrax.diffeqsolve(
                terms, solver, jnp.asarray(0.0, dtype), jnp.asarray(T, dtype),
                jnp.asarray(T / config.num_steps, dtype), y0,
                stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
                saveat=diffrax.SaveAt(t1=True), max_steps=max_steps, throw=False,
                adjoint=diffrax.RecursiveCheckpointAdjoint())
            return sol.ys[-1], sol.stats["num_steps"], sol.result == diffrax.RESULTS.successful

        y, steps, ok = jax.vmap(one)(tokens)
        nll = next_token_nll(m.head(y), targets)
        loss = jnp.sum(nll * weights, axis=-1) / jnp.sum(weights, axis=-1)
        return loss, steps, ok

    losses, steps, oks = [], [], []
    for i in range(0, len(inputs), batch_size):
        sl = slice(i, i + batch_size)
        loss, n, ok = run(state, jnp.asarray(inputs[sl]), jnp.asarray(targets[sl]),
                          jnp.asarray(weights[sl]))
        losses.append(np.asarray(loss))
        steps.append(np.asarray(n))
        oks.append(np.asarray(ok))
    steps_arr = np.concatenate(steps).astype(float)
    return AdaptiveResult(loss=np.concatenate(losses), steps=steps_arr,
                          evaluations=e0 + e_step * steps_arr, ok=np.concatenate(oks),
                          rtol=rtol)
