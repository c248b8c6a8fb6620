"""SVFlow diagnostics of one layer, in flow words: pure functions of arrays.

One layer ``t`` of an SVFlow (a Transformer layer read as a flow step, see
:mod:`svflow_jax.flow.attention`) gives, for one sequence of ``n`` tokens:

* ``x (..., s, d)``: the directions (unit vectors) of the ``s`` tokens being explained
  ("scored" tokens), points of ``S^{d-1}``;
* ``log_q (..., H, s, n)``: the log of the attention (variational) posterior
  ``q_h(j | x_i)`` over context positions ``j``, one distribution per head ``h``;
* ``eta (..., H, n, d)``: the natural parameters ``eta_hj`` of the vMF components, one per
  head and context position: mean direction ``mu_hj = eta_hj / |eta_hj|`` and concentration
  ``kappa_hj = |eta_hj|``;
* ``context (..., s, n)`` booleans: which positions ``j`` token ``i`` may be explained by
  (``j <= i`` for a causal model, all valid tokens for an encoder).

Per head ``h`` the layer's generative model of ``x_i`` is the vMF mixture over its context,
with the uniform prior ``pi_j = 1 / |context(i)|``::

    log p_h(x_i)     = log sum_j pi_j vMF(x_i; mu_hj, kappa_hj)                 (evidence)
    p_h(j | x_i)     = pi_j vMF(x_i; mu_hj, kappa_hj) / p_h(x_i)                (true posterior)
    log vMF(x; eta)  = log C_d(|eta|) + eta . x

and the diagnostics are ``log p_h(x_i)``, ``KL(q_h(.|x_i) || p_h(.|x_i))``, the entropy of
``q_h(.|x_i)``, ``kappa_hj = |eta_hj|``, and between two runs on the same scored token
``KL(q_clean || q_perturbed)`` (both over the same context tokens). Why one mixture per head
(and not one over the product latent of all heads): ``docs/theory.md``, section 19.

Everything broadcasts over leading axes and is jit-friendly; averaging over heads, tokens and
sequences is the caller's choice (:mod:`svflow_jax.diagnose`). Use float64 where the numbers
are verified: ``log C_d`` at ``d`` in the hundreds is a difference of large terms.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from .. import vmf

__all__ = [
    "directions",
    "safe_log",
    "component_log_likelihoods",
    "vmf_log_likelihoods",
    "log_prior",
    "log_evidence",
    "true_posterior_log",
    "kl_divergence",
    "entropy",
    "concentrations",
    "resultant_concentration",
]


def directions(y: Float[Array, "... d"]) -> Float[Array, "... d"]:
    """``y / |y|`` (rows of zeros stay zero)."""
    r = jnp.linalg.norm(y, axis=-1, keepdims=True)
    return y / jnp.where(r > 0, r, 1.0)


def safe_log(p: Float[Array, "..."], mask: Bool[Array, "..."] | None = None) -> Float[Array, "..."]:
    """``log p`` with ``p`` floored at the smallest normal number of its dtype (an attention
    weight that underflowed to 0 reads as ``log(tiny)``, not ``-inf``); ``-inf`` off ``mask``."""
    out = jnp.log(jnp.maximum(p, jnp.finfo(p.dtype).tiny))
    return out if mask is None else jnp.where(mask, out, -jnp.inf)


def component_log_likelihoods(
    x: Float[Array, "... s d"], eta: Float[Array, "... H n d"]
) -> Float[Array, "... H s n"]:
    """``log vMF(x_i; eta_hj) = log C_d(|eta_hj|) + eta_hj . x_i`` for every head, scored token
    ``i`` and component ``j``."""
    return vmf_log_likelihoods(
        jnp.einsum("...sd,...hnd->...hsn", x, eta), concentrations(eta), x.shape[-1])


def vmf_log_likelihoods(
    dots: Float[Array, "... H s n"], kappa: Float[Array, "... H n"], d: int
) -> Float[Array, "... H s n"]:
    """The same from its two ingredients, ``dots = eta_hj . x_i`` and ``kappa = |eta_hj|``
    (for callers that compute them without forming ``eta``, as :mod:`svflow_jax.diagnose`
    does): ``log C_d(kappa_hj) + dots_hij``."""
    return vmf.log_normalizer(kappa, d)[..., None, :] + dots


def log_prior(context: Bool[Array, "... s n"]) -> Float[Array, "... s n"]:
    """``log pi_j = -log |context(i)|`` on the context, ``-inf`` off it (uniform prior)."""
    count = jnp.sum(context, axis=-1, keepdims=True)
    return jnp.where(context, -jnp.log(jnp.maximum(count, 1)).astype(jnp.result_type(float)),
                     -jnp.inf)


def _masked_logsumexp(a: Array, mask: Array) -> Array:
    a = jnp.where(mask, a, -jnp.inf)
    m = jnp.max(a, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return jnp.log(jnp.sum(jnp.where(mask, jnp.exp(a - m), 0.0), axis=-1)) + m[..., 0]


def log_evidence(
    loglik: Float[Array, "... H s n"], context: Bool[Array, "... s n"]
) -> Float[Array, "... H s"]:
    """``log p_h(x_i) = log sum_j pi_j vMF(x_i; eta_hj)`` from
    :func:`component_log_likelihoods` (uniform prior on the context)."""
    ctx = context[..., None, :, :]
    return _masked_logsumexp(loglik + log_prior(context)[..., None, :, :], ctx)


def true_posterior_log(
    loglik: Float[Array, "... H s n"], context: Bool[Array, "... s n"]
) -> Float[Array, "... H s n"]:
    """``log p_h(j | x_i)``: Bayes' rule for the mixture; ``-inf`` off the context."""
    ctx = context[..., None, :, :]
    joint = loglik + log_prior(context)[..., None, :, :]
    out = joint - _masked_logsumexp(joint, ctx)[..., None]
    return jnp.where(ctx, out, -jnp.inf)


def kl_divergence(
    log_q: Float[Array, "... n"], log_p: Float[Array, "... n"], mask: Bool[Array, "... n"]
) -> Float[Array, "..."]:
    """``KL(q || p) = sum_j q_j (log q_j - log p_j)`` over ``mask`` (both normalised there);
    terms with ``q_j = 0`` are 0. Clipped below at 0 (round-off)."""
    q = jnp.where(mask, jnp.exp(jnp.where(mask, log_q, 0.0)), 0.0)
    diff = jnp.where(mask & (q > 0), log_q - jnp.where(mask, log_p, 0.0), 0.0)
    return jnp.maximum(jnp.sum(q * diff, axis=-1), 0.0)


def entropy(log_q: Float[Array, "... n"], mask: Bool[Array, "... n"]) -> Float[Array, "..."]:
    """``-sum_j q_j log q_j`` over ``mask`` (nats)."""
    q = jnp.where(mask, jnp.exp(jnp.where(mask, log_q, 0.0)), 0.0)
    return -jnp.sum(jnp.where(q > 0, q * jnp.where(mask, log_q, 0.0), 0.0), axis=-1)


def concentrations(eta: Float[Array, "... d"]) -> Float[Array, "..."]:
    """``kappa = |eta|``: the concentration of a vMF with natural parameter ``eta``."""
    return jnp.linalg.norm(eta, axis=-1)


def resultant_concentration(
    x: Float[Array, "... n d"], debiased: bool = True
) -> Float[Array, "..."]:
    """``kappa`` estimated from the mean resultant length of ``n`` unit vectors
    (maximum likelihood given ``R``, :func:`svflow_jax.vmf.estimate_concentration`).

    The plain ``R = |mean_i x_i|`` has a finite-sample floor: for unit vectors with mean
    ``m = E x``, ``E R^2 = |m|^2 + (1 - |m|^2) / n``, so isotropic directions (``m = 0``) give
    ``R ~ 1 / sqrt(n)`` and ``kappa ~ d / sqrt(n)`` (51 for ``n = 128``, ``d = 576``).
    ``debiased`` (the default) uses the unbiased ``R^2 = (n R_plain^2 - 1) / (n - 1)``, clipped
    at 0 (``kappa = 0``), instead; ``debiased=False`` the plain ``R``. ``R`` is capped just
    below 1 so that identical directions give a large finite ``kappa``."""
    n = x.shape[-2]
    r2 = jnp.sum(jnp.mean(x, axis=-2) ** 2, axis=-1)
    if debiased:
        if n < 2:
            raise ValueError(f"the debiased resultant needs n >= 2 vectors, got {n}")
        r2 = jnp.maximum((n * r2 - 1.0) / (n - 1.0), 0.0)
    r = jnp.clip(jnp.sqrt(r2), 0.0, 1.0 - 1e3 * jnp.finfo(x.dtype).eps)
    return vmf.estimate_concentration(r, x.shape[-1])
