"""The tuned recipes that ``svflow train`` runs when no option says otherwise.

:data:`BASELINE` is a pre-norm Transformer (the Euler design with per-layer weights: a
parallel-block Transformer with RMSNorm, see :class:`~svflow_jax.designs.SolverLM`) of a size
that trains in minutes on a laptop CPU (``docs/results/baseline.md``): width 192, 6 heads of
32, FFN 768, 4 layers, byte context 128, batch 32, AdamW (weight decay 0.1) with a linear
warm-up and a cosine decay to a tenth, clipping at 1. Its backward pass stores the matrix
products and recomputes the rest (``remat="dots"``: the same gradient, a training step 7.6%
faster than recomputing every block on the 2-core development machine,
``docs/results/benchmark.md``). Its peak learning rate is the best of
the short sweep over :data:`LR_GRID` that ``experiments/layer_designs.py --part baseline`` runs
(the results page ``docs/results/baseline.md`` has the sweep and the learning curve).

:data:`RECALL` is the same model on the associative-recall tasks (sequences of 25 tokens),
initialised with weights of standard deviation ``d^(-1/2)`` (:data:`RECALL_MODEL`) instead of
0.02: at 0.02 the product ``W_Q W_K^T`` that an induction head needs starts about 13 times
smaller, its gradient with it, and one-hop recall stayed at chance for 2000 steps; at
``d^(-1/2)`` it is learned (accuracy 1.0) by step 750 (``docs/results/baseline.md``).

The recipes are plain values (no JAX import), so ``svflow train --help`` shows them without
loading JAX; :func:`recipe` builds the :class:`~svflow_jax.training.TrainConfig`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

__all__ = ["MODEL", "BASELINE", "RECALL", "RECALL_MODEL", "LR_GRID", "recipe"]

#: the model of both recipes (``context`` is the Austen window; the recall task sets its own)
MODEL: MappingProxyType[str, Any] = MappingProxyType(dict(
    design="euler", norm_position="pre", weights="per_layer", d_model=192, n_heads=6,
    d_head=32, d_ff=768, num_steps=4, num_anchors=4, duration=4.0, context=128,
    remat="dots"))

#: the tuned default of ``svflow train``: byte-level Jane Austen, bits per character on
#: *Persuasion*
BASELINE: MappingProxyType[str, Any] = MappingProxyType(dict(
    task="austen", steps=1800, batch_size=32, lr=2e-3, warmup=100, weight_decay=0.1,
    eval_every=250, eval_sequences=384, checkpoint_every=250))

#: the model of :data:`RECALL`: :data:`MODEL` at the initial scale ``d^(-1/2)``
RECALL_MODEL: MappingProxyType[str, Any] = MappingProxyType(dict(
    MODEL, init_std=round(MODEL["d_model"] ** -0.5, 4)))

#: the default of ``svflow train --task recall`` (and ``recall1``)
RECALL: MappingProxyType[str, Any] = MappingProxyType(dict(
    BASELINE, task="recall", steps=1500, lr=1e-3, eval_sequences=512))

#: the peak learning rates of the sweep that chose :data:`BASELINE`'s
LR_GRID = (1e-3, 2e-3, 4e-3)


def recipe(task: str = "austen"):
    """The :class:`~svflow_jax.training.TrainConfig` that ``svflow train --task <task>`` runs
    by default."""
    from svflow_jax.designs import DesignConfig

    from .trainer import TrainConfig

    if task == "austen":
        return TrainConfig(model=DesignConfig(**MODEL), **BASELINE)
    return TrainConfig(model=DesignConfig(**RECALL_MODEL), **dict(RECALL, task=task))
