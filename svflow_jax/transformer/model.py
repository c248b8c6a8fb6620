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

The ``L`` layers have separate weights stored stacked along a leading axis (``nnx.vmap`` at
construction) and are applied with ``nnx.scan``, so tracing and compile time do not grow with
depth.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from svflow_jax.transformer.config import TransformerConfig

__all__ = [
    "Norm",
    "Attention",
    "FFN",
    "MoE",
    "Block",
    "Transformer",
    "TransformerLM",
    "tangent_project",
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
        self.bias = _zeros(config, (d,)) if config.norm == "layer" and config.use_bias else None

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
# Attention
# --------------------------------------------------------------------------------------------


class Attention(nnx.Module):
    """Multi-head (optionally grouped-query) softmax attention.

    ``out = sum_h softmax(q_h k_g^T / sqrt(d_head) [+ mask]) v_g W_O[h]`` with
    ``q_h = x W_Q[:, h]``, ``k_g = x W_K[:, g]``, ``v_g = x W_V[:, g]`` and ``g = h // (H/Hkv)``.

    Parameters: ``wq (d, H, dk)``, ``wk (d, Hkv, dk)``, ``wv (d, Hkv, dk)``, ``wo (H, dk, d)``;
    with ``use_bias`` also ``bq (H, dk)``, ``bk (Hkv, dk)``, ``bv (Hkv, dk)``, ``bo (d,)``.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        d, H, G, k = config.d_model, config.n_heads, config.kv_heads, config.d_head
        self.n_heads, self.n_kv_heads, self.d_head = H, G, k
        self.causal = config.causal
        self.wq = _param(rngs, config, (d, H, k))
        self.wk = _param(rngs, config, (d, G, k))
        self.wv = _param(rngs, config, (d, G, k))
        self.wo = _param(rngs, config, (H, k, d))
        self.bq = _zeros(config, (H, k)) if config.use_bias else None
        self.bk = _zeros(config, (G, k)) if config.use_bias else None
        self.bv = _zeros(config, (G, k)) if config.use_bias else None
        self.bo = _zeros(config, (d,)) if config.use_bias else None

    def _qkv(self, x: Float[Array, "... n d"]) -> tuple[Array, Array, Array]:
        q = jnp.einsum("...nd,dhk->...nhk", x, _get(self.wq, x))
        k = jnp.einsum("...nd,dgk->...ngk", x, _get(self.wk, x))
        v = jnp.einsum("...nd,dgk->...ngk", x, _get(self.wv, x))
        if self.bq is not None:
            q, k, v = q + _get(self.bq, x), k + _get(self.bk, x), v + _get(self.bv, x)
        # RoPE hook: rotary embeddings would rotate q and k here, per position, before the
        # scores (config.rope is validated to be None until that exists).
        # Grouped-query attention: query head h reads key/value head h // (H // Hkv), so each
        # key/value head is repeated for its group (Llama's repeat_kv) and the einsums below are
        # plain multi-head ones. (A separate group axis, of size 1 without GQA, made XLA
        # transpose and copy the (H, n, n) scores several times per layer: ~5-10% of a CPU
        # forward pass, see experiments/benchmark.py.)
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            k, v = jnp.repeat(k, group, axis=-2), jnp.repeat(v, group, axis=-2)
        return q, k, v

    def _probs(self, q: Array, k: Array) -> Float[Array, "... h q s"]:
        scores = jnp.einsum("...qhk,...shk->...hqs", q, k) / math.sqrt(self.d_head)
        if self.causal:
            n = scores.shape[-1]
            allowed = jnp.tril(jnp.ones((n, n), dtype=bool))
            # The most negative finite number, not -inf: exp underflows to an exact 0 for the
            # masked keys, and a fully masked row (possible with future padding masks) gives a
            # uniform row instead of 0/0 = NaN.
            scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
        return jax.nn.softmax(scores, axis=-1)

    def attention_weights(self, x: Float[Array, "... n d"]) -> Float[Array, "... H n n"]:
        """The softmax matrices, one per query head: ``[..., h, i, j]`` = weight of key j for
        query i."""
        q, k, _ = self._qkv(x)
        return self._probs(q, k)

    def __call__(self, x: Float[Array, "... n d"]) -> Float[Array, "... n d"]:
        q, k, v = self._qkv(x)
        o = jnp.einsum("...hqs,...shk->...qhk", self._probs(q, k), v)
        out = jnp.einsum("...nhk,hkd->...nd", o, _get(self.wo, x))
        if self.bo is not None:
            out = out + _get(self.bo, x)
        return out


# --------------------------------------------------------------------------------------------
# FFN and Mixture of Experts
# --------------------------------------------------------------------------------------------


def _gelu(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=False)  # exact erf GELU


class FFN(nnx.Module):
    """Position-wise FFN, ``W_out gelu(W_in x)`` or ``W_down (silu(W_gate x) * W_up x)``.

    With ``n_experts = E`` every weight gets a leading expert axis (``(E, d, f)``, ...) and the
    call returns all expert outputs ``(..., E, d)``; ``MoE`` mixes them.

    Parameters (gelu): ``w_in (d, f)``, ``w_out (f, d)`` [``b_in (f,)``, ``b_out (d,)``];
    (swiglu): ``w_gate``, ``w_up (d, f)``, ``w_down (f, d)`` [``b_gate``, ``b_up (f,)``,
    ``b_down (d,)``].
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, n_experts: int | None = None):
        self.kind = config.expert_kind
        self.experts = n_experts is not None
        E = () if n_experts is None else (n_experts,)
        d, f = config.d_model, config.d_ff
        bias = config.use_bias
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
        if self.kind == "gelu":
            hidden = _gelu(self._linear(x, self.w_in, self.b_in, into=True))
            return self._linear(hidden, self.w_out, self.b_out, into=False)
        gate = self._linear(x, self.w_gate, self.b_gate, into=True)
        up = self._linear(x, self.w_up, self.b_up, into=True)
        return self._linear(jax.nn.silu(gate) * up, self.w_down, self.b_down, into=False)


class MoE(nnx.Module):
    """Top-k Mixture of Experts: ``sum_e w_e(x) FFN_e(x)``.

    Router logits ``x W_r`` (``router (d, E)``, no bias); ``w`` is the softmax over the ``k``
    largest logits (= softmax over all, renormalised on the top-k) and exactly 0 elsewhere.
    Experts are evaluated densely and mixed with ``w``: simple, exact, and fine at our sizes.
    Ties between logits are broken towards the lower expert index (``lax.top_k``).
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        assert config.n_experts is not None and config.top_k is not None  # validated
        self.top_k = config.top_k
        self.router = _param(rngs, config, (config.d_model, config.n_experts))
        self.experts = FFN(config, rngs=rngs, n_experts=config.n_experts)

    def router_weights(self, x: Float[Array, "... d"]) -> Float[Array, "... E"]:
        """Mixing weights ``w``: non-negative, summing to 1, non-zero on the top-k experts only."""
        logits = jnp.einsum("...d,de->...e", x, _get(self.router, x))
        n_experts = logits.shape[-1]
        _, top = jax.lax.top_k(logits, self.top_k)
        selected = jnp.sum(jax.nn.one_hot(top, n_experts, dtype=jnp.int32), axis=-2) > 0
        # finfo.min (not -inf) keeps the max finite; exp then underflows to an exact 0.
        return jax.nn.softmax(jnp.where(selected, logits, jnp.finfo(logits.dtype).min), axis=-1)

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        w = self.router_weights(x)
        return jnp.einsum("...e,...ed->...d", w, self.experts(x))


# --------------------------------------------------------------------------------------------
# One layer
# --------------------------------------------------------------------------------------------


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

    def branch(self, name: str, z: Float[Array, "... n d"]) -> Float[Array, "... n d"]:
        """Branch ``"attn"`` or ``"ffn"`` at branch input ``z``, tangent-projected at ``z`` if
        ``project_branches`` (this is the increment before the factor ``h``)."""
        u = self.attn(z) if name == "attn" else self.ffn(z)
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

    def states(self, x: Float[Array, "... n d"]) -> list[Float[Array, "... n d"]]:
        """The residual stream after each sub-step (the last one is the layer output)."""
        post = self.config.norm_position == "post"
        out = []
        for norm, names, step in self._substeps():
            z = x if post else norm(x)
            u = self.branch(names[0], z)
            for name in names[1:]:
                u = u + self.branch(name, z)
            x = x + step * u
            if post:
                x = norm(x)
            out.append(x)
        return out

    def __call__(self, x: Float[Array, "... n d"]) -> Float[Array, "... n d"]:
        return self.states(x)[-1]


# --------------------------------------------------------------------------------------------
# The stack
# --------------------------------------------------------------------------------------------


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
    def from_layer_params(
        cls,
        config: TransformerConfig,
        params: dict[str, Array],
        outer_params: dict[str, Array] | None = None,
    ) -> Transformer:
        """A model whose weights are ``params`` (layout of ``layer_params``) and
        ``outer_params`` (layout of ``outer_norm_params``; ``None``: gains 1, biases 0)."""
        from svflow_jax.transformer.params import (
            outer_norm_params,
            set_layer_params,
            set_outer_norm_params,
        )

        # Build the structure abstractly (no random draws: compiling the PRNG on CPU costs
        # seconds per new shape) and fill in every parameter below.
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
        set_layer_params(model, params)
        if outer_params is None:
            outer_params = {
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

    def _scan(self, x: Array, collect: Callable[[list[Array]], Array] | None):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def step(x: Array, layer: Block) -> tuple[Array, Array | None]:
            states = layer.states(x)
            return states[-1], (None if collect is None else collect(states))

        return step(x, self.layers)

    def __call__(self, x: Float[Array, "... n d"]) -> Float[Array, "... n d"]:
        x, _ = self._scan(self._input(x), None)
        return self.final_norm(x) if self.final_norm is not None else x

    def hidden_states(
        self, x: Float[Array, "... n d"], *, substeps: bool = False
    ) -> Float[Array, "m ... n d"]:
        """The residual stream entering layer 1 (after the input Norm in post-norm), then after
        every layer: shape ``(L + 1, ..., n, d)``. With ``substeps=True``, after every residual
        sub-step instead: ``(L * S + 1, ..., n, d)``, ``S = config.n_substeps``. The pre-norm
        final Norm is not applied (it is not a layer)."""
        x0 = self._input(x)
        if substeps:
            _, ys = self._scan(x0, jnp.stack)  # (L, S, ..., n, d)
            ys = ys.reshape(-1, *ys.shape[2:])
        else:
            _, ys = self._scan(x0, lambda states: states[-1])
        return jnp.concatenate([x0[None], ys], axis=0)


class TransformerLM(nnx.Module):
    """Token embedding (``embed (V, d)``) -> ``Transformer`` -> logits (``unembed (d, V)``).

    No position embedding: causal masking is the only source of order until RoPE lands.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        if config.vocab_size is None:
            raise ValueError("TransformerLM needs config.vocab_size")
        self.embed = _param(rngs, config, (config.vocab_size, config.d_model))
        self.transformer = Transformer(config, rngs=rngs)
        self.unembed = _param(rngs, config, (config.d_model, config.vocab_size))

    def __call__(self, tokens: Int[Array, "... n"]) -> Float[Array, "... n V"]:
        x = jnp.take(self.embed[...], tokens, axis=0)
        x = self.transformer(x)
        return jnp.einsum("...nd,dv->...nv", x, _get(self.unembed, x))
