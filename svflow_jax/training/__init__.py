"""Training layer designs (a bridging package): tasks, the optax trainer, ``svflow train``.

* :mod:`.tasks`: byte-level Jane Austen (bits per character, a held-out novel) and multi-hop
  associative recall (accuracy); batches are functions of ``(seed, step)``.
* :mod:`.trainer`: :func:`train` (AdamW + warm-up/cosine + clipping, jitted step, data-parallel
  sharding, orbax checkpoints with exact resume, JSONL/CSV metrics, progress bar) and
  :func:`evaluate`.
* :mod:`.cli`: the ``svflow train`` subcommand.
"""

import importlib
from typing import Any

# Loaded on first use (PEP 562), so that other subcommands do not import optax and orbax just
# to list ``svflow train``'s options.
_WHERE = {"AustenBytes": ".tasks", "MultiHopRecall": ".tasks", "get_task": ".tasks",
          "TrainConfig": ".trainer", "TrainResult": ".trainer", "train": ".trainer",
          "evaluate": ".trainer", "loss_and_count": ".trainer", "make_optimizer": ".trainer"}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
