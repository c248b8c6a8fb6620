"""``svflow train``: train one layer design (a method of the solver catalogue) on a task.

Options are checked before anything is compiled, sizes against the machine's memory and the
documented bounds; bad options exit with code 2. A run writes
``config.json``, ``run.json``, ``metrics.jsonl``, ``metrics.csv``, orbax checkpoints and
``final.json`` to ``--out``; running the same command again resumes from the latest checkpoint
(with more ``--steps``, a finished run is extended at its final learning rate). A run whose loss
becomes non-finite stops there with exit code 1 (``final.json`` says where).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from . import runtime
from .common import add_run_options, resolve_methods, subcommand
from .types import nonnegative_int, positive_float, positive_int, seed

__all__ = ["add_parser", "run", "config_from_args", "MAX_WIDTH", "MAX_BLOCKS"]

#: largest width (``--d-model``, ``--d-ff``, ``--heads`` x ``--d-head``) and context
MAX_WIDTH = 16384
#: largest block count (``--num-steps``, each of ``--extra-depths``, ``--random-depths``) and
#: number of weight anchors (``--anchors``)
MAX_BLOCKS = 4096


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``train`` subcommand to an ``argparse`` subparsers object."""
    p = subcommand(
        subparsers, "train", help="train a solver as a Transformer layer design (optax, resumable)",
        description="Builds a causal language model whose stack is a solver (a layer design: "
        "--method, a method of the solver catalogue, listed by --list-methods, or "
        "package.module:Attr naming a Method, a solver or a diffrax.ButcherTableau, the "
        "current folder searched first) "
        "and trains it with AdamW, warm-up + cosine decay and gradient clipping, the batch "
        "sharded over all devices. Writes config.json, metrics.jsonl/.csv, checkpoints and "
        "final.json to --out; the same command resumes an interrupted run. Widths and context "
        f"are at most {MAX_WIDTH}, block counts and anchors at most {MAX_BLOCKS}, and the model "
        "must fit in the machine's memory.")
    p.add_argument("--config", type=Path, help="a config.json of an earlier run (explicit "
                   "options below win)")
    from ..training.recipes import BASELINE, MODEL, RECALL
    from ..training.tasks import TASKS

    m, b = argparse.Namespace(**MODEL), argparse.Namespace(**BASELINE)
    p.add_argument("--method", dest="design", metavar="METHOD",
                   help="the layer design: a method of the solver catalogue or "
                   f"package.module:Attr (default {m.design})")
    p.add_argument("--task", choices=list(TASKS),
                   help="austen: byte-level LM on Jane Austen, bits per character on "
                   "Persuasion (default); recall: two-hop associative recall, recall1: one-hop "
                   f"recall, accuracy (both: {RECALL['steps']} steps at --lr {RECALL['lr']:g} by "
                   "default)")
    p.add_argument("--weights", choices=["per_layer", "linear", "chebyshev"],
                   help=f"weights per layer, or continuous in depth (default {m.weights})")
    p.add_argument("--norm", dest="norm_position", choices=["post", "pre"],
                   help=f"post-norm on the sphere or pre-norm (default {m.norm_position})")
    p.add_argument("--update", choices=["residual", "ngpt"],
                   help="the block's step: residual (default) or nGPT's normalised step with "
                   "learned per-dimension rates (post-norm only, with --norm post)")
    p.add_argument("--head-bias", action="store_true", default=None,
                   help="a bias on the logits, started at the log frequencies of the training "
                   "tokens (keeps a post-norm stack from collapsing to the unigram model)")
    p.add_argument("--embed-norm", action="store_true", default=None,
                   help="pre-norm: a Norm on the embeddings, so that every token's state starts "
                   "at unit length (the first block's step is measured against 1)")
    p.add_argument("--num-steps", type=positive_int,
                   help=f"blocks of the stack (default {m.num_steps})")
    p.add_argument("--anchors", dest="num_anchors", type=positive_int,
                   help=f"weight anchors (layers of weights, default {m.num_anchors})")
    p.add_argument("--duration", type=positive_float,
                   help=f"depth-time T (default {m.duration:g})")
    p.add_argument("--d-model", type=positive_int, help=f"width (default {m.d_model})")
    p.add_argument("--heads", dest="n_heads", type=positive_int,
                   help=f"heads (default {m.n_heads})")
    p.add_argument("--d-head", type=positive_int, help=f"head width (default {m.d_head})")
    p.add_argument("--d-ff", type=positive_int, help=f"FFN width (default {m.d_ff})")
    p.add_argument("--context", type=positive_int, help="bytes per window (austen; "
                   f"default {m.context})")
    p.add_argument("--extra-depths", type=positive_int, nargs="+", metavar="N",
                   help="also take the loss at N blocks (the mean over --num-steps and these), "
                   "so that the weights, continuous in depth (--weights linear or chebyshev), "
                   "stay a discretisation of one flow when the stack is refined; each adds "
                   "its blocks' forward and backward pass to a step")
    p.add_argument("--random-depths", type=positive_int, nargs="+", metavar="N",
                   help="each step takes the loss at one block count drawn from --num-steps "
                   "and these (uniformly, seeded): the expected loss of --extra-depths at one "
                   "depth's cost per step on average")
    p.add_argument("--steps", type=positive_int, help=f"optimiser steps (default {b.steps})")
    p.add_argument("--batch-size", type=positive_int,
                   help=f"sequences per step (default {b.batch_size})")
    p.add_argument("--lr", type=positive_float, help=f"peak learning rate (default {b.lr:g})")
    p.add_argument("--warmup", type=nonnegative_int,
                   help=f"warm-up steps (default {b.warmup})")
    p.add_argument("--seed", type=seed, help="seed, 0 <= seed < 2**32 (default 0)")
    p.add_argument("--eval-every", type=nonnegative_int,
                   help=f"validation period (default {b.eval_every}; 0: no validation)")
    p.add_argument("--checkpoint-every", type=nonnegative_int,
                   help=f"checkpoint period in steps (default {b.checkpoint_every}; 0: only "
                   "at the end)")
    p.add_argument("--on-mismatch", choices=["refuse", "warn"], default="refuse",
                   help="resuming on another device count or an edited --method module: "
                   "refuse (default) or warn and continue")
    add_run_options(p, "train-<method>", cache=False)
    p.add_argument("--list-methods", action="store_true",
                   help="list the methods of the solver catalogue and exit")
    p.add_argument("--json", action="store_true",
                   help="end on final.json's content as one JSON line (for scripts) instead "
                   "of the one-line summary")
    p.set_defaults(run=run)
    return p


_MODEL_FIELDS = ("design", "weights", "norm_position", "update", "head_bias", "embed_norm",
                 "num_steps", "num_anchors", "duration", "d_model", "n_heads", "d_head", "d_ff",
                 "context")
_TRAIN_FIELDS = ("task", "steps", "batch_size", "lr", "warmup", "seed", "eval_every",
                 "checkpoint_every", "extra_depths", "random_depths")


def config_from_args(args: argparse.Namespace):
    """The :class:`~svflow_jax.training.TrainConfig` of the options (``ValueError`` if
    inconsistent)."""
    from svflow_jax.designs import DesignConfig

    from ..training.recipes import recipe
    from ..training.trainer import TrainConfig

    base = recipe(args.task or "austen")
    if args.config is not None:
        base = _read_config(Path(args.config), TrainConfig)
    model = {k: getattr(args, k) for k in _MODEL_FIELDS if getattr(args, k) is not None}
    train = {k: getattr(args, k) for k in _TRAIN_FIELDS if getattr(args, k) is not None}
    return TrainConfig(**{**base.to_json(), **train,
                          "model": DesignConfig(**{**base.to_json()["model"], **model})})


def _read_config(path: Path, config_class):
    """The ``TrainConfig`` of a ``config.json``; ``UsageError`` naming the file and the field."""
    data = _config_json(path)
    fields = {f.name for f in dataclasses.fields(config_class)}
    from svflow_jax.designs import DesignConfig

    model_fields = {f.name for f in dataclasses.fields(DesignConfig)}
    unknown = [k for k in data if k not in fields] + [
        f"model.{k}" for k in data["model"] if k not in model_fields]
    if unknown:
        raise runtime.UsageError(f"--config {path}: unknown field {unknown[0]!r}")
    try:
        return config_class.from_json(data)
    except (ValueError, TypeError) as err:
        raise runtime.UsageError(f"--config {path}: {err}") from None


def check_sizes(config) -> None:
    """Refuses (``UsageError``, exit 2, naming the option) widths above :data:`MAX_WIDTH`,
    block and anchor counts above :data:`MAX_BLOCKS`, and a model whose training state would
    not fit in memory (:func:`~.runtime.check_memory`, naming the option behind the largest
    part of the estimate): float32 weights with their gradient and two AdamW moments (4
    copies); a Chebyshev path's K x K interpolation matrices (float64: the matrix, its inverse
    and the inversion's workspace); per block stage the activations of a batch (states, FFN
    hidden units and attention scores, kept for the backward pass), for every block of a step:
    ``--num-steps`` plus every ``--extra-depths``, or the deepest of ``--random-depths``."""
    m = config.model
    for option, value in (("--d-model", m.d_model), ("--d-ff", m.d_ff),
                          ("--heads x --d-head", m.n_heads * m.d_head), ("--context", m.context)):
        if value > MAX_WIDTH:
            raise runtime.UsageError(f"{option} {value}: at most {MAX_WIDTH}")
    why = "blocks are compiled and run one after the other: a bound on time"
    runtime.check_at_most("--num-steps", m.num_steps, MAX_BLOCKS, why)
    runtime.check_at_most("--anchors", m.num_anchors, MAX_BLOCKS, "layers of weights")
    for option, depths in (("--extra-depths", config.extra_depths),
                           ("--random-depths", config.random_depths)):
        for depth in depths:
            runtime.check_at_most(option, depth, MAX_BLOCKS, why)
    width = "--d-model" if m.d_model >= m.d_ff else "--d-ff"
    vocab = max(256, getattr(m, "vocab_size", 256) or 256)
    per_layer = 4 * m.d_model * m.n_heads * m.d_head + 2 * m.d_model * m.d_ff
    parts = {  # bytes, by the option that sets them
        "--anchors": 4 * 4 * m.num_anchors * per_layer
        + (3 * 8 * m.num_anchors ** 2 if m.weights == "chebyshev" else 0),
        width: 4 * 4 * 2 * vocab * m.d_model}
    blocks = m.num_steps + sum(config.extra_depths)
    depth_option = "--extra-depths" if sum(config.extra_depths) > m.num_steps else width
    if config.random_depths and max(config.random_depths) > m.num_steps:
        blocks, depth_option = max(blocks, *config.random_depths), "--random-depths"
    stages = 16  # the costliest catalogue methods evaluate up to 13 stages per block
    activations = 4 * (config.batch_size * m.context * blocks * stages
                       * (2 * m.d_model + m.d_ff + m.n_heads * m.context))
    parts[depth_option] = parts.get(depth_option, 0) + activations
    option = max(parts, key=lambda k: parts[k])
    runtime.check_memory(sum(parts.values()), option,
                         f"training this model (d = {m.d_model}, {m.num_anchors} anchors, "
                         f"{blocks} blocks per step, batch {config.batch_size} x {m.context})")


def _config_json(path: Path) -> dict:
    """The object of a ``config.json`` (``--config``), read without JAX; ``UsageError``
    naming the file when it is not JSON or not a training run's configuration."""
    text = runtime.read_text_file(path, "--config")
    try:
        data = json.loads(text)
    except ValueError as err:
        raise runtime.UsageError(f"--config {path}: not JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise runtime.UsageError(f"--config {path}: not the config.json of a training run (an "
                                 "object with a \"model\" object)")
    return data


def _planned(args: argparse.Namespace) -> argparse.Namespace | None:
    """The run the options ask for, from the recipes, ``--config`` and the options as plain
    values (no JAX): what :func:`check_sizes` and the pre-norm check read before the
    :class:`~svflow_jax.training.TrainConfig` is built. ``None`` when a value of ``--config``
    is not of its type (the config's own check names it)."""
    from ..training.recipes import BASELINE, MODEL, RECALL, RECALL_MODEL

    task = args.task or "austen"
    model, train = dict(MODEL), dict(BASELINE)
    if task != "austen":
        model, train = dict(RECALL_MODEL), dict(RECALL, task=task)
    train.update(extra_depths=(), random_depths=())
    if args.config is not None:
        data = _config_json(Path(args.config))
        model, train = dict(data["model"]), {k: v for k, v in data.items() if k != "model"}
    model.update({k: getattr(args, k) for k in _MODEL_FIELDS if getattr(args, k) is not None})
    train.update({k: getattr(args, k) for k in _TRAIN_FIELDS if getattr(args, k) is not None})
    try:
        return argparse.Namespace(**{**train, "extra_depths": tuple(train["extra_depths"]),
                                     "random_depths": tuple(train["random_depths"])},
                                  model=argparse.Namespace(**model))
    except (KeyError, TypeError):
        return None


def _check_planned(args: argparse.Namespace) -> None:
    """The checks of the planned run that need no JAX: sizes (:func:`check_sizes`), the
    configuration's cross-field rules (:mod:`svflow_jax.designs.rules`: a catalogue method
    without a pre-norm form in a pre-norm stack, nGPT's step in a pre-norm one, other depths
    with per-layer weights, ...), and a text too short for one window."""
    from ..designs.rules import check_depths, check_norm_options
    from ..training.tasks import get_task

    planned = _planned(args)
    if planned is None:
        return
    try:
        check_sizes(planned)
        task = get_task(planned.task, planned.model.context)
    except (TypeError, AttributeError, ValueError):  # a value of --config: named later
        return
    m = planned.model
    try:
        check_norm_options(m.design, m.norm_position, getattr(m, "update", "residual"),
                           getattr(m, "embed_norm", False))
        check_depths(m.weights, planned.extra_depths, planned.random_depths)
    except ValueError as err:
        raise _config_error(err, args) from None
    except (TypeError, AttributeError):  # a value of --config: named later
        return
    if hasattr(task, "check_text"):  # a text task: one window of each split at least
        try:
            task.check_text()  # pyright: ignore[reportAttributeAccessIssue]
        except ValueError as err:
            raise runtime.UsageError(str(err)) from None


def _config_error(err: Exception, args: argparse.Namespace) -> runtime.UsageError:
    """The refusal of a configuration, saying how to leave the default pre-norm stack where
    the configuration needs a post-norm one."""
    message = str(err)
    if (("no pre-norm form" in message or "needs norm_position='post'" in message)
            and args.norm_position is None):
        message += " (svflow train is pre-norm by default: add --norm post)"
    return runtime.UsageError(message)


def _latest_checkpoint(out: Path) -> int | None:
    """The step of the latest finished checkpoint in ``out/checkpoints`` (orbax names each
    finished one by its step), or ``None``."""
    folder = out / "checkpoints"
    steps = [int(p.name) for p in folder.iterdir() if p.name.isdigit()] \
        if folder.is_dir() else []
    return max(steps, default=None)


#: XLA programs of a training run on an empty cache: the model's initialisation (one small
#: program per operation), the training step and the validation; measured on the CPU, 42 for
#: the recipe and for the tests' tiny model alike
PROGRAMS = 42


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The handler: validate (exit 2 on bad options; every check before JAX is imported but
    those of a user's ``--method`` module and the config's own), train, write ``final.json``
    and ``loss.png``, and say in one line how it went."""
    from .catalog import check_methods, method_lines

    if args.list_methods:
        print("\n".join(method_lines()))
        return runtime.EXIT_OK
    if args.config is not None and not Path(args.config).is_file():
        raise runtime.UsageError(f"--config: no such file {args.config}")
    if args.design is not None:
        check_methods([args.design], "--method")
    _check_planned(args)
    design = "".join(ch if ch.isalnum() or ch in "-_" else "_"
                     for ch in str(args.design or _default_design(args)))
    out = Path(args.out or runtime.default_out("train", design))
    args.out_folder = runtime.prepare_out(out, "train", overwrite=args.overwrite, resumable=True)
    # JAX from here: a user's --method module, the configuration's own checks, the training
    if args.design is not None:
        resolve_methods([args.design], "--method")
    try:
        config = config_from_args(args)
    except (ValueError, TypeError, KeyError) as err:
        raise _config_error(err, args) from None
    check_sizes(config)
    programs = PROGRAMS + len(config.extra_depths) + len(config.random_depths)
    runtime.announce_compiling(parser.prog, programs, _cache_in_force(),
                               "no compile cache: set $JAX_COMPILATION_CACHE_DIR to keep them")
    from ..environment import environment
    from ..reporting import dumps, write_json
    from ..training.loop import TrainingDiverged
    from ..training.trainer import train

    try:
        result = train(config, out, progress=not args.no_progress,
                       on_mismatch=args.on_mismatch)
    except ValueError as err:  # e.g. batch not divisible by the devices, another config in out
        raise runtime.UsageError(str(err)) from None
    except TrainingDiverged as err:  # stopped at the first non-finite loss
        write_json(out / "final.json", {
            "design": config.model.design, "task": config.task, "steps": config.steps,
            "diverged_at": err.step, "loss": err.loss, "stopped": str(err),
            "environment": environment()})
        _figure(out)
        args.out_folder.finish()
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return runtime.EXIT_FAILED
    except KeyboardInterrupt as err:
        step = getattr(err, "step", None)
        latest = _latest_checkpoint(out)
        where = f"at step {step}" if step is not None else "before the first step"
        saved = (f"last checkpoint step {latest}" if latest is not None
                 else "no checkpoint yet (a rerun starts at step 0)")
        raise runtime.Interrupted(f"interrupted {where}; {saved}; resume with: "
                                  f"{runtime.command_line(args, out)}") from None
    summary = {"design": config.model.design, "task": config.task, "steps": config.steps,
               "seconds": result.seconds, "resumed_from": result.resumed_from, **result.final,
               "environment": environment()}
    diverged = [k for k, v in result.final.items()
                if isinstance(v, float) and not math.isfinite(v)]
    if diverged:  # written as null (strict JSON), and said why
        summary["not_finite"] = diverged
    write_json(out / "final.json", summary)
    rows = _figure(out)
    args.out_folder.finish()
    if args.json:
        print(dumps(summary))
    else:
        from ..training.report import summary_line

        print(summary_line(rows, config.steps, result.seconds, str(out),
                           result.resumed_from))
    if diverged:
        print(f"{parser.prog}: the run diverged: {', '.join(diverged)} not finite (try a "
              "smaller --lr or --duration)", file=sys.stderr)
        return runtime.EXIT_FAILED
    return runtime.EXIT_OK


def _figure(out: Path) -> list[dict]:
    """``loss.png`` from every row of ``metrics.jsonl`` (a resumed run's too); the rows."""
    from ..atomic import read_jsonl
    from ..training.report import loss_figure

    rows = read_jsonl(out / "metrics.jsonl")
    loss_figure(out / "loss.png", rows)
    return rows


def _default_design(args: argparse.Namespace) -> str:
    """The design of the run without JAX: ``--config``'s, else the recipe's."""
    from ..training.recipes import MODEL

    if args.config is not None:
        design = _config_json(Path(args.config))["model"].get("design")
        if isinstance(design, str):
            return design
    return MODEL["design"]


def _cache_in_force() -> str | None:
    """JAX's persistent compilation cache folder, when one is set (``svflow train`` opens
    none of its own: ``$JAX_COMPILATION_CACHE_DIR``)."""
    import jax

    return getattr(jax.config, "jax_compilation_cache_dir", None) or None
