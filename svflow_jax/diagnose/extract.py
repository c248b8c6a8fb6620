"""Reading the SVFlow diagnostics off a Transformer, layer by layer.

The Transformer's internals come from the bridge's one reader
(:func:`svflow_jax.bridge.readout.read_layers`: the model's own forward pass, each block
recording its sub-steps); this module turns the attention sub-step of each layer into the
arrays in flow words that the pure functions of :mod:`svflow_jax.flow.diagnostics` take. Every
block the Transformer builds is read (a macaron block's attention sub-step comes after its
first FFN half-step). Units and choices (``docs/theory.md``, section 19):

* the point explained at layer ``t`` is the direction ``x_i = y_i / |y_i|`` of the residual
  stream ``y`` entering the layer's attention sub-step (``hidden_states[t]`` for sequential
  and parallel blocks);
* the attention posterior ``q_h(j | x_i)`` is the model's own softmax, recomputed in float64
  from the (float32) branch input ``z = Norm(y)`` (pre-norm) or ``z = y`` (post-norm);
* the natural parameter of component ``(h, j)`` is the head's value-output image of the branch
  input, in the model's units (no rescaling):
  ``eta_hj = (z_j W_V^{g(h)} + b_V^{g(h)}) W_O^h + b_O / H``, so that
  ``sum_h sum_j q_h(j | x_i) eta_hj`` is exactly the attention output at token ``i``;
* the attention kernel concentration of head ``h`` at scored token ``i`` is
  ``|q_hi| mean_j |k_hj| / sqrt(d_k)``, the factor multiplying the cosine in the logits
  (RoPE is a rotation and preserves both norms).

Everything per window is one jitted call: the model's scanned forward, which computes each
layer's metrics as it passes and keeps only small per-layer
summaries (the ``(H, n, d)`` natural parameters of 30 layers are never stored).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array

from ..bridge.readout import (
    attention_substep,
    check_supported,
    head_values,
    natural_parameters,
    read_layers,
)
from ..flow import diagnostics as fd
from ..next_token import token_scores
from ..transformer.model import Block, TransformerLM
from .metrics import LOCAL, SVFLOW

__all__ = ["LayerSummaries", "LOCAL_METRICS", "check_supported", "window_diagnostics",
           "scale_attention_logits",
           "natural_parameters"]


class LayerSummaries(NamedTuple):
    """Per-window results of :func:`window_diagnostics` (NumPy arrays, float64).

    ``P`` sequences (sequence 0 is the clean reference), ``L`` layers, ``H`` heads; head
    metrics are averaged over the ``s`` scored tokens (and over ``j`` for ``kappa_eta``).
    """

    log_evidence: np.ndarray  # (L, P, H) log p_h(x_i), flow units (eta / sqrt(d))
    kl_q_p: np.ndarray  # (L, P, H) KL(q_h || p_h), flow units
    kl_excess: np.ndarray  # (L, P, H) KL(q_h || p_h) - (log n_i - H(q_h)), flow units
    kl_clean: np.ndarray  # (L, P, H) KL(q_clean || q_p), 0 for p = 0
    entropy: np.ndarray  # (L, P, H) entropy of q_h (nats)
    kappa_eta: np.ndarray  # (L, P, H) mean_j |eta_hj|, flow units
    kappa_posterior: np.ndarray  # (L, P, H) mean_i sum_j q_h(j|x_i) |eta_hj|, flow units
    kappa_attn: np.ndarray  # (L, P, H) attention kernel concentration
    kappa_resultant: np.ndarray  # (L, P) from the mean resultant length of all n directions
    target_logp: np.ndarray | None  # (P, s) log-probability of the next token (LMs)
    confidence: np.ndarray | None  # (P, s) top-1 probability
    correct: np.ndarray | None  # (P, s) top-1 == next token
    # the vMF metrics whose value and ranking depend on the unit, in the model's units (eta
    # read off the Norm's sphere of radius sqrt(d)): log_evidence, kl_q_p, kl_excess
    log_evidence_model: np.ndarray | None = None
    kl_q_p_model: np.ndarray | None = None
    kl_excess_model: np.ndarray | None = None
    # layer-local: the LOCAL_METRICS with only that layer's context shuffled (the clean run's
    # stream at the layer's input, its positions permuted as in sequence p; no upstream change)
    local: dict[str, np.ndarray] | None = None


#: The metrics also read layer-locally (``LayerSummaries.local``; the records of
#: :mod:`.metrics` with ``local``). ``log_evidence`` is not among them: a layer-local shuffle
#: leaves it exactly unchanged (a uniform mixture over the same context tokens, whose ``eta``
#: does not see positions).
LOCAL_METRICS = LOCAL


def _qk_norms(attn, z: Array) -> tuple[Array, Array]:
    """``|q_hi|`` (..., H, n) and ``|k_hj|`` (..., H, n) before RoPE (which preserves them)."""
    q = jnp.einsum("...nd,dhk->...hnk", z, attn.wq[...].astype(z.dtype))
    k = jnp.einsum("...nd,dgk->...gnk", z, attn.wk[...].astype(z.dtype))
    if attn.bq is not None:
        q = q + attn.bq[...].astype(z.dtype)[:, None, :]
        k = k + attn.bk[...].astype(z.dtype)[:, None, :]
    if attn.q_norm_gain is not None:
        def rms(a):
            return a / jnp.sqrt(jnp.mean(a * a, axis=-1, keepdims=True) + attn.eps)
        q = rms(q) * attn.q_norm_gain[...].astype(z.dtype)
        k = rms(k) * attn.k_norm_gain[...].astype(z.dtype)
    group = attn.n_heads // attn.n_kv_heads
    k = jnp.repeat(k, group, axis=-3)
    return jnp.linalg.norm(q, axis=-1), jnp.linalg.norm(k, axis=-1)


def _eta_dots_and_norms(attn, z: Array, x: Array) -> tuple[Array, Array]:
    """``eta_hj . x_i`` (..., H, s, n) and ``|eta_hj|`` (..., H, n) without forming ``eta``:
    ``eta_hj . x_i = v_hj . (x_i W_O^h^T) + x_i . b_O / H`` and
    ``|eta_hj|^2 = v_hj W_O^h W_O^h^T v_hj^T + 2 v_hj W_O^h b_O / H + |b_O|^2 / H^2``
    (``O(H n k^2)`` instead of ``O(H n k d)``)."""
    v = head_values(attn, z)  # (..., H, n, k)
    wo = attn.wo[...].astype(z.dtype)  # (H, k, d)
    dots = jnp.einsum("...hnk,...hsk->...hsn", v, jnp.einsum("...sd,hkd->...hsk", x, wo))
    gram = jnp.einsum("hkd,hld->hkl", wo, wo)
    sq = jnp.einsum("...hnk,hkl,...hnl->...hn", v, gram, v)
    if attn.bo is not None:
        b = attn.bo[...].astype(z.dtype) / attn.n_heads
        dots = dots + jnp.einsum("...sd,d->...s", x, b)[..., None, :, None]
        sq = sq + 2 * jnp.einsum("...hnk,hkd,d->...hn", v, wo, b) + jnp.sum(b * b)
    return dots, jnp.sqrt(jnp.maximum(sq, 0.0))


def _layer_metrics(layer: Block, y: Array, z: Array, inverse: Array, scored: int,
                   dtype) -> dict:
    """Metrics of one layer for ``P`` sequences; sequence 0 is the reference. ``y (P, n, d)``:
    the stream entering the attention sub-step, ``z``: the attention branch input.

    The large contractions run in the model's dtype (float32 for a checkpoint); everything
    from the vMF normalisers, the posteriors and the divergences on is in ``dtype``."""
    n, d = y.shape[-2], y.shape[-1]
    causal = layer.config.causal
    attn = layer.attn
    probs = attn.attention_weights(z)[..., n - scored:, :].astype(dtype)  # (P, H, s, n)
    rows = jnp.arange(n - scored, n)[:, None]
    context = (jnp.arange(n)[None, :] <= rows) if causal else jnp.ones((scored, n), bool)
    ctx = jnp.broadcast_to(context, probs.shape)
    log_q = fd.safe_log(probs, ctx)

    x = fd.directions(y)  # (P, n, d)
    dots, kappa = _eta_dots_and_norms(attn, z, x[..., n - scored:, :])
    dots, kappa = dots.astype(dtype), kappa.astype(dtype)
    entropy = fd.entropy(log_q, ctx)
    log_n = jnp.log(jnp.sum(context, -1)).astype(dtype)  # log of each token's context size
    mean = lambda a: jnp.mean(a, axis=-1)  # noqa: E731 (over scored tokens)

    def vmf_metrics(unit: float) -> dict:
        """The mixture's quantities with ``eta`` in units of ``unit`` times the model's."""
        loglik = fd.vmf_log_likelihoods(dots * unit, kappa * unit, d)
        kl = fd.kl_divergence(log_q, fd.true_posterior_log(loglik, context), ctx)
        return {"log_evidence": mean(fd.log_evidence(loglik, context)), "kl_q_p": mean(kl),
                "kl_excess": mean(kl - (log_n - entropy))}

    # Flow units are the definition: to_flow's eta is the model's divided by rho = sqrt(d).
    unit = 1.0 / math.sqrt(d)
    flow, model = vmf_metrics(unit), vmf_metrics(1.0)

    # q_clean vs q_p over the same context tokens: column src of sequence p is position
    # inverse[p, src] (the clean token src sits there after the shuffle).
    aligned = jnp.take_along_axis(log_q, inverse[:, None, None, :], axis=-1)
    qn, kn = _qk_norms(attn, z)  # (P, H, n)
    qn, kn = qn.astype(dtype), kn.astype(dtype)
    k_mean = jnp.sum(jnp.where(context, kn[..., None, :], 0.0), -1) / jnp.sum(context, -1)
    kappa_attn = qn[..., n - scored:] * k_mean / math.sqrt(attn.d_head)
    return {
        **flow,
        **{f"{name}_model": value for name, value in model.items()},
        "kl_clean": mean(fd.kl_divergence(log_q[:1], aligned, ctx)),
        "entropy": mean(entropy),
        "kappa_eta": jnp.mean(kappa * unit, axis=-1),
        "kappa_posterior": mean(jnp.einsum("phsn,phn->phs", jnp.exp(log_q), kappa * unit)),
        "kappa_attn": mean(kappa_attn),
        "kappa_resultant": fd.resultant_concentration(x.astype(dtype)),
    }


@nnx.jit(static_argnames=("scored", "dtype"), graph_updates=False)  # reads the model
def _window(model: TransformerLM, tokens, inverse, targets, scored: int, dtype):
    perm = jnp.argsort(inverse, axis=1)  # position pos of sequence p holds clean token perm[p, pos]

    def read(layer, substeps, _):
        sub = attention_substep(substeps)
        cumulative = _layer_metrics(layer, sub.stream_in, sub.branch_input, inverse, scored,
                                    dtype)
        # Layer-local: the clean stream entering this layer (row 0), permuted like row p; the
        # Norm acts token by token, so the branch input permutes alike.
        local = _layer_metrics(layer, sub.stream_in[0][perm], sub.branch_input[0][perm],
                               inverse, scored, dtype)
        # only these leave the program, so XLA drops the rest of the local pass
        return cumulative, {name: local[name] for name in LOCAL_METRICS}

    y, (per_layer, local) = read_layers(model, tokens, read)  # one forward, read per layer
    task = None
    if targets is not None:
        final = y[:, -scored:, :]
        if model.transformer.final_norm is not None:
            final = model.transformer.final_norm(final)
        nll, confidence, correct = token_scores(model.logits(final), targets, dtype)
        task = (-nll, confidence, correct)
    return per_layer, local, task


def window_diagnostics(
    model: TransformerLM,
    tokens: np.ndarray,
    inverse: np.ndarray,
    scored: int,
    targets: np.ndarray | None = None,
    dtype: Any = None,
) -> LayerSummaries:
    """The per-layer diagnostics of ``P`` versions of one window.

    Args:
        model: a ``TransformerLM`` (pre- or post-norm, causal or not).
        tokens: ``(P, n)`` token ids; row 0 is the clean window, the others perturbed copies.
        inverse: ``(P, n)`` integers: ``inverse[p, src]`` is the position in row ``p`` of the
            token at position ``src`` of row 0 (the identity for row 0).
        scored: the last ``scored`` positions are the scored tokens (never moved).
        targets: ``(P, scored)`` next-token ids of the scored positions (causal LMs), or None.
        dtype: the dtype of the metrics (default float64 if x64 is on, else float32).
    """
    check_supported(model)
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or np.asarray(inverse).shape != tokens.shape:
        raise ValueError(f"tokens and inverse must both be (P, n), got {tokens.shape}, "
                         f"{np.asarray(inverse).shape}")
    if not 1 <= scored <= tokens.shape[1]:
        raise ValueError(f"scored must be in [1, n={tokens.shape[1]}], got {scored}")
    if targets is not None and not model.config.lm_head:
        raise ValueError("targets need a model with an LM head")
    dtype = dtype or (jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    per_layer, local, task = _window(model, jnp.asarray(tokens), jnp.asarray(inverse),
                                     None if targets is None else jnp.asarray(targets), scored,
                                     jnp.dtype(dtype))
    per_layer = {k: np.asarray(v, np.float64) for k, v in per_layer.items()}
    missing = {m.name for m in SVFLOW} - set(per_layer)
    if missing:  # a record of .metrics without its computation in _layer_metrics
        raise NotImplementedError(f"metrics without an extraction: {sorted(missing)}")
    local = {k: np.asarray(v, np.float64) for k, v in local.items()}
    if task is None:
        tl = conf = corr = None
    else:
        tl, conf, corr = (np.asarray(a) for a in task)
    return LayerSummaries(**per_layer, target_logp=tl, confidence=conf, correct=corr,
                          local=local)


def scale_attention_logits(model: TransformerLM, factor: float) -> TransformerLM:
    """A copy of ``model`` whose attention logits are multiplied by ``factor`` in every layer
    (the kernel concentration of every head scaled by ``factor``): the queries' weights and
    biases are scaled, or the query Norm gains when ``qk_norm`` (RoPE is linear in ``q``)."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor must be a finite positive number, got {factor!r}")
    out = nnx.clone(model)
    attn = out.transformer.layers.attn
    names = ("q_norm_gain",) if attn.q_norm_gain is not None else ("wq", "bq")
    for name in names:
        p = getattr(attn, name)
        if p is not None:
            p[...] = p[...] * jnp.asarray(factor, p[...].dtype)
    return out
