"""GGUF files (llama.cpp's format): float or quantised tensors, dequantised with the ``gguf``
package, and the tokenizer stored in the metadata (``tokenizer.ggml.*``, byte-level BPE). The
header and tensor table are read by :mod:`.gguf_file`.

The ``general.architecture`` picks the family (a :class:`~.families.GGUFLayout`); today
``llama``. GGUF lists dimensions innermost first; the arrays here (and our shapes) are in NumPy
order. A ``rope_freqs`` tensor (Llama 3.1's frequency factors) becomes ``RoPE.freq_factors``.
A damaged file (truncated, a flipped count byte, a tensor cut short) is a
:class:`~.base.CheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from svflow_jax.checkpoints.base import (
    CheckpointError,
    ConfigReader,
    LoadedModel,
    Source,
    build,
    convert,
    make_config,
)
from svflow_jax.checkpoints.families import FAMILIES, GGUFLayout
from svflow_jax.checkpoints.families.llama import llama_cpp_unpermute
from svflow_jax.checkpoints.gguf_file import GGUFTensor, read_gguf
from svflow_jax.checkpoints.specs import embedding_specs, layer_specs, norm_specs
from svflow_jax.transformer import RoPE, TransformerConfig

__all__ = ["load_gguf", "config_from_gguf", "tokenizer_from_gguf", "llama_cpp_unpermute"]

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _layouts() -> dict[str, GGUFLayout]:
    return {f.gguf.architecture: f.gguf for f in FAMILIES.values() if f.gguf is not None}


class GGUFSource(Source):
    def __init__(self, tensors: Mapping[str, GGUFTensor], where: str):
        self.where = where
        self._tensors = dict(tensors)
        self.shapes = {name: t.shape for name, t in tensors.items()}

    def check_types(self, names: Iterable[str]) -> None:
        import gguf

        bad = []
        for name in names:
            qtype = self._tensors[name].qtype
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
                f"{self.where}: unsupported GGUF quantisation type (the gguf package cannot "
                "dequantise it): " + "; ".join(bad)
            )

    def get(self, name: str) -> np.ndarray:
        import gguf

        t = self._tensors[name]
        shape = self.shapes[name]
        try:
            if t.qtype.name in _FLOAT_TYPES and t.qtype.name != "BF16":
                return np.asarray(t.data).reshape(shape)
            return gguf.quants.dequantize(t.data, t.qtype).reshape(shape)
        except Exception as err:  # noqa: BLE001 - a tensor cut short, a damaged block
            raise CheckpointError(
                f"{self.where}: tensor {name!r} unreadable (expected shape {shape}; {err})"
            ) from None


def config_from_gguf(
    meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]] | None = None,
    dtype: Any = jnp.float32, where: str = "GGUF metadata",
) -> TransformerConfig:
    """The ``TransformerConfig`` of a GGUF's metadata (a pre-RMSNorm SwiGLU decoder)."""
    arch = meta.get("general.architecture")
    layouts = _layouts()
    if arch not in layouts:
        raise CheckpointError(
            f"{where}: unsupported GGUF architecture {arch!r}; supported: "
            + ", ".join(repr(a) for a in layouts)
        )
    tensor_shapes = tensor_shapes or {}
    m = ConfigReader(meta, where)

    def key(name: str) -> str:
        return f"{arch}.{name}"

    d, H = m.int(key("embedding_length"), kind="width"), m.int(key("attention.head_count"),
                                                               kind="heads")
    if m.int(key("expert_count"), 0, low=0) > 0:
        raise m.error(f"GGUF {arch} with experts (MoE) is not supported")
    head_dim = m.int(key("attention.key_length"), d // H, kind="width")
    rope_dim = m.int(key("rope.dimension_count"), head_dim, kind="width")
    if rope_dim != head_dim:
        raise m.error(f"partial RoPE (rope.dimension_count={rope_dim} < {head_dim})")
    scaling = meta.get(key("rope.scaling.type"), "none")
    if scaling not in ("none", None):
        raise m.error(f"unsupported GGUF rope scaling type {scaling!r}")
    if meta.get(key("attention.sliding_window")):
        raise m.error("sliding-window attention is not supported")
    if key("vocab_size") in meta:
        vocab = m.int(key("vocab_size"), kind="vocab")
    elif "token_embd.weight" in tensor_shapes:
        vocab = tensor_shapes["token_embd.weight"][0]
    else:
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise m.error(f"neither {key('vocab_size')} nor token_embd.weight nor a tokenizer")
        vocab = len(tokens)
    return make_config(
        where,
        d_model=d,
        n_layers=m.int(key("block_count"), kind="layers"),
        n_heads=H,
        d_head=head_dim,
        d_ff=m.int(key("feed_forward_length"), kind="width"),
        n_kv_heads=m.int(key("attention.head_count_kv"), H, kind="heads"),
        norm_position="pre",
        norm="rms",
        norm_eps=m.float(key("attention.layer_norm_rms_epsilon")),
        final_norm=True,
        causal=True,
        ffn="swiglu",
        qkv_bias=False,
        out_bias=False,
        ffn_bias=False,
        rope=RoPE(theta=m.float(key("rope.freq_base"), 10000.0)),
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


def _read(path: Path) -> tuple[dict[str, Any], GGUFSource]:
    """The metadata and tensors of a GGUF file; a damaged file is a :class:`CheckpointError`."""
    meta, tensors = read_gguf(path)
    return meta, GGUFSource(tensors, str(path))


def load_gguf(
    path: str | Path, *, dtype: Any = jnp.float32, allow_nonfinite: bool = False
) -> LoadedModel:
    """A GGUF file as a ``TransformerLM``, with the GGUF's own tokenizer.

    Args:
        path: the ``.gguf`` file; quantised tensors are dequantised with the ``gguf`` package
            and Q/K rows un-permuted from llama.cpp's RoPE layout.
        dtype: dtype of the parameters (default float32).
        allow_nonfinite: load tensors holding NaN or inf (with a warning naming them) instead
            of refusing them.

    Returns:
        ``LoadedModel(model, config, tokenizer)`` (the tokenizer built from the GGUF's BPE).

    Raises:
        CheckpointError: another architecture, an unsupported quantisation, missing or
            misshapen tensors, a damaged file, non-finite weights.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    meta, source = _read(path)
    config = config_from_gguf(meta, source.shapes, dtype, str(path))
    layout = _layouts()[meta["general.architecture"]]

    def pre(role: str) -> Any:
        return layout.pre(role, config) if layout.pre is not None else None

    names = layout.names
    specs = (
        embedding_specs(config, names)
        + layer_specs(config, names, pre)
        + norm_specs(config, None, names, ("final_norm",))
    )
    ignored: set[str] = set()
    if "rope_freqs.weight" in source.shapes:  # Llama 3.1 frequency factors, one per pair
        factors = source.get("rope_freqs.weight").astype(np.float64).ravel()
        try:
            rope = RoPE(theta=config.rope.theta, freq_factors=tuple(factors))
            config = dataclasses.replace(config, rope=rope)
        except ValueError as err:
            raise CheckpointError(f"{path}: rope_freqs.weight: {err}") from None
        ignored.add("rope_freqs.weight")
    source.check_types(n for n in source.shapes if n not in ignored)
    layer, outer, embed = convert(specs, source, ignored, dtype, allow_nonfinite)
    model = build(config, layer, outer, embed)
    tokenizer = None
    if "tokenizer.ggml.model" in meta:
        try:
            tokenizer = tokenizer_from_gguf(meta)
        except CheckpointError as err:
            raise CheckpointError(f"{path}: {err}") from None
        except Exception as err:  # noqa: BLE001 - damaged token lists, merges, ids
            raise CheckpointError(
                f"{path}: unreadable tokenizer metadata ({type(err).__name__}: {err})"
            ) from None
    return LoadedModel(model, config, tokenizer)
