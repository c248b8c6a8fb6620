"""Training layer designs (a bridging package): tasks, the optax trainer, ``svflow train``.

* :mod:`.tasks`: byte-level Jane Austen (bits per character, a held-out novel) and multi-hop
  associative recall (accuracy); batches are functions of ``(seed, step)``.
* :mod:`.trainer`: :func:`train` (AdamW + warm-up/cosine + clipping, jitted step, data-parallel
  sharding, orbax checkpoints with exact resume, JSONL/CSV metrics, progress bar) and
  :func:`evaluate`.
* :mod:`.cli`: the ``svflow train`` subcommand.
"""

from .tasks import AustenBytes, MultiHopRecall, get_task
from .trainer import TrainConfig, TrainResult, evaluate, loss_and_count, make_optimizer, train

__all__ = [
    "AustenBytes",
    "MultiHopRecall",
    "get_task",
    "TrainConfig",
    "TrainResult",
    "train",
    "evaluate",
    "loss_and_count",
    "make_optimizer",
]
