"""Llama, Qwen2 and Qwen3: pre-RMSNorm decoders with RoPE, SwiGLU and grouped-query attention.

``q_proj (H dk, d)`` -> ``wq (d, H, dk)`` (transposed, split into heads), likewise
``k_proj``/``v_proj``; ``o_proj (d, H dk)`` -> ``wo (H, dk, d)``; ``gate/up/down_proj`` ->
``w_gate/w_up/w_down`` (transposed); ``input_layernorm``/``post_attention_layernorm`` ->
``norm_attn_gain``/``norm_ffn_gain``; ``model.norm`` -> the final Norm; ``q_norm``/``k_norm``
(Qwen3) -> ``q_norm_gain``/``k_norm_gain``; Q/K/V biases (Qwen2, Llama ``attention_bias``). A
tied LM head (``tie_word_embeddings``) is absent from the file: the logits use ``embed``.

GGUF (llama.cpp, architecture ``llama``): ``token_embd``, ``blk.{i}.attn_{q,k,v,output}``,
``blk.{i}.ffn_{gate,up,down}``, ``blk.{i}.{attn,ffn}_norm``, ``output_norm``, ``output``
(absent: tied); Q/K rows are stored permuted for llama.cpp's RoPE layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from svflow_jax.checkpoints.base import ConfigReader, Spec, hf_sizes, make_config
from svflow_jax.checkpoints.families import Family, GGUFLayout
from svflow_jax.checkpoints.specs import embedding_specs, layer_specs, norm_specs
from svflow_jax.transformer import RoPE, TransformerConfig

# transformers' defaults for fields a config.json may omit (the same for the three)
_ROPE_THETA, _TIE, _RMS_EPS = 10000.0, False, 1e-6


def rope_from_hf(hf: ConfigReader, default_theta: float) -> RoPE:
    """RoPE settings, wherever this transformers version put them: ``rope_parameters`` (recent),
    ``rope_scaling`` (older: scaling only, ``rope_theta`` at the top level) or neither."""
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):  # the newer one wins
        if isinstance(hf.get(key), Mapping):
            params |= dict(hf.get(key))
    rope = ConfigReader(params, hf.where)
    theta = rope.float("rope_theta", hf.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise hf.error(f"partial_rotary_factor={partial} (partial RoPE) is not supported")
    if rope_type == "default":
        return RoPE(theta=theta)
    if rope_type == "llama3":
        return RoPE(
            theta=theta,
            rope_type="llama3",
            factor=rope.float("factor"),
            low_freq_factor=rope.float("low_freq_factor"),
            high_freq_factor=rope.float("high_freq_factor"),
            original_max_position_embeddings=rope.int(
                "original_max_position_embeddings", kind="positions"),
        )
    raise hf.error(f"unsupported rope_type {rope_type!r}; supported: 'default', 'llama3'")


def config(hf: ConfigReader, dtype: Any) -> TransformerConfig:
    model_type = hf.get("model_type")
    act = hf.get("hidden_act", hf.get("hidden_activation"))
    if act != "silu":
        raise hf.error(f"hidden_act={act!r} is not supported for {model_type} (only silu)")
    if hf.get("use_sliding_window") or (
        model_type == "llama" and hf.get("sliding_window") is not None
    ):
        raise hf.error(
            f"sliding-window attention (sliding_window={hf.get('sliding_window')}) is not "
            "supported"
        )
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise hf.error(
            f"layer_types {sorted(set(map(str, layer_types)))}: only 'full_attention' is "
            "supported (no sliding window)"
        )
    attention_bias = bool(hf.get("attention_bias", False))
    return decoder(
        hf, dtype,
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        out_bias=False if model_type == "qwen2" else attention_bias,
        ffn_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_embeddings=bool(hf.get("tie_word_embeddings", _TIE)),
    )


def decoder(hf: ConfigReader, dtype: Any, **fields: Any) -> TransformerConfig:
    """A pre-RMSNorm, gated-FFN (SwiGLU unless ``fields`` say otherwise), RoPE decoder of the
    usual sizes; ``fields`` set or override the rest (biases, ``qk_norm``, tying, ...)."""
    sizes = hf_sizes(hf)
    d, H = sizes["d_model"], sizes["n_heads"]
    return make_config(
        hf.where,
        **sizes,
        d_head=hf.int("head_dim", d // H, kind="width"),
        n_kv_heads=hf.int("num_key_value_heads", H, kind="heads"),
        residual_scale=1.0,
        norm_gain=True,
        block="sequential",
        param_dtype=dtype,
        norm_position="pre",
        norm="rms",
        norm_eps=hf.float("rms_norm_eps", _RMS_EPS),
        final_norm=True,
        causal=True,
        ffn="swiglu",
        rope=rope_from_hf(hf, _ROPE_THETA),
        lm_head=True,
        **fields,
    )


NAMES = {
    "wq": "model.layers.{i}.self_attn.q_proj.weight",
    "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight",
    "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "bq": "model.layers.{i}.self_attn.q_proj.bias",
    "bk": "model.layers.{i}.self_attn.k_proj.bias",
    "bv": "model.layers.{i}.self_attn.v_proj.bias",
    "bo": "model.layers.{i}.self_attn.o_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
    "b_gate": "model.layers.{i}.mlp.gate_proj.bias",
    "b_up": "model.layers.{i}.mlp.up_proj.bias",
    "b_down": "model.layers.{i}.mlp.down_proj.bias",
    "norm_attn_gain": "model.layers.{i}.input_layernorm.weight",
    "norm_ffn_gain": "model.layers.{i}.post_attention_layernorm.weight",
    "final_norm_gain": "model.norm.weight",
    "embed": "model.embed_tokens.weight",
    "unembed": "lm_head.weight",
}


def specs(cfg: TransformerConfig, model_type: str, names: Mapping[str, str] = NAMES,
          pre: Any = None) -> list[Spec]:
    return (
        embedding_specs(cfg, names)
        + layer_specs(cfg, names, pre)
        + norm_specs(cfg, None, names, ("final_norm",))
    )


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py).

    The converter reorders the rows of each head from the rotate-half layout (pairs ``(i,
    i + dk/2)``) to llama.cpp's interleaved one (pairs ``(2i, 2i+1)``):
    ``w.reshape(n_head, 2, dk // 2, *rest).swapaxes(1, 2)``; this swaps the axes back. For K,
    ``n_head`` is the number of key/value heads.
    """
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _gguf_pre(role: str, cfg: TransformerConfig) -> Any:
    if role == "wq":
        return lambda w: llama_cpp_unpermute(w, cfg.n_heads)
    if role == "wk":
        return lambda w: llama_cpp_unpermute(w, cfg.kv_heads)
    return None


GGUF_NAMES = {
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
    "w_gate": "blk.{i}.ffn_gate.weight",
    "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
    "norm_attn_gain": "blk.{i}.attn_norm.weight",
    "norm_ffn_gain": "blk.{i}.ffn_norm.weight",
    "final_norm_gain": "output_norm.weight",
    "embed": "token_embd.weight",
    "unembed": "output.weight",
}


FAMILY = Family(
    model_types=("llama", "qwen2", "qwen3"),
    config=config,
    specs=specs,
    ignore=lambda name: name.endswith("rotary_emb.inv_freq"),
    tied_head=("lm_head.weight", NAMES["embed"]),
    gguf=GGUFLayout("llama", GGUF_NAMES, _gguf_pre),
)
