"""Training a :class:`~svflow_jax.designs.SolverLM` on a task: :func:`train` and :func:`evaluate`.

:func:`train` builds the design's language model from a :class:`TrainConfig`, the task's batch
stream and :func:`make_optimizer`, and runs the project's training loop
(:func:`svflow_jax.training.loop.fit`: one jitted step, data-parallel sharding, orbax
checkpoints with exact resume, append-only metrics). Float32 throughout; the initial weights
and every batch are functions of the seed (and the step), so a run is reproducible, and a
resumed run is the uninterrupted one (bit for bit on the same devices: tested). A model with
a head bias (``DesignConfig.head_bias``) starts it at the task's log prior (``log_prior``), so
the untrained model already predicts the unigram distribution.

The loss is the mean next-token negative log-likelihood over the scored positions
(:func:`svflow_jax.next_token.next_token_nll`). Every ``log_every`` steps a row (loss, gradient
norm, learning rate, tokens, seconds) is logged; every ``eval_every`` steps and at the end the
validation loss and the task's metric join it.

Files in ``out``: ``config.json`` (the :class:`TrainConfig`), ``run.json`` (the device count
and a hash of the design's source), ``metrics.jsonl`` / ``metrics.csv`` and ``checkpoints/``.
A run started on a folder that holds a checkpoint resumes from it; another configuration is
refused, except more ``steps`` for a finished run, which extends it (see ``schedule_steps``).
A design named ``package.module:Attr`` is hashed by its module file, so a module edited between
an interruption and the resume is noticed (refused, or warned about with
``on_mismatch="warn"``); so is a resume on another number of devices.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from svflow_jax import atomic
from svflow_jax.designs import DesignConfig, SolverLM
from svflow_jax.designs.rules import check_depths
from svflow_jax.next_token import next_token_nll, weighted_mean
from svflow_jax.solvers.catalogue import Method

from .loop import AdamW, StepInfo, fit, optimizer
from .tasks import get_task

__all__ = ["TrainConfig", "TrainResult", "train", "make_optimizer", "evaluate", "loss_and_count",
           "lm_loss", "depths_loss", "random_depth_loss", "draw_depth", "design_source",
           "initial_model"]


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
        schedule_steps: length of the warm-up + cosine schedule (``None``: ``steps``). A
            finished run extended to more ``steps`` keeps its schedule's length: the extra
            steps run at the final learning rate ``lr * final_lr_fraction``.
        extra_depths: block counts at which the loss is also taken: the training loss is the
            mean over the model's ``num_steps`` and these (:func:`depths_loss`), so the same
            weights must work at every one of them, as a discretisation of one flow does
            (continuous-in-depth weights). Each costs a forward and backward pass.
        random_depths: block counts of which each step draws one (uniformly, with the
            model's ``num_steps``; the draw a function of ``seed`` and the step) and takes
            the loss at it alone (:func:`random_depth_loss`): the expected loss is
            ``depths_loss``'s, at the cost of one depth per step on average. Not with
            ``extra_depths``.
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
    schedule_steps: int | None = None
    extra_depths: tuple[int, ...] = ()
    random_depths: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("extra_depths", "random_depths"):
            depths = tuple(getattr(self, name))  # from JSON lists
            object.__setattr__(self, name, depths)
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                       for n in depths):
                raise ValueError(f"TrainConfig.{name} must be positive ints, got {depths!r}")
        check_depths(self.model.weights, self.extra_depths, self.random_depths)
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
        if self.schedule_steps is not None and (
                not isinstance(self.schedule_steps, int) or self.schedule_steps < 1):
            raise ValueError(f"TrainConfig.schedule_steps must be None or a positive int, got "
                             f"{self.schedule_steps!r}")
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


def _schedule_args(config: TrainConfig) -> tuple:
    return (config.lr, config.warmup, config.schedule_steps or config.steps,
            config.final_lr_fraction)


def make_optimizer(config: TrainConfig) -> AdamW:
    """``clip_by_global_norm`` then AdamW with warm-up + cosine decay
    (:class:`svflow_jax.training.loop.AdamW`)."""
    return optimizer(*_schedule_args(config), config.weight_decay, config.clip)


def loss_and_count(model: SolverLM, inputs, targets, weights, num_steps=None):
    """``(sum of weighted nats, sum of weights, number of correct argmax predictions)``."""
    logits = model(inputs, num_steps=num_steps)
    nll = next_token_nll(logits, targets)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(nll * weights), jnp.sum(weights), jnp.sum(correct * weights)


def lm_loss(model: nnx.Module, inputs, targets, weights) -> tuple[jax.Array, None]:
    """The training loss of a language model: the weighted mean next-token NLL (nats)."""
    return weighted_mean(next_token_nll(model(inputs), targets), weights), None


def depths_loss(model: SolverLM, inputs, targets, weights, *, depths: tuple[int | None, ...]
                ) -> tuple[jax.Array, None]:
    """The mean over ``depths`` (block counts; ``None``: the trained one) of :func:`lm_loss`
    with the stack run at that depth."""
    losses = [_loss_at(model, inputs, targets, weights, n) for n in depths]
    return jnp.mean(jnp.stack(losses)), None


def _loss_at(model: SolverLM, inputs, targets, weights, num_steps: int | None) -> jax.Array:
    """:func:`lm_loss`'s value with the stack run at ``num_steps`` blocks."""
    return weighted_mean(next_token_nll(model(inputs, num_steps=num_steps), targets), weights)


def draw_depth(seed: int, step: int, count: int) -> int:
    """The index (in ``range(count)``) of the depth that step ``step`` of a run with
    ``random_depths`` trains: uniform, a function of the seed and the step alone, so a resumed
    run draws what the uninterrupted one did."""
    return int(np.random.default_rng((seed, step, 0x5D)).integers(count))


def random_depth_loss(model: SolverLM, inputs, targets, weights, choice, *,
                      depths: tuple[int | None, ...]) -> tuple[jax.Array, None]:
    """:func:`lm_loss` with the stack run at ``depths[choice[0]]`` blocks (``None``: the
    trained depth). ``choice`` is an int array along the batch (one value repeated, so that
    it is sharded as the batch is); ``lax.switch`` runs only the drawn depth's branch."""
    branches = [functools.partial(_loss_at, model, inputs, targets, weights, n) for n in depths]
    return jax.lax.switch(choice[0], branches), None


@functools.partial(jax.jit, static_argnums=(0, 5))
def _eval_sums(graphdef, state, inputs, targets, weights, num_steps):
    """One program per (model structure, depth): shared by every run and seed."""
    return loss_and_count(nnx.merge(graphdef, state), inputs, targets, weights, num_steps)


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


def design_source(design: str | Method) -> str:
    """What a design is built from, as a string that changes when it does: ``sha256:`` of the
    module file of a ``package.module:Attr`` design, or of the Butcher tableau's coefficients
    of a :class:`~svflow_jax.solvers.catalogue.Method` object built from one; a registered
    design is the package's own (its version is recorded with every output):
    ``"registered:<name>"``."""
    if isinstance(design, Method):
        solver = design.solver
        while hasattr(solver, "solver"):  # the wrappers (retraction) around the method
            solver = solver.solver
        tableau = getattr(solver, "tableau", None)
        if tableau is None:
            return f"object:{design!r}"
        arrays = [tableau.c, tableau.b_sol, tableau.b_error, *tableau.a_lower]
        digest = hashlib.sha256(b"".join(np.asarray(a, np.float64).tobytes() + b"|"
                                         for a in arrays))
        return "sha256:" + digest.hexdigest()
    if ":" not in design:
        return f"registered:{design}"
    spec = importlib.util.find_spec(design.split(":", 1)[0])
    if spec is None or spec.origin is None or not Path(spec.origin).is_file():
        return f"unhashable:{design}"
    return "sha256:" + hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()


def _comparable(config: TrainConfig) -> TrainConfig:
    """What must match to resume: everything but the length of the run and what the backward
    pass recomputes (``remat`` gives the same gradient)."""
    return dataclasses.replace(config, steps=1, schedule_steps=None,
                               model=config.model.replace(remat=True))


def _settle_config(out: Path, config: TrainConfig, latest: int | None) -> TrainConfig:
    """The configuration to run in ``out``: ``config``, checked against a saved run's
    (module docstring). A folder without a checkpoint holds nothing to resume."""
    path = out / "config.json"
    if latest is None or not path.exists():
        return config
    saved = TrainConfig.from_json(json.loads(path.read_text()))
    if _jsonable(_comparable(saved).to_json()) != _jsonable(_comparable(config).to_json()):
        raise ValueError(f"{out} holds a run with another configuration ({path}); use a new "
                         "folder")
    if config.schedule_steps is None:  # the schedule is the saved run's
        config = dataclasses.replace(config, schedule_steps=saved.schedule_steps)
        if config.steps != saved.steps and saved.schedule_steps is None:
            config = dataclasses.replace(config, schedule_steps=saved.steps)
    if config.steps != saved.steps and latest < saved.steps:
        raise ValueError(f"{out} holds an unfinished run of {saved.steps} steps (checkpoint at "
                         f"step {latest}); resume it with its own --steps {saved.steps}, and "
                         "extend it once it has finished")
    if config.steps < latest:
        raise ValueError(f"{out} holds a run trained for {latest} steps: more than the "
                         f"{config.steps} asked for")
    return config


def initial_model(config: TrainConfig, task) -> SolverLM:
    """The model :func:`train` starts from: ``config.model`` drawn with ``config.seed``, its
    head bias (where it has one) at ``task``'s log prior, so the head starts as the unigram
    model."""
    model = SolverLM(config.model, rngs=nnx.Rngs(config.seed))
    if model.unembed_bias is not None:
        model.unembed_bias[...] = jnp.asarray(task.log_prior())
    return model


def train(
    config: TrainConfig, out: str | Path | None = None, *, progress: bool = True,
    stop_after: int | None = None, devices=None, on_mismatch: str = "refuse",
) -> TrainResult:
    """Trains ``config`` (module docstring). ``out``: folder for config, metrics and
    checkpoints (resumes from its latest checkpoint); ``None``: nothing written, no resume.
    ``stop_after``: stop (after checkpointing) at this step, as if interrupted. ``devices``:
    the devices to shard the batch over (default: all of ``jax.devices()``).
    ``on_mismatch``: ``"warn"`` resumes on another device count or an edited design module
    (default: refused with ``ValueError``).

    Raises:
        svflow_jax.training.loop.TrainingDiverged: at the first non-finite loss.
    """
    import orbax.checkpoint as ocp

    config = config.resolved()
    task = get_task(config.task, config.model.context)
    n_devices = len(jax.devices() if devices is None else list(devices))
    if config.batch_size % n_devices:
        raise ValueError(f"batch_size={config.batch_size} must be divisible by the "
                         f"{n_devices} devices (data parallelism)")
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        with ocp.CheckpointManager((out / "checkpoints").resolve()) as manager:
            latest = manager.latest_step()
        config = _settle_config(out, config, latest)
        atomic.write_json(out / "config.json", _jsonable(config.to_json()))

    lr = make_optimizer(config).schedule
    tokens_per_step = config.batch_size * task.context

    def log(info: StepInfo) -> dict[str, Any] | None:
        done = info.done
        validate = config.eval_every > 0 and (done % config.eval_every == 0
                                              or done == config.steps)
        if not (done % config.log_every == 0 or validate or done == config.steps):
            return None
        row = {"loss": float(info.loss), "grad_norm": float(info.grad_norm),
               "lr": float(lr(done - 1)), "tokens": done * tokens_per_step,
               "seconds": info.seconds()}
        if validate:
            metrics = evaluate(info.model(), task, config.eval_sequences)
            row.update({f"val_{k}": v for k, v in metrics.items()})
            row["seconds"] = info.seconds()
        return row

    model = initial_model(config, task)
    depths = (None, *config.extra_depths, *config.random_depths)

    def batch(step: int) -> tuple[Any, ...]:
        arrays = task.batch(config.seed, step, config.batch_size)
        if not config.random_depths:
            return arrays
        choice = draw_depth(config.seed, step, len(depths))
        return (*arrays, np.full((config.batch_size,), choice, np.int32))

    loss_fn = lm_loss
    if config.extra_depths:
        loss_fn = functools.partial(depths_loss, depths=depths)
    if config.random_depths:
        loss_fn = functools.partial(random_depth_loss, depths=depths)
    result = fit(
        model, loss_fn, make_optimizer(config), batch, config.steps, log=log,
        out=out, checkpoint_every=config.checkpoint_every, stop_after=stop_after,
        devices=devices, fingerprint={"design_source": design_source(config.model.design)},
        on_mismatch=on_mismatch, progress=progress,
        description=f"train {config.model.design}")
    history = result.history
    final = next((r for r in reversed(history) if any(k.startswith("val_") for k in r)), {})
    return TrainResult(model=result.model, config=config, history=history,
                       final={k: v for k, v in final.items() if k.startswith("val_")},
                       resumed_from=result.resumed_from, seconds=result.seconds)


def _jsonable(data):
    return json.loads(json.dumps(data, default=str))


def history_array(history: list[dict[str, Any]], key: str) -> np.ndarray:
    """``(step, value)`` rows of the history entries that have ``key``."""
    return np.array([(r["step"], r[key]) for r in history if key in r], float)
