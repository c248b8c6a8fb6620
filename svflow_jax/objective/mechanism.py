"""The mechanism, measured: how the gradient that moves a layer's posterior is aligned with the
gradient that moves its scores, through the token representation both are read from.

For branch ``b`` (attention or MoE) of layer ``t``, with branch input ``z`` (the shared token
representation), the loss gradient splits exactly into the part flowing through the posterior
(attention: queries and keys; MoE: the router) and the part flowing through the scores
(attention: the values' natural parameters ``eta_hj``; MoE: the experts)::

    dL/dz = g_post + g_score,   g_post = dL/d delta_post,   g_score = dL/d delta_score

(:mod:`svflow_jax.objective.bridge` feeds each path ``z + delta``, ``delta = 0``). The coupling
is measured by three proxies, per layer, each flattened over the batch's tokens and the width
unless stated:

* the global cosine ``cos = <g_post, g_score> / (|g_post| |g_score|)``;
* the per-token cosine ``mean_i <g_post,i, g_score,i> / (|g_post,i| |g_score,i|)`` (tokens
  ``i`` of the batch where both norms are non-zero), which a few tokens with large gradients
  cannot dominate;
* the posterior share of the gradient at the shared representation, ``share = <g_post, g> /
  |g|^2`` with ``g = g_post + g_score = dL/dz``: the exact split ``|g|^2 = <g_post, g> +
  <g_score, g>`` attributes ``share`` of the squared gradient norm to the posterior path (0:
  the posterior does not move ``z``; it can leave ``[0, 1]`` when the paths oppose).

Beside them ``|g_post| / |g_score|``. Any upstream parameter ``theta`` receives ``(dz/dtheta)^T
(g_post + g_score)``: a positive cosine means the two contributions push the representation,
and everything upstream of it, the same way.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

from ..transformer.model import TransformerLM
from .bridge import forward_terms, zero_deltas
from .terms import j_align

__all__ = ["Coupling", "gradient_coupling", "cosine"]


@dataclasses.dataclass
class Coupling:
    """Per-layer coupling of one batch (NumPy, float64). ``ffn_*`` are NaN for a dense FFN
    (no posterior). ``*_cos``: global cosine; ``*_token_cos``: per-token cosine averaged;
    ``*_post_share``: ``<g_post, g> / |g|^2``; ``*_norm_ratio``: ``|g_post| / |g_score|``
    (module docstring)."""

    attn_cos: np.ndarray  # (L,)
    attn_token_cos: np.ndarray  # (L,)
    attn_norm_ratio: np.ndarray  # (L,)
    attn_post_share: np.ndarray  # (L,)
    ffn_cos: np.ndarray  # (L,)
    ffn_token_cos: np.ndarray  # (L,)
    ffn_norm_ratio: np.ndarray  # (L,)
    ffn_post_share: np.ndarray  # (L,)

    def to_json(self) -> dict[str, Any]:
        return {k: [float(x) for x in v] for k, v in dataclasses.asdict(self).items()}


def state_dtype(state) -> jnp.dtype:
    """The floating dtype of a model state's parameters (the activations' dtype)."""
    return jnp.result_type(*[a.dtype for a in jax.tree.leaves(state)
                             if jnp.issubdtype(a.dtype, jnp.floating)])


def cosine(a: Array, b: Array, axis=None) -> Array:
    """``<a, b> / (|a| |b|)`` over ``axis`` (NaN where a norm is 0)."""
    num = jnp.sum(a * b, axis=axis)
    den = jnp.sqrt(jnp.sum(a * a, axis=axis) * jnp.sum(b * b, axis=axis))
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.nan)


@functools.partial(jax.jit, static_argnums=0)
def _coupling(graphdef, state, tokens, targets):
    def loss(deltas):
        logits, _ = forward_terms(nnx.merge(graphdef, state), tokens, deltas)
        return j_align(logits.astype(jnp.float32), targets)

    model = nnx.merge(graphdef, state)
    g = jax.grad(loss)(zero_deltas(model, tokens.shape, state_dtype(state)))
    out = {}
    for branch in ("attn", "ffn"):
        gp, gs = g[f"{branch}_post"], g[f"{branch}_score"]  # (L, B, n, d)
        L = gp.shape[0]
        fp, fs = gp.reshape(L, -1), gs.reshape(L, -1)
        out[f"{branch}_cos"] = cosine(fp, fs, axis=-1)
        tok = cosine(gp, gs, axis=-1).reshape(L, -1)
        out[f"{branch}_token_cos"] = jnp.nanmean(tok, axis=-1)
        ns = jnp.linalg.norm(fs, axis=-1)
        out[f"{branch}_norm_ratio"] = jnp.linalg.norm(fp, axis=-1) / jnp.where(ns > 0, ns, jnp.nan)
        total = fp + fs
        gg = jnp.sum(total * total, axis=-1)
        out[f"{branch}_post_share"] = jnp.sum(fp * total, axis=-1) / jnp.where(gg > 0, gg, jnp.nan)
    return out


def gradient_coupling(
    model: TransformerLM, tokens: Int[Array, "B n"], targets: Int[Array, "B n"]
) -> Coupling:
    """The per-layer :class:`Coupling` of the next-token loss ``J_align`` on one batch."""
    graphdef, state = nnx.split(model)
    out = _coupling(graphdef, state, jnp.asarray(tokens), jnp.asarray(targets))
    out = {k: np.asarray(v, np.float64) for k, v in out.items()}
    if model.config.ffn != "moe":
        for k in ("ffn_cos", "ffn_token_cos", "ffn_norm_ratio", "ffn_post_share"):
            out[k] = np.full_like(out[k], np.nan)
    return Coupling(**out)
