"""Training a :class:`~svflow_jax.designs.SolverLM` with optax: one jitted step, exact resume.

Optimiser: ``clip_by_global_norm(clip)`` then AdamW (decoupled weight decay) with a linear
warm-up to ``lr`` over ``warmup`` steps and a cosine decay to ``lr * final_lr_fraction`` at
``steps`` (``optax.warmup_cosine_decay_schedule``). Float32 throughout; the initial weights and
every batch are functions of the seed (and the step), so a run is reproducible.

Data parallelism: the batch is sharded over all devices along a ``"data"`` mesh axis
(``jax.sharding.NamedSharding``), the parameters and optimiser state are replicated, and
``jax.jit`` inserts the gradient all-reduce. The same code runs on one CPU, several forced CPU
host devices (``XLA_FLAGS=--xla_force_host_platform_device_count=4``), several GPUs, or several
hosts (call ``jax.distributed.initialize()`` first; every process then feeds its share of the
global batch, see :func:`train`). ``batch_size`` must be divisible by the device count.

Checkpoints: ``orbax.checkpoint.CheckpointManager`` in ``out/checkpoints`` every
``checkpoint_every`` steps (and at the end), holding the parameters, the optimiser state, the
step and the elapsed wall-clock time. A run started with an ``out`` folder that holds a
checkpoint resumes from the latest one; the metric files are cut back to that step, and since
batch ``i`` depends only on ``(seed, i)`` the resumed loss curve is the uninterrupted one
(bit-for-bit on the same devices: tested).

Metrics: ``out/metrics.jsonl`` (one JSON object per logged step) and ``out/metrics.csv``;
``out/config.json`` holds the configuration.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from svflow_jax.designs import DesignConfig, SolverLM
from svflow_jax.tables import write_csv

from .tasks import get_task

__all__ = ["TrainConfig", "TrainResult", "train", "make_optimizer", "evaluate", "loss_and_count"]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run.

    Attributes:
        model: the :class:`DesignConfig` (its ``context`` and ``vocab_size`` are set from the
            task by :func:`train`).
        task: ``"austen"`` or ``"recall"``.
        steps: optimiser steps.
        batch_size: sequences per step (divisible by the number of devices).
        lr, warmup, final_lr_fraction: peak learning rate, warm-up steps, end of the cosine.
        weight_decay, clip: AdamW decay, global-norm clipping threshold.
        seed: initial weights and batches.
        eval_every: validation every this many steps (and at the last step); 0: none.
        eval_sequences: validation sequences.
        log_every: training metrics every this many steps.
        checkpoint_every: orbax checkpoint every this many steps (0: only at the end).
    """

    model: DesignConfig = DesignConfig()
    task: str = "austen"
    steps: int = 200
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 20
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    eval_sequences: int = 64
    log_every: int = 10
    checkpoint_every: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_sequences", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
        for name in ("warmup", "checkpoint_every", "seed", "eval_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"TrainConfig.{name} must be an int >= 0, got {value!r}")
        for name in ("lr", "clip"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"TrainConfig.{name} must be a positive number, got {value!r}")
        if not 0 <= self.weight_decay < 1 or not 0 <= self.final_lr_fraction <= 1:
            raise ValueError("weight_decay must be in [0, 1) and final_lr_fraction in [0, 1]")
        get_task(self.task)

    def resolved(self) -> TrainConfig:
        """The config with the model's vocabulary and context set by the task."""
        task = get_task(self.task, self.model.context)
        return dataclasses.replace(self, model=self.model.replace(
            vocab_size=task.vocab_size, context=task.context))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainConfig:
        data = dict(data)
        data["model"] = DesignConfig(**data["model"])
        return cls(**data)


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns: the trained model, the metric rows, the final validation."""

    model: SolverLM
    config: TrainConfig
    history: list[dict[str, Any]]
    final: dict[str, float]
    resumed_from: int | None
    seconds: float


def _optimizer_key(config: TrainConfig) -> tuple:
    """The hyper-parameters that fix the optimiser (hashable: a static jit argument)."""
    return (config.lr, config.warmup, config.steps, config.final_lr_fraction,
            config.weight_decay, config.clip)


def _schedule(lr, warmup, steps, final_lr_fraction):
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1), end_value=lr * final_lr_fraction)


def _optimizer(lr, warmup, steps, final_lr_fraction, weight_decay, clip):
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(_schedule(lr, warmup, steps, final_lr_fraction),
                                   weight_decay=weight_decay))


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm`` then AdamW with warm-up + cosine decay (module docstring)."""
    return _optimizer(*_optimizer_key(config))


def make_optimizer_lr(config: TrainConfig):
    """The learning-rate schedule of :func:`make_optimizer` (for logging)."""
    return _schedule(config.lr, config.warmup, config.steps, config.final_lr_fraction)


def loss_and_count(model: SolverLM, inputs, targets, weights, num_steps=None):
    """``(sum of weighted nats, sum of weights, number of correct argmax predictions)``."""
    logits = model(inputs, num_steps=num_steps).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(nll * weights), jnp.sum(weights), jnp.sum(correct * weights)


def _mesh(devices=None) -> Mesh:
    """The devices (default: all) on one ``"data"`` axis (automatic sharding propagation)."""
    return Mesh(np.array(jax.devices() if devices is None else list(devices)), ("data",))


def _put_batch(batch, mesh):
    sharding = NamedSharding(mesh, P("data"))
    return tuple(jax.device_put(jnp.asarray(a), sharding) for a in batch)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _eval_sums(graphdef, state, inputs, targets, weights, num_steps):
    """One program per (model structure, depth): shared by every run and seed."""
    return loss_and_count(nnx.merge(graphdef, state), inputs, targets, weights, num_steps)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _train_step(graphdef, optimizer_key, params, opt_state, inputs, targets, weights):
    """One AdamW step; one program per (model structure, optimiser), shared by every seed."""

    def loss_fn(params):
        total, count, _ = loss_and_count(nnx.merge(graphdef, params), inputs, targets, weights)
        return total / count

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = _optimizer(*optimizer_key).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)


def evaluate(model: SolverLM, task, num_sequences: int, batch_size: int = 32,
             num_steps: int | None = None) -> dict[str, float]:
    """Validation ``loss`` (mean nats per scored token) and the task's metric (``bpc`` or
    ``accuracy``) at ``num_steps`` blocks (default: the trained depth)."""
    graphdef, state = nnx.split(model)
    total = count = correct = 0.0
    for inputs, targets, weights in task.eval_batches(num_sequences, batch_size):
        a, b, c = _eval_sums(graphdef, state, inputs, targets, weights, num_steps)
        total, count, correct = total + float(a), count + float(b), correct + float(c)
    loss = total / count
    out = {"loss": loss}
    out[task.metric] = task.score(loss) if task.metric == "bpc" else correct / count
    return out


def _write_rows(out: Path, rows: list[dict[str, Any]]) -> None:
    with open(out / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    write_csv(out / "metrics.csv", rows)


def _read_rows(out: Path, upto: int) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto]


def train(
    config: TrainConfig, out: str | Path | None = None, *, progress: bool = True,
    stop_after: int | None = None, devices=None,
) -> TrainResult:
    """Trains ``config`` (module docstring). ``out``: folder for config, metrics and
    checkpoints (resumes from its latest checkpoint); ``None``: nothing written, no resume.
    ``stop_after``: stop (after checkpointing) at this step, as if interrupted. ``devices``:
    the devices to shard the batch over (default: all of ``jax.devices()``)."""
    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    config = config.resolved()
    task = get_task(config.task, config.model.context)
    mesh = _mesh(devices)
    if config.batch_size % mesh.size:
        raise ValueError(f"batch_size={config.batch_size} must be divisible by the "
                         f"{mesh.size} devices (data parallelism)")

    model = SolverLM(config.model, rngs=nnx.Rngs(config.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_optimizer(config)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)
    start, elapsed, history, resumed_from = 0, 0.0, [], None

    manager = None
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        saved = out / "config.json"
        if saved.exists() and json.loads(saved.read_text()) != _jsonable(config.to_json()):
            raise ValueError(f"{out} holds a run with another configuration ({saved}); use a "
                             "new folder")
        saved.write_text(json.dumps(_jsonable(config.to_json()), indent=2))
        manager = ocp.CheckpointManager(
            (out / "checkpoints").resolve(),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        latest = manager.latest_step()
        if latest is not None:
            target = {"params": params, "opt_state": opt_state,
                      "elapsed": jnp.zeros((), jnp.float64 if jax.config.x64_enabled
                                           else jnp.float32)}
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
            restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
            params, opt_state = restored["params"], restored["opt_state"]
            elapsed, start, resumed_from = float(restored["elapsed"]), latest, latest
            history = _read_rows(out, latest)

    key = _optimizer_key(config)

    schedule_lr = make_optimizer_lr(config)
    end = config.steps if stop_after is None else min(stop_after, config.steps)
    bar = tqdm(range(start, end), desc=f"train {config.model.design}", disable=not progress,
               initial=start, total=config.steps)
    t_start = time.perf_counter() - elapsed
    for step in bar:
        batch = _put_batch(task.batch(config.seed, step, config.batch_size), mesh)
        params, opt_state, loss, gnorm = _train_step(graphdef, key, params, opt_state, *batch)
        done = step + 1
        validate = config.eval_every > 0 and (done % config.eval_every == 0
                                              or done == config.steps)
        if done % config.log_every == 0 or validate or done == config.steps:
            row = {"step": done, "loss": float(loss), "grad_norm": float(gnorm),
                   "lr": float(schedule_lr(step)), "tokens": done * config.batch_size *
                   task.context, "seconds": time.perf_counter() - t_start}
            if validate:
                metrics = evaluate(nnx.merge(graphdef, params), task, config.eval_sequences)
                row.update({f"val_{k}": v for k, v in metrics.items()})
                row["seconds"] = time.perf_counter() - t_start
            history.append(row)
            bar.set_postfix(loss=f"{float(loss):.3f}")
            if out is not None:
                _write_rows(out, history)
        checkpoint_now = manager is not None and (
            done == end or (config.checkpoint_every and done % config.checkpoint_every == 0))
        if checkpoint_now:
            manager.save(done, args=ocp.args.StandardSave({
                "params": params, "opt_state": opt_state,
                "elapsed": jnp.asarray(time.perf_counter() - t_start)}))
    bar.close()
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    model = nnx.merge(graphdef, params)
    final = next((r for r in reversed(history) if any(k.startswith("val_") for k in r)), {})
    return TrainResult(model=model, config=config, history=history,
                       final={k: v for k, v in final.items() if k.startswith("val_")},
                       resumed_from=resumed_from, seconds=time.perf_counter() - t_start)


def _jsonable(data):
    return json.loads(json.dumps(data, default=str))


def history_array(history: list[dict[str, Any]], key: str) -> np.ndarray:
    """``(step, value)`` rows of the history entries that have ``key``."""
    return np.array([(r["step"], r[key]) for r in history if key in r], float)
