"""What every checkpoint format shares: the error, the result, tensor specifications and the
one conversion from a source's tensors to a ``TransformerLM``.

A :class:`Spec` maps ``k`` source tensors (names and shapes in the file) to ``m`` targets
(names of :func:`~svflow_jax.transformer.layer_params`, :func:`outer_norm_params` or
:func:`embedding_params`) through one function ``convert(*sources) -> targets``; ``k = m = 1``
is the common case, ``k = 1, m = 3`` a fused QKV matrix (GPT-2's ``c_attn``), ``k = 2, m = 3``
that matrix with a LayerNorm gain folded in (GPT-NeoX), ``k = 0`` a constant. Sizes read from a
configuration are bounded (:data:`MAX_SIZES`, :meth:`ConfigReader.int`), so one that asks for
10^9 layers is refused before anything is planned or allocated; :func:`convert` then checks
every name and shape of a source against the specs before it reads a single tensor, and reads,
casts, converts, refuses non-finite values by tensor name, and stacks the per-layer targets.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from svflow_jax.checkpoints.paths import CheckpointError
from svflow_jax.transformer import (
    TransformerConfig,
    TransformerLM,
    set_embedding_params,
    set_layer_params,
    set_outer_norm_params,
)

__all__ = [
    "CheckpointError",
    "LoadedModel",
    "Spec",
    "Source",
    "ConfigReader",
    "convert",
    "build",
    "MAX_SIZES",
]


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


# Upper bounds on configuration sizes, far above any published model (the largest have ~10^5
# hidden units, ~10^2 layers, ~10^6 vocabulary entries); a value above one is a damaged or
# hostile file, refused before any array of that size is planned or allocated.
MAX_SIZES: dict[str, int] = {
    "layers": 4096,
    "width": 1 << 18,  # d_model, d_ff, heads x head width
    "heads": 4096,
    "vocab": 1 << 23,
    "positions": 1 << 24,
}


class ConfigReader:
    """Typed, bounded access to a configuration mapping (``config.json`` or GGUF metadata):
    every missing key, wrong type or out-of-range size is a :class:`CheckpointError` naming
    ``where`` and the key."""

    def __init__(self, values: Mapping[str, Any], where: str):
        if not isinstance(values, Mapping):
            raise CheckpointError(f"{where}: expected a JSON object, got {type(values).__name__}")
        self.values, self.where = values, where

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: {message}")

    def require(self, key: str) -> Any:
        if self.values.get(key) is None:
            raise self.error(f"missing key {key!r}")
        return self.values[key]

    def int(self, key: str, default: Any = None, *, kind: str | None = None,
            low: int = 1) -> int:
        """``values[key]`` (``default`` when absent or null) as a whole number in
        ``[low, MAX_SIZES[kind]]``."""
        value = self.values.get(key)
        value = default if value is None else value
        if value is None:
            raise self.error(f"missing key {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer)) or (
            isinstance(value, float) and not value.is_integer()
        ):
            raise self.error(f"{key}={value!r} is not a whole number")
        value = int(value)
        high = MAX_SIZES[kind] if kind is not None else None
        if value < low or (high is not None and value > high):
            bound = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise self.error(f"{key}={value} is outside {bound}")
        return value

    def float(self, key: str, default: Any = None) -> float:
        value = self.values.get(key)
        value = default if value is None else value
        if value is None:
            raise self.error(f"missing key {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not (
            np.isfinite(value)
        ):
            raise self.error(f"{key}={value!r} is not a finite number")
        return float(value)


def _as_tuple(x: Any) -> tuple:
    return (x,) if isinstance(x, str) else tuple(x)


@dataclass(frozen=True)
class Spec:
    """Source tensors (names and NumPy-order shapes in the file) -> target arrays.

    ``sources``/``targets`` may be one name or a tuple; with one source, ``shapes`` is its
    shape, otherwise a tuple of shapes (no sources: a constant, such as the unit gains of a
    Norm whose gains were folded elsewhere). ``convert(*arrays)`` returns one array per target
    (a bare array when there is one target). ``layer`` is the layer index of per-layer targets
    (stacked along a leading axis by :func:`convert`), ``None`` for the embeddings, LM head and
    the stack's own Norm.
    """

    sources: str | tuple[str, ...]
    shapes: tuple
    targets: str | tuple[str, ...]
    layer: int | None = None
    convert: Callable[..., Any] = lambda w: w

    def __post_init__(self) -> None:
        sources = _as_tuple(self.sources)
        shapes = (tuple(self.shapes),) if isinstance(self.sources, str) else tuple(
            tuple(s) for s in self.shapes)
        if len(shapes) != len(sources):
            raise ValueError(f"Spec {sources}: {len(shapes)} shapes for {len(sources)} sources")
        object.__setattr__(self, "sources", sources)
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "targets", _as_tuple(self.targets))

    def apply(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        out = self.convert(*arrays)
        out = (out,) if isinstance(out, np.ndarray) else tuple(out)
        if len(out) != len(self.targets):
            raise ValueError(f"Spec {self.sources}: {len(out)} arrays for {self.targets}")
        return out


class Source:
    """Tensors of a checkpoint: ``shapes`` (NumPy order) without loading, ``get`` to load.
    ``where`` names the file or folder in messages."""

    shapes: dict[str, tuple[int, ...]]
    where: str

    def get(self, name: str) -> np.ndarray:
        raise NotImplementedError


def _listing(names: Sequence[str], limit: int = 20) -> str:
    names = sorted(names)
    if len(names) <= limit:
        return str(names)
    return f"{names[:limit]} and {len(names) - limit} more"


_EMBEDDINGS = ("embed", "pos_embed", "type_embed", "unembed")


def _check_finite(name: str, value: np.ndarray, where: str, allow: bool) -> None:
    if value.dtype.kind != "f":
        return
    bad = ~np.isfinite(value)
    if not bad.any():
        return
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    message = (f"{where}: tensor {name!r} has {int(bad.sum())} non-finite value(s) (NaN or inf), "
               f"the first at index {first}")
    if not allow:
        raise CheckpointError(message + "; pass allow_nonfinite=True to load it anyway")
    warnings.warn(message + " (loaded anyway: allow_nonfinite=True)", RuntimeWarning,
                  stacklevel=3)


def convert(
    specs: list[Spec], source: Source, ignored: set[str], dtype: Any,
    allow_nonfinite: bool = False,
) -> tuple[dict, dict, dict]:
    """Checks names and shapes (reporting every problem at once), then loads and converts.

    Returns ``(layer, outer, embed)``: per-layer targets stacked ``(L, ...)``, the outer Norm's
    and the embeddings' arrays.
    """
    where = source.where
    expected = {name: shape for s in specs for name, shape in zip(s.sources, s.shapes, strict=True)}
    present = set(source.shapes) - ignored
    missing, extra = set(expected) - present, present - set(expected)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing tensors {_listing(missing)}")
        if extra:
            parts.append(f"unexpected (extra) tensors {_listing(extra)}")
        raise CheckpointError(f"{where}: " + "; ".join(parts))
    bad = [
        f"{name}: expected shape {shape}, got {tuple(source.shapes[name])}"
        for name, shape in expected.items()
        if tuple(source.shapes[name]) != shape
    ]
    if bad:
        raise CheckpointError(f"{where}: shape mismatch: " + "; ".join(bad))

    np_dtype = np.dtype(jnp.dtype(dtype))
    groups: dict[str, dict[str, Any]] = {"layer": {}, "outer": {}, "embed": {}}
    for s in specs:
        arrays = []
        for name in s.sources:
            value = np.asarray(source.get(name)).astype(np_dtype)  # bf16/f16 -> dtype
            _check_finite(name, value, where, allow_nonfinite)
            arrays.append(value)
        for target, value in zip(s.targets, s.apply(*arrays), strict=True):
            value = np.ascontiguousarray(value, dtype=np_dtype)  # a fold may compute in f64
            if s.layer is not None:
                groups["layer"].setdefault(target, {})[s.layer] = value
            else:
                groups["embed" if target in _EMBEDDINGS else "outer"][target] = value
    layer = {
        name: np.stack([per_layer[i] for i in range(len(per_layer))])
        for name, per_layer in groups["layer"].items()
    }
    return layer, groups["outer"], groups["embed"]


def build(config: TransformerConfig, layer: dict, outer: dict, embed: dict) -> TransformerLM:
    """A ``TransformerLM`` with exactly these weights (no random initialisation)."""
    model = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    set_layer_params(model.transformer, {k: jnp.asarray(v) for k, v in layer.items()})
    set_outer_norm_params(model.transformer, {k: jnp.asarray(v) for k, v in outer.items()})
    set_embedding_params(model, {k: jnp.asarray(v) for k, v in embed.items()})
    return model


def hf_sizes(hf: ConfigReader) -> dict[str, int]:
    """``d_model``, ``n_layers``, ``n_heads``, ``d_ff``, ``vocab_size`` from the usual
    ``config.json`` keys (``hidden_size``, ``num_hidden_layers``, ...), each bounded."""
    return dict(
        d_model=hf.int("hidden_size", kind="width"),
        n_layers=hf.int("num_hidden_layers", kind="layers"),
        n_heads=hf.int("num_attention_heads", kind="heads"),
        d_ff=hf.int("intermediate_size", kind="width"),
        vocab_size=hf.int("vocab_size", kind="vocab"),
    )


def make_config(where: str, **fields: Any) -> TransformerConfig:
    """``TransformerConfig(**fields)``; its own validation errors name ``where``."""
    try:
        return TransformerConfig(**fields)
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{where}: inconsistent configuration: {err}") from None


def tokenizer_from_file(path: Path) -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json``, or a :class:`CheckpointError`."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the Rust library raises a bare Exception
        raise CheckpointError(f"{path}: unreadable tokenizer ({err})") from None
