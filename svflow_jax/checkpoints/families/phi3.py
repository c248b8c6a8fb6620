"""Phi-3: a Llama-style decoder (pre-RMSNorm, RoPE, SwiGLU, GQA) with fused projections.

``self_attn.qkv_proj ((H + 2 G) dk, d)`` is Q, K and V stacked by rows -> ``wq``, ``wk``, ``wv``
(one spec, three targets); ``mlp.gate_up_proj (2 f, d)`` is the gate then the up projection
-> ``w_gate``, ``w_up`` (one spec, two targets). Every other tensor is named and converted as
in :mod:`.llama`. Refused by name: sliding-window attention (``sliding_window``, set in
Phi-3-mini-4k), ``longrope``/``su`` RoPE scaling (Phi-3 128k) and partial rotary embeddings.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from svflow_jax.checkpoints.base import ConfigReader, Spec
from svflow_jax.checkpoints.families import Family, llama
from svflow_jax.checkpoints.specs import in_heads, transpose
from svflow_jax.transformer import TransformerConfig


def config(hf: ConfigReader, dtype: Any) -> TransformerConfig:
    if hf.get("sliding_window") is not None:
        raise hf.error(f"sliding-window attention (sliding_window={hf.get('sliding_window')}) "
                       "is not supported")
    return llama.config(hf, dtype)  # silu, RoPE (default only), no biases, untied or tied


def specs(cfg: TransformerConfig, model_type: str) -> list[Spec]:
    d, H, G, dk, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.d_head, cfg.d_ff
    fused = {"wq", "wk", "wv", "w_gate", "w_up"}
    out = [s for s in llama.specs(cfg, model_type) if not set(s.targets) & fused]

    def qkv(w: np.ndarray) -> tuple[np.ndarray, ...]:
        q, k, v = np.split(w, [H * dk, (H + G) * dk])
        return in_heads(H, dk)(q), in_heads(G, dk)(k), in_heads(G, dk)(v)

    def gate_up(w: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(transpose(part) for part in np.split(w, 2))

    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out += [
            Spec(p + "self_attn.qkv_proj.weight", ((H + 2 * G) * dk, d), ("wq", "wk", "wv"),
                 i, qkv),
            Spec(p + "mlp.gate_up_proj.weight", (2 * f, d), ("w_gate", "w_up"), i, gate_up),
        ]
    return out


FAMILY = Family(
    model_types=("phi3",),
    config=config,
    specs=specs,
    ignore=lambda name: name.endswith("rotary_emb.inv_freq"),
    tied_head=("lm_head.weight", llama.NAMES["embed"]),
)
