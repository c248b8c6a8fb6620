"""Reading the objective's posteriors and scores off a :class:`TransformerLM`.

One forward pass, :func:`forward_terms`, is the model's own (the bridge's one reader,
:func:`svflow_jax.bridge.readout.read_layers`; tested equal to ``model(tokens)``): each block
runs its sub-steps and Norms itself and asks this module only to evaluate its branches, which
it does in flow words:

* attention: the posterior ``q_h(j | x_i)`` (``Attention.attention_weights`` of the branch
  input ``z``) and the natural parameters ``eta_hj = (z_j W_V + b_V) W_O^h + b_O / H``
  (:func:`svflow_jax.bridge.readout.natural_parameters`), whose posterior mean
  ``sum_h sum_j q_h(j | x_i) eta_hj`` *is* the attention branch (so the branch is computed from
  them); the explained point ``x_i`` is the direction of the residual stream entering the
  sub-step (section 19 of ``docs/theory.md``);
* MoE: the router logits ``z W_r``, the dense posterior ``softmax(z W_r)``, the model's top-k
  weights ``MoE.router_weights(z)`` and the expert scores ``s_e(z)`` (``MoE.experts``), the
  branch being ``sum_e w_e(z) s_e(z)``.

For the coupling measurement (``docs/theory.md``, section 20) the posterior path and the score
path of each branch read the branch input through two separate zero perturbations,
``z + delta_post`` and ``z + delta_score``: the gradient of the loss with respect to each is the
part of ``dL/dz`` that flows through the posterior or through the scores.

Supported: every block the Transformer builds (:func:`svflow_jax.bridge.readout.check_supported`:
sequential, parallel and macaron, pre- or post-norm, causal or not), no padding mask. A macaron
block's two FFN half-steps share their weights and their perturbations; its FFN measures are
the mean over the two.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..bridge.readout import check_supported, natural_parameters, read_layers
from ..flow import diagnostics as fd
from ..transformer.model import Block, TransformerLM
from . import terms

__all__ = ["LayerTerms", "check_supported", "forward_terms", "zero_deltas", "DELTA_NAMES"]

DELTA_NAMES = ("attn_post", "attn_score", "ffn_post", "ffn_score")


class LayerTerms(NamedTuple):
    """Per-layer quantities of one batch (leading axis ``L``). MoE fields are ``None`` for a
    dense FFN. Means are over the batch's tokens (and heads)."""

    attn_j_var: Float[Array, " L"]  # mean_{h,i} KL(q_h || p_h)
    attn_entropy: Float[Array, " L"]  # mean_{h,i} H(q_h(. | x_i)) (nats)
    attn_log_evidence: Float[Array, " L"]  # mean_{h,i} log p_h(x_i)
    moe_j_var: Float[Array, " L"] | None  # mean_i KL(q(. | x_i) || p(. | x_i)), dense router
    router_entropy: Float[Array, " L"] | None  # mean_i H(softmax(z_i W_r))
    population_kl: Float[Array, " L"] | None  # KL(qbar || uniform)
    switch: Float[Array, " L"] | None  # E sum_e f_e P_e
    load: Float[Array, "L E"] | None  # f_e, fraction of top-k slots


def zero_deltas(model: TransformerLM, shape: tuple[int, ...], dtype=jnp.float32) -> dict:
    """Zero perturbations ``(L, *shape, d)`` for every name of :data:`DELTA_NAMES`."""
    cfg = model.config
    z = jnp.zeros((cfg.n_layers, *shape, cfg.d_model), dtype)
    return {name: z for name in DELTA_NAMES}


def _attn_branch(layer: Block, y, z, dp, ds, context):
    attn = layer.attn
    probs = attn.attention_weights(z + dp)  # (B, H, n, n)
    eta = natural_parameters(attn, z + ds)  # (B, H, n, d)
    u = jnp.einsum("...hij,...hjd->...id", probs, eta)
    x = fd.directions(y)
    ctx = jnp.broadcast_to(context, probs.shape)
    log_q = fd.safe_log(probs, ctx)
    loglik = fd.component_log_likelihoods(x, eta)
    stats = {
        "attn_j_var": jnp.mean(terms.j_var(log_q, loglik, context)),
        "attn_entropy": jnp.mean(fd.entropy(log_q, ctx)),
        "attn_log_evidence": jnp.mean(fd.log_evidence(loglik, context)),
    }
    return u, stats


def _ffn_branch(layer: Block, y, z, dp, ds):
    if layer.config.ffn != "moe":
        return layer.ffn(z), {}
    moe = layer.ffn
    zp = z + dp
    logits = jnp.einsum("...d,de->...e", zp, moe.router[...].astype(zp.dtype))
    weights = moe.router_weights(zp)
    scores = moe.experts(z + ds)  # (..., E, d)
    u = jnp.einsum("...e,...ed->...d", weights, scores)
    dense = jax.nn.softmax(logits, axis=-1)
    mask = jnp.ones(logits.shape[-1:], bool)
    stats = {
        "moe_j_var": jnp.mean(terms.moe_j_var(logits, fd.directions(y), scores)),
        "router_entropy": jnp.mean(fd.entropy(jax.nn.log_softmax(logits, axis=-1), mask)),
        "population_kl": terms.population_kl(dense),
        "switch": terms.switch_loss(logits, moe.top_k),
        "load": terms.expert_load(terms.top_k_mask(logits, moe.top_k)),
    }
    return u, stats


def forward_terms(
    model: TransformerLM, tokens: Int[Array, "B n"], deltas: dict | None = None
) -> tuple[Float[Array, "B n V"], LayerTerms]:
    """The model's logits and its per-layer :class:`LayerTerms` in one pass (differentiable).

    ``deltas``: :func:`zero_deltas` ``(L, B, n, d)`` perturbations of each branch's posterior
    and score inputs (default zeros; differentiate with respect to them for the coupling)."""
    cfg = model.config
    n = tokens.shape[-1]
    if deltas is None:
        deltas = zero_deltas(model, tokens.shape)
    context = jnp.tril(jnp.ones((n, n), bool)) if cfg.causal else jnp.ones((n, n), bool)
    found: list[dict] = []  # the branches' statistics of the layer being read

    def branch(d, layer: Block, name: str, z, y):
        if name == "attn":
            u, stats = _attn_branch(layer, y, z, d["attn_post"], d["attn_score"], context)
        else:
            u, stats = _ffn_branch(layer, y, z, d["ffn_post"], d["ffn_score"])
        found.append(stats)
        return u

    def read(layer, substeps, d):
        stats: dict[str, list] = {}
        for one in found:  # a macaron block's two FFN half-steps: their mean
            for key, value in one.items():
                stats.setdefault(key, []).append(value)
        found.clear()
        return {key: sum(v) / len(v) for key, v in stats.items()}

    y, per_layer = read_layers(model, tokens, read, deltas, branch=branch)
    stack = model.transformer
    if stack.final_norm is not None:
        y = stack.final_norm(y)
    logits = model.logits(y)
    fields = {name: (per_layer[name] if name in per_layer else None)
              for name in LayerTerms._fields}
    if cfg.ffn != "moe":
        assert fields["moe_j_var"] is None
    return logits, LayerTerms(**fields)
