"""Training layer designs (a bridging package): tasks, the optax trainer, ``svflow train``.

* :mod:`.tasks`: byte-level Jane Austen (bits per character, a held-out novel) and multi-hop
  associative recall (accuracy); batches are functions of ``(seed, step)``.
* :mod:`.loop`: the project's one training loop :func:`fit` (a model, a loss, a data stream,
  an optax optimiser; jitted step, data-parallel sharding, orbax checkpoints with exact resume,
  append-only metrics, a stop at the first non-finite loss) and :func:`optimizer`.
* :mod:`.report`: what a run shows at its end, ``loss.png`` and a one-line summary.
* :mod:`.trainer`: :func:`train` (a layer design on a task, through :func:`fit`) and
  :func:`evaluate`.
* the ``svflow train`` subcommand is :mod:`svflow_jax.cli.train`.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for readers and the API docs
    from .loop import (
        AdamW,
        FitResult,
        StepInfo,
        TrainingDiverged,
        TrainingInterrupted,
        fit,
        optimizer,
    )
    from .tasks import AustenBytes, MultiHopRecall, get_task
    from .trainer import (
        TrainConfig,
        TrainResult,
        evaluate,
        lm_loss,
        loss_and_count,
        make_optimizer,
        train,
    )

_MODULES = {
    ".tasks": ["AustenBytes", "MultiHopRecall", "get_task"],
    ".trainer": ["TrainConfig", "TrainResult", "train", "evaluate", "loss_and_count",
                 "make_optimizer", "lm_loss"],
    ".loop": ["fit", "optimizer", "AdamW", "FitResult", "StepInfo", "TrainingDiverged",
              "TrainingInterrupted"],
}
__all__ = ["AustenBytes", "MultiHopRecall", "get_task", "TrainConfig", "TrainResult", "train",
           "evaluate", "loss_and_count", "make_optimizer", "lm_loss", "fit", "optimizer",
           "AdamW", "FitResult", "StepInfo", "TrainingDiverged", "TrainingInterrupted"]

# Loaded on first use (PEP 562), so that other subcommands do not import optax and orbax just
# to list ``svflow train``'s options.
_WHERE = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
