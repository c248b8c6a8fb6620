"""BERT: a post-LayerNorm encoder with learned absolute positions and token types.

Word/position/token-type embeddings; the embedding LayerNorm is the post-norm stack's input
Norm; ``attention.output.LayerNorm``/``output.LayerNorm`` are ``norm_attn``/``norm_ffn``. The
pooler and pre-training heads (``pooler.*``, ``cls.*``) are not part of the encoder and are
skipped; so is the buffer ``embeddings.position_ids``. Old checkpoints' ``bert.`` prefix and
``gamma``/``beta`` LayerNorm names are renamed.
"""

from __future__ import annotations

from typing import Any

from svflow_jax.checkpoints.base import ConfigReader, Spec, hf_sizes, make_config
from svflow_jax.checkpoints.families import Family
from svflow_jax.checkpoints.specs import embedding_specs, layer_specs, norm_specs
from svflow_jax.transformer import TransformerConfig


def config(hf: ConfigReader, dtype: Any) -> TransformerConfig:
    act = hf.get("hidden_act", hf.get("hidden_activation"))
    if act != "gelu":
        raise hf.error(f"hidden_act={act!r} is not supported for bert (only exact-erf 'gelu')")
    position = hf.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise hf.error(f"position_embedding_type={position!r} is not supported")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise hf.error("bert as a decoder / with cross-attention is not supported")
    sizes = hf_sizes(hf)
    return make_config(
        hf.where,
        **sizes,
        d_head=sizes["d_model"] // sizes["n_heads"],
        param_dtype=dtype,
        norm_position="post",
        norm="layer",
        norm_eps=hf.float("layer_norm_eps", 1e-12),
        causal=False,
        ffn="gelu",
        use_bias=True,
        n_positions=hf.int("max_position_embeddings", kind="positions"),
        type_vocab_size=hf.int("type_vocab_size", 2, kind="vocab", low=0) or None,
        lm_head=False,
    )


NAMES = {
    "wq": "encoder.layer.{i}.attention.self.query.weight",
    "wk": "encoder.layer.{i}.attention.self.key.weight",
    "wv": "encoder.layer.{i}.attention.self.value.weight",
    "wo": "encoder.layer.{i}.attention.output.dense.weight",
    "bq": "encoder.layer.{i}.attention.self.query.bias",
    "bk": "encoder.layer.{i}.attention.self.key.bias",
    "bv": "encoder.layer.{i}.attention.self.value.bias",
    "bo": "encoder.layer.{i}.attention.output.dense.bias",
    "w_in": "encoder.layer.{i}.intermediate.dense.weight",
    "b_in": "encoder.layer.{i}.intermediate.dense.bias",
    "w_out": "encoder.layer.{i}.output.dense.weight",
    "b_out": "encoder.layer.{i}.output.dense.bias",
    "norm_attn_gain": "encoder.layer.{i}.attention.output.LayerNorm.weight",
    "norm_attn_bias": "encoder.layer.{i}.attention.output.LayerNorm.bias",
    "norm_ffn_gain": "encoder.layer.{i}.output.LayerNorm.weight",
    "norm_ffn_bias": "encoder.layer.{i}.output.LayerNorm.bias",
    "input_norm_gain": "embeddings.LayerNorm.weight",
    "input_norm_bias": "embeddings.LayerNorm.bias",
    "embed": "embeddings.word_embeddings.weight",
    "pos_embed": "embeddings.position_embeddings.weight",
    "type_embed": "embeddings.token_type_embeddings.weight",
}


def specs(cfg: TransformerConfig, model_type: str) -> list[Spec]:
    return (
        embedding_specs(cfg, NAMES)
        + norm_specs(cfg, None, NAMES, ("input_norm",))
        + layer_specs(cfg, NAMES)
    )


def rename(name: str) -> str:
    new = name.removeprefix("bert.")
    if ".LayerNorm." in new:
        new = new.replace("LayerNorm.gamma", "LayerNorm.weight")
        new = new.replace("LayerNorm.beta", "LayerNorm.bias")
    return new


FAMILY = Family(
    model_types=("bert",),
    config=config,
    specs=specs,
    rename=rename,
    ignore=lambda name: name == "embeddings.position_ids"
    or name.endswith("rotary_emb.inv_freq") or name.startswith(("pooler.", "cls.")),
)
