"""Training layer designs (a bridging package): tasks, the optax trainer, ``svflow train``.

* :mod:`.tasks`: byte-level Jane Austen (bits per character, a held-out novel) and multi-hop
  associative recall (accuracy); batches are functions of ``(seed, step)``.
* :mod:`.trainer`: :func:`train` (AdamW + warm-up/cosine + clipping, jitted step, data-parallel
  sharding, orbax checkpoints with exact resume, JSONL/CSV metrics, progress bar) and
  :func:`evaluate`.
* the ``svflow train`` subcommand is :mod:`svflow_jax.cli.train`.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for readers and the API docs
    from .tasks import AustenBytes, MultiHopRecall, get_task
    from .trainer import TrainConfig, TrainResult, evaluate, loss_and_count, make_optimizer, train

__all__ = ["AustenBytes", "MultiHopRecall", "get_task", "TrainConfig", "TrainResult", "train",
           "evaluate", "loss_and_count", "make_optimizer"]

# Loaded on first use (PEP 562), so that other subcommands do not import optax and orbax just
# to list ``svflow train``'s options.
_WHERE = {name: ".tasks" if i < 3 else ".trainer" for i, name in enumerate(__all__)}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
