"""The measurements of the layer-design comparison, as functions returning plain results.

``experiments/layer_designs.py`` (report, figures), the notebook and the tests call these and
nothing else; there is no second implementation.

* :func:`equal_compute_steps`: the number of blocks of each design that spends a budget of
  field evaluations (counted at run time, :func:`svflow_jax.designs.evaluations`).
* :func:`run_design`: trains one design at one seed (resumable: a finished run is read back from
  its folder) and measures it: final validation, depth transfer, adaptive depth.
* :func:`depth_transfer`: a trained model evaluated at other numbers of blocks.
* :func:`richardson`: the differences between the final states at ``N, 2N, 4N, ...`` blocks and
  their ratios, which tend to ``2^p`` for a stack that discretises one flow with a method of
  order ``p``, and the angle of each from their Richardson limit (:func:`limit_angles`);
  :func:`order_regime` reads from which block count on the ratios are ``2^p``.
* :func:`adaptive_depth`: per-sequence adaptive depth at several tolerances.
* :func:`token_collapse`: the mean cosine between the final token states of a sequence (1: every
  token at one point, the head can only output one distribution).
* :func:`step_lengths`: how far each block of a stack on the sphere moves the tokens (the
  geodesic step's angle, unbounded, against the normalised step's, below pi/2).
* :func:`throughput`: tokens/s of a training step and of a forward pass of several models
  (designs, the plain NNX :class:`~svflow_jax.transformer.TransformerLM` of the same width and
  compute), timed side by side.
* :func:`gradient_memory`: XLA's temporary memory of the compiled gradient program against the
  number of blocks, with and without rematerialisation.
* :func:`interval`: mean and 95% half-width (Student t) over seeds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from svflow_jax import atomic
from svflow_jax.designs import DesignConfig, SolverLM, evaluations
from svflow_jax.environment import environment
from svflow_jax.fitting import t_quantile
from svflow_jax.solvers import catalogue
from svflow_jax.transformer import TransformerLM

from .loop import placed, put_batch, train_step
from .tasks import get_task
from .trainer import TrainConfig, evaluate, lm_loss, make_optimizer, train

__all__ = [
    "equal_compute_steps",
    "count_parameters",
    "run_design",
    "depth_transfer",
    "richardson",
    "extrapolate",
    "limit_angles",
    "ORDER_BAND",
    "order_regime",
    "adaptive_depth",
    "token_collapse",
    "COLLAPSED",
    "step_lengths",
    "throughput",
    "gradient_memory",
    "interval",
]

def interval(values, level: float = 0.95) -> tuple[float, float]:
    """``(mean, half-width)`` of the two-sided ``level`` Student-t interval of the mean of the
    finite values, ``t_{(1 + level) / 2, n - 1} s / sqrt(n)`` (half-width NaN for a single
    value)."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return math.nan, math.nan
    if len(v) == 1:
        return float(v[0]), math.nan
    t = t_quantile((1 + level) / 2, len(v) - 1)
    return float(v.mean()), float(t * v.std(ddof=1) / math.sqrt(len(v)))


def equal_compute_steps(designs: list[str], budget: float) -> dict[str, int]:
    """Blocks ``N`` per design so that a forward pass costs ``budget`` field evaluations.
    Raises if a design cannot meet the budget exactly (pick a budget that all divide)."""
    out = {}
    for name in designs:
        per_step = catalogue.get(name).evaluations_per_step
        first = evaluations(catalogue.get(name), 1) - per_step
        steps = (budget - first) / per_step
        if steps < 1 or abs(steps - round(steps)) > 1e-9:
            raise ValueError(f"design {name!r} costs {first:g} + {per_step:g} N evaluations: no "
                             f"whole number of blocks N spends {budget:g}")
        out[name] = int(round(steps))
    return out


def count_parameters(model: nnx.Module) -> int:
    """Number of trainable scalars."""
    return int(sum(np.prod(a.shape) for a in jax.tree.leaves(nnx.state(model, nnx.Param))))


def depth_transfer(model: SolverLM, task, factors, eval_sequences: int) -> list[dict[str, Any]]:
    """Validation at ``max(1, round(f N))`` blocks for each factor ``f`` (``N`` the trained
    number); the same continuous-in-depth weights, a different step size."""
    rows = []
    for f in factors:
        steps = max(1, int(round(f * model.config.num_steps)))
        metrics = evaluate(model, task, eval_sequences, num_steps=steps)
        rows.append({"factor": f, "num_steps": steps,
                     "evaluations": evaluations(model.config.layer_design, steps), **metrics})
    return rows


@nnx.jit(static_argnums=(2, 3), graph_updates=False)  # one program per model structure
def _final_state(model: SolverLM, inputs, num_steps: int | None, unit: bool):
    """The final states at ``num_steps`` blocks (default: trained), divided by their norms
    with ``unit``."""
    y = model.final_state(inputs, num_steps=num_steps)
    return y / jnp.linalg.norm(y, axis=-1, keepdims=True) if unit else y


#: a run whose :func:`token_collapse` is at least this is reported as collapsed, not ranked
COLLAPSED = 0.99


def token_collapse(model: SolverLM, task, eval_sequences: int, batch_size: int = 32) -> float:
    """Mean over validation sequences of the mean cosine between the final states of two
    distinct tokens of the sequence, ``(sum_{i != j} cos(y_i, y_j)) / (n (n - 1))``, at the
    trained depth. 1 means collapse: every position holds the same state, so the head predicts
    one distribution whatever the context (the context-free, unigram loss); near 0 for the
    independent directions of an untrained model."""
    values = []
    for inputs, _, _ in task.eval_batches(eval_sequences, batch_size):
        y = _final_state(model, jnp.asarray(inputs), None, False)
        u = y / jnp.linalg.norm(y, axis=-1, keepdims=True)
        n = u.shape[-2]
        total = jnp.sum(jnp.sum(u, axis=-2) ** 2, axis=-1)  # sum_{i,j} cos = |sum_i u_i|^2
        values.append(np.asarray((total - n) / (n * (n - 1))))
    return float(np.mean(np.concatenate(values)))


def step_lengths(model: SolverLM, task, eval_sequences: int,
                 batch_size: int = 32) -> dict[str, list[float]]:
    """How far each block of a stack on the sphere (``norm_position="post"``) moves the
    tokens: at block ``k``'s start state ``y_k`` (the trained depth, ``h = T / N``), the length
    of its first stage's step, ``theta = h |P_y v(t_k, y_k)|``, with ``v`` the fields' sum.

    For geodesic Euler, ``exp_y(h P_y v)``, ``theta`` is the angle the block turns the token,
    with no bound: past ``pi`` the token passes the antipode. The normalised step
    ``(y + h v) / |y + h v|`` of post-norm Euler turns it by ``atan(theta) < pi / 2``.

    Returns, per block, over the validation tokens: ``median``, ``p99``, ``max`` and
    ``above_pi`` (the share of tokens with ``theta > pi``)."""
    from svflow_jax import sphere
    from svflow_jax.designs import integrate

    c = model.config
    if c.norm_position != "post":
        raise ValueError("step_lengths measures stacks on the sphere (norm_position='post'); "
                         f"this one is {c.norm_position!r}")
    solver = c.layer_design.solver_for(c.norm_position)
    h = c.duration / c.num_steps
    graphdef, state = nnx.split(model)

    @jax.jit  # one program for every batch: the blocks' step lengths, (blocks, batch, n)
    def lengths(state, inputs):
        lm = nnx.merge(graphdef, state)
        terms, y, out = lm.terms(), lm.initial_state(inputs), []
        for k in range(c.num_steps):
            t = k * h
            v = terms.vf(t, y, None)
            v = sum(v) if isinstance(v, tuple) else v  # a splitting: one field per term
            out.append(h * jnp.linalg.norm(sphere.project_tangent(y, v), axis=-1))
            y = integrate(solver, terms, y, t, t + h, 1, remat=False)
        return jnp.stack(out)

    batches = [np.asarray(lengths(state, jnp.asarray(inputs))).reshape(c.num_steps, -1)
               for inputs, _, _ in task.eval_batches(eval_sequences, batch_size)]
    per_block = list(np.concatenate(batches, axis=1))
    return {"median": [float(np.median(t)) for t in per_block],
            "p99": [float(np.quantile(t, 0.99)) for t in per_block],
            "max": [float(t.max()) for t in per_block],
            "above_pi": [float(np.mean(t > np.pi)) for t in per_block]}


def richardson(model: SolverLM, task, multiples=(1, 2, 4, 8, 16), eval_sequences: int = 32,
               batch_size: int = 32) -> dict[str, list[float]]:
    """The final states (what the head reads: after the final Norm for pre-norm) at ``m N``
    blocks for each multiple ``m`` of the trained ``N``, on validation sequences; ``differences``
    ``e_k = RMS_tokens |y_{m_k N} - y_{m_{k+1} N}|`` and ``ratios`` ``e_k / e_{k+1}``. For a
    stack that is a convergent discretisation of one flow by a method of order ``p``, and
    multiples that double, the ratios tend to ``2^p`` (Richardson); for a model whose blocks do
    not discretise a flow they do not."""
    n = model.config.num_steps
    unit = model.config.norm_position != "post"  # pre-norm: the direction the head reads
    states = []
    for mult in multiples:
        ys = [np.asarray(_final_state(model, jnp.asarray(inputs), int(mult * n), unit),
                         np.float64)
              for inputs, _, _ in task.eval_batches(eval_sequences, batch_size)]
        states.append(np.concatenate(ys))
    diffs = [float(np.sqrt(np.mean(np.sum((a - b) ** 2, axis=-1))))
             for a, b in zip(states[:-1], states[1:], strict=True)]
    ratios = [a / b if b > 0 else math.inf for a, b in zip(diffs[:-1], diffs[1:], strict=True)]
    order = model.config.layer_design.order
    return {"multiples": [float(m) for m in multiples], "differences": diffs, "ratios": ratios,
            "angles_to_limit": limit_angles(states, order) if len(states) > 1 else []}


def extrapolate(coarse, fine, order: int):
    """Richardson's limit from two solutions whose step halves, ``fine + (fine - coarse) /
    (2^p - 1)``: exact for an error ``C h^p`` (arrays or floats alike)."""
    return fine + (fine - coarse) / (2.0 ** order - 1.0)


def limit_angles(states, order: int) -> list[float]:
    """The RMS over tokens of the angle, in degrees, between each of ``states`` (final states
    at block counts that double, ``(..., d)`` each) and the Richardson limit of the last two
    (:func:`extrapolate`), directions compared (the head reads a direction)."""
    limit = extrapolate(states[-2], states[-1], order)
    u = limit / np.linalg.norm(limit, axis=-1, keepdims=True)
    out = []
    for y in states:
        cos = np.sum(y * u, axis=-1) / np.linalg.norm(y, axis=-1)
        out.append(float(np.degrees(np.sqrt(np.mean(np.arccos(np.clip(cos, -1.0, 1.0)) ** 2)))))
    return out


#: a Richardson ratio within this relative distance of ``2^p`` counts as the order-``p`` regime
ORDER_BAND = 0.10


def order_regime(ratios, blocks, order: int, band: float = ORDER_BAND) -> int | None:
    """The smallest block count ``blocks[k]`` from which every Richardson ratio
    ``ratios[j] = e_j / e_(j+1)`` (``j >= k``; ``e_j`` the difference between ``blocks[j]`` and
    ``blocks[j + 1]``) lies within ``band`` of ``2^order`` (``|r / 2^p - 1| <= band``); ``None``
    when the finest does not."""
    start = None
    for k in range(len(ratios) - 1, -1, -1):
        if abs(ratios[k] / 2.0 ** order - 1.0) > band:
            break
        start = blocks[k]
    return start


def adaptive_depth(model: SolverLM, task, rtols, eval_sequences: int,
                   max_steps: int = 256, method: str | None = None) -> list[dict[str, Any]]:
    """Adaptive depth at each tolerance: per-sequence evaluations and losses (lists), their
    means, and whether every solve finished (``method``: see :func:`adaptive_evaluate`)."""
    from svflow_jax.designs.adaptive import adaptive_evaluate

    batches = task.eval_batches(eval_sequences, eval_sequences)
    inputs, targets, weights = (np.concatenate([b[i] for b in batches]) for i in range(3))
    rows = []
    for rtol in rtols:
        res = adaptive_evaluate(model, inputs, targets, weights, rtol=rtol, max_steps=max_steps,
                                method=method)
        rows.append({"rtol": rtol, "loss": float(res.loss.mean()),
                     "evaluations": float(res.evaluations.mean()),
                     "all_finished": bool(res.ok.all()),
                     "per_input_loss": res.loss.tolist(),
                     "per_input_evaluations": res.evaluations.tolist()})
    return rows


def throughput(models: Mapping[str, nnx.Module], batch_size: int, context: int,
               rounds: int = 5, seed: int = 0) -> dict[str, dict[str, float]]:
    """Tokens per second of one AdamW training step and of one forward pass of each of
    ``models`` (name -> :class:`SolverLM` or :class:`TransformerLM`) on random tokens, timed
    side by side: after one warm-up call of each program, ``rounds`` rounds each call every
    model's step and forward pass once; a rate is ``batch_size * context`` over the median
    call. Alternating the models within each round spreads a change of the machine's load over
    all of them, so their ratios stay fair on a busy machine."""
    tokens = jax.random.randint(jax.random.key(seed), (batch_size, context + 1), 0,
                                min(m.config.vocab_size for m in models.values()), jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # as the tasks give them
    calls = {}  # (model, "train" | "inference") -> a call of its compiled program
    for name, model in models.items():
        # the trainer's own step, placed as fit places it: the program a training run compiled
        mesh, graphdef, params, rest, tx, opt_state = placed(model, make_optimizer(
            TrainConfig(steps=100)))
        batch = put_batch((inputs, targets, jnp.ones(targets.shape, jnp.float32)), mesh)
        forward = jax.jit(lambda params, graphdef=graphdef, rest=rest:
                          nnx.merge(graphdef, params, rest)(inputs))
        calls[name, "train"] = partial(train_step, graphdef, lm_loss, tx, params, rest,
                                       opt_state, batch)
        calls[name, "inference"] = partial(forward, params)
    for call in calls.values():
        jax.block_until_ready(call())  # compiles
    samples = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(call())
            samples[key].append(time.perf_counter() - start)
    n = batch_size * context
    return {name: {f"{kind}_tokens_per_s": n / float(np.median(samples[name, kind]))
                   for kind in ("train", "inference")} for name in models}


def gradient_memory(config: DesignConfig, depths, batch_size: int) -> dict[str, list[float]]:
    """MiB of temporary memory (``compiled.memory_analysis().temp_size_in_bytes``) of the
    compiled gradient of the LM loss at each number of blocks, with ``remat`` on and off.
    Nothing runs: the programs are only compiled, on abstract weights. The blocks are scanned,
    so with rematerialisation only the state between blocks is stored per block (``B n d``
    floats); without it, every stage's activations are."""
    out: dict[str, list[float]] = {"depths": [float(n) for n in depths]}
    tokens = jax.ShapeDtypeStruct((batch_size, config.context), jnp.int32)
    for remat in (True, False):
        sizes = []
        for n in depths:
            c = config.replace(num_steps=int(n), remat=remat)
            model = nnx.eval_shape(lambda c=c: SolverLM(c, rngs=nnx.Rngs(0)))
            graphdef, params = nnx.split(model, nnx.Param)

            def loss(params, tokens, graphdef=graphdef):
                logits = nnx.merge(graphdef, params)(tokens).astype(jnp.float32)
                return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

            compiled = jax.jit(jax.grad(loss)).lower(params, tokens).compile()
            sizes.append(compiled.memory_analysis().temp_size_in_bytes / 2**20)
        out["remat" if remat else "no_remat"] = sizes
    return out


def plain_transformer(config: DesignConfig, layers: int, seed: int = 0) -> TransformerLM:
    """The plain NNX TransformerLM of the same width, context and vocabulary with ``layers``
    layers (post-norm, parallel block: the Euler design's architecture)."""
    model = SolverLM(config.replace(design="euler", weights="per_layer", num_anchors=layers,
                                    num_steps=layers, update="residual"), rngs=nnx.Rngs(seed))
    from svflow_jax.transformer import TransformerConfig

    tc = dataclasses.replace(model.transformer_config(), project_branches=False)
    assert isinstance(tc, TransformerConfig)
    return TransformerLM(tc, rngs=nnx.Rngs(seed))


def run_design(
    base: TrainConfig, design: str, num_steps: int, seed: int, out: Path, *,
    transfer_factors=(0.5, 2.0, 4.0), rtols=(), eval_sequences: int | None = None,
    richardson_multiples=(), progress: bool = False,
) -> dict[str, Any]:
    """Trains ``design`` with ``num_steps`` blocks at ``seed`` into ``out`` and measures it
    (final validation, :func:`depth_transfer`, :func:`token_collapse`, :func:`adaptive_depth`
    at ``rtols``, :func:`richardson` at ``richardson_multiples``). A finished run
    (``out/summary.json``) is read back instead; an interrupted one resumes."""
    summary_path = Path(out) / "summary.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    config = dataclasses.replace(base, seed=seed, model=base.model.replace(
        design=design, num_steps=num_steps))
    result = train(config, out, progress=progress)
    config = result.config
    task = get_task(config.task, config.model.context)
    n_eval = eval_sequences or config.eval_sequences
    summary = {
        "design": design, "seed": seed, "num_steps": num_steps,
        "evaluations": evaluations(catalogue.get(design), num_steps),
        "parameters": count_parameters(result.model),
        "train_seconds": result.seconds, "history": result.history, "final": result.final,
        "transfer": depth_transfer(result.model, task, transfer_factors, n_eval),
        "collapse": token_collapse(result.model, task, n_eval),
        "richardson": richardson(result.model, task, richardson_multiples, n_eval)
        if richardson_multiples else None,
        "adaptive": adaptive_depth(result.model, task, rtols, n_eval)
        if rtols and catalogue.get(design).adaptive is not None
        and config.model.weights != "per_layer" and config.model.norm_position == "post"
        else [],
        "environment": environment(),
    }
    atomic.write_json(summary_path, summary, indent=None)
    return summary
