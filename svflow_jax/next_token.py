"""The next-token loss: one definition for training, evaluation and diagnostics.

For logits ``z`` over a vocabulary of ``V`` tokens and a target ``y``,

    log p(y) = z_y - logsumexp(z),       nll = -log p(y)        (nats),

computed after casting the logits to ``dtype`` (by default the wider of the logits' dtype and
float32: a bfloat16 model's logsumexp in bfloat16 loses about two digits, and a float64 model's
loss keeps float64's digits). :func:`token_scores` adds what evaluations
report beside the loss: the top-1 confidence ``max_v p(v)`` and whether the top-1 token is the
target. :func:`weighted_mean` is the loss a trainer minimises, ``sum_i w_i nll_i / sum_i w_i``
(``w`` marks the scored positions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

__all__ = ["next_token_nll", "token_scores", "weighted_mean"]


def _loss_dtype(logits: Array, dtype) -> jnp.dtype:
    """``dtype``, or by default the wider of the logits' dtype and float32."""
    return jnp.promote_types(logits.dtype, jnp.float32) if dtype is None else jnp.dtype(dtype)


def next_token_nll(
    logits: Float[Array, "... V"], targets: Int[Array, "..."], dtype=None,
) -> Float[Array, "..."]:
    """``-log softmax(logits)[target]`` at every position, in ``dtype`` (module docstring)."""
    logits = logits.astype(_loss_dtype(logits, dtype))
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def token_scores(
    logits: Float[Array, "... V"], targets: Int[Array, "..."], dtype=None,
) -> tuple[Float[Array, "..."], Float[Array, "..."], Bool[Array, "..."]]:
    """``(nll, top-1 confidence, top-1 correct)`` at every position (module docstring)."""
    logits = logits.astype(_loss_dtype(logits, dtype))
    nll = next_token_nll(logits, targets, logits.dtype)
    confidence = jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))
    return nll, confidence, jnp.argmax(logits, axis=-1) == targets


def weighted_mean(
    nll: Float[Array, "..."], weights: Float[Array, "..."] | None = None,
) -> Float[Array, ""]:
    """``sum w nll / sum w`` (the plain mean without ``weights``)."""
    if weights is None:
        return jnp.mean(nll)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1e-30)
