"""Tests of the standard Transformer (``svflow_jax.transformer``).

The central check rebuilds every layer variant from the formulas, in plain NumPy with Python
loops over layers, heads and tokens (no code shared with the model), feeds both the same
randomly drawn parameters in the documented ``layer_params`` layout, and asks for agreement to
1e-12 in float64, sub-step by sub-step.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.special import erf
from scipy.special import softmax as sp_softmax

from svflow_jax.transformer import (
    RoPE,
    Transformer,
    TransformerConfig,
    TransformerLM,
    apply_rope,
    embedding_params,
    layer_params,
    outer_norm_params,
    set_embedding_params,
    set_layer_params,
    set_outer_norm_params,
)

F64 = jnp.float64
TOL = 1e-12  # float64 agreement asked for by the correspondence layer

# d_model != n_heads * d_head on purpose (6 vs 4 * 3 = 12): allowed and documented.
BASE = dict(d_model=6, n_layers=3, n_heads=4, d_head=3, d_ff=10, param_dtype=F64)
N_TOKENS = 5


# ============================================================================================
# Independent NumPy reference
# ============================================================================================


def bias_flags(cfg: TransformerConfig) -> dict[str, bool]:
    """Which biases exist: each override, or use_bias when it is None (LayerNorm only for
    the Norm bias)."""
    flags = {}
    for group in ("qkv", "out", "ffn", "norm"):
        override = getattr(cfg, f"{group}_bias")
        flags[group] = cfg.use_bias if override is None else override
    flags["norm"] = flags["norm"] and cfg.norm == "layer"
    return flags


def shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """The documented parameter layout, written out again here (not read from the model)."""
    L, d, H, dk, f = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_ff
    G = cfg.n_kv_heads or H
    out = {"wq": (L, d, H, dk), "wk": (L, d, G, dk), "wv": (L, d, G, dk), "wo": (L, H, dk, d)}
    flags = bias_flags(cfg)
    qkv_bias, out_bias, ffn_bias, norm_bias = (flags[k] for k in ("qkv", "out", "ffn", "norm"))
    if qkv_bias:
        out |= {"bq": (L, H, dk), "bk": (L, G, dk), "bv": (L, G, dk)}
    if out_bias:
        out["bo"] = (L, d)
    if cfg.qk_norm:
        out |= {"q_norm_gain": (L, dk), "k_norm_gain": (L, dk)}
    kind = cfg.expert_ffn if cfg.ffn == "moe" else cfg.ffn
    E = (cfg.n_experts,) if cfg.ffn == "moe" else ()
    if cfg.ffn == "moe":
        out["router"] = (L, d, cfg.n_experts)
    if kind == "gelu":
        out |= {"w_in": (L, *E, d, f), "w_out": (L, *E, f, d)}
        if ffn_bias:
            out |= {"b_in": (L, *E, f), "b_out": (L, *E, d)}
    else:
        out |= {"w_gate": (L, *E, d, f), "w_up": (L, *E, d, f), "w_down": (L, *E, f, d)}
        if ffn_bias:
            out |= {"b_gate": (L, *E, f), "b_up": (L, *E, f), "b_down": (L, *E, d)}
    norms = ["norm"] if cfg.block == "parallel" else ["norm_attn", "norm_ffn"]
    for norm in norms:
        if cfg.norm_gain:
            out[f"{norm}_gain"] = (L, d)
        if norm_bias:
            out[f"{norm}_bias"] = (L, d)
    return out


def outer_names(cfg: TransformerConfig) -> list[str]:
    if cfg.norm_position == "pre" and not cfg.final_norm:
        return []
    prefix = "input_norm" if cfg.norm_position == "post" else "final_norm"
    names = [f"{prefix}_gain"] if cfg.norm_gain else []
    return names + ([f"{prefix}_bias"] if bias_flags(cfg)["norm"] else [])


def random_params(cfg: TransformerConfig, seed: int) -> tuple[dict, dict]:
    """Weights of order 1/sqrt(fan_in) so that every branch matters (the default init_std=0.02
    would make attention nearly uniform and the branches nearly invisible)."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in shapes(cfg).items():
        if name.endswith("_gain"):
            params[name] = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.startswith("b") or name.endswith("_bias"):
            params[name] = 0.2 * rng.standard_normal(shape)
        else:
            # (L, d, H, dk) for wq/wk/wv, (L, H, dk, d) for wo, (L, [E,] in, out) otherwise
            fan_in = {
                "wq": shape[1],
                "wk": shape[1],
                "wv": shape[1],
                "wo": shape[1] * shape[2],
            }.get(name, shape[-2])
            scale = 2.0 if name == "router" else 1.0  # spread the router logits
            params[name] = scale * rng.standard_normal(shape) / np.sqrt(fan_in)
    outer = {
        name: (1.0 if name.endswith("_gain") else 0.0) + 0.2 * rng.standard_normal(cfg.d_model)
        for name in outer_names(cfg)
    }
    return params, outer


def ref_norm(x, cfg, gain=None, bias=None):
    if cfg.norm == "rms":
        y = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + cfg.norm_eps)
    else:
        mu = np.mean(x, axis=-1, keepdims=True)
        y = (x - mu) / np.sqrt(np.var(x, axis=-1, keepdims=True) + cfg.norm_eps)
    if gain is not None:
        y = y * gain
    if bias is not None:
        y = y + bias
    return y


def ref_softmax_rows(s):
    e = np.exp(s - np.max(s, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def ref_inv_freq(cfg: TransformerConfig) -> np.ndarray:
    """theta^(-2i/dk), or Meta's Llama 3.1 ``apply_scaling`` written out frequency by frequency."""
    rope, dk = cfg.rope, cfg.d_head
    out = []
    for i in range(dk // 2):
        freq = rope.theta ** (-2 * i / dk)
        if rope.rope_type == "llama3":
            old = rope.original_max_position_embeddings
            lo, hi = rope.low_freq_factor, rope.high_freq_factor
            wavelen = 2 * np.pi / freq
            if wavelen < old / hi:
                pass
            elif wavelen > old / lo:
                freq = freq / rope.factor
            else:
                smooth = (old / wavelen - lo) / (hi - lo)
                freq = (1 - smooth) * freq / rope.factor + smooth * freq
        out.append(freq)
    return np.array(out)


def ref_rotate(x, positions, inv_freq):
    """Pair (i, i + dk/2) of each row rotated by the angle position * inv_freq[i]."""
    half = x.shape[-1] // 2
    out = np.array(x, dtype=float)
    for i in range(half):
        angle = positions * inv_freq[i]  # (..., n)
        c, s = np.cos(angle), np.sin(angle)
        out[..., i] = c * x[..., i] - s * x[..., i + half]
        out[..., i + half] = s * x[..., i] + c * x[..., i + half]
    return out


def ref_attention(x, p, cfg, mask=None, positions=None):
    """Head by head: sum_h softmax(q_h k_h^T / sqrt(dk) [causal] [padding]) v_h Wo_h, with
    q_h, k_h [biased] [RMS-normalised per head] [rotated]. Fully masked rows give 0."""
    H = cfg.n_heads
    G = cfg.n_kv_heads or H
    n = x.shape[-2]
    names = shapes(cfg)
    if positions is None:
        positions = np.arange(n)
    out = np.zeros(x.shape)
    for h in range(H):
        g = h // (H // G)  # the key/value head serving query head h
        q = x @ p["wq"][:, h, :]
        k = x @ p["wk"][:, g, :]
        v = x @ p["wv"][:, g, :]
        if "bq" in names:
            q, k, v = q + p["bq"][h], k + p["bk"][g], v + p["bv"][g]
        if cfg.qk_norm:
            q = q / np.sqrt(np.mean(q**2, -1, keepdims=True) + cfg.norm_eps) * p["q_norm_gain"]
            k = k / np.sqrt(np.mean(k**2, -1, keepdims=True) + cfg.norm_eps) * p["k_norm_gain"]
        if cfg.rope is not None:
            q = ref_rotate(q, positions, ref_inv_freq(cfg))
            k = ref_rotate(k, positions, ref_inv_freq(cfg))
        s = q @ np.swapaxes(k, -1, -2) / np.sqrt(cfg.d_head)
        allowed = np.ones(s.shape, dtype=bool)
        if cfg.causal:
            allowed = allowed & np.tril(np.ones((n, n), dtype=bool))
        if mask is not None:
            allowed = allowed & mask[..., None, :]
        top = np.max(np.where(allowed, s, -np.inf), -1, keepdims=True)
        e = np.where(allowed, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
        total = np.sum(e, -1, keepdims=True)
        w = e / np.where(total > 0, total, 1.0)
        out = out + (w @ v) @ p["wo"][h]
    return out + p["bo"] if "bo" in names else out


def gelu(z):
    return 0.5 * z * (1.0 + erf(z / np.sqrt(2.0)))


def silu(z):
    return z / (1.0 + np.exp(-z))


def ref_dense_ffn(x, p, kind, bias, e=None):
    """One FFN; ``e`` selects an expert (weights with an expert axis)."""

    def w(name):
        return p[name] if e is None else p[name][e]

    def b(name):
        return w(name) if bias else 0.0

    if kind == "gelu":
        return gelu(x @ w("w_in") + b("b_in")) @ w("w_out") + b("b_out")
    gate, up = x @ w("w_gate") + b("b_gate"), x @ w("w_up") + b("b_up")
    return (silu(gate) * up) @ w("w_down") + b("b_down")


def ref_moe(x, p, cfg):
    """Token by token: softmax over the top-k router logits, weighted sum of those experts."""
    flat = x.reshape(-1, x.shape[-1])
    out = np.zeros(flat.shape)
    for t, xt in enumerate(flat):
        logits = xt @ p["router"]
        top = np.argsort(-logits, kind="stable")[: cfg.top_k]
        w = sp_softmax(logits[top])
        for wi, e in zip(w, top, strict=True):
            out[t] += wi * ref_dense_ffn(xt, p, cfg.expert_ffn, bias_flags(cfg)["ffn"], e=e)
    return out.reshape(x.shape)


def ref_layer(x, p, cfg, mask=None, positions=None):
    """One layer, spelled out per variant. Returns the state after each residual sub-step."""
    h = cfg.residual_scale

    def P(z, u):
        if not cfg.project_branches:
            return u
        return u - (np.sum(z * u, -1, keepdims=True) / np.sum(z * z, -1, keepdims=True)) * z

    def A(z):
        return ref_attention(z, p, cfg, mask, positions)

    def F(z):
        if cfg.ffn == "moe":
            return ref_moe(z, p, cfg)
        return ref_dense_ffn(z, p, cfg.ffn, bias_flags(cfg)["ffn"])

    def N(role, y):
        return ref_norm(y, cfg, p.get(f"{role}_gain"), p.get(f"{role}_bias"))

    states = []
    if cfg.norm_position == "post":
        if cfg.block == "sequential":
            x = N("norm_attn", x + h * P(x, A(x)))
            states.append(x)
            x = N("norm_ffn", x + h * P(x, F(x)))
            states.append(x)
        elif cfg.block == "parallel":
            x = N("norm", x + h * (P(x, A(x)) + P(x, F(x))))
            states.append(x)
        else:  # macaron
            x = N("norm_ffn", x + (h / 2) * P(x, F(x)))
            states.append(x)
            x = N("norm_attn", x + h * P(x, A(x)))
            states.append(x)
            x = N("norm_ffn", x + (h / 2) * P(x, F(x)))
            states.append(x)
    else:
        if cfg.block == "sequential":
            z = N("norm_attn", x)
            x = x + h * P(z, A(z))
            states.append(x)
            z = N("norm_ffn", x)
            x = x + h * P(z, F(z))
            states.append(x)
        elif cfg.block == "parallel":
            z = N("norm", x)
            x = x + h * (P(z, A(z)) + P(z, F(z)))
            states.append(x)
        else:  # macaron
            z = N("norm_ffn", x)
            x = x + (h / 2) * P(z, F(z))
            states.append(x)
            z = N("norm_attn", x)
            x = x + h * P(z, A(z))
            states.append(x)
            z = N("norm_ffn", x)
            x = x + (h / 2) * P(z, F(z))
            states.append(x)
    return states


def ref_stack(x, params, outer, cfg, mask=None, positions=None):
    """All sub-step states (first entry: input of layer 1) and the output of the stack."""
    if cfg.norm_position == "post":
        x = ref_norm(x, cfg, outer.get("input_norm_gain"), outer.get("input_norm_bias"))
    states = [x]
    for layer in range(cfg.n_layers):
        p = {name: a[layer] for name, a in params.items()}
        states += ref_layer(states[-1], p, cfg, mask, positions)
    y = states[-1]
    if cfg.norm_position == "pre" and cfg.final_norm:
        y = ref_norm(y, cfg, outer.get("final_norm_gain"), outer.get("final_norm_bias"))
    return np.stack(states), y


# ============================================================================================
# The variants: every block x norm_position x ffn, other options varied across them
# ============================================================================================


def _cases() -> list[dict]:
    cases = []
    blocks = ("sequential", "parallel", "macaron")
    for i, (block, pos, ffn) in enumerate(
        itertools.product(blocks, ("post", "pre"), ("gelu", "swiglu", "moe"))
    ):
        # Index arithmetic with periods 2, 4, 5, ... (coprime-ish to the period 3 of ffn)
        # spreads every option over both values and over the product axes.
        case = dict(
            block=block,
            norm_position=pos,
            ffn=ffn,
            norm="layer" if (i // 2) % 2 else "rms",
            norm_gain=i % 2 == 0,
            norm_eps=0.0 if i % 4 in (0, 3) else 1e-6,
            use_bias=i % 5 in (1, 3),
            project_branches=i % 4 in (1, 2),
            causal=(i // 2) % 3 == 0,
            n_kv_heads=2 if i % 4 == 0 else (1 if i % 7 == 1 else None),
            residual_scale=(1.0, 0.6, 0.35)[(i // 4) % 3],
            final_norm=not (pos == "pre" and i % 4 == 0),
        )
        if ffn == "moe":
            case |= dict(
                n_experts=4,
                top_k=(1, 2, 4)[(i // 6) % 3],
                expert_ffn="swiglu" if (i // 3) % 2 else "gelu",
            )
        cases.append(case)
    return cases


CASES = _cases()


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{c['block']}-{c['norm_position']}-{c['ffn']}" for c in CASES]
)
def test_matches_numpy_reference(case):
    cfg = TransformerConfig(**BASE, **case)
    params, outer = random_params(cfg, seed=len(str(case)))
    model = Transformer.from_layer_params(
        cfg,
        {k: jnp.asarray(v) for k, v in params.items()},
        {k: jnp.asarray(v) for k, v in outer.items()},
    )
    lead = (2,) if case["causal"] else (3, 2)  # any leading batch axes
    x = np.random.default_rng(1).standard_normal((*lead, N_TOKENS, cfg.d_model))

    ref_states, ref_out = ref_stack(x, params, outer, cfg)
    states = np.asarray(model.hidden_states(jnp.asarray(x), substeps=True))
    out = np.asarray(model(jnp.asarray(x)))

    assert states.shape == (cfg.n_layers * cfg.n_substeps + 1, *lead, N_TOKENS, cfg.d_model)
    np.testing.assert_allclose(states, ref_states, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(out, ref_out, rtol=TOL, atol=TOL)
    # The layers really act (a test on near-identity layers would prove little).
    assert np.max(np.abs(states[-1] - states[0])) > 0.1


def test_abstract_model_is_a_fresh_copy_with_the_real_shapes():
    """``Transformer.abstract`` (built once per configuration, copied on every call) has the
    parameter shapes and dtypes of a real model, and filling one copy leaves the next abstract."""
    cfg = TransformerConfig(**BASE, block="sequential", norm_position="post", norm_gain=True)
    real = Transformer(cfg, rngs=nnx.Rngs(0))
    first = Transformer.abstract(cfg)
    want = {k: (v.shape, v.dtype) for k, v in layer_params(real).items()}
    assert {k: (v.shape, v.dtype) for k, v in layer_params(first).items()} == want
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in layer_params(first).values())
    set_layer_params(first, layer_params(real))
    second = Transformer.abstract(cfg)
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in layer_params(second).values())
    assert all(isinstance(v, jax.Array) for v in layer_params(first).values())


def test_hidden_states_per_layer():
    """Layer-level states are every S-th sub-step state; the output is their final Norm."""
    cfg = TransformerConfig(**BASE, block="macaron", norm_position="pre", causal=True)
    params, outer = random_params(cfg, seed=3)
    model = Transformer.from_layer_params(
        cfg, jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, outer)
    )
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, N_TOKENS, cfg.d_model)))
    per_layer = np.asarray(model.hidden_states(x))
    ref_states, ref_out = ref_stack(np.asarray(x), params, outer, cfg)
    assert per_layer.shape == (cfg.n_layers + 1, 2, N_TOKENS, cfg.d_model)
    np.testing.assert_allclose(per_layer, ref_states[:: cfg.n_substeps], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(model(x)), ref_out, rtol=TOL, atol=TOL)


# ============================================================================================
# Properties
# ============================================================================================


def _model(seed=0, **overrides) -> tuple[Transformer, TransformerConfig]:
    cfg = TransformerConfig(**(BASE | overrides))
    params, outer = random_params(cfg, seed)
    return Transformer.from_layer_params(
        cfg, jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, outer)
    ), cfg


def test_causal_mask_and_softmax_rows():
    model, cfg = _model(causal=True, norm_position="pre", block="parallel")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, N_TOKENS, cfg.d_model))
    i = 2
    x_perturbed = x.copy()
    x_perturbed[:, i + 1 :] += rng.standard_normal(x_perturbed[:, i + 1 :].shape)
    y, y_perturbed = np.asarray(model(jnp.asarray(x))), np.asarray(model(jnp.asarray(x_perturbed)))
    # Masked keys get an exact 0 weight, so the prefix is bit-identical, not merely close.
    np.testing.assert_array_equal(y[:, : i + 1], y_perturbed[:, : i + 1])
    assert np.max(np.abs(y[:, i + 1 :] - y_perturbed[:, i + 1 :])) > 1e-3  # it did perturb

    # Control: without the mask the prefix does see the future.
    unmasked, _ = _model(causal=False, norm_position="pre", block="parallel")
    a, b = np.asarray(unmasked(jnp.asarray(x))), np.asarray(unmasked(jnp.asarray(x_perturbed)))
    assert np.max(np.abs(a[:, : i + 1] - b[:, : i + 1])) > 1e-3

    weights = np.asarray(model.layer(1).attn.attention_weights(jnp.asarray(x)))
    assert weights.shape == (2, cfg.n_heads, N_TOKENS, N_TOKENS)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=0, atol=TOL)
    assert np.all(
        weights[..., np.triu_indices(N_TOKENS, k=1)[0], np.triu_indices(N_TOKENS, 1)[1]] == 0.0
    )
    assert np.all(weights[..., np.tril_indices(N_TOKENS)[0], np.tril_indices(N_TOKENS)[1]] > 0)


@pytest.mark.parametrize("ffn", ["swiglu", "moe"])
def test_projected_branches_are_tangent(ffn):
    moe = dict(n_experts=3, top_k=2) if ffn == "moe" else {}
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, N_TOKENS, BASE["d_model"])))
    for position in ("post", "pre"):
        proj, _ = _model(project_branches=True, norm_position=position, ffn=ffn, **moe)
        free, _ = _model(project_branches=False, norm_position=position, ffn=ffn, **moe)
        for name in ("attn", "ffn"):
            u = np.asarray(proj.layer(0).branch(name, x))
            cos = np.sum(u * x, -1) / (np.linalg.norm(u, axis=-1) * np.linalg.norm(x, axis=-1))
            assert np.max(np.abs(cos)) < TOL
            # Control: the raw branch is not tangent, so the projection did something.
            v = np.asarray(free.layer(0).branch(name, x))
            assert np.max(np.abs(np.sum(v * x, -1))) > 1e-2

    # End to end, pre-norm without gain (branch input z = x / rms(x) is parallel to x): every
    # residual increment is orthogonal to the state it starts from.
    model, cfg = _model(
        project_branches=True, norm_position="pre", norm_gain=False, ffn=ffn, block="macaron", **moe
    )
    s = np.asarray(model.hidden_states(x, substeps=True))
    dx = s[1:] - s[:-1]
    cos = np.sum(dx * s[:-1], -1) / (np.linalg.norm(dx, axis=-1) * np.linalg.norm(s[:-1], axis=-1))
    assert np.max(np.abs(cos)) < TOL


def test_moe_router_weights_top_k_and_dense_limit():
    x = jnp.asarray(np.random.default_rng(6).standard_normal((3, N_TOKENS, BASE["d_model"])))
    E = 5
    for k in (1, 2, 3, E):
        model, _ = _model(ffn="moe", n_experts=E, top_k=k, expert_ffn="swiglu")
        moe = model.layer(0).ffn
        w = np.asarray(moe.router_weights(x))
        logits = np.asarray(x) @ np.asarray(layer_params(model)["router"][0])
        top = np.argsort(-logits, axis=-1)[..., :k]
        in_top = np.zeros(w.shape, dtype=bool)
        np.put_along_axis(in_top, top, True, axis=-1)
        assert np.all(w[~in_top] == 0.0)  # exactly zero off the top-k
        assert np.all(w[in_top] > 0.0)
        np.testing.assert_allclose(w.sum(-1), 1.0, rtol=0, atol=TOL)
        # Renormalised softmax of all logits == softmax of the top-k logits.
        dense = sp_softmax(logits, axis=-1)
        renorm = np.where(in_top, dense, 0.0) / np.sum(
            np.where(in_top, dense, 0.0), -1, keepdims=True
        )
        np.testing.assert_allclose(w, renorm, rtol=TOL, atol=TOL)
        if k == E:  # k = E is plain dense softmax routing
            np.testing.assert_allclose(w, dense, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("block", ["sequential", "parallel", "macaron"])
def test_post_norm_rms_rows_on_sphere_of_radius_sqrt_d(block):
    model, cfg = _model(
        norm_position="post", norm="rms", norm_eps=0.0, norm_gain=False, block=block
    )
    x = jnp.asarray(10.0 * np.random.default_rng(7).standard_normal((2, N_TOKENS, cfg.d_model)))
    radii = np.linalg.norm(np.asarray(model.hidden_states(x, substeps=True)), axis=-1)
    np.testing.assert_allclose(radii, np.sqrt(cfg.d_model), rtol=TOL, atol=0)
    np.testing.assert_allclose(
        np.linalg.norm(np.asarray(model(x)), axis=-1), np.sqrt(cfg.d_model), rtol=TOL, atol=0
    )


# ============================================================================================
# Depth-independent tracing, parameter round trip
# ============================================================================================


def _count_eqns(jaxpr) -> int:
    """Equations of a jaxpr including every nested sub-jaxpr (scan bodies, pjit, ...)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    total += _count_eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    total += _count_eqns(sub)
    return total


@pytest.mark.parametrize(
    "variant",
    [
        dict(block="macaron", ffn="moe", n_experts=3, top_k=2),
        dict(
            norm_position="pre", ffn="swiglu", causal=True, rope=RoPE(theta=100.0),
            qk_norm=True, qkv_bias=True, n_kv_heads=2, d_head=4,
        ),
    ],
    ids=["macaron-moe", "llama-like-masked"],
)
def test_program_size_does_not_grow_with_depth(variant):
    """Deterministic stand-in for "compile time is flat in L": same jaxpr, same HLO for L=2 and
    L=64 (up to the digits of the layer count in the shapes)."""
    sizes = {}
    for L in (2, 64):
        cfg = TransformerConfig(**(BASE | dict(n_layers=L) | variant))
        abstract = nnx.eval_shape(lambda cfg=cfg: Transformer(cfg, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        x = jax.ShapeDtypeStruct((2, N_TOKENS, cfg.d_model), F64)
        masked = cfg.rope is not None

        def forward(state, x, graphdef=graphdef, masked=masked):
            mask = jnp.arange(N_TOKENS) < jnp.array([[N_TOKENS], [3]]) if masked else None
            return nnx.merge(graphdef, state).hidden_states(x, substeps=True, mask=mask)

        def init(cfg=cfg):
            return nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)))

        hlo = jax.jit(forward).lower(state, x).as_text()
        sizes[L] = (
            _count_eqns(jax.make_jaxpr(forward)(state, x).jaxpr),
            _count_eqns(jax.make_jaxpr(init)().jaxpr),
            len(re.sub(r"\d+", "0", hlo)),  # digits normalised: 2 vs 64 in shapes
        )
    assert sizes[2] == sizes[64], sizes


def test_layer_params_round_trip_is_bit_identical():
    cfg = TransformerConfig(
        **(BASE | dict(n_layers=2, norm="layer", use_bias=True, ffn="moe", n_experts=2, top_k=1))
    )
    a = Transformer(cfg, rngs=nnx.Rngs(0))
    b = Transformer(cfg, rngs=nnx.Rngs(1))
    pa, pb = layer_params(a), layer_params(b)
    assert set(pa) == set(shapes(cfg))  # the documented names...
    assert {k: v.shape for k, v in pa.items()} == shapes(cfg)  # ...and shapes
    assert all(v.dtype == F64 for v in pa.values())
    assert not np.array_equal(pa["wq"], pb["wq"])
    # Standard init: N(0, 0.02^2) weights (checked loosely on the largest array), zero biases.
    assert abs(float(np.std(np.asarray(pa["w_in"]))) - 0.02) < 0.004
    assert not np.any(np.asarray(pa["b_in"]))

    set_layer_params(b, pa)
    set_outer_norm_params(b, outer_norm_params(a))
    for name, value in layer_params(b).items():
        np.testing.assert_array_equal(value, pa[name])
        assert value.dtype == pa[name].dtype
    x = jnp.asarray(np.random.default_rng(8).standard_normal((N_TOKENS, cfg.d_model)))
    np.testing.assert_array_equal(a(x), b(x))

    c = Transformer.from_layer_params(cfg, pa, outer_norm_params(a))
    np.testing.assert_array_equal(c(x), a(x))

    with pytest.raises(KeyError, match="missing"):
        set_layer_params(b, {k: v for k, v in pa.items() if k != "wo"})
    with pytest.raises(KeyError, match="unexpected"):
        set_layer_params(b, pa | {"w_gate": pa["w_in"]})
    with pytest.raises(ValueError, match="wq"):
        set_layer_params(b, pa | {"wq": pa["wq"][:1]})
    with pytest.raises(ValueError, match="float32"):
        set_layer_params(b, pa | {"wq": pa["wq"].astype(jnp.float32)})


# ============================================================================================
# float32
# ============================================================================================


def test_float32_matches_float64():
    """Same weights rounded to float32. Tolerance 1e-5 relative to the largest entry: float32
    unit roundoff is 6e-8, rounding the weights alone perturbs the function by about that
    times the conditioning, and 3 layers of O(10)-term dot products, softmax and Norms
    accumulate at most O(100) roundoffs; 1e-5 ~ 170 u leaves a margin, and is still far below
    any modelling difference (those are O(1), see the reference test). Measured: ~3e-7."""
    for overrides in (
        dict(norm_position="post", ffn="moe", n_experts=3, top_k=2),
        dict(norm_position="pre", block="parallel", causal=True),
    ):
        cfg64 = TransformerConfig(**(BASE | overrides))
        params, outer = random_params(cfg64, seed=9)
        m64 = Transformer.from_layer_params(
            cfg64, jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, outer)
        )
        cfg32 = dataclasses.replace(cfg64, param_dtype=jnp.float32)
        m32 = Transformer.from_layer_params(
            cfg32,
            {k: jnp.asarray(v, jnp.float32) for k, v in params.items()},
            {k: jnp.asarray(v, jnp.float32) for k, v in outer.items()},
        )
        x = np.random.default_rng(10).standard_normal((2, N_TOKENS, cfg64.d_model))
        y64 = np.asarray(m64(jnp.asarray(x)))
        y32 = m32(jnp.asarray(x, jnp.float32))
        assert y32.dtype == jnp.float32
        err = np.max(np.abs(np.asarray(y32, np.float64) - y64)) / np.max(np.abs(y64))
        assert err < 1e-5, err


# ============================================================================================
# Config validation, LM wrapper
# ============================================================================================


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (dict(ffn="moe", n_experts=2, top_k=3), ValueError, "top_k=3 cannot exceed"),
        (dict(ffn="moe", n_experts=2), ValueError, "needs both"),
        (dict(n_experts=2, top_k=1), ValueError, "MoE settings"),
        (dict(n_kv_heads=3), ValueError, "must divide"),
        (dict(block="serial"), ValueError, "block must be one of"),
        (dict(norm_position="middle"), ValueError, "norm_position"),
        (dict(norm="batch"), ValueError, "norm must be one of"),
        (dict(ffn="relu"), ValueError, "ffn must be one of"),
        (dict(norm_eps=-1e-6), ValueError, "norm_eps"),
        (dict(residual_scale=float("nan")), ValueError, "residual_scale"),
        (dict(n_layers=0), ValueError, "n_layers"),
        (dict(d_head=True), ValueError, "d_head"),
        (dict(param_dtype=jnp.int32), ValueError, "floating"),
        (dict(rope="standard"), ValueError, "rope must be None or a RoPE"),
        (dict(rope=RoPE()), ValueError, "even d_head"),
        (dict(norm_bias=True), ValueError, "norm_bias=True needs norm='layer'"),
        (dict(qkv_bias=1), ValueError, "qkv_bias must be None or a bool"),
        (dict(n_positions=0), ValueError, "n_positions"),
        (dict(d_head=4, rope=RoPE(freq_factors=(1.0,))), ValueError, "freq_factors"),
    ],
)
def test_config_validation(overrides, error, match):
    with pytest.raises(error, match=match):
        TransformerConfig(**(BASE | overrides))


def test_config_allows_d_model_other_than_heads_times_d_head():
    cfg = TransformerConfig(**BASE)
    assert cfg.d_model != cfg.n_heads * cfg.d_head
    assert cfg.kv_heads == cfg.n_heads and cfg.n_substeps == 2


def test_lm_is_embed_stack_unembed():
    cfg = TransformerConfig(
        **(BASE | dict(n_layers=1, vocab_size=7, causal=True, norm_position="pre"))
    )
    lm = TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.array([[0, 3, 6, 2], [1, 1, 5, 0]])
    logits = np.asarray(lm(tokens))
    assert logits.shape == (2, 4, 7)
    hidden = np.asarray(lm.transformer(jnp.asarray(np.asarray(lm.embed[...])[tokens])))
    np.testing.assert_allclose(logits, hidden @ np.asarray(lm.unembed[...]), rtol=TOL, atol=TOL)
    with pytest.raises(ValueError, match="vocab_size"):
        TransformerLM(TransformerConfig(**BASE), rngs=nnx.Rngs(0))


def test_no_flow_side_imports():
    """The deep-learning side stands alone: no import of the flow side anywhere in the package."""
    import ast
    from pathlib import Path

    import svflow_jax.transformer as package

    forbidden = (
        "svflow_jax.flow", "svflow_jax.sphere", "svflow_jax.vmf", "svflow_jax.solvers",
        "svflow_jax.bridge.correspondence", "svflow_jax.checkpoints",
    )
    seen = 0
    for path in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import, resolved from svflow_jax.transformer
                    parts = ["svflow_jax", "transformer"][: 3 - node.level]
                    base = ".".join([*parts, *([base] if base else [])])
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            seen += 1
            bad = [n for n in names for f in forbidden if n == f or n.startswith(f + ".")]
            assert not bad, f"{path.name} imports {bad}"
    assert seen > 10  # the walk did find the package's imports


# ============================================================================================
# Real-model layers: RoPE, Q/K/V/O biases, q/k norm, padding masks, embeddings and LM head
# ============================================================================================

LLAMA3 = RoPE(
    theta=500.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
REAL_CASES = {
    # Llama: pre-norm RMSNorm, SwiGLU, causal, GQA, RoPE.
    "llama": dict(
        norm_position="pre", ffn="swiglu", causal=True, n_kv_heads=2, d_head=4,
        rope=RoPE(theta=100.0), norm_eps=1e-5,
    ),
    "llama3": dict(
        norm_position="pre", ffn="swiglu", causal=True, n_kv_heads=1, d_head=8, rope=LLAMA3,
    ),
    # Qwen2: Q/K/V biases only.
    "qwen2": dict(
        norm_position="pre", ffn="swiglu", causal=True, n_kv_heads=2, d_head=4,
        rope=RoPE(theta=1e4), qkv_bias=True,
    ),
    # Qwen3: per-head q/k RMSNorm, d_head unrelated to d_model / n_heads.
    "qwen3": dict(
        norm_position="pre", ffn="swiglu", causal=True, n_kv_heads=2, d_head=6,
        rope=RoPE(theta=1e4), qk_norm=True,
    ),
    # BERT: post-norm LayerNorm with biases everywhere, exact GELU, bidirectional.
    "bert": dict(norm_position="post", norm="layer", ffn="gelu", use_bias=True, norm_eps=1e-12),
    # Switches mixed: O and FFN biases without Q/K/V biases, LayerNorm without bias.
    "mixed": dict(
        norm_position="pre", norm="layer", use_bias=True, qkv_bias=False, norm_bias=False,
        rope=RoPE(theta=30.0), d_head=4, causal=True,
    ),
}


@pytest.mark.parametrize("name", list(REAL_CASES))
def test_real_model_layers_match_numpy_reference(name):
    """Each real-model layer kind against the loop-by-loop NumPy reference (RoPE by explicit
    pair rotations), on a padded batch with explicit positions, float64, 1e-12 on the valid
    positions."""
    cfg = TransformerConfig(**(BASE | REAL_CASES[name]))
    params, outer = random_params(cfg, seed=11)
    model = Transformer.from_layer_params(
        cfg, jax.tree.map(jnp.asarray, params), jax.tree.map(jnp.asarray, outer)
    )
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, N_TOKENS, cfg.d_model))
    lengths = np.array([N_TOKENS, 3, 1])
    cols = np.arange(N_TOKENS)
    if cfg.causal:  # decoders: left padding, positions counted from the first valid token
        mask = cols >= (N_TOKENS - lengths)[:, None]
        positions = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    else:  # BERT: right padding
        mask = cols < lengths[:, None]
        positions = np.broadcast_to(cols, mask.shape)
    ref_states, ref_out = ref_stack(x, params, outer, cfg, mask, positions)
    m, pos = jnp.asarray(mask), jnp.asarray(positions)
    states = np.asarray(model.hidden_states(jnp.asarray(x), substeps=True, mask=m, positions=pos))
    out = np.asarray(model(jnp.asarray(x), m, pos))
    np.testing.assert_allclose(states[:, mask], ref_states[:, mask], rtol=TOL, atol=TOL)
    np.testing.assert_allclose(out[mask], ref_out[mask], rtol=TOL, atol=TOL)
    assert np.all(np.isfinite(states))  # padded rows too (a fully masked row is uniform)
    assert np.max(np.abs(states[-1][mask] - states[0][mask])) > 0.1


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_padding_mask(name):
    """Padded keys get exactly zero attention; valid outputs equal the unpadded run and do not
    depend on what the padded tokens hold."""
    model, cfg = _model(**REAL_CASES[name])
    rng = np.random.default_rng(13)
    x = rng.standard_normal((2, N_TOKENS, cfg.d_model))
    mask = np.arange(N_TOKENS) < np.array([[N_TOKENS], [3]])  # right padding
    attn = model.layer(0).attn
    w = np.asarray(attn.attention_weights(jnp.asarray(x), jnp.asarray(mask)))
    assert np.all(w[1][:, :, 3:] == 0.0)  # no query reads a padded key
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=0, atol=TOL)

    y = np.asarray(model(jnp.asarray(x), jnp.asarray(mask)))
    x2 = x.copy()
    x2[1, 3:] = 100.0 * rng.standard_normal(x2[1, 3:].shape)
    y2 = np.asarray(model(jnp.asarray(x2), jnp.asarray(mask)))
    np.testing.assert_array_equal(y[1, :3], y2[1, :3])
    alone = np.asarray(model(jnp.asarray(x[1:, :3])))
    np.testing.assert_allclose(y[1, :3], alone[0], rtol=TOL, atol=TOL)
    if not cfg.causal:  # control: without the mask BERT's valid tokens do see the padding
        y3 = np.asarray(model(jnp.asarray(x2)))
        assert np.max(np.abs(y3[1, :3] - y[1, :3])) > 1e-3


def test_rope_closed_form():
    """Each pair (i, i + dk/2) is rotated by the angle position * theta^(-2i/dk)."""
    dk, theta = 8, 50.0
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 5, 3, dk))  # (batch, n, heads, dk)
    positions = np.array([[0, 1, 2, 3, 4], [7, 3, 0, 11, 2]])
    y = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), RoPE(theta).inv_freq(dk)))
    for b, t, h, i in itertools.product(range(2), range(5), range(3), range(dk // 2)):
        angle = positions[b, t] * theta ** (-2 * i / dk)
        rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        pair = rot @ np.array([x[b, t, h, i], x[b, t, h, i + dk // 2]])
        np.testing.assert_allclose([y[b, t, h, i], y[b, t, h, i + dk // 2]], pair, atol=TOL)
    # Rotations: norms kept; position 0 is the identity.
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=TOL)
    np.testing.assert_array_equal(y[0, 0], x[0, 0])


@pytest.mark.parametrize("rope", [RoPE(theta=1e4), LLAMA3], ids=["default", "llama3"])
def test_rope_scores_depend_only_on_relative_position(rope):
    dk = 8
    rng = np.random.default_rng(15)
    q, k = rng.standard_normal(dk), rng.standard_normal(dk)
    inv = rope.inv_freq(dk)

    def score(m, n):
        rq = apply_rope(jnp.asarray(q)[None, None], jnp.array([m]), inv)
        rk = apply_rope(jnp.asarray(k)[None, None], jnp.array([n]), inv)
        return float(jnp.sum(rq * rk))

    for m, n in [(0, 0), (3, 1), (1, 3), (5, 9)]:
        for shift in (1, 17, 250):
            assert abs(score(m + shift, n + shift) - score(m, n)) < 1e-10
    assert abs(score(3, 1) - score(1, 3)) > 1e-3  # but it does depend on m - n


def test_llama3_frequency_scaling():
    """RoPE.inv_freq against a direct NumPy transcription of Llama 3.1's formula, with all three
    regimes (kept, smoothed, divided by the factor) present."""
    for dk, theta, original in [(8, 500.0, 64), (16, 5e5, 256), (128, 5e5, 8192)]:
        rope = RoPE(
            theta=theta, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=original,
        )
        cfg = TransformerConfig(**(BASE | dict(d_head=dk, rope=rope)))
        got, want = rope.inv_freq(dk), ref_inv_freq(cfg)
        np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
        base = theta ** (-np.arange(0, dk, 2) / dk)
        ratio = got / base
        assert np.any(ratio == 1.0) and np.any(np.isclose(ratio, 1 / 8, rtol=1e-14))
        assert np.any((ratio < 1.0) & (ratio > 1 / 8)), ratio  # the smoothed band
    with pytest.raises(ValueError, match="needs factor"):
        RoPE(rope_type="llama3")
    with pytest.raises(ValueError, match="rope_type must be one of"):
        RoPE(rope_type="yarn")


def test_lm_embeddings_and_heads():
    """BERT-style embeddings (word + position + token type), a tied head, no head."""
    base = BASE | dict(n_layers=1, vocab_size=9)
    tokens = jnp.array([[0, 3, 8, 2], [1, 1, 5, 0]])
    types = jnp.array([[0, 0, 1, 1], [0, 1, 1, 1]])

    bert = TransformerLM(
        TransformerConfig(**(base | dict(n_positions=6, type_vocab_size=2, lm_head=False))),
        rngs=nnx.Rngs(0),
    )
    e = {k: np.asarray(v) for k, v in embedding_params(bert).items()}
    assert set(e) == {"embed", "pos_embed", "type_embed"}
    expect = e["embed"][tokens] + e["pos_embed"][np.arange(4)] + e["type_embed"][types]
    np.testing.assert_allclose(bert.embeddings(tokens, types), expect, rtol=TOL, atol=TOL)
    out = np.asarray(bert(tokens, token_types=types))
    np.testing.assert_allclose(out, bert.transformer(jnp.asarray(expect)), rtol=TOL, atol=TOL)
    no_types = e["embed"][tokens] + e["pos_embed"][np.arange(4)] + e["type_embed"][0]
    np.testing.assert_allclose(bert.embeddings(tokens), no_types, rtol=TOL, atol=TOL)

    tied = TransformerLM(
        TransformerConfig(**(base | dict(tie_embeddings=True, norm_position="pre"))),
        rngs=nnx.Rngs(1),
    )
    assert set(embedding_params(tied)) == {"embed"}
    hidden = np.asarray(tied.transformer(tied.embeddings(tokens)))
    np.testing.assert_allclose(
        tied(tokens), hidden @ np.asarray(tied.embed[...]).T, rtol=TOL, atol=TOL
    )
    with pytest.raises(KeyError, match="unexpected"):
        set_embedding_params(tied, {"embed": tied.embed[...], "unembed": tied.embed[...].T})


# ============================================================================================
# Activations and embedding scale (GPT-2's tanh GELU, Gemma's GeGLU and sqrt(d) embeddings)
# ============================================================================================


def _tanh_gelu(z: np.ndarray) -> np.ndarray:
    """GPT-2's ``gelu_new``, transcribed from its definition."""
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))


@pytest.mark.parametrize(
    ("ffn", "activation"), [("gelu", "gelu_tanh"), ("swiglu", "gelu_tanh"), ("gelu", "silu")]
)
def test_ffn_activation_by_direct_computation(ffn, activation):
    from svflow_jax.transformer.model import FFN

    cfg = TransformerConfig(**BASE, ffn=ffn, activation=activation, use_bias=True)
    ffn_module = FFN(cfg, rngs=nnx.Rngs(3))
    x = np.random.default_rng(0).normal(size=(N_TOKENS, cfg.d_model))
    phi = _tanh_gelu if activation == "gelu_tanh" else (lambda z: z / (1.0 + np.exp(-z)))
    w = {k: np.asarray(v[...]) for k, v in vars(ffn_module).items() if isinstance(v, nnx.Param)}
    if ffn == "gelu":
        expect = phi(x @ w["w_in"] + w["b_in"]) @ w["w_out"] + w["b_out"]
    else:
        gate, up = x @ w["w_gate"] + w["b_gate"], x @ w["w_up"] + w["b_up"]
        expect = (phi(gate) * up) @ w["w_down"] + w["b_down"]
    np.testing.assert_allclose(np.asarray(ffn_module(jnp.asarray(x))), expect, rtol=0, atol=TOL)
    assert cfg.ffn_activation == activation
    assert TransformerConfig(**BASE, ffn=ffn).ffn_activation == (
        "gelu" if ffn == "gelu" else "silu")


def test_embed_scale_scales_the_input_not_the_tied_head():
    cfg = TransformerConfig(**BASE, vocab_size=7, tie_embeddings=True, embed_scale=2.5)
    lm = TransformerLM(cfg, rngs=nnx.Rngs(0))
    plain = TransformerLM(dataclasses.replace(cfg, embed_scale=1.0), rngs=nnx.Rngs(0))
    tokens = jnp.asarray([1, 4, 6])
    embed = np.asarray(embedding_params(lm)["embed"])
    np.testing.assert_array_equal(np.asarray(lm.embeddings(tokens)), 2.5 * embed[[1, 4, 6]])
    x = jnp.ones((3, cfg.d_model), F64)
    np.testing.assert_array_equal(np.asarray(lm.logits(x)), np.asarray(plain.logits(x)))
    with pytest.raises(ValueError, match="embed_scale must be a finite float > 0"):
        TransformerConfig(**BASE, embed_scale=0.0)
    with pytest.raises(ValueError, match="activation must be one of"):
        TransformerConfig(**BASE, activation="relu")


def test_params_module_does_not_import_the_model_at_run_time():
    """No import circle: ``params.py`` imports ``model.py`` only for annotations."""
    import ast
    import inspect as pyinspect

    from svflow_jax.transformer import params

    tree = ast.parse(pyinspect.getsource(params))
    runtime = [
        node.module for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
    ]
    assert "svflow_jax.transformer.model" not in runtime


def test_partial_rotary_embedding_by_direct_computation():
    """``RoPE(rotary_dim=r)`` (GPT-NeoX) rotates the pairs ``(i, i + r/2)``, ``i < r/2``, by
    ``p theta^(-2i/r)`` and leaves coordinates ``r..k-1`` as they are."""
    k, r, theta = 8, 4, 100.0
    rope = RoPE(theta=theta, rotary_dim=r)
    x = np.random.default_rng(1).normal(size=(3, 2, k))  # (n, heads, k)
    pos = np.array([0, 1, 5])
    out = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), rope.inv_freq(k)))
    expect = x.copy()
    for i in range(r // 2):
        angle = pos[:, None] * theta ** (-2 * i / r)
        a, b = x[..., i], x[..., i + r // 2]
        expect[..., i] = a * np.cos(angle) - b * np.sin(angle)
        expect[..., i + r // 2] = b * np.cos(angle) + a * np.sin(angle)
    np.testing.assert_allclose(out, expect, rtol=0, atol=TOL)
    np.testing.assert_array_equal(out[..., r:], x[..., r:])
    with pytest.raises(ValueError, match="rotary_dim=10 exceeds d_head=8"):
        TransformerConfig(**(BASE | {"d_head": 8}), rope=RoPE(rotary_dim=10))
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        RoPE(rotary_dim=3)


@pytest.mark.parametrize("top_k", [1, 2])
def test_switch_gate_weights_and_the_router_gradient(top_k):
    """``router_gate="switch"``: the selected experts' weights are the full softmax's
    probabilities (NumPy), summing to less than 1; with top-1 the renormalised router gets an
    exactly zero task gradient and the Switch-gated one a non-zero one (autodiff)."""
    from svflow_jax.bridge.correspondence import check_supported
    from svflow_jax.transformer.model import MoE

    rng = np.random.default_rng(top_k)
    x = jnp.asarray(rng.standard_normal((5, 8)))
    c = jnp.asarray(rng.standard_normal((5, 8)))
    grads = {}
    for gate in ("renormalised", "switch"):
        config = TransformerConfig(d_model=8, n_layers=1, n_heads=2, d_head=4, d_ff=16,
                                   ffn="moe", n_experts=4, top_k=top_k, router_gate=gate,
                                   norm_position="pre", param_dtype=jnp.float64)
        moe = MoE(config, rngs=nnx.Rngs(0))
        logits = np.asarray(x) @ np.asarray(moe.router[...])
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-logits, axis=-1)[:, :top_k]
        mask = np.zeros_like(p, bool)
        np.put_along_axis(mask, top, True, axis=-1)
        want = np.where(mask, p, 0.0) if gate == "switch" else np.where(
            mask, p, 0.0) / np.where(mask, p, 0.0).sum(-1, keepdims=True)
        np.testing.assert_allclose(moe.router_weights(x), want, rtol=1e-12, atol=1e-15)
        graphdef, state = nnx.split(moe)
        grads[gate] = jax.grad(lambda s, g=graphdef: jnp.sum(nnx.merge(g, s)(x) * c))(state)
        if gate == "switch":
            assert np.all(want.sum(-1) < 1)
            with pytest.raises(ValueError, match="router_gate='switch'"):
                check_supported(config)
    renorm = float(jnp.max(jnp.abs(grads["renormalised"]["router"][...])))
    switch = float(jnp.max(jnp.abs(grads["switch"]["router"][...])))
    assert switch > 1e-3
    assert renorm == 0.0 if top_k == 1 else renorm > 1e-3


def test_qk_stop_gradient_cuts_only_the_posterior_path_to_the_tokens():
    """``qk_stop_gradient``: the same outputs; the same parameter gradients (``W_Q``, ``W_K``
    still train); the input gradient is that of the value path alone, recomputed by hand with
    the attention posterior held constant, and the posterior itself sends the input no
    gradient (the plain attention's does)."""
    from svflow_jax.transformer.model import Attention

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, 5, 8)))
    c = jnp.asarray(rng.standard_normal((2, 5, 8)))
    base = dict(d_model=8, n_layers=1, n_heads=2, d_head=4, d_ff=16, causal=True,
                param_dtype=jnp.float64, init_std=0.5)
    plain = Attention(TransformerConfig(**base), rngs=nnx.Rngs(0))
    cut = Attention(TransformerConfig(**base, qk_stop_gradient=True), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(cut(x), plain(x))

    def loss(module, s, y):
        return jnp.sum(nnx.merge(nnx.graphdef(module), s)(y) * c)

    g_plain = jax.grad(loss, argnums=(1, 2))(plain, nnx.state(plain), x)
    g_cut = jax.grad(loss, argnums=(1, 2))(cut, nnx.state(cut), x)
    for name in ("wq", "wk", "wv", "wo"):
        np.testing.assert_allclose(g_cut[0][name][...], g_plain[0][name][...], rtol=1e-12,
                                   atol=1e-15)
    assert float(jnp.max(jnp.abs(g_cut[0]["wk"][...]))) > 1e-3
    assert float(jnp.max(jnp.abs(g_cut[0]["wq"][...]))) > 1e-3
    # by hand: out = sum_h P_h (x W_V^h) W_O^h with P held constant
    probs = np.asarray(plain.attention_weights(x))  # (B, H, n, n)
    wv, wo = np.asarray(plain.wv[...]), np.asarray(plain.wo[...])
    dout = np.asarray(c)  # dL/d out
    dv = np.einsum("bhij,bid,hkd->bjhk", probs, dout, wo)  # dL/dv_{j,h}
    np.testing.assert_allclose(g_cut[1], np.einsum("bjhk,dhk->bjd", dv, wv), rtol=1e-10,
                               atol=1e-12)
    assert float(jnp.max(jnp.abs(g_plain[1] - g_cut[1]))) > 1e-3  # the key/query path

    def through_posterior(module, y):
        return jnp.sum(module.attention_weights(y) * jnp.asarray(probs[::-1]))

    assert float(jnp.max(jnp.abs(jax.grad(lambda y: through_posterior(cut, y))(x)))) == 0.0
    assert float(jnp.max(jnp.abs(jax.grad(lambda y: through_posterior(plain, y))(x)))) > 1e-3
    with pytest.raises(ValueError, match="qk_stop_gradient must be a bool"):
        TransformerConfig(**base, qk_stop_gradient=1)
