"""GPT-2: a pre-LayerNorm decoder (gains and biases) with learned absolute positions, biases
everywhere, a tanh GELU MLP and a tied LM head.

GPT-2 stores its linear maps as ``Conv1D`` weights in ``(in, out)`` order (the transpose of
``nn.Linear``): ``attn.c_attn (d, 3 d)`` is Q, K and V side by side -> ``wq``, ``wk``, ``wv``
``(d, H, dk)`` (one spec, three targets; its bias ``(3 d,)`` likewise); ``attn.c_proj (d, d)`` ->
``wo (H, dk, d)``; ``mlp.c_fc (d, f)``, ``mlp.c_proj (f, d)`` -> ``w_in``, ``w_out`` as they are;
``ln_1``/``ln_2``/``ln_f`` -> ``norm_attn``/``norm_ffn``/the final Norm; ``wte``/``wpe`` ->
``embed``/``pos_embed``. Checkpoints saved from ``GPT2Model`` lack the ``transformer.`` prefix
(it is added); the causal-mask buffers ``attn.bias``/``attn.masked_bias`` of old files are
skipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from svflow_jax.checkpoints.base import ConfigReader, Spec, make_config
from svflow_jax.checkpoints.families import Family
from svflow_jax.transformer import TransformerConfig

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def config(hf: ConfigReader, dtype: Any) -> TransformerConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in _ACTIVATIONS:
        raise hf.error(f"activation_function={act!r} is not supported for gpt2 "
                       f"(supported: {', '.join(_ACTIVATIONS)})")
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(flag):
            raise hf.error(f"{flag}=true is not supported for gpt2")
    if hf.get("scale_attn_weights") is False:
        raise hf.error("scale_attn_weights=false (unscaled attention logits) is not supported")
    d, H = hf.int("n_embd", kind="width"), hf.int("n_head", kind="heads")
    if d % H:
        raise hf.error(f"n_embd={d} is not a multiple of n_head={H}")
    return make_config(
        hf.where,
        d_model=d,
        n_layers=hf.int("n_layer", kind="layers"),
        n_heads=H,
        d_head=d // H,
        d_ff=hf.int("n_inner", 4 * d, kind="width"),
        vocab_size=hf.int("vocab_size", kind="vocab"),
        n_positions=hf.int("n_positions", kind="positions"),
        residual_scale=1.0,
        block="sequential",
        norm_position="pre",
        norm="layer",
        norm_gain=True,
        norm_eps=hf.float("layer_norm_epsilon", 1e-5),
        final_norm=True,
        causal=True,
        ffn="gelu",
        activation=_ACTIVATIONS[act],
        use_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        lm_head=True,
        param_dtype=dtype,
    )


def specs(cfg: TransformerConfig, model_type: str) -> list[Spec]:
    d, H, dk, f, V = cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_ff, cfg.vocab_size

    def qkv(w: np.ndarray) -> tuple[np.ndarray, ...]:  # (d, 3 d) -> three (d, H, dk)
        return tuple(part.reshape(d, H, dk) for part in np.split(w, 3, axis=-1))

    def qkv_bias(b: np.ndarray) -> tuple[np.ndarray, ...]:  # (3 d,) -> three (H, dk)
        return tuple(part.reshape(H, dk) for part in np.split(b, 3))

    out = [
        Spec("transformer.wte.weight", (V, d), "embed"),
        Spec("transformer.wpe.weight", (cfg.n_positions, d), "pos_embed"),
        Spec("transformer.ln_f.weight", (d,), "final_norm_gain"),
        Spec("transformer.ln_f.bias", (d,), "final_norm_bias"),
    ]
    if not cfg.tie_embeddings:
        out.append(Spec("lm_head.weight", (V, d), "unembed", None, lambda w: w.T))
    for i in range(cfg.n_layers):
        p = f"transformer.h.{i}."
        out += [
            Spec(p + "attn.c_attn.weight", (d, 3 * d), ("wq", "wk", "wv"), i, qkv),
            Spec(p + "attn.c_attn.bias", (3 * d,), ("bq", "bk", "bv"), i, qkv_bias),
            Spec(p + "attn.c_proj.weight", (d, d), "wo", i, lambda w: w.reshape(H, dk, d)),
            Spec(p + "attn.c_proj.bias", (d,), "bo", i),
            Spec(p + "mlp.c_fc.weight", (d, f), "w_in", i),
            Spec(p + "mlp.c_fc.bias", (f,), "b_in", i),
            Spec(p + "mlp.c_proj.weight", (f, d), "w_out", i),
            Spec(p + "mlp.c_proj.bias", (d,), "b_out", i),
        ]
        for ours, theirs in (("norm_attn", "ln_1"), ("norm_ffn", "ln_2")):
            out += [Spec(p + f"{theirs}.weight", (d,), f"{ours}_gain", i),
                    Spec(p + f"{theirs}.bias", (d,), f"{ours}_bias", i)]
    return out


def rename(name: str) -> str:
    if name.startswith(("h.", "wte.", "wpe.", "ln_f.")):
        return "transformer." + name
    return name


FAMILY = Family(
    model_types=("gpt2",),
    config=config,
    specs=specs,
    rename=rename,
    ignore=lambda name: name.endswith((".attn.bias", ".attn.masked_bias")),
    tied_head=("lm_head.weight", "transformer.wte.weight"),
)
