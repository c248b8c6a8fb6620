"""Named, stacked parameter arrays of a ``Transformer``: the interface other code relies on.

``layer_params(model)`` returns a flat ``dict[str, Array]``; every array has the layer axis
``L`` first. ``d = d_model``, ``H = n_heads``, ``Hkv = kv_heads``, ``dk = d_head``, ``f = d_ff``,
``E = n_experts``; ``[...]`` marks arrays present only with the flag named.

```text
=================  ======================  ==================================================
name               shape                   role
=================  ======================  ==================================================
wq                 (L, d, H, dk)           queries  ``q_h = x wq[:, h]``
wk, wv             (L, d, Hkv, dk)         keys, values (head ``h`` reads ``h // (H/Hkv)``)
wo                 (L, H, dk, d)           output   ``sum_h o_h wo[h]``
[bq]               (L, H, dk)              has_qkv_bias
[bk, bv]           (L, Hkv, dk)            has_qkv_bias
[bo]               (L, d)                  has_out_bias
[q_norm_gain,      (L, dk)                 qk_norm (per-head RMSNorm of queries and keys)
 k_norm_gain]
w_in, w_out        (L, d, f), (L, f, d)    ffn="gelu":   ``w_out^T gelu(w_in^T x)``
w_gate, w_up       (L, d, f)               ffn="swiglu": ``w_down^T (silu(w_gate^T x) * ...``
w_down             (L, f, d)               ...``w_up^T x)``
[b_in, b_gate,     (L, f)                  has_ffn_bias
 b_up]
[b_out, b_down]    (L, d)                  has_ffn_bias
router             (L, d, E)               ffn="moe": logits ``x router`` (no bias)
expert weights     (L, E, ...)             ffn="moe": the gelu/swiglu names above with an
                                           expert axis after L, e.g. w_in (L, E, d, f),
                                           b_out (L, E, d)
[norm_attn_gain,   (L, d)                  norm_gain; sequential/macaron (macaron's two FFN
 norm_ffn_gain]                            halves share norm_ffn)
[norm_gain]        (L, d)                  norm_gain; parallel (one Norm per layer)
[..._bias]         (L, d)                  has_norm_bias (LayerNorm): same names, ``_bias``
=================  ======================  ==================================================
```

``outer_norm_params(model)`` returns the (unstacked, ``(d,)``) gain/bias of the stack's own
Norm: ``input_norm_gain`` [``input_norm_bias``] (post-norm) or ``final_norm_gain``
[``final_norm_bias``] (pre-norm with ``final_norm``); empty when that Norm has no parameters.

``embedding_params(lm)`` returns the ``TransformerLM``'s own arrays: ``embed (V, d)``,
[``pos_embed (P, d)``] (``n_positions``), [``type_embed (T, d)``] (``type_vocab_size``),
[``unembed (d, V)``] (``lm_head`` and not ``tie_embeddings``), [``unembed_bias (V,)``]
(``lm_head`` and ``head_bias``).

The setters check names, shapes and dtypes strictly (no silent casting) and store the given
arrays as they are, so a get/set round trip is bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array

# The model classes are not imported here (model.py imports this module): the accessors take a
# ``Transformer`` or a ``TransformerLM`` as an ``nnx.Module`` and read it by attribute name.

__all__ = [
    "layer_params",
    "set_layer_params",
    "outer_norm_params",
    "set_outer_norm_params",
    "embedding_params",
    "set_embedding_params",
]


def _name(path: tuple) -> str:
    """Public name of a parameter from its NNX path inside a Block / the Transformer."""
    path = tuple(str(p) for p in path)
    if path[0] in ("attn", "ffn"):
        return path[-1]  # wq, ..., w_in, router, experts/w_in -> w_in
    return f"{path[0]}_{path[-1]}"  # norm_attn/gain -> norm_attn_gain


def _named_params(node: nnx.Module) -> Iterator[tuple[str, nnx.Param]]:
    for path, value in nnx.iter_graph(node):
        if isinstance(value, nnx.Param) and path:
            yield _name(path), value


def _layer_vars(model: nnx.Module) -> dict[str, nnx.Param]:
    out: dict[str, nnx.Param] = {}
    for name, var in _named_params(getattr(model, "layers")):  # noqa: B009 (any nnx.Module)
        assert name not in out, f"duplicate parameter name {name}"  # guards the naming rule
        out[name] = var
    return out


def _outer_vars(model: nnx.Module) -> dict[str, nnx.Param]:
    out: dict[str, nnx.Param] = {}
    for attr in ("input_norm", "final_norm"):
        norm = getattr(model, attr)
        if norm is not None:
            for name, var in _named_params(norm):
                out[f"{attr}_{name.split('_')[-1]}"] = var
    return out


def _set(variables: dict[str, nnx.Param], params: Mapping[str, Array], what: str) -> None:
    missing, unknown = set(variables) - set(params), set(params) - set(variables)
    if missing or unknown:
        raise KeyError(
            f"{what}: missing {sorted(missing)}, unexpected {sorted(unknown)}; "
            f"expected exactly {sorted(variables)}"
        )
    for name, var in variables.items():
        new = jnp.asarray(params[name])
        old = var.get_value()  # may be abstract (ShapeDtypeStruct) before the first set
        if new.shape != old.shape or new.dtype != old.dtype:
            raise ValueError(
                f"{what}[{name!r}]: got {new.dtype}{list(new.shape)}, "
                f"expected {old.dtype}{list(old.shape)}"
            )
    for name, var in variables.items():
        var.set_value(jnp.asarray(params[name]))


def layer_params(model: nnx.Module) -> dict[str, Array]:
    """The per-layer parameters, stacked along a leading layer axis (layout: module docstring)."""
    return {name: var.get_value() for name, var in _layer_vars(model).items()}


def set_layer_params(model: nnx.Module, params: Mapping[str, Array]) -> None:
    """Overwrite the per-layer parameters in place with ``params`` (same names, shapes, dtypes)."""
    _set(_layer_vars(model), params, "layer_params")


def outer_norm_params(model: nnx.Module) -> dict[str, Array]:
    """Gain/bias of the stack's input (post-norm) or final (pre-norm) Norm, if any."""
    return {name: var.get_value() for name, var in _outer_vars(model).items()}


def set_outer_norm_params(model: nnx.Module, params: Mapping[str, Array]) -> None:
    """Overwrite the outer Norm parameters in place (same names, shapes, dtypes)."""
    _set(_outer_vars(model), params, "outer_norm_params")


_EMBEDDINGS = ("embed", "pos_embed", "type_embed", "unembed", "unembed_bias")


def _embedding_vars(lm: nnx.Module) -> dict[str, nnx.Param]:
    return {name: getattr(lm, name) for name in _EMBEDDINGS if getattr(lm, name) is not None}


def embedding_params(lm: nnx.Module) -> dict[str, Array]:
    """The embeddings and LM head of a ``TransformerLM`` (layout: module docstring)."""
    return {name: var[...] for name, var in _embedding_vars(lm).items()}


def set_embedding_params(lm: nnx.Module, params: Mapping[str, Array]) -> None:
    """Overwrite the embeddings and LM head in place (same names, shapes, dtypes)."""
    _set(_embedding_vars(lm), params, "embedding_params")
