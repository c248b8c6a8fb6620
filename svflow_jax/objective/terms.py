"""The terms of the hybrid objective, in flow words: pure functions of arrays.

Our reading of the paper's objective (its full text is not available to us; ``docs/theory.md``,
section 20, states every formula and choice):

* ``J_align``: the cross-entropy of the vMF class likelihoods at the final time ``T``. Class
  ``c`` has natural parameter ``eta_c = kappa_c mu_c``; the class posterior of a final point
  ``x_T`` under the prior ``pi_c proportional to 1 / C_d(kappa_c)`` (which cancels the
  normalisers) is ``softmax_c(eta_c . x_T)``, the unembedding's logits, so ``J_align`` is the
  usual next-token cross-entropy. With ``normalised=True`` the prior is uniform and the logits
  are ``log C_d(kappa_c) + eta_c . x_T`` (the vMF log-likelihoods).
* ``J_var``: ``KL(q(. | x) || p(. | x))`` between a layer's variational posterior ``q`` (the
  attention softmax of one head, or the MoE router) and the true posterior ``p`` of the layer's
  vMF mixture (uniform prior, components ``vMF(x; eta_j)``, ``eta`` in the model's units: the
  vectors the branch adds to the stream; ``svflow diagnose`` defines its ``kl_q_p`` in flow
  units, ``eta / sqrt(d)``, and reports this one as ``kl_q_p_model``), averaged over heads,
  tokens and layers. The true posterior and the KL are those of
  :mod:`svflow_jax.flow.diagnostics` (one way to measure), with ``log C_d`` from
  :func:`svflow_jax.vmf.log_normalizer`, whose gradient in ``kappa`` is exactly ``-A_d(kappa)``.
* MoE balance: the population KL ``KL(qbar || pi)`` with ``qbar_e = E_x q(e | x)`` the router's
  posterior averaged over the tokens of a batch and ``pi`` uniform; and, for comparison, the
  Switch-Transformer auxiliary loss ``E sum_e f_e P_e`` (Fedus et al. 2021, eq. 4), ``f_e`` the
  fraction of routing slots dispatched to expert ``e`` and ``P_e`` the mean router probability.

Everything broadcasts over leading axes; means are over all leading axes unless a ``weights``
array is given. Use float64 to verify, float32 to train.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .. import vmf
from ..flow import diagnostics as fd
from ..next_token import next_token_nll, weighted_mean

__all__ = [
    "class_logits",
    "j_align",
    "j_var",
    "attention_j_var",
    "expert_log_likelihoods",
    "moe_j_var",
    "population_kl",
    "switch_loss",
    "expert_load",
    "top_k_mask",
    "usage_stats",
]


def class_logits(
    x: Float[Array, "... d"], eta: Float[Array, "C d"], *, normalised: bool = False
) -> Float[Array, "... C"]:
    """``eta_c . x`` (``normalised``: plus ``log C_d(|eta_c|)``, the vMF log-likelihoods)."""
    logits = jnp.einsum("...d,cd->...c", x, eta)
    if normalised:
        logits = logits + vmf.log_normalizer(fd.concentrations(eta), x.shape[-1])
    return logits


def j_align(
    logits: Float[Array, "... C"],
    targets: Int[Array, "..."],
    weights: Float[Array, "..."] | None = None,
) -> Float[Array, ""]:
    """``J_align = mean_i -log softmax(logits_i)[target_i]`` (weighted mean if ``weights``), in
    the logits' dtype (:func:`svflow_jax.next_token.next_token_nll`)."""
    return weighted_mean(next_token_nll(logits, targets, logits.dtype), weights)


def j_var(
    log_q: Float[Array, "... s n"],
    loglik: Float[Array, "... s n"],
    context: Bool[Array, "... s n"],
) -> Float[Array, "... s"]:
    """``KL(q(. | x_i) || p(. | x_i))`` per scored token, with ``p`` the true posterior of the
    mixture ``sum_j pi_j exp(loglik_ij)`` under the uniform prior on ``context``
    (:func:`svflow_jax.flow.diagnostics.true_posterior_log`). 0 exactly when ``q = p``."""
    log_p = fd.true_posterior_log(loglik, context)
    ctx = jnp.broadcast_to(context, log_q.shape)
    return fd.kl_divergence(log_q, log_p, ctx)


def attention_j_var(
    probs: Float[Array, "... H s n"],
    x: Float[Array, "... s d"],
    eta: Float[Array, "... H n d"],
    context: Bool[Array, "s n"],
) -> Float[Array, "..."]:
    """``J_var`` of an attention layer, averaged over heads and scored tokens.

    ``probs``: the attention weights ``q_h(j | x_i)``; ``x``: the unit directions of the scored
    tokens; ``eta``: the natural parameters ``eta_hj`` of the components (section 19)."""
    log_q = fd.safe_log(probs, jnp.broadcast_to(context, probs.shape))
    loglik = fd.component_log_likelihoods(x, eta)
    return jnp.mean(j_var(log_q, loglik, context), axis=(-2, -1))


def expert_log_likelihoods(
    x: Float[Array, "... d"], scores: Float[Array, "... E d"]
) -> Float[Array, "... E"]:
    """``log vMF(x; eta_e) = log C_d(|eta_e|) + eta_e . x`` with ``eta_e = s_e(x)``, expert
    ``e``'s score at the token read as the natural parameter of a vMF component (our reading:
    a vMF's Euclidean score is its natural parameter)."""
    dots = jnp.einsum("...d,...ed->...e", x, scores)
    return fd.vmf_log_likelihoods(dots[..., None, None, :], fd.concentrations(scores)[..., None, :],
                                  x.shape[-1])[..., 0, 0, :]


def moe_j_var(
    router_logits: Float[Array, "... E"],
    x: Float[Array, "... d"],
    scores: Float[Array, "... E d"],
) -> Float[Array, "..."]:
    """``KL(q(. | x) || p(. | x))`` per token for a MoE layer: ``q = softmax(router_logits)``
    (the dense router posterior) and ``p`` the true posterior of the experts' vMF mixture
    (uniform prior over the ``E`` experts)."""
    log_q = jax.nn.log_softmax(router_logits, axis=-1)[..., None, :]
    loglik = expert_log_likelihoods(x, scores)[..., None, :]
    context = jnp.ones((1, router_logits.shape[-1]), bool)
    return j_var(log_q, loglik, context)[..., 0]


def population_kl(
    router_probs: Float[Array, "... E"], weights: Float[Array, "..."] | None = None
) -> Float[Array, ""]:
    """``KL(qbar || pi) = sum_e qbar_e log(E qbar_e)``, ``qbar = mean_x q(. | x)`` over every
    leading axis (weighted by ``weights``), ``pi`` uniform over the ``E`` experts."""
    qbar = _population_mean(router_probs, weights)
    E = router_probs.shape[-1]
    mask = jnp.ones((E,), bool)
    return fd.kl_divergence(fd.safe_log(qbar), jnp.full((E,), -math.log(E), qbar.dtype), mask)


def _population_mean(a: Array, weights: Array | None) -> Array:
    flat = a.reshape(-1, a.shape[-1])
    if weights is None:
        return jnp.mean(flat, axis=0)
    w = weights.reshape(-1, 1).astype(a.dtype)
    return jnp.sum(flat * w, axis=0) / jnp.maximum(jnp.sum(w), 1e-30)


def expert_load(
    selected: Bool[Array, "... E"] | Float[Array, "... E"],
    weights: Float[Array, "..."] | None = None,
) -> Float[Array, " E"]:
    """``f_e``: the fraction of routing slots (token, choice) dispatched to expert ``e``
    (``selected`` is 1 on each token's top-k experts; ``sum_e f_e = 1``)."""
    counts = _population_mean(selected.astype(jnp.result_type(float)), weights)
    return counts / jnp.maximum(jnp.sum(counts), 1e-30)


def top_k_mask(router_logits: Float[Array, "... E"], top_k: int) -> Bool[Array, "... E"]:
    """The ``top_k`` selected experts of each token (``jax.lax.top_k``: ties to the lower
    index, the rule of the Transformer's MoE block)."""
    _, top = jax.lax.top_k(router_logits, top_k)
    return jnp.any(top[..., :, None] == jnp.arange(router_logits.shape[-1]), axis=-2)


def switch_loss(
    router_logits: Float[Array, "... E"], top_k: int, weights: Float[Array, "..."] | None = None
) -> Float[Array, ""]:
    """The Switch-Transformer auxiliary loss ``E sum_e f_e P_e`` (1 at perfect balance):
    ``f_e`` = :func:`expert_load` of the top-k selection (no gradient: a count), ``P_e`` the
    mean dense router probability ``softmax(router_logits)_e`` over the tokens."""
    E = router_logits.shape[-1]
    f = jax.lax.stop_gradient(expert_load(top_k_mask(router_logits, top_k), weights))
    P = _population_mean(jax.nn.softmax(router_logits, axis=-1), weights)
    return E * jnp.sum(f * P)


def usage_stats(load: Float[Array, " E"], dead_fraction: float = 0.01) -> dict[str, Array]:
    """Collapse measures of one layer's expert load ``f`` (``sum_e f_e = 1``):

    * ``usage_entropy``: ``-sum_e f_e log f_e`` in nats (``log E`` when balanced, 0 when one
      expert takes every token);
    * ``max_load``: ``E max_e f_e`` (1 when balanced, ``E`` at total collapse);
    * ``dead``: the number of experts with ``f_e < dead_fraction / E``.
    """
    E = load.shape[-1]
    mask = jnp.ones(load.shape, bool)
    return {
        "usage_entropy": fd.entropy(fd.safe_log(load), mask),
        "max_load": E * jnp.max(load, axis=-1),
        "dead": jnp.sum(load < dead_fraction / E, axis=-1),
    }
