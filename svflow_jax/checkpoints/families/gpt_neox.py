"""GPT-NeoX (Pythia): a pre-LayerNorm decoder whose layers add attention and MLP in parallel,
each behind its own LayerNorm, with partial rotary embeddings and a fused per-head QKV.

``attention.query_key_value ((H 3 dk), d)`` holds, per head, the rows of Q, K and V one after
the other (``view(H, 3, dk, d)``) -> ``wq``, ``wk``, ``wv`` (its bias likewise);
``attention.dense`` -> ``wo``, ``bo``; ``mlp.dense_h_to_4h``/``dense_4h_to_h`` -> ``w_in``/
``w_out`` (with biases, exact GELU); ``final_layer_norm`` -> the final Norm; ``embed_in`` ->
``embed``; ``embed_out`` -> ``unembed``. RoPE acts on the first ``rotary_pct`` (or
``partial_rotary_factor``) of each head's coordinates (``RoPE.rotary_dim``).

With ``use_parallel_residual`` (Pythia), a layer is ``x + Attn(LN_1(x)) + MLP(LN_2(x))``. Both
LayerNorms share the centring and scaling ``n(x)`` and differ only in gain and bias:
``LN_j(x) = g_j * n(x) + b_j``. The gain and bias of ``LN_1`` fold into the first linear maps
of the attention (``W' = diag(g_1) W``, ``b' = b + b_1 W`` for Q, K, V) and those of ``LN_2``
into the MLP's ``W_in``, ``b_in`` (computed in float64): one spec takes the fused QKV matrix and
the LayerNorm gain (two sources) to three targets. The Transformer's ``parallel`` block then
has one parameter-free Norm per layer (gain 1, bias 0). Without ``use_parallel_residual`` the
layer is sequential, ``input_layernorm``/``post_attention_layernorm`` -> ``norm_attn``/
``norm_ffn``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from svflow_jax.checkpoints.base import ConfigReader, Spec, hf_sizes, make_config
from svflow_jax.checkpoints.families import Family
from svflow_jax.checkpoints.specs import transpose
from svflow_jax.transformer import RoPE, TransformerConfig


def config(hf: ConfigReader, dtype: Any) -> TransformerConfig:
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise hf.error(f"hidden_act={act!r} is not supported for gpt_neox (only exact 'gelu')")
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(hf.get(key), Mapping):
            params |= dict(hf.get(key))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise hf.error(f"unsupported rope_type {rope_type!r} for gpt_neox; supported: 'default'")
    rope = ConfigReader(params, hf.where)
    partial = rope.float("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    theta = rope.float("rope_theta", hf.get("rotary_emb_base", 10000.0))
    sizes = hf_sizes(hf)
    d, H = sizes["d_model"], sizes["n_heads"]
    if d % H:
        raise hf.error(f"hidden_size={d} is not a multiple of num_attention_heads={H}")
    dk = d // H
    rotary = int(dk * partial)
    if not 0 < rotary <= dk or rotary % 2:
        raise hf.error(f"partial_rotary_factor={partial} gives {rotary} rotary coordinates of "
                       f"{dk}: need an even number in [2, {dk}]")
    parallel = bool(hf.get("use_parallel_residual", True))
    attention_bias = bool(hf.get("attention_bias", True))
    return make_config(
        hf.where,
        **sizes,
        d_head=dk,
        residual_scale=1.0,
        block="parallel" if parallel else "sequential",
        norm_position="pre",
        norm="layer",
        norm_gain=True,
        norm_bias=True,
        norm_eps=hf.float("layer_norm_eps", 1e-5),
        final_norm=True,
        causal=True,
        ffn="gelu",
        qkv_bias=attention_bias or parallel,  # parallel: LN_1's bias folds into Q, K, V
        out_bias=attention_bias,
        ffn_bias=True,
        rope=RoPE(theta=theta, rotary_dim=None if rotary == dk else rotary),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        lm_head=True,
        param_dtype=dtype,
    )


def specs(cfg: TransformerConfig, model_type: str) -> list[Spec]:
    d, H, dk, f, V = cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_ff, cfg.vocab_size
    parallel = cfg.block == "parallel"
    file_bias = cfg.has_out_bias  # the file has Q/K/V and O biases iff attention_bias

    def split(w: np.ndarray) -> tuple[np.ndarray, ...]:  # (H 3 dk, d) -> three (d, H, dk)
        per_head = w.reshape(H, 3, dk, d)
        return tuple(per_head[:, j].transpose(2, 0, 1) for j in range(3))

    def split_bias(b: np.ndarray) -> tuple[np.ndarray, ...]:  # (H 3 dk,) -> three (H, dk)
        return tuple(b.reshape(H, 3, dk)[:, j] for j in range(3))

    def folded_qkv(w: np.ndarray, gain: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(gain.astype(np.float64)[:, None, None] * m for m in split(w))

    def folded_qkv_bias(w: np.ndarray, ln_bias: np.ndarray, *b: np.ndarray):
        own = split_bias(b[0]) if b else (0.0, 0.0, 0.0)
        return tuple(o + np.einsum("d,dhk->hk", ln_bias.astype(np.float64), m)
                     for o, m in zip(own, split(w), strict=True))

    out = [
        Spec("gpt_neox.embed_in.weight", (V, d), "embed"),
        Spec("gpt_neox.final_layer_norm.weight", (d,), "final_norm_gain"),
        Spec("gpt_neox.final_layer_norm.bias", (d,), "final_norm_bias"),
    ]
    if not cfg.tie_embeddings:
        out.append(Spec("embed_out.weight", (V, d), "unembed", None, transpose))
    for i in range(cfg.n_layers):
        p = f"gpt_neox.layers.{i}."
        qkv, qkv_b = p + "attention.query_key_value.weight", p + "attention.query_key_value.bias"
        ln1, ln2 = p + "input_layernorm.", p + "post_attention_layernorm."
        w_in, b_in = p + "mlp.dense_h_to_4h.weight", p + "mlp.dense_h_to_4h.bias"
        out += [
            Spec(p + "attention.dense.weight", (d, d), "wo", i,
                 lambda w: w.T.reshape(H, dk, d)),
            Spec(p + "mlp.dense_4h_to_h.weight", (d, f), "w_out", i, transpose),
            Spec(p + "mlp.dense_4h_to_h.bias", (d,), "b_out", i),
        ]
        if file_bias:
            out.append(Spec(p + "attention.dense.bias", (d,), "bo", i))
        if not parallel:
            out += [
                Spec(qkv, (3 * d, d), ("wq", "wk", "wv"), i, split),
                Spec(w_in, (f, d), "w_in", i, transpose),
                Spec(b_in, (f,), "b_in", i),
            ]
            if file_bias:
                out.append(Spec(qkv_b, (3 * d,), ("bq", "bk", "bv"), i, split_bias))
            for ours, theirs in (("norm_attn", ln1), ("norm_ffn", ln2)):
                out += [Spec(theirs + "weight", (d,), f"{ours}_gain", i),
                        Spec(theirs + "bias", (d,), f"{ours}_bias", i)]
            continue
        bias_sources = (qkv, ln1 + "bias") + ((qkv_b,) if file_bias else ())
        bias_shapes = ((3 * d, d), (d,)) + (((3 * d,),) if file_bias else ())
        out += [
            Spec((qkv, ln1 + "weight"), ((3 * d, d), (d,)), ("wq", "wk", "wv"), i, folded_qkv),
            Spec(bias_sources, bias_shapes, ("bq", "bk", "bv"), i, folded_qkv_bias),
            Spec((w_in, ln2 + "weight"), ((f, d), (d,)), "w_in", i,
                 lambda w, g: g.astype(np.float64)[:, None] * w.T),
            Spec((w_in, b_in, ln2 + "bias"), ((f, d), (f,), (d,)), "b_in", i,
                 lambda w, b, c: b + c.astype(np.float64) @ w.T),
            Spec((), (), ("norm_gain", "norm_bias"), i,
                 lambda: (np.ones(d), np.zeros(d))),  # the shared, parameter-free n(x)
        ]
    return out


FAMILY = Family(
    model_types=("gpt_neox",),
    config=config,
    specs=specs,
    ignore=lambda name: name.endswith(
        (".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")),
    tied_head=("embed_out.weight", "gpt_neox.embed_in.weight"),
)
