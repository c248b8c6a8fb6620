"""Reading a pre-norm ``TransformerLM`` layer by layer: the logit lens and an exact direct-logit
decomposition.

In a pre-norm stack the residual stream is a sum. Sub-step ``s`` of layer ``l`` adds
``h_s u_{l,s,b}`` for each of its branches ``b`` (attention or FFN), read at the sub-step's input
Norm, so the final state is

    x_L = x_0 + sum_{l, s, b} h_s u_{l, s, b},

``x_0`` the embedding. The logits are ``W_U^T N(x_L)`` with the final Norm
``N(x) = g * (C x) r(x) + b``: ``C`` the centring ``x - mean(x)`` (LayerNorm) or the identity
(RMSNorm), ``r(x) = 1 / sqrt(mean((C x)^2) + eps)`` one number per token, ``g`` the gains and
``b`` the bias (LayerNorm with bias), and the LM head may add its own bias ``beta``. ``N`` is
linear in ``x`` once ``r`` is fixed, so with the Norm's scale ``r`` frozen at its value at the
final state,

    logits = sum_k W_U^T (g * (C c_k) r(x_L)) + W_U^T b + beta,   c_k in {x_0, h_s u_{l,s,b}},

exactly: the decomposition's remainder is round-off, not an approximation. This is the
convention of TransformerLens (which folds the Norm into the weights and divides by a
separately cached scale; here ``r`` and the gains are applied to every contribution, the same
map). It is not a linearisation of the Norm: the Jacobian of an RMSNorm at ``x_L`` annihilates
``x_L`` itself (``N`` is scale-invariant), so a first-order expansion would give the sum of all
contributions no logit at all. A contribution's part says what it adds through the final
state's scale, not what removing it would change.

The remainder is computed, and reported with a bound: in floating point, each logit is a sum of
``K`` parts (the ``K`` contributions, the Norm bias, the head bias), each a dot product of
``d`` terms, so two orderings differ by at most ``(K + d + 2) eps sum |part|`` (eps of the
computation's dtype, or of the float32 matrix multiply in force when the caller passes it);
a remainder above that bound is not round-off (:attr:`Decomposition.roundoff`).

Post-norm stacks renormalise the stream after every sub-step, so it is not a sum of
contributions: refused.

The logit lens applies the final Norm and the unembedding to the residual stream after every
sub-step (``hidden_states(substeps=True)``): per state, the top-k tokens and the mean
next-token loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from ..next_token import next_token_nll
from .model import Block, TransformerLM

__all__ = ["Decomposition", "Lens", "component_names", "residual_contributions",
           "decompose_logits", "final_logits", "logit_lens"]


def _check_pre_norm(model: TransformerLM) -> None:
    cfg = model.config
    if cfg.norm_position != "pre":
        raise ValueError("the logit decomposition and lens need a pre-norm model: a post-norm "
                         "stack renormalises the residual stream after every sub-step, so it is "
                         "not a sum of contributions")
    if not cfg.lm_head:
        raise ValueError("the model has no LM head (config.lm_head=False): nothing to decompose")


def component_names(model: TransformerLM) -> tuple[str, ...]:
    """``"embedding"``, then ``"layer l <branch>"`` (layers counted from 1, as in ``svflow
    inspect``) for every branch of every sub-step (macaron: ``ffn1``, ``attn``, ``ffn2``)."""
    per_layer = {"parallel": ["attn", "ffn"], "sequential": ["attn", "ffn"],
                 "macaron": ["ffn1", "attn", "ffn2"]}[model.config.block]
    return ("embedding",) + tuple(f"layer {i + 1} {b}" for i in range(model.config.n_layers)
                                  for b in per_layer)


def residual_contributions(
    model: TransformerLM, tokens: Int[Array, "... n"], *, positions: Array | None = None,
) -> Float[Array, "c ... n d"]:
    """The terms ``c_k`` of the residual stream, in the order of :func:`component_names`: the
    embedding, then ``h_s u_{l,s,b}`` of every branch. They sum to the final state (before the
    final Norm)."""
    _check_pre_norm(model)
    x0 = model.transformer._input(model.embeddings(tokens, positions=positions))

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def step(x: Array, layer: Block) -> tuple[Array, Array]:
        parts = []
        for norm, names, h in layer._substeps():
            z = norm(x)
            us = [h * layer.branch(name, z, None, positions) for name in names]
            parts += us
            x = x + sum(us[1:], us[0])
        return x, jnp.stack(parts)

    _, per_layer = step(x0, model.transformer.layers)  # (L, B, ..., n, d)
    per_layer = per_layer.reshape(-1, *per_layer.shape[2:])
    return jnp.concatenate([x0[None], per_layer], axis=0)


def _final_norm_parts(model: TransformerLM, x_final: Array):
    """``(apply, bias)``: the final Norm with its scale frozen at ``x_final`` (a linear map of
    a contribution) and its bias (``None`` without one)."""
    norm = model.transformer.final_norm
    if norm is None:
        return (lambda c: c), None
    xc = x_final - jnp.mean(x_final, -1, keepdims=True) if norm.kind == "layer" else x_final
    r = 1.0 / jnp.sqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + norm.eps)
    gain = None if norm.gain is None else norm.gain[...]
    bias = None if norm.bias is None else norm.bias[...]

    def apply(c: Array) -> Array:
        if norm.kind == "layer":
            c = c - jnp.mean(c, -1, keepdims=True)
        c = c * r
        return c if gain is None else c * gain

    return apply, bias


def _unembedding(model: TransformerLM, like: Array) -> Array:
    """``W_U`` as ``(d, V)``."""
    if model.unembed is not None:
        return model.unembed[...].astype(like.dtype)
    return model.embed[...].astype(like.dtype).T


@dataclasses.dataclass(frozen=True)
class Decomposition:
    """Direct logit attribution: ``contributions[k]`` is component ``names[k]``'s part of the
    logits of ``token_ids``; ``bias`` the final Norm's bias through the unembedding and
    ``head_bias`` the LM head's own bias (zeros without them); ``logits`` the model's own
    logits of ``token_ids``; ``remainder`` the largest ``|logits - sum_k contributions[k] -
    bias - head_bias|`` and ``remainder_bound`` the largest round-off that sum may carry
    (module docstring), both relative to the largest ``|logits|``."""

    names: tuple[str, ...]
    contributions: Float[Array, "c ... n k"]
    bias: Float[Array, "... n k"]
    head_bias: Float[Array, "... n k"]
    logits: Float[Array, "... n k"]
    token_ids: Int[Array, "... n k"] | None
    remainder: float
    remainder_bound: float

    @property
    def roundoff(self) -> bool:
        """Whether the remainder is within round-off (at most :attr:`remainder_bound`)."""
        return self.remainder <= self.remainder_bound


def decompose_logits(
    model: TransformerLM,
    tokens: Int[Array, "... n"],
    token_ids: Int[Array, "... n k"] | None = None,
    *,
    positions: Array | None = None,
    eps: float | None = None,
) -> Decomposition:
    """The logits of ``token_ids`` (``None``: the whole vocabulary) split into the embedding's
    and every branch's contribution through the final Norm with its scale frozen at the final
    state, the Norm's bias and the head's bias. ``eps``: the unit of the remainder's bound
    (default: the machine epsilon of the model's dtype; pass the float32 matrix multiply's in
    force on a GPU, whose default rounds float32 products to TF32)."""
    contrib = residual_contributions(model, tokens, positions=positions)
    x_final = contrib.sum(0)
    apply, bias = _final_norm_parts(model, x_final)
    w = _unembedding(model, contrib)  # (d, V)
    normed = apply(contrib)  # (c, ..., n, d)
    logits = model(tokens, positions=positions)
    beta = (jnp.zeros(w.shape[-1:], logits.dtype) if model.unembed_bias is None
            else model.unembed_bias[...].astype(logits.dtype))
    if token_ids is None:
        parts = jnp.einsum("c...nd,dv->c...nv", normed, w)
        b = (jnp.zeros(parts.shape[1:], parts.dtype) if bias is None
             else jnp.broadcast_to(bias @ w, parts.shape[1:]))
        head = jnp.broadcast_to(beta, parts.shape[1:])
    else:
        wk = jnp.moveaxis(w[:, token_ids], 0, -1)  # (..., n, k, d)
        parts = jnp.einsum("c...nd,...nkd->c...nk", normed, wk)
        b = (jnp.zeros(parts.shape[1:], parts.dtype) if bias is None
             else jnp.einsum("d,...nkd->...nk", bias.astype(wk.dtype), wk))
        head = beta[token_ids]
        logits = jnp.take_along_axis(logits, token_ids, axis=-1)
    scale = jnp.max(jnp.abs(logits))
    gap = jnp.max(jnp.abs(logits - parts.sum(0) - b - head)) / scale
    unit = float(jnp.finfo(parts.dtype).eps) if eps is None else float(eps)
    terms = parts.shape[0] + w.shape[0] + 2
    size = jnp.abs(parts).sum(0) + jnp.abs(b) + jnp.abs(head)
    bound = terms * unit * jnp.max(size) / scale
    return Decomposition(names=component_names(model), contributions=parts, bias=b,
                         head_bias=head, logits=logits, token_ids=token_ids,
                         remainder=float(gap), remainder_bound=float(bound))


def final_logits(model: TransformerLM, states: Float[Array, "... n d"]
                 ) -> Float[Array, "... n V"]:
    """The logits the model would output if the residual stream ended at ``states``: the final
    Norm (when the model has one) and the unembedding."""
    norm = model.transformer.final_norm
    return model.logits(norm(states) if norm is not None else states)


@dataclasses.dataclass(frozen=True)
class Lens:
    """The logit lens after every sub-step: ``top_ids[m]`` the ``top_k`` tokens of state ``m``
    (``m = 0``: the embedding; then one per sub-step; the last is the model's output) and
    ``loss[m]`` the mean next-token cross-entropy (nats) when ``targets`` were given."""

    labels: tuple[str, ...]
    top_ids: Int[Array, "m ... n k"]
    loss: Float[Array, " m"] | None


def logit_lens(
    model: TransformerLM,
    tokens: Int[Array, "... n"],
    targets: Int[Array, "... n"] | None = None,
    *,
    top_k: int = 5,
    positions: Array | None = None,
) -> Lens:
    """Final Norm and unembedding applied to the residual stream after every sub-step (one
    state at a time, so the ``(states, n, V)`` logits are never held at once)."""
    _check_pre_norm(model)
    states = model.hidden_states(tokens, positions=positions, substeps=True)

    def read(x: Array):
        logits = final_logits(model, x)
        top = jax.lax.top_k(logits, top_k)[1]
        if targets is None:
            return top, jnp.zeros((), logits.dtype)
        return top, next_token_nll(logits, targets, logits.dtype).mean()

    top, loss = jax.lax.map(read, states)
    subs = list(component_names(model)[1:])
    if model.config.block == "parallel":  # one sub-step holds both branches
        subs = [n + "+ffn" for n in subs if n.endswith(" attn")]
    labels = ("embedding",) + tuple(f"after {n}" for n in subs)
    return Lens(labels=labels, top_ids=top, loss=None if targets is None else loss)
