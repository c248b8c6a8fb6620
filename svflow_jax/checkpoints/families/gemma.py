"""Gemma (the first generation): a Llama-style decoder with three differences.

* RMSNorm gains are stored as ``w`` and applied as ``1 + w``: every Norm gain is converted to
  ``1 + w`` at load time (in the parameter dtype, as Gemma computes it in float32).
* The token embeddings are multiplied by ``sqrt(d)`` before the first layer
  (``TransformerConfig.embed_scale``); the tied LM head uses the unscaled embedding.
* The MLP is GeGLU: ``down(gelu_tanh(gate(x)) * up(x))`` (``activation="gelu_tanh"``).

Tensor names are Llama's (:mod:`.llama`); ``head_dim`` is explicit (256 in the released
models, not ``hidden / heads``) and the head is always tied.

Refused by name: Gemma 2 (logit soft-capping of attention and output, a Norm after each branch
as well as before it, alternating sliding-window layers, ``query_pre_attn_scalar``) and Gemma 3
(also per-head query/key RMSNorm with Gemma's ``1 + w`` gains and separate RoPE bases for local
and global layers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from svflow_jax.checkpoints.base import ConfigReader, Spec
from svflow_jax.checkpoints.families import Family, llama
from svflow_jax.transformer import TransformerConfig

# "gelu" in a Gemma config is the official releases' legacy name for the tanh approximation
# (transformers replaces it by "gelu_pytorch_tanh", as its Gemma code always ran).
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu_tanh"}
_GEMMA2 = ("logit soft-capping (attn_logit_softcapping, final_logit_softcapping), a Norm after "
           "each branch as well as before it, alternating sliding-window layers and "
           "query_pre_attn_scalar")
_REFUSED = {
    "gemma2": "Gemma 2 has " + _GEMMA2,
    "gemma3": "Gemma 3 has " + _GEMMA2 + ", per-head query/key RMSNorm and separate RoPE "
              "bases for local and global layers",
    "gemma3_text": "Gemma 3 has " + _GEMMA2 + ", per-head query/key RMSNorm and separate RoPE "
                   "bases for local and global layers",
}


def config(hf: ConfigReader, dtype: Any) -> TransformerConfig:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTIVATIONS:
        raise hf.error(f"hidden_activation={act!r} is not supported for gemma "
                       f"(supported: {', '.join(_ACTIVATIONS)})")
    if hf.get("use_bidirectional_attention"):
        raise hf.error("use_bidirectional_attention=true is not supported")
    bias = bool(hf.get("attention_bias", False))
    return llama.decoder(
        hf, dtype,
        activation=_ACTIVATIONS[act],
        qkv_bias=bias,
        out_bias=bias,
        ffn_bias=False,
        tie_embeddings=True,
        embed_scale=math.sqrt(hf.int("hidden_size", kind="width")),
    )


def _one_plus(w: Any) -> Any:
    return 1 + w


def specs(cfg: TransformerConfig, model_type: str) -> list[Spec]:
    return [
        dataclasses.replace(s, convert=_one_plus) if s.targets[0].endswith("_gain") else s
        for s in llama.specs(cfg, model_type)
    ]


FAMILY = Family(
    model_types=("gemma",),
    config=config,
    specs=specs,
    ignore=lambda name: name.endswith("rotary_emb.inv_freq"),
    tied_head=("lm_head.weight", llama.NAMES["embed"]),
    refused=_REFUSED,
)
