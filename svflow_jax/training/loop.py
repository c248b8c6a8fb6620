"""The training loop: a model, a loss, a data stream and an optax optimiser; sharded, resumable.

:func:`fit` is the project's one training loop (the layer designs, the objective study and the
population experiment all call it) and :func:`train_step` its one optimiser update:

    (loss, aux), g = value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(g, opt_state, params)
    params = optax.apply_updates(params, updates)

``loss_fn(model, *batch) -> (loss, aux)`` is any function of an NNX model and a batch (a
hashable callable: it is a static argument of the compiled step, so a module-level function or
a frozen dataclass lets runs share one program). The data stream ``data(step)`` returns the
batch of optimiser step ``step`` (a tuple of arrays, batch axis first); since it is a function
of the step, a resumed run sees the batches an uninterrupted one would.

:class:`AdamW` (:func:`optimizer`) is global-norm clipping then AdamW (decoupled weight decay)
with a linear warm-up to ``lr`` and a cosine decay to ``lr * final_lr_fraction`` at ``steps``;
past ``steps`` the learning rate stays at that final value. Its numbers are arguments of the
compiled step, not constants: a learning-rate sweep compiles one step, not one per rate.

Data parallelism: the batch is sharded over the devices along a ``"data"`` mesh axis
(``jax.sharding.NamedSharding``), parameters and optimiser state are replicated, and
``jax.jit`` inserts the gradient all-reduce. The same code runs on one CPU, forced CPU host
devices, several GPUs or several hosts.

With an ``out`` folder, :func:`fit` keeps

* ``out/checkpoints``: orbax checkpoints of the parameters, the optimiser state and the elapsed
  time, every ``checkpoint_every`` steps and at the end; a later call resumes from the latest.
* ``out/metrics.jsonl``: the logged rows, APPENDED one line per row (a kill can only cut the
  last line short); at resume a cut last line is removed and rows past the restored step are
  dropped, so the file is the uninterrupted run's. ``out/metrics.csv``: the same rows,
  rewritten atomically.
* ``out/run.json``: the device count and the caller's ``fingerprint`` (e.g. a hash of the
  source the model was built from). A resume on other devices or another source is refused
  (``ValueError``), or only warned about with ``on_mismatch="warn"``: the numbers then differ
  from the uninterrupted run's.

A non-finite loss stops the loop at once (:class:`TrainingDiverged`); no checkpoint is written
after it, so the latest checkpoint holds finite weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import signal
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from svflow_jax import atomic
from svflow_jax.reporting import write_csv

__all__ = ["AdamW", "optimizer", "train_step", "placed", "put_batch", "fit", "FitResult",
           "StepInfo", "TrainingDiverged", "TrainingInterrupted"]


@functools.partial(jax.tree_util.register_dataclass, meta_fields=[], data_fields=[
    "lr", "warmup", "steps", "final_lr_fraction", "weight_decay", "clip"])
@dataclasses.dataclass(frozen=True)
class AdamW:
    """Global-norm clipping at ``clip`` (none if ``None``), then AdamW (decoupled weight decay
    ``weight_decay``) on :meth:`schedule`: a linear warm-up from 0 to ``lr`` over ``warmup``
    steps, a cosine decay to ``lr * final_lr_fraction`` at ``steps``, constant after.

    A pytree whose leaves are these numbers. :func:`train_step` receives them as values, not as
    constants of the program, so runs that differ in learning rate, schedule length, weight
    decay or clipping norm share one compiled step (only clipping or not changes the program).
    """

    lr: float
    warmup: int
    steps: int
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    clip: float | None = 1.0

    def schedule(self, count):
        """The learning rate of step ``count`` (counted from 0), in the dtype of ``count / 1``.
        With ``c = count - warmup``, ``D = max(steps, warmup + 1) - warmup`` and
        ``a = final_lr_fraction``:

            lr * count / warmup                                    count < warmup
            lr * (a + (1 - a) (1 + cos(pi min(c, D) / D)) / 2)     otherwise

        (optax's ``warmup_cosine_decay_schedule(0, lr, warmup, warmup + D, a * lr)``, written so
        that every number may be a traced value.)"""
        lr, warmup, a = self.lr, self.warmup, self.final_lr_fraction
        warm = lr * (count / jnp.maximum(warmup, 1))  # a warm-up of 0 steps is never selected
        decay = jnp.maximum(self.steps, warmup + 1) - warmup
        c = jnp.minimum(count - warmup, decay)
        cool = lr * (a + (1 - a) * (0.5 * (1 + jnp.cos(jnp.pi * (c / decay)))))
        return jnp.where(count < warmup, warm, cool)

    def transformation(self) -> optax.GradientTransformation:
        """The optax optimiser (its numbers may be traced values)."""
        adamw = optax.adamw(self.schedule, weight_decay=self.weight_decay)
        return adamw if self.clip is None else optax.chain(optax.clip_by_global_norm(self.clip),
                                                           adamw)


def optimizer(lr: float, warmup: int, steps: int, final_lr_fraction: float = 0.1,
              weight_decay: float = 0.01, clip: float | None = 1.0) -> AdamW:
    """The project's optimiser, :class:`AdamW` (clipping, AdamW, warm-up + cosine decay)."""
    return AdamW(lr, warmup, steps, final_lr_fraction, weight_decay, clip)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Given:
    """Any other optax optimiser, a constant of the compiled step (one program per object)."""

    tx: optax.GradientTransformation

    def transformation(self) -> optax.GradientTransformation:
        return self.tx


@functools.partial(jax.jit, static_argnums=(0, 1))
def train_step(graphdef, loss_fn, tx: AdamW | _Given, params, rest, opt_state, batch):
    """One optimiser step (module docstring): ``(params, opt_state, loss, aux, |grad|)``.
    ``tx``: an :class:`AdamW` (its numbers are arguments of the program) or any optax optimiser
    wrapped by :func:`fit`. ``rest``: the model's variables that are not trained (held fixed)."""

    def objective(params):
        return loss_fn(nnx.merge(graphdef, params, rest), *batch)

    (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
    updates, opt_state = tx.transformation().update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux, optax.tree.norm(grads)


class TrainingDiverged(RuntimeError):
    """The loss became non-finite; ``step`` is the optimiser step that produced it."""

    def __init__(self, step: int, loss: float):
        self.step, self.loss = step, loss
        super().__init__(f"the training loss is {loss} at step {step}: the run diverged "
                         "(a smaller --lr or a shorter --duration may help); stopped there, "
                         "the latest checkpoint is from before it")


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`fit`: ``step`` is the last optimiser step done. A checkpoint
    being written was finished first; steps after the latest checkpoint are done again by a
    resumed run (their metrics rows are dropped then)."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"interrupted at step {step}")


class _Deferred:
    """Ctrl-C (SIGINT) held back while a checkpoint or a metrics row is written: raised as
    ``KeyboardInterrupt`` when the write is done, so that an interrupt never lands inside
    orbax's save (which logs a traceback of it) or half-way through a file. Elsewhere it is
    raised at once, as Python's own handler does. Installed only from the main thread, over
    Python's default handler (a caller's own handler is left alone)."""

    def __init__(self) -> None:
        self.inside = self.pending = False
        self.installed = (threading.current_thread() is threading.main_thread()
                          and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if self.installed:
            signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.inside:
            self.pending = True
        else:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def section(self, *, hold: bool = False):
        """Defers Ctrl-C inside the block; raises it after (``hold``: forgets it)."""
        self.inside = True
        try:
            yield
        finally:
            self.inside = False
            if self.pending and not hold:
                self.pending = False
                raise KeyboardInterrupt

    def restore(self) -> None:
        if self.installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.installed = False


@dataclasses.dataclass
class StepInfo:
    """What the ``log`` callback of :func:`fit` sees after optimiser step ``done``: the loss,
    the loss function's ``aux`` and the gradient norm (device arrays), and :meth:`model`."""

    done: int
    loss: jax.Array
    aux: Any
    grad_norm: jax.Array
    started: float
    _merge: Callable[[], nnx.Module]

    def model(self) -> nnx.Module:
        """The model with the weights after this step."""
        return self._merge()

    def seconds(self) -> float:
        """Wall-clock seconds of the run so far (counting the time before a resume)."""
        return time.perf_counter() - self.started


@dataclasses.dataclass
class FitResult:
    """What :func:`fit` returns: the trained model, the logged rows (from the start, also
    when resumed), the step it resumed from and the wall-clock seconds (counting the time
    before an interruption)."""

    model: nnx.Module
    history: list[dict[str, Any]]
    resumed_from: int | None
    seconds: float


def _mesh(devices=None) -> Mesh:
    return Mesh(np.array(jax.devices() if devices is None else list(devices)), ("data",))


def placed(model: nnx.Module, tx: AdamW | optax.GradientTransformation, devices=None):
    """What :func:`fit` hands :func:`train_step` at step 0: ``(mesh, graphdef, params, rest,
    tx, opt_state)``, the weights and the fresh optimiser state replicated over the devices'
    mesh (a batch goes through :func:`put_batch`). A caller that places them so runs the very
    program that :func:`fit` compiled."""
    mesh = _mesh(devices)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    replicated = NamedSharding(mesh, P())
    params, rest = jax.device_put(params, replicated), jax.device_put(rest, replicated)
    step_tx = tx if isinstance(tx, AdamW) else _Given(tx)
    opt_state = jax.device_put(step_tx.transformation().init(params), replicated)
    return mesh, graphdef, params, rest, step_tx, opt_state


def put_batch(batch, mesh: Mesh):
    """The batch's arrays, sharded along their first axis over ``mesh``'s ``"data"`` axis."""
    sharding = NamedSharding(mesh, P("data"))
    return tuple(jax.device_put(jnp.asarray(a), sharding) for a in batch)


def _check_run(out: Path, info: dict[str, Any], resuming: bool, on_mismatch: str) -> None:
    """Compares ``info`` with ``out/run.json`` at a resume; records it otherwise."""
    path = out / "run.json"
    if resuming and path.exists():
        saved = json.loads(path.read_text())
        changed = [f"{k}: {saved.get(k)!r} then, {v!r} now" for k, v in info.items()
                   if saved.get(k) != v]
        if changed:
            message = (f"{out} holds a run made under other conditions ({'; '.join(changed)});"
                       " resumed, it would not continue the same numbers")
            if on_mismatch != "warn":
                raise ValueError(message + ". Use a new folder, or allow it explicitly")
            warnings.warn(message, stacklevel=3)
    atomic.write_json(path, info)


def _restore_rows(out: Path, upto: int) -> list[dict[str, Any]]:
    """The rows of ``out/metrics.jsonl`` up to step ``upto``: a cut last line is removed,
    rows past ``upto`` (logged after the checkpoint) are dropped from the file."""
    path = out / "metrics.jsonl"
    rows = atomic.read_jsonl(path, repair=True)
    steps = [r.get("step") for r in rows]
    if any(not isinstance(s, int) for s in steps) or steps != sorted(set(steps)):
        raise ValueError(f"{path}: the rows' steps are not increasing whole numbers; the log "
                         "does not belong to this run's checkpoints")
    kept = [r for r in rows if r["step"] <= upto]
    if len(kept) < len(rows):
        atomic.write_text(path, "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
    return kept


def _append_row(out: Path, row: dict[str, Any], history: list[dict[str, Any]]) -> None:
    atomic.append_line(out / "metrics.jsonl", atomic.dumps(row))
    write_csv(out / "metrics.csv", history)


def fit(
    model: nnx.Module,
    loss_fn: Callable[..., tuple[jax.Array, Any]],
    tx: AdamW | optax.GradientTransformation,
    data: Callable[[int], tuple],
    steps: int,
    *,
    log: Callable[[StepInfo], dict[str, Any] | None] | None = None,
    out: str | Path | None = None,
    checkpoint_every: int = 0,
    stop_after: int | None = None,
    devices: Sequence[Any] | None = None,
    fingerprint: Mapping[str, Any] | None = None,
    on_mismatch: str = "refuse",
    progress: bool = False,
    description: str = "train",
) -> FitResult:
    """Trains ``model`` for ``steps`` optimiser steps (module docstring).

    Args:
        model: an NNX module; its ``nnx.Param`` variables are trained, the rest held fixed.
        loss_fn: ``loss_fn(model, *batch) -> (scalar loss, aux)``, hashable.
        tx: the optimiser: an :class:`AdamW` (:func:`optimizer`), or any optax optimiser (then
            a constant of the compiled step: one program per object).
        data: ``data(step)``: the batch of step ``step`` (batch axis divisible by the devices).
        steps: the last step.
        log: called after every step; a returned dictionary is a row of the history (and of
            ``out/metrics.jsonl``), to which ``"step"`` is added.
        out: folder for checkpoints, metrics and ``run.json``; ``None``: nothing written.
        checkpoint_every: checkpoint period (0: only at the end or at ``stop_after``).
        stop_after: stop (after checkpointing) at this step, as if interrupted.
        devices: the devices to shard the batch over (default: all).
        fingerprint: recorded in ``out/run.json`` beside the device count, compared at resume.
        on_mismatch: ``"refuse"`` (``ValueError``) or ``"warn"`` when ``run.json`` differs.
        progress: show a tqdm progress bar from step 0 (``compiling...`` until the first
            step is done), with the loss and the latest validation figures of the logged rows
            (their ``val_*`` keys).
        description: the progress bar's label.

    Raises:
        TrainingDiverged: at the first non-finite loss.
        TrainingInterrupted: on Ctrl-C, with the last step done.
    """
    import orbax.checkpoint as ocp
    from tqdm.auto import tqdm

    if on_mismatch not in ("refuse", "warn"):
        raise ValueError(f"on_mismatch must be 'refuse' or 'warn', got {on_mismatch!r}")
    mesh, graphdef, params, rest, step_tx, opt_state = placed(model, tx, devices)
    start, elapsed, history, resumed_from = 0, 0.0, [], None

    manager = None
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        manager = ocp.CheckpointManager(
            (out / "checkpoints").resolve(),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
        latest = manager.latest_step()
        _check_run(out, {"devices": mesh.size, **(fingerprint or {})}, latest is not None,
                   on_mismatch)
        if latest is not None:
            target = {"params": params, "opt_state": opt_state,
                      "elapsed": jnp.zeros((), jnp.float64 if jax.config.x64_enabled
                                           else jnp.float32)}
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
            restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
            params, opt_state = restored["params"], restored["opt_state"]
            elapsed, start, resumed_from = float(restored["elapsed"]), latest, latest
        history = _restore_rows(out, start)

    end = steps if stop_after is None else min(stop_after, steps)
    bar = tqdm(range(start, end), desc=description, disable=not progress, initial=start,
               total=steps)
    bar.set_postfix_str("compiling the training step...")
    shown: dict[str, str] = {}
    t_start = time.perf_counter() - elapsed
    completed = start
    deferred = _Deferred()
    try:
        for step in bar:
            batch = data(step)
            if len(batch[0]) % mesh.size:
                raise ValueError(f"a batch of {len(batch[0])} must be divisible by the "
                                 f"{mesh.size} devices (data parallelism)")
            params, opt_state, loss, aux, gnorm = train_step(
                graphdef, loss_fn, step_tx, params, rest, opt_state, put_batch(batch, mesh))
            done = step + 1
            value = float(loss)
            completed = done
            if done == start + 1:  # compiled
                bar.set_postfix_str("", refresh=False)
            if not math.isfinite(value):
                if out is not None:
                    row = {"step": done, "loss": value,
                           "stopped": "non-finite loss: the run diverged"}
                    history.append(atomic.strict_json(row))
                    _append_row(out, row, history)
                raise TrainingDiverged(done, value)
            if log is not None:
                info = StepInfo(done, loss, aux, gnorm, t_start,
                                functools.partial(nnx.merge, graphdef, params, rest))
                row = log(info)
                if row is not None:
                    row = {"step": done, **row}
                    history.append(row)
                    shown["loss"] = f"{value:.3f}"
                    shown.update({k: f"{v:.4g}" for k, v in row.items()
                                  if k.startswith("val_") and isinstance(v, (int, float))})
                    bar.set_postfix(shown)
                    if out is not None:
                        with deferred.section():
                            _append_row(out, row, history)
            if manager is not None and (done == end or (
                    checkpoint_every and done % checkpoint_every == 0)):
                with deferred.section():
                    manager.save(done, args=ocp.args.StandardSave({
                        "params": params, "opt_state": opt_state,
                        "elapsed": jnp.asarray(time.perf_counter() - t_start)}))
    except KeyboardInterrupt:
        raise TrainingInterrupted(completed) from None
    finally:
        bar.close()
        try:
            if manager is not None:  # a save under way is finished, even after a Ctrl-C
                with deferred.section(hold=True):
                    manager.wait_until_finished()
                    manager.close()
        finally:
            deferred.restore()
    return FitResult(nnx.merge(graphdef, params, rest), history, resumed_from,
                     time.perf_counter() - t_start)
