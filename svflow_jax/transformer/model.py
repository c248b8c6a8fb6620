"""A standard Transformer in Flax NNX, readable in one sitting (in the spirit of nanoGPT).

Shapes: hidden states are ``(..., n, d)`` (any leading batch axes, ``n`` tokens, ``d = d_model``).
Letters in einsum strings: ``d`` model width, ``h`` head, ``g`` key/value head, ``k`` head width,
``f`` FFN width, ``e`` expert, ``q``/``s`` query/key position.

One layer is a short list of residual *sub-steps*. A sub-step with step ``c`` and branches
``B_1..B_m`` (attention ``A``, FFN ``F``) reads, with ``P_z u = u - (z.u / z.z) z`` applied only
when ``config.project_branches``::

    post-norm:  x <- Norm(x + c * sum_i P_x B_i(x))
    pre-norm:   z  = Norm(x);  x <- x + c * sum_i P_z B_i(z)

    sequential: [(A, h), (F, h)]    parallel: [(A + F, h)]    macaron: [(F, h/2), (A, h), (F, h/2)]

with ``h = config.residual_scale``. The two macaron halves share the FFN weights *and* the FFN
Norm, so a macaron layer is a Strang splitting. The stack is ``Norm -> layers`` (post-norm) or
``layers -> Norm`` (pre-norm, if ``final_norm``).

Real checkpoints map onto this as follows. Llama/Qwen: pre-norm, sequential, RMSNorm, SwiGLU,
causal, RoPE (Qwen2 adds Q/K/V biases, Qwen3 a per-head RMSNorm of queries and keys), then the
final Norm and the LM head. BERT: ``TransformerLM`` sums word, position and token-type
embeddings, the post-norm stack's input Norm is the embedding LayerNorm, and every layer is
``x = LN(x + attn(x)); x = LN(x + ffn(x))`` with exact-erf GELU and biases everywhere.

Batches of unequal lengths: ``mask`` is a ``(..., n)`` boolean array, ``True`` on valid tokens.
Padded keys receive exactly zero attention (combined with the causal mask when ``causal``);
outputs at padded positions are meaningless and should be ignored. ``positions`` (``(..., n)``
or ``(n,)`` integers, default ``0..n-1``) are the RoPE / learned-position indices; pass them
for left padding.

The ``L`` layers have separate weights stored stacked along a leading axis (``nnx.vmap`` at
construction) and are applied with ``nnx.scan``, so tracing and compile time do not grow with
depth.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from svflow_jax.transformer.config import TransformerConfig
from svflow_jax.transformer.params import (
    outer_norm_params,
    set_layer_params,
    set_outer_norm_params,
)

__all__ = [
    "Norm",
    "Attention",
    "FFN",
    "MoE",
    "Block",
    "SubStep",
    "Transformer",
    "TransformerLM",
    "tangent_project",
    "apply_rope",
]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _param(rngs: nnx.Rngs, config: TransformerConfig, shape: tuple[int, ...]) -> nnx.Param:
    """A weight drawn from ``N(0, init_std^2)`` in ``param_dtype``."""
    init = jax.nn.initializers.normal(config.init_std)
    return nnx.Param(init(rngs.params(), shape, config.param_dtype))


def _zeros(config: TransformerConfig, shape: tuple[int, ...]) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, config.param_dtype))


def _ones(config: TransformerConfig, shape: tuple[int, ...]) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, config.param_dtype))


def _get(p: nnx.Param, like: Array) -> Array:
    """Parameter value in the computation dtype (that of the activations ``like``)."""
    return p[...].astype(like.dtype)


def tangent_project(z: Float[Array, "... d"], u: Float[Array, "... d"]) -> Float[Array, "... d"]:
    """``u - (z.u / z.z) z``: the part of ``u`` tangent to the sphere through ``z``.

    Rows with ``z = 0`` (no sphere to be tangent to) are returned unchanged instead of NaN.
    """
    zz = jnp.sum(z * z, axis=-1, keepdims=True)
    zu = jnp.sum(z * u, axis=-1, keepdims=True)
    return u - (zu / jnp.where(zz > 0, zz, 1.0)) * z


# --------------------------------------------------------------------------------------------
# Norm
# --------------------------------------------------------------------------------------------


class Norm(nnx.Module):
    """RMSNorm ``x / sqrt(mean(x^2) + eps) [* g]`` or LayerNorm ``(x - mu) / sqrt(var + eps)
    [* g] [+ b]``. ``g`` exists iff ``norm_gain``; ``b`` only for LayerNorm with ``use_bias``."""

    def __init__(self, config: TransformerConfig):
        self.kind = config.norm
        self.eps = config.norm_eps
        d = config.d_model
        self.gain = _ones(config, (d,)) if config.norm_gain else None
        self.bias = _zeros(config, (d,)) if config.has_norm_bias else None

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        if self.kind == "layer":
            x = x - jnp.mean(x, axis=-1, keepdims=True)
        # For RMSNorm this is mean(x^2); for LayerNorm the (biased) variance of the centred x.
        y = x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        if self.gain is not None:
            y = y * _get(self.gain, y)
        if self.bias is not None:
            y = y + _get(self.bias, y)
        return y


# --------------------------------------------------------------------------------------------
# Rotary position embeddings
# --------------------------------------------------------------------------------------------


def apply_rope(
    x: Float[Array, "... n h k"], positions: Array, inv_freq: Array
) -> Float[Array, "... n h k"]:
    """Rotate-half RoPE: the pair ``(x_i, x_{i+r/2})`` is rotated by ``positions * inv_freq[i]``.

    ``positions`` broadcasts against the leading axes ``(..., n)`` of ``x``; ``inv_freq`` has
    ``r // 2`` entries (see :meth:`RoPE.inv_freq`): ``r = k`` rotates the whole head; ``r < k``
    (partial rotary embeddings) rotates the first ``r`` coordinates and passes the others.
    """
    half = np.shape(inv_freq)[-1]
    rotated, passed = x[..., : 2 * half], x[..., 2 * half:]
    angles = jnp.asarray(positions)[..., None].astype(x.dtype) * jnp.asarray(inv_freq, x.dtype)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # (..., n, 1, r/2)
    x1, x2 = rotated[..., :half], rotated[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, passed], axis=-1)


def _rms(x: Array, eps: float) -> Array:
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


class Attention(nnx.Module):
    """Multi-head (optionally grouped-query) softmax attention.

    ``out = sum_h softmax(q_h k_g^T / sqrt(d_head) [+ mask]) v_g W_O[h]`` with
    ``q_h = x W_Q[:, h]``, ``k_g = x W_K[:, g]``, ``v_g = x W_V[:, g]`` and ``g = h // (H/Hkv)``.

    Parameters: ``wq (d, H, dk)``, ``wk (d, Hkv, dk)``, ``wv (d, Hkv, dk)``, ``wo (H, dk, d)``;
    with ``has_qkv_bias`` also ``bq (H, dk)``, ``bk (Hkv, dk)``, ``bv (Hkv, dk)``; with
    ``has_out_bias`` ``bo (d,)``; with ``qk_norm`` the gains ``q_norm_gain``, ``k_norm_gain
    (dk,)``. Order: projections, biases, per-head RMSNorm (``qk_norm``), RoPE (``rope``).
    With ``qk_stop_gradient`` the queries and keys read ``stop_gradient(x)`` (same values; no
    gradient from the posterior to ``x``; ``TransformerConfig``).
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        d, H, G, k = config.d_model, config.n_heads, config.kv_heads, config.d_head
        self.n_heads, self.n_kv_heads, self.d_head = H, G, k
        self.causal = config.causal
        self.rope = config.rope
        self.eps = config.norm_eps
        self.qk_stop_gradient = config.qk_stop_gradient
        self.wq = _param(rngs, config, (d, H, k))
        self.wk = _param(rngs, config, (d, G, k))
        self.wv = _param(rngs, config, (d, G, k))
        self.wo = _param(rngs, config, (H, k, d))
        qkv_bias = config.has_qkv_bias
        self.bq = _zeros(config, (H, k)) if qkv_bias else None
        self.bk = _zeros(config, (G, k)) if qkv_bias else None
        self.bv = _zeros(config, (G, k)) if qkv_bias else None
        self.bo = _zeros(config, (d,)) if config.has_out_bias else None
        self.q_norm_gain = _ones(config, (k,)) if config.qk_norm else None
        self.k_norm_gain = _ones(config, (k,)) if config.qk_norm else None

    def _qkv(
        self, x: Float[Array, "... n d"], positions: Array | None = None
    ) -> tuple[Array, Array, Array]:
        xqk = jax.lax.stop_gradient(x) if self.qk_stop_gradient else x
        q = jnp.einsum("...nd,dhk->...nhk", xqk, _get(self.wq, x))
        k = jnp.einsum("...nd,dgk->...ngk", xqk, _get(self.wk, x))
        v = jnp.einsum("...nd,dgk->...ngk", x, _get(self.wv, x))
        if self.bq is not None:
            q, k, v = q + _get(self.bq, x), k + _get(self.bk, x), v + _get(self.bv, x)
        if self.q_norm_gain is not None:  # Qwen3: per-head RMSNorm, before the rotation
            q = _rms(q, self.eps) * _get(self.q_norm_gain, q)
            k = _rms(k, self.eps) * _get(self.k_norm_gain, k)
        if self.rope is not None:
            if positions is None:
                positions = jnp.arange(x.shape[-2])
            inv_freq = self.rope.inv_freq(self.d_head)  # a NumPy constant, fixed by the config
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        # Grouped-query attention: query head h reads key/value head h // (H // Hkv), so each
        # key/value head is repeated for its group (Llama's repeat_kv) and the einsums below are
        # plain multi-head ones. (A separate group axis, of size 1 without GQA, made XLA
        # transpose and copy the (H, n, n) scores several times per layer: ~5-10% of a CPU
        # forward pass, see experiments/benchmark.py.)
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            k, v = jnp.repeat(k, group, axis=-2), jnp.repeat(v, group, axis=-2)
        return q, k, v

    def _probs(self, q: Array, k: Array, mask: Array | None = None) -> Float[Array, "... h q s"]:
        scores = jnp.einsum("...qhk,...shk->...hqs", q, k) / math.sqrt(self.d_head)
        allowed = None
        if self.causal:
            n = scores.shape[-1]
            allowed = jnp.tril(jnp.ones((n, n), dtype=bool))
        if mask is not None:  # (..., n) valid tokens -> keys (..., 1, 1, n)
            keys = jnp.asarray(mask, bool)[..., None, None, :]
            allowed = keys if allowed is None else allowed & keys
        if allowed is not None:
            # The most negative finite number, not -inf: exp underflows to an exact 0 for the
            # masked keys, and a fully masked row (a padded query with causal masking) gives a
            # uniform row instead of 0/0 = NaN.
            scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
        return jax.nn.softmax(scores, axis=-1)

    def attention_weights(
        self, x: Float[Array, "... n d"], mask: Array | None = None, positions: Array | None = None
    ) -> Float[Array, "... H n n"]:
        """The softmax matrices, one per query head: ``[..., h, i, j]`` = weight of key j for
        query i."""
        q, k, _ = self._qkv(x, positions)
        return self._probs(q, k, mask)

    def __call__(
        self, x: Float[Array, "... n d"], mask: Array | None = None, positions: Array | None = None
    ) -> Float[Array, "... n d"]:
        q, k, v = self._qkv(x, positions)
        o = jnp.einsum("...hqs,...shk->...qhk", self._probs(q, k, mask), v)
        out = jnp.einsum("...nhk,hkd->...nd", o, _get(self.wo, x))
        if self.bo is not None:
            out = out + _get(self.bo, x)
        return out


# --------------------------------------------------------------------------------------------
# FFN and Mixture of Experts
# --------------------------------------------------------------------------------------------


_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": functools.partial(jax.nn.gelu, approximate=False),  # exact, erf
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "silu": jax.nn.silu,
}


class FFN(nnx.Module):
    """Position-wise FFN, ``W_out phi(W_in x)`` or ``W_down (phi(W_gate x) * W_up x)``, with
    ``phi = config.ffn_activation`` (exact GELU and SiLU by default).

    With ``n_experts = E`` every weight gets a leading expert axis (``(E, d, f)``, ...) and the
    call returns all expert outputs ``(..., E, d)``; ``MoE`` mixes them.

    Parameters (gelu): ``w_in (d, f)``, ``w_out (f, d)`` [``b_in (f,)``, ``b_out (d,)``];
    (swiglu, the dense Llama MLP ``down(silu(gate(x)) * up(x))``): ``w_gate``, ``w_up (d, f)``,
    ``w_down (f, d)`` [``b_gate``, ``b_up (f,)``, ``b_down (d,)``]; biases iff ``has_ffn_bias``.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, n_experts: int | None = None):
        self.kind = config.expert_kind
        self.activation = config.ffn_activation
        self.experts = n_experts is not None
        E = () if n_experts is None else (n_experts,)
        d, f = config.d_model, config.d_ff
        bias = config.has_ffn_bias
        if self.kind == "gelu":
            self.w_in = _param(rngs, config, (*E, d, f))
            self.w_out = _param(rngs, config, (*E, f, d))
            self.b_in = _zeros(config, (*E, f)) if bias else None
            self.b_out = _zeros(config, (*E, d)) if bias else None
        else:
            self.w_gate = _param(rngs, config, (*E, d, f))
            self.w_up = _param(rngs, config, (*E, d, f))
            self.w_down = _param(rngs, config, (*E, f, d))
            self.b_gate = _zeros(config, (*E, f)) if bias else None
            self.b_up = _zeros(config, (*E, f)) if bias else None
            self.b_down = _zeros(config, (*E, d)) if bias else None

    def _linear(self, x: Array, w: nnx.Param, b: nnx.Param | None, *, into: bool) -> Array:
        # into: x (..., d) -> (..., [E,] f), broadcasting x over experts; else (..., [E,] f) -> d.
        if self.experts:
            spec = "...d,edf->...ef" if into else "...ef,efd->...ed"
        else:
            spec = "...d,df->...f" if into else "...f,fd->...d"
        y = jnp.einsum(spec, x, _get(w, x))
        return y if b is None else y + _get(b, x)

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        phi = _ACTIVATIONS[self.activation]
        if self.kind == "gelu":
            hidden = phi(self._linear(x, self.w_in, self.b_in, into=True))
            return self._linear(hidden, self.w_out, self.b_out, into=False)
        gate = self._linear(x, self.w_gate, self.b_gate, into=True)
        up = self._linear(x, self.w_up, self.b_up, into=True)
        return self._linear(phi(gate) * up, self.w_down, self.b_down, into=False)


class MoE(nnx.Module):
    """Top-k Mixture of Experts: ``sum_e w_e(x) FFN_e(x)``.

    Router logits ``x W_r`` (``router (d, E)``, no bias); ``w`` is the softmax over the ``k``
    largest logits (= softmax over all, renormalised on the top-k) and exactly 0 elsewhere, or
    with ``router_gate="switch"`` the full softmax's probabilities of the top-k (not
    renormalised: with one expert, ``p_e(x) FFN_e(x)``, as in the Switch Transformer).
    Experts are evaluated densely and mixed with ``w``: simple, exact, and fine at our sizes.
    Ties between logits are broken towards the lower expert index (``lax.top_k``).
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        assert config.n_experts is not None and config.top_k is not None  # validated
        self.top_k = config.top_k
        self.gate = config.router_gate
        self.router = _param(rngs, config, (config.d_model, config.n_experts))
        self.experts = FFN(config, rngs=rngs, n_experts=config.n_experts)

    def router_weights(self, x: Float[Array, "... d"]) -> Float[Array, "... E"]:
        """Mixing weights ``w``: non-negative, non-zero on the top-k experts only, summing to 1
        (renormalised) or to the top-k's softmax probability (``switch``)."""
        logits = jnp.einsum("...d,de->...e", x, _get(self.router, x))
        n_experts = logits.shape[-1]
        _, top = jax.lax.top_k(logits, self.top_k)
        selected = jnp.sum(jax.nn.one_hot(top, n_experts, dtype=jnp.int32), axis=-2) > 0
        if self.gate == "switch":
            return jnp.where(selected, jax.nn.softmax(logits, axis=-1), 0.0)
        # finfo.min (not -inf) keeps the max finite; exp then underflows to an exact 0.
        return jax.nn.softmax(jnp.where(selected, logits, jnp.finfo(logits.dtype).min), axis=-1)

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        w = self.router_weights(x)
        return jnp.einsum("...e,...ed->...d", w, self.experts(x))


# --------------------------------------------------------------------------------------------
# One layer
# --------------------------------------------------------------------------------------------


class SubStep(NamedTuple):
    """One residual update of a :class:`Block`, as recorded by ``Block.states(record=...)``:
    ``stream_in -> stream_out = [Norm](stream_in + step * sum(branch_outputs))`` with the
    branches ``names`` evaluated at ``branch_input`` (tangent-projected if the config says)."""

    names: tuple[str, ...]
    step: float
    stream_in: Array
    branch_input: Array
    branch_outputs: tuple[Array, ...]
    stream_out: Array


class Block(nnx.Module):
    """One Transformer layer: attention ``attn``, FFN/MoE ``ffn`` and its Norms.

    Norms: ``norm_attn`` and ``norm_ffn`` (sequential, macaron: both FFN halves share
    ``norm_ffn``) or a single ``norm`` (parallel). In post-norm they follow the residual update,
    in pre-norm they produce the branch input.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.attn = Attention(config, rngs=rngs)
        self.ffn = MoE(config, rngs=rngs) if config.ffn == "moe" else FFN(config, rngs=rngs)
        if config.block == "parallel":
            self.norm = Norm(config)
        else:
            self.norm_attn = Norm(config)
            self.norm_ffn = Norm(config)

    def branch(
        self,
        name: str,
        z: Float[Array, "... n d"],
        mask: Array | None = None,
        positions: Array | None = None,
    ) -> Float[Array, "... n d"]:
        """Branch ``"attn"`` or ``"ffn"`` at branch input ``z``, tangent-projected at ``z`` if
        ``project_branches`` (this is the increment before the factor ``h``)."""
        u = self.attn(z, mask, positions) if name == "attn" else self.ffn(z)
        return tangent_project(z, u) if self.config.project_branches else u

    def _substeps(self) -> list[tuple[Norm, tuple[str, ...], float]]:
        """(Norm, branches, step) of each residual update of this layer, in order."""
        h = self.config.residual_scale
        if self.config.block == "parallel":
            return [(self.norm, ("attn", "ffn"), h)]
        attn, ffn = (self.norm_attn, ("attn",), h), (self.norm_ffn, ("ffn",), 0.5 * h)
        if self.config.block == "sequential":
            return [attn, (self.norm_ffn, ("ffn",), h)]
        return [ffn, attn, ffn]  # macaron: Strang splitting F(h/2) A(h) F(h/2)

    def states(
        self,
        x: Float[Array, "... n d"],
        mask: Array | None = None,
        positions: Array | None = None,
        *,
        record: Callable[[SubStep], None] | None = None,
        branch: Callable[[Block, str, Array, Array], Array] | None = None,
    ) -> list[Float[Array, "... n d"]]:
        """The residual stream after each sub-step (the last one is the layer output).

        The recording hook (in the manner of Flax's ``sow``): ``record`` is called with a
        :class:`SubStep` for each residual update, holding the stream that enters it, the
        branch input ``z``, the branch names and their outputs, so a reader sees the forward
        pass's own intermediates. ``branch(block, name, z, x)``, if given, evaluates a branch at
        input ``z`` of the stream ``x`` in place of the block's own (before the tangent
        projection; e.g. to read a branch through perturbed inputs); the sub-step structure,
        Norms and steps stay the block's."""
        post = self.config.norm_position == "post"
        out = []
        for norm, names, step in self._substeps():
            z = x if post else norm(x)
            if branch is None:
                raw = [self.attn(z, mask, positions) if name == "attn" else self.ffn(z)
                       for name in names]
            else:
                raw = [branch(self, name, z, x) for name in names]
            if self.config.project_branches:
                raw = [tangent_project(z, u) for u in raw]
            u = raw[0]
            for v in raw[1:]:
                u = u + v
            x_in, x = x, x + step * u
            if post:
                x = norm(x)
            if record is not None:
                record(SubStep(names, step, x_in, z, tuple(raw), x))
            out.append(x)
        return out

    def __call__(
        self,
        x: Float[Array, "... n d"],
        mask: Array | None = None,
        positions: Array | None = None,
    ) -> Float[Array, "... n d"]:
        return self.states(x, mask, positions)[-1]


# --------------------------------------------------------------------------------------------
# The stack
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _abstract_parts(cls: type, config: TransformerConfig):
    return nnx.split(nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0))))


class Transformer(nnx.Module):
    """``L`` layers on hidden states ``(..., n, d)``, with the input Norm (post-norm) or the
    final Norm (pre-norm, if ``final_norm``).

    ``layers`` is one ``Block`` whose parameters carry a leading layer axis ``(L, ...)``.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config

        @nnx.split_rngs(splits=config.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> Block:
            return Block(config, rngs=rngs)

        self.layers = make_layers(rngs)
        post = config.norm_position == "post"
        self.input_norm = Norm(config) if post else None
        self.final_norm = Norm(config) if not post and config.final_norm else None

    @classmethod
    def abstract(cls, config: TransformerConfig) -> Transformer:
        """A model of ``config``'s structure whose parameters are ``jax.ShapeDtypeStruct`` s:
        no random draws (compiling the PRNG on CPU costs seconds per new shape), and a fresh
        copy of a structure built once per configuration (building it takes ~10 ms; tracing a
        program, or drawing random weights, asks for it again and again)."""
        return nnx.merge(*_abstract_parts(cls, config), copy=True)

    @classmethod
    def from_layer_params(
        cls,
        config: TransformerConfig,
        params: dict[str, Array],
        outer_params: dict[str, Array] | None = None,
    ) -> Transformer:
        """A model whose weights are ``params`` (layout of ``layer_params``) and
        ``outer_params`` (layout of ``outer_norm_params``; ``None``: gains 1, biases 0)."""
        model = cls.abstract(config)
        set_layer_params(model, params)
        if outer_params is None:
            outer_params = {  # the abstract model holds shapes only: read them, not values
                name: (jnp.ones if name.endswith("_gain") else jnp.zeros)(a.shape, a.dtype)
                for name, a in outer_norm_params(model).items()
            }
        set_outer_norm_params(model, outer_params)
        return model

    def layer(self, i: int) -> Block:
        """A stand-alone copy of layer ``i`` (unstacked parameters)."""
        graphdef, state = nnx.split(self.layers)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))

    def _input(self, x: Array) -> Array:
        dtype = self.config.dtype or jnp.result_type(x.dtype, self.config.param_dtype)
        x = jnp.asarray(x, dtype)
        return self.input_norm(x) if self.input_norm is not None else x

    def _scan(
        self,
        x: Array,
        collect: Callable[[list[Array]], Array] | None,
        mask: Array | None = None,
        positions: Array | None = None,
    ):
        # mask and positions are the same for every layer: broadcast (in_axes None), not scanned.
        @nnx.scan(in_axes=(nnx.Carry, 0, None, None), out_axes=(nnx.Carry, 0))
        def step(x: Array, layer: Block, mask, positions) -> tuple[Array, Array | None]:
            states = layer.states(x, mask, positions)
            return states[-1], (None if collect is None else collect(states))

        return step(x, self.layers, mask, positions)

    def __call__(
        self,
        x: Float[Array, "... n d"],
        mask: Array | None = None,
        positions: Array | None = None,
    ) -> Float[Array, "... n d"]:
        """The stack's output. ``mask``: ``(..., n)`` booleans, ``True`` on valid tokens;
        ``positions``: RoPE positions (default ``0..n-1``)."""
        x, _ = self._scan(self._input(x), None, mask, positions)
        return self.final_norm(x) if self.final_norm is not None else x

    def hidden_states(
        self,
        x: Float[Array, "... n d"],
        *,
        substeps: bool = False,
        mask: Array | None = None,
        positions: Array | None = None,
    ) -> Float[Array, "m ... n d"]:
        """The residual stream entering layer 1 (after the input Norm in post-norm), then after
        every layer: shape ``(L + 1, ..., n, d)``. With ``substeps=True``, after every residual
        sub-step instead: ``(L * S + 1, ..., n, d)``, ``S = config.n_substeps``. The pre-norm
        final Norm is not applied (it is not a layer)."""
        x0 = self._input(x)
        if substeps:
            _, ys = self._scan(x0, jnp.stack, mask, positions)  # (L, S, ..., n, d)
            ys = ys.reshape(-1, *ys.shape[2:])
        else:
            _, ys = self._scan(x0, lambda states: states[-1], mask, positions)
        return jnp.concatenate([x0[None], ys], axis=0)


class TransformerLM(nnx.Module):
    """Embeddings -> ``Transformer`` -> logits (or the final hidden states).

    Embeddings: ``embed (V, d)`` indexed by the tokens, plus ``pos_embed (P, d)`` indexed by the
    positions (``n_positions``, learned absolute positions as in BERT) and ``type_embed (T, d)``
    indexed by the token types (``type_vocab_size``; absent types read row 0, as in BERT).
    Head (``lm_head``): ``unembed (d, V)``, or ``embed`` transposed with ``tie_embeddings``;
    with ``head_bias`` plus ``unembed_bias (V,)``.
    Without ``lm_head`` the call returns the stack's output ``(..., n, d)``.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        if config.vocab_size is None:
            raise ValueError("TransformerLM needs config.vocab_size")
        self.config = config
        d = config.d_model
        self.embed = _param(rngs, config, (config.vocab_size, d))
        positions, types = config.n_positions, config.type_vocab_size
        self.pos_embed = _param(rngs, config, (positions, d)) if positions else None
        self.type_embed = _param(rngs, config, (types, d)) if types else None
        self.transformer = Transformer(config, rngs=rngs)
        separate_head = config.lm_head and not config.tie_embeddings
        self.unembed = _param(rngs, config, (d, config.vocab_size)) if separate_head else None
        head_bias = config.lm_head and config.head_bias
        self.unembed_bias = _zeros(config, (config.vocab_size,)) if head_bias else None

    def embeddings(
        self,
        tokens: Int[Array, "... n"],
        token_types: Int[Array, "... n"] | None = None,
        positions: Int[Array, "... n"] | None = None,
    ) -> Float[Array, "... n d"]:
        """The stack's input: sum of the token (times ``embed_scale``), position and token-type
        embeddings."""
        x = jnp.take(self.embed[...], tokens, axis=0)
        if self.config.embed_scale != 1.0:
            x = x * jnp.asarray(self.config.embed_scale, x.dtype)
        if self.pos_embed is not None:
            pos = jnp.arange(x.shape[-2]) if positions is None else positions
            x = x + jnp.take(self.pos_embed[...], pos, axis=0)
        if self.type_embed is not None:
            types = jnp.zeros_like(tokens) if token_types is None else token_types
            x = x + jnp.take(self.type_embed[...], types, axis=0)
        return x

    def logits(self, x: Float[Array, "... n d"]) -> Float[Array, "... n V"]:
        """The LM head applied to (final-normed) hidden states."""
        if not self.config.lm_head:
            raise ValueError("this TransformerLM has no LM head (config.lm_head=False)")
        if self.unembed is not None:
            logits = jnp.einsum("...nd,dv->...nv", x, _get(self.unembed, x))
        else:
            logits = jnp.einsum("...nd,vd->...nv", x, _get(self.embed, x))
        if self.unembed_bias is not None:
            logits = logits + _get(self.unembed_bias, logits)
        return logits

    def __call__(
        self,
        tokens: Int[Array, "... n"],
        *,
        mask: Array | None = None,
        token_types: Int[Array, "... n"] | None = None,
        positions: Int[Array, "... n"] | None = None,
    ) -> Float[Array, "... n V"]:
        """Logits ``(..., n, V)`` (or final hidden states ``(..., n, d)`` without ``lm_head``);
        ``mask``: ``(..., n)`` booleans, ``True`` on valid tokens."""
        x = self.transformer(self.embeddings(tokens, token_types, positions), mask, positions)
        return self.logits(x) if self.config.lm_head else x

    def hidden_states(
        self,
        tokens: Int[Array, "... n"],
        *,
        mask: Array | None = None,
        token_types: Int[Array, "... n"] | None = None,
        positions: Int[Array, "... n"] | None = None,
        substeps: bool = False,
    ) -> Float[Array, "m ... n d"]:
        """``Transformer.hidden_states`` of the embedded tokens (no final Norm)."""
        x = self.embeddings(tokens, token_types, positions)
        return self.transformer.hidden_states(
            x, substeps=substeps, mask=mask, positions=positions
        )
