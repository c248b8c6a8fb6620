"""Architecture families: one module per family, each defining ``FAMILY`` (a :class:`Family`).

A family says how a Hugging Face ``config.json`` of its ``model_type`` (s) becomes a
``TransformerConfig`` and which source tensors become which parameters (a list of
:class:`~svflow_jax.checkpoints.base.Spec`). The modules of this package are found when it is
imported, so adding a family is adding a module here (plus its golden file and test).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from svflow_jax.checkpoints.base import CheckpointError, ConfigReader, Spec
from svflow_jax.transformer import TransformerConfig

__all__ = ["Family", "FAMILIES", "family", "GGUFLayout"]


def _keep(name: str) -> str:
    return name


def _nothing(name: str) -> bool:
    return False


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp stores a family: its ``general.architecture`` name, our roles -> tensor
    names, and a conversion applied first per role (llama.cpp's Q/K row permutation)."""

    architecture: str
    names: Mapping[str, str]
    pre: Callable[[str, TransformerConfig], Callable | None] | None = None


@dataclass(frozen=True)
class Family:
    """One architecture family.

    Attributes:
        model_types: the ``config.json`` ``model_type`` values it reads.
        config: ``(config.json as a ConfigReader, param dtype) -> TransformerConfig``; refuses
            (with :meth:`ConfigReader.error`) what the Transformer cannot honour.
        specs: ``(config, model_type) -> list[Spec]``: every tensor of the file and where it
            goes.
        rename: a file's tensor name -> the name the specs use (old spellings).
        ignore: tensor names that are no part of the model (buffers, unused heads).
        tied_head: ``(head, embedding)`` names: a file may store a tied LM head, accepted only
            when equal to the embedding.
        refused: related ``model_type`` s refused by name, with what differs.
        gguf: the family's GGUF layout, if llama.cpp files of it are read.
    """

    model_types: tuple[str, ...]
    config: Callable[[ConfigReader, Any], TransformerConfig]
    specs: Callable[[TransformerConfig, str], list[Spec]]
    rename: Callable[[str], str] = _keep
    ignore: Callable[[str], bool] = _nothing
    tied_head: tuple[str, str] | None = None
    refused: Mapping[str, str] = field(default_factory=dict)
    gguf: GGUFLayout | None = None


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        fam = getattr(module, "FAMILY", None)
        if isinstance(fam, Family):
            for model_type in fam.model_types:
                if model_type in found:
                    raise RuntimeError(f"model_type {model_type!r} claimed by two families")
                found[model_type] = fam
    return found


FAMILIES: dict[str, Family] = _discover()


def family(model_type: Any, where: str) -> Family:
    """The family reading ``model_type``, or a :class:`CheckpointError` naming what is
    supported (and, for a relative of a supported family, what differs)."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    for fam in FAMILIES.values():
        if model_type in fam.refused:
            raise CheckpointError(f"{where}: model_type {model_type!r} is not supported: "
                                  f"{fam.refused[model_type]}")
    raise CheckpointError(
        f"{where}: unknown model_type {model_type!r}; supported: {', '.join(FAMILIES)}"
    )
