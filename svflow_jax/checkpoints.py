"""Real checkpoints into the Flax ``TransformerLM``: Hugging Face folders and GGUF files.

* :func:`load_hf` reads a Hugging Face model folder (``config.json`` + ``model.safetensors`` or
  a sharded ``model.safetensors.index.json``, and ``tokenizer.json`` when present) for
  ``model_type`` ``llama``, ``qwen2``, ``qwen3`` and ``bert``.
* :func:`load_gguf` reads a GGUF file of a ``llama``-architecture model (llama.cpp's format,
  float or quantised tensors, dequantised with the ``gguf`` package) with the tokenizer stored
  in its metadata (``tokenizer.ggml.*``, byte-level BPE).
* :func:`load` picks one of the two from the path.

Each returns ``LoadedModel(model, config, tokenizer)``: a ``TransformerLM`` (parameters in
``dtype``, float32 by default), its ``TransformerConfig`` and a ``tokenizers.Tokenizer`` (or
``None`` when the folder has no ``tokenizer.json``).

What maps onto what (``d`` hidden size, ``H``/``G`` query/key-value heads, ``dk`` head width):

* Llama/Qwen: ``q_proj (H dk, d)`` -> ``wq (d, H, dk)`` (transposed, split into heads), likewise
  ``k_proj``/``v_proj``; ``o_proj (d, H dk)`` -> ``wo (H, dk, d)``; ``gate/up/down_proj`` ->
  ``w_gate/w_up/w_down`` (transposed); ``input_layernorm``/``post_attention_layernorm`` ->
  ``norm_attn_gain``/``norm_ffn_gain``; ``model.norm`` -> the final Norm; ``q_norm``/``k_norm``
  (Qwen3) -> ``q_norm_gain``/``k_norm_gain``; Q/K/V biases (Qwen2, Llama ``attention_bias``).
  A tied LM head (``tie_word_embeddings``) is absent from the file: the logits use ``embed``.
* BERT: word/position/token-type embeddings, the embedding LayerNorm as the post-norm stack's
  input Norm, ``attention.output.LayerNorm``/``output.LayerNorm`` as ``norm_attn``/``norm_ffn``.
  The pooler and pre-training heads (``pooler.*``, ``cls.*``) are not part of the encoder and
  are skipped; so are the buffers ``embeddings.position_ids`` and ``rotary_emb.inv_freq``.
* GGUF (llama): ``token_embd``, ``blk.{i}.attn_{q,k,v,output}``, ``blk.{i}.ffn_{gate,up,down}``,
  ``blk.{i}.{attn,ffn}_norm``, ``output_norm``, ``output`` (absent: tied), ``rope_freqs``
  (Llama 3.1 frequency factors). llama.cpp's converter stores the rows of Q and K permuted for
  its RoPE layout (:func:`llama_cpp_unpermute` undoes it). GGUF lists dimensions innermost
  first; the reader's arrays (and our shapes) are in NumPy order.

Anything the Transformer cannot honour is refused with a :class:`CheckpointError` naming it:
an unknown ``model_type`` or GGUF architecture, a RoPE type other than default/llama3, partial
rotary embeddings, sliding-window attention, an activation other than silu (decoders) or exact
gelu (BERT), missing or unexpected tensors (all listed), shape mismatches (name, expected,
got), and quantisation types ``gguf`` cannot dequantise.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from svflow_jax.transformer import (
    RoPE,
    TransformerConfig,
    TransformerLM,
    set_embedding_params,
    set_layer_params,
    set_outer_norm_params,
)

__all__ = [
    "CheckpointError",
    "LoadedModel",
    "load",
    "load_hf",
    "load_gguf",
    "config_from_hf",
    "config_from_gguf",
    "tokenizer_from_gguf",
    "llama_cpp_unpermute",
    "SUPPORTED_MODEL_TYPES",
]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "bert")


class CheckpointError(ValueError):
    """A checkpoint this package cannot load exactly; the message names the problem."""


class LoadedModel(NamedTuple):
    """What the loaders return; unpacks as ``model, config, tokenizer``.

    Attributes:
        model: the ``TransformerLM`` with the checkpoint's weights; ``model(ids)`` maps token ids
            of shape ``(batch, n)`` to logits ``(batch, n, vocab)``.
        config: its ``TransformerConfig``.
        tokenizer: the checkpoint's ``tokenizers.Tokenizer``, or ``None`` when it ships none.
    """

    model: TransformerLM
    config: TransformerConfig
    tokenizer: Any  # tokenizers.Tokenizer | None


# ============================================================================================
# Config mapping
# ============================================================================================

_DECODER_DEFAULTS = {  # transformers' defaults for fields a config.json may omit
    "llama": dict(rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "qwen2": dict(rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
    "qwen3": dict(rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6),
}


def _rope_from_hf(hf: Mapping[str, Any], default_theta: float) -> RoPE:
    """RoPE settings, wherever this transformers version put them: ``rope_parameters`` (recent),
    ``rope_scaling`` (older: scaling only, ``rope_theta`` at the top level) or neither."""
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):  # the newer one wins
        if isinstance(hf.get(key), Mapping):
            params |= dict(hf[key])
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise CheckpointError(f"partial_rotary_factor={partial} (partial RoPE) is not supported")
    if rope_type == "default":
        return RoPE(theta=float(theta))
    if rope_type == "llama3":
        try:
            return RoPE(
                theta=float(theta),
                rope_type="llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        except KeyError as err:
            raise CheckpointError(f"rope_type 'llama3' needs {err.args[0]!r}") from None
    raise CheckpointError(
        f"unsupported rope_type {rope_type!r}; supported: 'default', 'llama3'"
    )


def config_from_hf(hf: Mapping[str, Any], dtype: Any = jnp.float32) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face ``config.json`` (as a dict)."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unknown model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    d, H = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    common = dict(
        d_model=d,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=H,
        d_ff=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        residual_scale=1.0,
        norm_gain=True,
        block="sequential",
        param_dtype=dtype,
    )
    act = hf.get("hidden_act", hf.get("hidden_activation"))
    if model_type == "bert":
        if act != "gelu":
            raise CheckpointError(
                f"hidden_act={act!r} is not supported for bert (only exact-erf 'gelu')"
            )
        position = hf.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise CheckpointError(f"position_embedding_type={position!r} is not supported")
        if hf.get("is_decoder") or hf.get("add_cross_attention"):
            raise CheckpointError("bert as a decoder / with cross-attention is not supported")
        return TransformerConfig(
            **common,
            d_head=d // H,
            norm_position="post",
            norm="layer",
            norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
            causal=False,
            ffn="gelu",
            use_bias=True,
            n_positions=int(hf["max_position_embeddings"]),
            type_vocab_size=int(hf.get("type_vocab_size", 2)) or None,
            lm_head=False,
        )

    defaults = _DECODER_DEFAULTS[model_type]
    if act != "silu":
        raise CheckpointError(f"hidden_act={act!r} is not supported for {model_type} (only silu)")
    if hf.get("use_sliding_window") or (
        model_type == "llama" and hf.get("sliding_window") is not None
    ):
        raise CheckpointError(
            f"sliding-window attention (sliding_window={hf.get('sliding_window')}) is not "
            "supported"
        )
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise CheckpointError(
            f"layer_types {sorted(set(layer_types))}: only 'full_attention' is supported "
            "(no sliding window)"
        )
    head_dim = hf.get("head_dim") or d // H
    attention_bias = bool(hf.get("attention_bias", False))
    return TransformerConfig(
        **common,
        d_head=int(head_dim),
        n_kv_heads=int(hf.get("num_key_value_heads") or H),
        norm_position="pre",
        norm="rms",
        norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
        final_norm=True,
        causal=True,
        ffn="swiglu",
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        out_bias=False if model_type == "qwen2" else attention_bias,
        ffn_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        rope=_rope_from_hf(hf, defaults["rope_theta"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", defaults["tie_word_embeddings"])),
        lm_head=True,
    )


# ============================================================================================
# Tensor specifications and the generic conversion
# ============================================================================================


@dataclass(frozen=True)
class _Spec:
    """One source tensor: its name and shape in the file, and where it goes."""

    source: str
    shape: tuple[int, ...]
    group: str  # "layer" | "outer" | "embed"
    target: str
    layer: int | None
    convert: Callable[[np.ndarray], np.ndarray]


def _in_heads(heads: int, dk: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda w: w.T.reshape(w.shape[1], heads, dk)  # (heads dk, d) -> (d, heads, dk)


def _out_heads(heads: int, dk: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda w: w.T.reshape(heads, dk, w.shape[0])  # (d, H dk) -> (H, dk, d)


def _heads(heads: int, dk: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda b: b.reshape(heads, dk)


def _transpose(w: np.ndarray) -> np.ndarray:
    return w.T


def _same(w: np.ndarray) -> np.ndarray:
    return w


def _attention_specs(
    cfg: TransformerConfig, layer: int, names: Mapping[str, str], pre: Callable | None = None
) -> list[_Spec]:
    """Q/K/V/O (+ biases, q/k norms). ``names`` maps our roles to source names; ``pre`` maps a
    role to an extra conversion applied first (GGUF's Q/K un-permutation)."""
    d, H, G, dk = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.d_head
    table: list[tuple[str, tuple[int, ...], str, Callable]] = [
        ("wq", (H * dk, d), "wq", _in_heads(H, dk)),
        ("wk", (G * dk, d), "wk", _in_heads(G, dk)),
        ("wv", (G * dk, d), "wv", _in_heads(G, dk)),
        ("wo", (d, H * dk), "wo", _out_heads(H, dk)),
    ]
    if cfg.has_qkv_bias:
        table += [
            ("bq", (H * dk,), "bq", _heads(H, dk)),
            ("bk", (G * dk,), "bk", _heads(G, dk)),
            ("bv", (G * dk,), "bv", _heads(G, dk)),
        ]
    if cfg.has_out_bias:
        table.append(("bo", (d,), "bo", _same))
    if cfg.qk_norm:
        table += [("q_norm", (dk,), "q_norm_gain", _same), ("k_norm", (dk,), "k_norm_gain", _same)]
    out = []
    for role, shape, target, convert in table:
        first = pre(role) if pre is not None else None
        fn = convert if first is None else (lambda w, f=first, c=convert: c(f(w)))
        out.append(_Spec(names[role].format(i=layer), shape, "layer", target, layer, fn))
    return out


def _ffn_specs(cfg: TransformerConfig, layer: int, names: Mapping[str, str]) -> list[_Spec]:
    d, f = cfg.d_model, cfg.d_ff
    if cfg.ffn == "swiglu":
        table = [("w_gate", (f, d)), ("w_up", (f, d)), ("w_down", (d, f))]
        biases = [("b_gate", (f,)), ("b_up", (f,)), ("b_down", (d,))]
    else:
        table = [("w_in", (f, d)), ("w_out", (d, f))]
        biases = [("b_in", (f,)), ("b_out", (d,))]
    out = [_Spec(names[r].format(i=layer), s, "layer", r, layer, _transpose) for r, s in table]
    if cfg.has_ffn_bias:
        out += [_Spec(names[r].format(i=layer), s, "layer", r, layer, _same) for r, s in biases]
    return out


def _norm_specs(
    cfg: TransformerConfig, layer: int | None, names: Mapping[str, str], roles: Iterable[str]
) -> list[_Spec]:
    out = []
    group = "outer" if layer is None else "layer"
    for role in roles:  # e.g. norm_attn -> norm_attn_gain (+ norm_attn_bias)
        kinds = ["gain"] + (["bias"] if cfg.has_norm_bias else [])
        for kind in kinds:
            source = names[f"{role}_{kind}"].format(i=layer)
            out.append(_Spec(source, (cfg.d_model,), group, f"{role}_{kind}", layer, _same))
    return out


_HF_DECODER = {
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

_HF_BERT = {
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

_GGUF_LLAMA = {
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


def _layer_specs(cfg: TransformerConfig, names: Mapping[str, str], pre=None) -> list[_Spec]:
    out = []
    for i in range(cfg.n_layers):
        out += _attention_specs(cfg, i, names, pre)
        out += _ffn_specs(cfg, i, names)
        out += _norm_specs(cfg, i, names, ("norm_attn", "norm_ffn"))
    return out


def _embedding_specs(cfg: TransformerConfig, names: Mapping[str, str]) -> list[_Spec]:
    V, d = cfg.vocab_size, cfg.d_model
    out = [_Spec(names["embed"], (V, d), "embed", "embed", None, _same)]
    if cfg.n_positions:
        shape = (cfg.n_positions, d)
        out.append(_Spec(names["pos_embed"], shape, "embed", "pos_embed", None, _same))
    if cfg.type_vocab_size:
        shape = (cfg.type_vocab_size, d)
        out.append(_Spec(names["type_embed"], shape, "embed", "type_embed", None, _same))
    if cfg.lm_head and not cfg.tie_embeddings:
        out.append(_Spec(names["unembed"], (V, d), "embed", "unembed", None, _transpose))
    return out


def _hf_specs(model_type: str, cfg: TransformerConfig) -> list[_Spec]:
    if model_type == "bert":
        return (
            _embedding_specs(cfg, _HF_BERT)
            + _norm_specs(cfg, None, _HF_BERT, ("input_norm",))
            + _layer_specs(cfg, _HF_BERT)
        )
    return (
        _embedding_specs(cfg, _HF_DECODER)
        + _layer_specs(cfg, _HF_DECODER)
        + _norm_specs(cfg, None, _HF_DECODER, ("final_norm",))
    )


class _Source:
    """Tensors of a checkpoint: ``shapes`` (NumPy order) without loading, ``get`` to load."""

    shapes: dict[str, tuple[int, ...]]

    def get(self, name: str) -> np.ndarray:
        raise NotImplementedError


def _convert(
    specs: list[_Spec], source: _Source, ignored: set[str], what: str, dtype: Any
) -> tuple[dict, dict, dict]:
    """Checks names and shapes (reporting every problem at once), then loads and converts."""
    expected = {s.source: s for s in specs}
    present = set(source.shapes) - ignored
    missing, extra = sorted(set(expected) - present), sorted(present - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if extra:
            parts.append(f"unexpected (extra) tensors {extra}")
        raise CheckpointError(f"{what}: " + "; ".join(parts))
    bad = [
        f"{s.source}: expected shape {s.shape}, got {tuple(source.shapes[s.source])}"
        for s in specs
        if tuple(source.shapes[s.source]) != s.shape
    ]
    if bad:
        raise CheckpointError(f"{what}: shape mismatch: " + "; ".join(bad))

    np_dtype = np.dtype(jnp.dtype(dtype))
    groups: dict[str, dict[str, Any]] = {"layer": {}, "outer": {}, "embed": {}}
    for s in specs:
        value = np.asarray(source.get(s.source)).astype(np_dtype)  # bf16/f16 -> dtype
        value = np.ascontiguousarray(s.convert(value))
        if s.layer is None:
            groups[s.group][s.target] = value
        else:
            groups["layer"].setdefault(s.target, {})[s.layer] = value
    layer = {
        name: np.stack([per_layer[i] for i in range(len(per_layer))])
        for name, per_layer in groups["layer"].items()
    }
    return layer, groups["outer"], groups["embed"]


def _build(config: TransformerConfig, layer: dict, outer: dict, embed: dict) -> TransformerLM:
    """A ``TransformerLM`` with exactly these weights (no random initialisation)."""
    model = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    set_layer_params(model.transformer, {k: jnp.asarray(v) for k, v in layer.items()})
    set_outer_norm_params(model.transformer, {k: jnp.asarray(v) for k, v in outer.items()})
    set_embedding_params(model, {k: jnp.asarray(v) for k, v in embed.items()})
    return model


# ============================================================================================
# Hugging Face folders (safetensors)
# ============================================================================================


def _read_raw_safetensors(path: Path, name: str) -> np.ndarray:
    """One tensor read directly from the file, for dtypes NumPy lacks (bfloat16)."""
    import ml_dtypes

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        info = json.loads(f.read(n))[name]
        start, end = info["data_offsets"]
        f.seek(8 + n + start)
        raw = f.read(end - start)
    dtypes = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
              "F8_E5M2": ml_dtypes.float8_e5m2}
    if info["dtype"] not in dtypes:
        raise CheckpointError(f"{path.name}: tensor {name!r} has unsupported dtype {info['dtype']}")
    return np.frombuffer(raw, dtypes[info["dtype"]]).reshape(info["shape"])


class _SafetensorsFolder(_Source):
    def __init__(self, folder: Path):
        from safetensors import safe_open

        single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif single.exists():
            files = [single.name]
        else:
            raise CheckpointError(
                f"{folder}: neither model.safetensors nor model.safetensors.index.json"
            )
        self._file: dict[str, Path] = {}
        self._stored: dict[str, str] = {}  # our name -> name in the file (BERT renames)
        self.shapes = {}
        for file in files:
            path = folder / file
            if not path.exists():
                raise CheckpointError(f"{folder}: shard {file} listed in the index is missing")
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    self._file[name] = path
                    self.shapes[name] = tuple(f.get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        path, stored = self._file[name], self._stored.get(name, name)
        try:
            with safe_open(str(path), framework="numpy") as f:
                return f.get_tensor(stored)
        except TypeError:  # a dtype NumPy does not know (bfloat16, float8)
            return _read_raw_safetensors(path, stored)


def _normalise_names(model_type: str, source: _SafetensorsFolder) -> set[str]:
    """Renames (BERT: old checkpoints' ``bert.`` prefix and gamma/beta) and returns the names
    to skip."""
    rename: dict[str, str] = {}
    if model_type == "bert":
        for name in list(source.shapes):
            new = name.removeprefix("bert.")
            if ".LayerNorm." in new:
                new = new.replace("LayerNorm.gamma", "LayerNorm.weight")
                new = new.replace("LayerNorm.beta", "LayerNorm.bias")
            rename[name] = new
    else:
        rename = {name: name for name in source.shapes}
    source.shapes = {rename[n]: s for n, s in source.shapes.items()}
    source._file = {rename[n]: p for n, p in source._file.items()}
    source._stored = {new: old for old, new in rename.items()}

    def skip(name: str) -> bool:
        if name.endswith("rotary_emb.inv_freq") or name == "embeddings.position_ids":
            return True
        return model_type == "bert" and name.startswith(("pooler.", "cls."))

    return {n for n in source.shapes if skip(n)}


def _resolve_folder(path: str | Path, download: bool, revision: str | None) -> Path:
    folder = Path(path)
    if folder.is_dir():
        return folder
    if not download:
        raise CheckpointError(
            f"{path}: no such folder (pass download=True to fetch a hub repository)"
        )
    try:
        from huggingface_hub import snapshot_download
    except ImportError as err:
        raise CheckpointError("download=True needs the huggingface_hub package") from err
    return Path(
        snapshot_download(
            str(path), revision=revision, allow_patterns=["*.json", "*.safetensors"]
        )
    )


def load_hf(
    path: str | Path,
    *,
    dtype: Any = jnp.float32,
    download: bool = False,
    revision: str | None = None,
) -> LoadedModel:
    """A Hugging Face model folder (llama, qwen2, qwen3, bert) as a ``TransformerLM``.

    ``download=True`` fetches ``path`` as a hub repository id with
    ``huggingface_hub.snapshot_download`` when it is not a local folder (needs that package
    and a network connection; nothing else here does).

    Args:
        path: a folder with ``config.json``, ``model.safetensors`` (or a sharded index) and
            ``tokenizer.json``; with ``download=True``, a hub repository id.
        dtype: dtype of the parameters (default float32).
        download: fetch ``path`` from the hub when it is not a local folder.
        revision: the hub revision to fetch (with ``download=True``).

    Returns:
        ``LoadedModel(model, config, tokenizer)``.

    Raises:
        CheckpointError: anything the Transformer cannot honour exactly (an unknown
            ``model_type``, a RoPE type, sliding windows, missing, extra or misshapen tensors),
            named in the message.
    """
    folder = _resolve_folder(path, download, revision)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder}: no config.json")
    hf = json.loads(config_path.read_text())
    config = config_from_hf(hf, dtype)
    model_type = hf["model_type"]
    source = _SafetensorsFolder(folder)
    ignored = _normalise_names(model_type, source)
    if config.tie_embeddings and "lm_head.weight" in source.shapes:
        # Some writers save the tied head anyway: accept it only if it is the embedding.
        head, emb = source.get("lm_head.weight"), source.get(_HF_DECODER["embed"])
        if head.shape != emb.shape or not np.array_equal(head, emb):
            raise CheckpointError(
                "tie_word_embeddings is true but lm_head.weight differs from the embedding"
            )
        ignored.add("lm_head.weight")
    specs = _hf_specs(model_type, config)
    layer, outer, embed = _convert(specs, source, ignored, str(folder), dtype)
    model = _build(config, layer, outer, embed)
    tokenizer = None
    if (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return LoadedModel(model, config, tokenizer)


# ============================================================================================
# GGUF
# ============================================================================================


def llama_cpp_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py).

    The converter reorders the rows of each head from the rotate-half layout (pairs ``(i,
    i + dk/2)``) to llama.cpp's interleaved one (pairs ``(2i, 2i+1)``):
    ``w.reshape(n_head, 2, dk // 2, *rest).swapaxes(1, 2)``; this swaps the axes back. For K,
    ``n_head`` is the number of key/value heads.
    """
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


class _GGUFSource(_Source):
    def __init__(self, reader: Any):
        self._tensors = {t.name: t for t in reader.tensors}
        # ne (innermost first) reversed = NumPy order.
        self.shapes = {
            t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in reader.tensors
        }

    def check_types(self, names: Iterable[str]) -> None:
        import gguf

        bad = []
        for name in names:
            qtype = self._tensors[name].tensor_type
            if qtype.name in _FLOAT_TYPES:
                continue
            if qtype.name.startswith("I") and qtype.name[1:].isdigit():  # I8..I64
                bad.append(f"{name}: {qtype.name}")
                continue
            try:
                gguf.quants.dequantize(np.zeros(0, np.uint8), qtype)
            except NotImplementedError:
                bad.append(f"{name}: {qtype.name}")
            except Exception:  # noqa: BLE001 - an empty probe may trip a supported type
                pass
        if bad:
            raise CheckpointError(
                "unsupported GGUF quantisation type (the gguf package cannot dequantise it): "
                + "; ".join(bad)
            )

    def get(self, name: str) -> np.ndarray:
        import gguf

        t = self._tensors[name]
        shape = self.shapes[name]
        if t.tensor_type.name in _FLOAT_TYPES and t.tensor_type.name != "BF16":
            return np.asarray(t.data).reshape(shape)
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)


def _metadata(reader: Any) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def config_from_gguf(
    meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]] | None = None,
    dtype: Any = jnp.float32,
) -> TransformerConfig:
    """The ``TransformerConfig`` of a llama-architecture GGUF's metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"unsupported GGUF architecture {arch!r}; supported: 'llama'")
    tensor_shapes = tensor_shapes or {}

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks llama.{key}")
        return value

    d, H = int(get("embedding_length")), int(get("attention.head_count"))
    if int(meta.get("llama.expert_count", 0) or 0) > 0:
        raise CheckpointError("GGUF llama with experts (MoE) is not supported")
    head_dim = int(get("attention.key_length", d // H))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise CheckpointError(f"partial RoPE (rope.dimension_count={rope_dim} < {head_dim})")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise CheckpointError(f"unsupported GGUF rope scaling type {scaling!r}")
    if meta.get("llama.attention.sliding_window"):
        raise CheckpointError("sliding-window attention is not supported")
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        vocab = tensor_shapes.get("token_embd.weight", (len(meta["tokenizer.ggml.tokens"]),))[0]
    return TransformerConfig(
        d_model=d,
        n_layers=int(get("block_count")),
        n_heads=H,
        d_head=head_dim,
        d_ff=int(get("feed_forward_length")),
        n_kv_heads=int(get("attention.head_count_kv", H)),
        norm_position="pre",
        norm="rms",
        norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        final_norm=True,
        causal=True,
        ffn="swiglu",
        qkv_bias=False,
        out_bias=False,
        ffn_bias=False,
        rope=RoPE(theta=float(get("rope.freq_base", 10000.0))),
        vocab_size=int(vocab),
        tie_embeddings="output.weight" not in tensor_shapes,
        param_dtype=dtype,
    )


# Pre-tokenizer regexes of llama.cpp's BPE vocabularies (llama-vocab.cpp).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` from a GGUF's ``tokenizer.ggml.*`` metadata.

    Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) with the pre-tokenizers
    ``gpt2``/``default`` (GPT-2's regex), ``smollm``/``starcoder``/``refact``/``codeshell``
    (single digits, then GPT-2's regex: SmolLM2) and ``llama-bpe`` (Llama 3's regex). CONTROL
    and USER_DEFINED tokens become special tokens; ``add_bos_token``/``add_eos_token`` add them.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        pre_tok = byte_level
    elif pre in ("smollm", "starcoder", "refact", "codeshell"):
        pre_tok = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("llama-bpe", "llama3"):
        pre_tok = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise CheckpointError(f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError("GGUF tokenizer has duplicate tokens")
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"))
    )
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (3, 4)]  # CONTROL, USER_DEFINED
    tok.add_special_tokens(special)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join(
            ([tokens[bos]] if add_bos else []) + ["$A"] + ([tokens[eos]] if add_eos else [])
        )
        specials = {(tokens[i], int(i)) for i, on in ((bos, add_bos), (eos, add_eos)) if on}
        tok.post_processor = TemplateProcessing(single=single, special_tokens=sorted(specials))
    return tok


def load_gguf(path: str | Path, *, dtype: Any = jnp.float32) -> LoadedModel:
    """A llama-architecture GGUF file as a ``TransformerLM``, with the GGUF's own tokenizer.

    Args:
        path: the ``.gguf`` file; quantised tensors are dequantised with the ``gguf`` package
            and Q/K rows un-permuted from llama.cpp's RoPE layout.
        dtype: dtype of the parameters (default float32).

    Returns:
        ``LoadedModel(model, config, tokenizer)`` (the tokenizer built from the GGUF's BPE).

    Raises:
        CheckpointError: another architecture, an unsupported quantisation, missing or
            misshapen tensors.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    reader = gguf.GGUFReader(str(path))
    meta = _metadata(reader)
    source = _GGUFSource(reader)
    config = config_from_gguf(meta, source.shapes, dtype)
    H, G = config.n_heads, config.kv_heads

    def unpermute(role: str) -> Callable[[np.ndarray], np.ndarray] | None:
        if role == "wq":
            return lambda w: llama_cpp_unpermute(w, H)
        if role == "wk":
            return lambda w: llama_cpp_unpermute(w, G)
        return None

    specs = (
        _embedding_specs(config, _GGUF_LLAMA)
        + _layer_specs(config, _GGUF_LLAMA, unpermute)
        + _norm_specs(config, None, _GGUF_LLAMA, ("final_norm",))
    )
    ignored: set[str] = set()
    if "rope_freqs.weight" in source.shapes:  # Llama 3.1 frequency factors, one per pair
        factors = source.get("rope_freqs.weight").astype(np.float64).ravel()
        try:
            rope = RoPE(theta=config.rope.theta, freq_factors=tuple(factors))
            config = dataclasses.replace(config, rope=rope)
        except ValueError as err:
            raise CheckpointError(f"rope_freqs.weight: {err}") from None
        ignored.add("rope_freqs.weight")
    source.check_types(n for n in source.shapes if n not in ignored)
    layer, outer, embed = _convert(specs, source, ignored, str(path), dtype)
    model = _build(config, layer, outer, embed)
    tokenizer = tokenizer_from_gguf(meta) if "tokenizer.ggml.model" in meta else None
    return LoadedModel(model, config, tokenizer)


def load(path: str | Path, **kwargs: Any) -> LoadedModel:
    """:func:`load_gguf` for a ``.gguf`` file, :func:`load_hf` otherwise.

    Args:
        path: a ``.gguf`` file or a Hugging Face folder.
        **kwargs: passed on to the loader (``dtype``; for folders also ``download``,
            ``revision``).

    Returns:
        ``LoadedModel(model, config, tokenizer)``.

    Raises:
        CheckpointError: see the two loaders.
    """
    if str(path).endswith(".gguf"):
        return load_gguf(path, **kwargs)
    return load_hf(path, **kwargs)
