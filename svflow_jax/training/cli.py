"""``svflow train``: train one layer design on a task (argparse wiring and handler).

``svflow_jax/cli.py`` calls :func:`add_train_parser` on its subparsers. Options are checked
before anything is compiled; bad options exit with code 2 (argparse's error). A run writes
``config.json``, ``metrics.jsonl``, ``metrics.csv``, orbax checkpoints and ``final.json`` to
``--out``; running the same command again resumes from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..cli_types import nonnegative_int, positive_float, positive_int

__all__ = ["add_train_parser", "run_train", "config_from_args"]


_positive_int, _nonnegative_int, _positive_float = positive_int, nonnegative_int, positive_float


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the ``train`` subcommand to an ``argparse`` subparsers object."""
    from ..solvers import catalogue

    p = subparsers.add_parser(
        "train", help="train a solver as a Transformer layer design (optax, resumable)",
        description="Builds a causal language model whose stack is a solver (a layer design: "
        f"a method of the solver catalogue, {', '.join(catalogue.names())}, or "
        "package.module:Attr naming a Method, a solver or a diffrax.ButcherTableau, the "
        "current folder searched first) "
        "and trains it with AdamW, warm-up + cosine decay and gradient clipping, the batch "
        "sharded over all devices. Writes config.json, metrics.jsonl/.csv, checkpoints and "
        "final.json to --out; the same command resumes an interrupted run. Exit code 2 on bad "
        "options.")
    p.add_argument("--config", type=Path, help="a config.json of an earlier run (explicit "
                   "options below win)")
    p.add_argument("--design", help="layer design (default euler)")
    p.add_argument("--task", choices=["austen", "recall"],
                   help="austen: byte-level LM on Jane Austen, bits per character; recall: "
                   "two-hop associative recall, accuracy (default austen)")
    p.add_argument("--weights", choices=["per_layer", "linear", "chebyshev"],
                   help="weights per layer, or continuous in depth (default per_layer)")
    p.add_argument("--norm", dest="norm_position", choices=["post", "pre"],
                   help="post-norm on the sphere (default) or pre-norm")
    p.add_argument("--num-steps", type=_positive_int, help="blocks of the stack (default 8)")
    p.add_argument("--anchors", dest="num_anchors", type=_positive_int,
                   help="weight anchors (layers of weights, default 8)")
    p.add_argument("--duration", type=_positive_float, help="depth-time T (default 8)")
    p.add_argument("--d-model", type=_positive_int, help="width (default 64)")
    p.add_argument("--heads", dest="n_heads", type=_positive_int, help="heads (default 4)")
    p.add_argument("--d-head", type=_positive_int, help="head width (default 16)")
    p.add_argument("--d-ff", type=_positive_int, help="FFN width (default 128)")
    p.add_argument("--context", type=_positive_int, help="bytes per window (austen; "
                   "default 64)")
    p.add_argument("--steps", type=_positive_int, help="optimiser steps (default 200)")
    p.add_argument("--batch-size", type=_positive_int, help="sequences per step (default 16)")
    p.add_argument("--lr", type=_positive_float, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup", type=_nonnegative_int, help="warm-up steps (default 20)")
    p.add_argument("--seed", type=_nonnegative_int, help="seed (default 0)")
    p.add_argument("--eval-every", type=_nonnegative_int,
                   help="validation period (default 50; 0: no validation)")
    p.add_argument("--checkpoint-every", type=_nonnegative_int,
                   help="checkpoint period in steps (default 0: only at the end)")
    p.add_argument("--out", help="output folder (default results/train-<design>-<time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list-designs", action="store_true", help="list the designs and exit")
    p.set_defaults(run=run_train)
    return p


_MODEL_FIELDS = ("design", "weights", "norm_position", "num_steps", "num_anchors", "duration",
                 "d_model", "n_heads", "d_head", "d_ff", "context")
_TRAIN_FIELDS = ("task", "steps", "batch_size", "lr", "warmup", "seed", "eval_every",
                 "checkpoint_every")


def config_from_args(args: argparse.Namespace):
    """The :class:`~svflow_jax.training.TrainConfig` of the options (``ValueError`` if
    inconsistent)."""
    from svflow_jax.designs import DesignConfig

    from .trainer import TrainConfig

    base = TrainConfig()
    if args.config is not None:
        base = TrainConfig.from_json(json.loads(Path(args.config).read_text()))
    model = {k: getattr(args, k) for k in _MODEL_FIELDS if getattr(args, k) is not None}
    train = {k: getattr(args, k) for k in _TRAIN_FIELDS if getattr(args, k) is not None}
    return TrainConfig(**{**base.to_json(), **train,
                          "model": DesignConfig(**{**base.to_json()["model"], **model})})


def run_train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The handler: validate (exit 2 on bad options), train, write ``final.json``."""
    from ..solvers import catalogue

    if args.list_designs:
        for method in catalogue.methods():
            print(f"{method.name:18s} {method.description}")
        return 0
    if args.config is not None and not Path(args.config).is_file():
        parser.error(f"--config: no such file {args.config}")
    try:
        config = config_from_args(args)
    except (ValueError, TypeError, KeyError) as err:
        parser.error(str(err))
    out = Path(args.out or Path("results") / f"train-{config.model.design}-"
               f"{time.strftime('%Y%m%d-%H%M%S')}")
    from ..environment import environment
    from .trainer import train

    try:
        result = train(config, out, progress=not args.no_progress)
    except ValueError as err:  # e.g. batch not divisible by the devices, another config in out
        parser.error(str(err))
    summary = {"design": config.model.design, "task": config.task, "steps": config.steps,
               "seconds": result.seconds, "resumed_from": result.resumed_from, **result.final,
               "environment": environment()}
    (out / "final.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return 0
