"""Hugging Face model folders: ``config.json``, ``model.safetensors`` (or a sharded
``model.safetensors.index.json``) and ``tokenizer.json`` when present.

The ``model_type`` picks the family (:mod:`svflow_jax.checkpoints.families`); the family turns
the configuration into a ``TransformerConfig`` and lists the tensors; :func:`~.base.convert`
checks and converts them. Every problem with the folder's files is a
:class:`~.base.CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import struct
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
    tokenizer_from_file,
)
from svflow_jax.checkpoints.families import FAMILIES, family
from svflow_jax.transformer import TransformerConfig

__all__ = ["load_hf", "config_from_hf", "SUPPORTED_MODEL_TYPES", "read_json"]

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


def read_json(path: Path) -> Any:
    """A JSON file's content, or a :class:`CheckpointError` naming the file."""
    try:
        return json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable JSON ({err})") from None


def config_from_hf(hf: Any, dtype: Any = jnp.float32, where: str = "config.json"
                   ) -> TransformerConfig:
    """The ``TransformerConfig`` of a Hugging Face ``config.json`` (as a dict)."""
    reader = ConfigReader(hf, where)
    return family(reader.get("model_type"), where).config(reader, dtype)


def _read_raw_safetensors(path: Path, name: str) -> np.ndarray:
    """One tensor read directly from the file, for dtypes NumPy lacks (bfloat16, float8)."""
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
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    return np.frombuffer(raw, dtypes[info["dtype"]]).reshape(info["shape"])


class SafetensorsFolder(Source):
    """The tensors of a folder's safetensors file(s), renamed by ``rename``."""

    def __init__(self, folder: Path, rename=lambda name: name):
        from safetensors import safe_open

        self.where = str(folder)
        single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index)
            if not isinstance(weight_map, dict) or not isinstance(
                weight_map.get("weight_map"), dict
            ):
                raise CheckpointError(f"{index}: no 'weight_map' object")
            files = sorted(set(map(str, weight_map["weight_map"].values())))
        elif single.exists():
            files = [single.name]
        else:
            raise CheckpointError(
                f"{folder}: neither model.safetensors nor model.safetensors.index.json"
            )
        self._file: dict[str, Path] = {}
        self._stored: dict[str, str] = {}  # our name -> name in the file
        self.shapes = {}
        for file in files:
            path = folder / file
            if not path.is_file():
                raise CheckpointError(f"{folder}: shard {file} listed in the index is missing")
            try:
                with safe_open(str(path), framework="numpy") as f:
                    for stored in f.keys():
                        name = rename(stored)
                        self._file[name], self._stored[name] = path, stored
                        self.shapes[name] = tuple(f.get_slice(stored).get_shape())
            except Exception as err:  # noqa: BLE001 - SafetensorError and OSError alike
                raise CheckpointError(f"{path}: unreadable safetensors header ({err})") from None

    def get(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        path, stored = self._file[name], self._stored[name]
        try:
            try:
                with safe_open(str(path), framework="numpy") as f:
                    return f.get_tensor(stored)
            except TypeError:  # a dtype NumPy does not know (bfloat16, float8)
                return _read_raw_safetensors(path, stored)
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - a file changed or damaged after its header
            raise CheckpointError(f"{path}: tensor {stored!r} unreadable ({err})") from None


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
    allow_nonfinite: bool = False,
) -> LoadedModel:
    """A Hugging Face model folder (see :data:`SUPPORTED_MODEL_TYPES`) as a ``TransformerLM``.

    ``download=True`` fetches ``path`` as a hub repository id with
    ``huggingface_hub.snapshot_download`` when it is not a local folder (needs that package
    and a network connection; nothing else here does).

    Args:
        path: a folder with ``config.json``, ``model.safetensors`` (or a sharded index) and
            ``tokenizer.json``; with ``download=True``, a hub repository id.
        dtype: dtype of the parameters (default float32).
        download: fetch ``path`` from the hub when it is not a local folder.
        revision: the hub revision to fetch (with ``download=True``).
        allow_nonfinite: load tensors holding NaN or inf (with a warning naming them) instead
            of refusing them.

    Returns:
        ``LoadedModel(model, config, tokenizer)``.

    Raises:
        CheckpointError: anything the Transformer cannot honour exactly (an unknown
            ``model_type``, a RoPE type, sliding windows, missing, extra or misshapen tensors),
            an unreadable or damaged file, a missing or out-of-range configuration value, or
            non-finite weights, named in the message.
    """
    folder = _resolve_folder(path, download, revision)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder}: no config.json")
    hf = read_json(config_path)
    config = config_from_hf(hf, dtype, str(config_path))
    model_type = hf["model_type"]
    fam = FAMILIES[model_type]
    source = SafetensorsFolder(folder, fam.rename)
    ignored = {name for name in source.shapes if fam.ignore(name)}
    if fam.tied_head is not None and config.tie_embeddings and fam.tied_head[0] in source.shapes:
        # Some writers save the tied head anyway: accept it only if it is the embedding.
        head_name, embed_name = fam.tied_head
        if embed_name in source.shapes:
            head, emb = source.get(head_name), source.get(embed_name)
            if head.shape != emb.shape or not np.array_equal(head, emb):
                raise CheckpointError(
                    f"{folder}: tie_word_embeddings is true but {head_name} differs from the "
                    "embedding"
                )
            ignored.add(head_name)
    specs = fam.specs(config, model_type)
    layer, outer, embed = convert(specs, source, ignored, dtype, allow_nonfinite)
    model = build(config, layer, outer, embed)
    tokenizer = None
    if (folder / "tokenizer.json").exists():
        tokenizer = tokenizer_from_file(folder / "tokenizer.json")
    return LoadedModel(model, config, tokenizer)
