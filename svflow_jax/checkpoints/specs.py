"""Building blocks of the families' tensor specifications (:class:`~.base.Spec` lists).

A family whose tensors are one matrix per role (Llama's ``q_proj``, ``k_proj``, ...) lists its
names in a ``names`` mapping from our roles to source names (``{i}`` is the layer index) and
gets its specs from :func:`layer_specs`, :func:`embedding_specs` and :func:`norm_specs`; a
family with fused tensors writes those few specs itself with ``in_heads``, ``out_heads``
and ``heads``.

Source layouts (PyTorch ``nn.Linear``, ``(out, in)``) and ours (``d`` hidden size, ``H``/``G``
query/key-value heads, ``dk`` head width):

* ``(H dk, d)`` -> ``(d, H, dk)``: :func:`in_heads` (Q, K, V);
* ``(d, H dk)`` -> ``(H, dk, d)``: :func:`out_heads` (the attention output);
* ``(f, d)`` -> ``(d, f)``: :func:`transpose` (FFN matrices, the LM head).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from svflow_jax.checkpoints.base import Spec
from svflow_jax.transformer import TransformerConfig

Convert = Callable[[np.ndarray], np.ndarray]


def in_heads(heads: int, dk: int) -> Convert:
    """``(heads dk, d) -> (d, heads, dk)``."""
    return lambda w: w.T.reshape(w.shape[1], heads, dk)


def out_heads(heads: int, dk: int) -> Convert:
    """``(d, heads dk) -> (heads, dk, d)``."""
    return lambda w: w.T.reshape(heads, dk, w.shape[0])


def heads(heads: int, dk: int) -> Convert:
    """``(heads dk,) -> (heads, dk)`` (biases)."""
    return lambda b: b.reshape(heads, dk)


def transpose(w: np.ndarray) -> np.ndarray:
    return w.T


def same(w: np.ndarray) -> np.ndarray:
    return w


def then(first: Convert | None, convert: Convert) -> Convert:
    """``convert(first(w))`` (``convert`` when ``first`` is ``None``)."""
    return convert if first is None else (lambda w: convert(first(w)))


def attention_specs(
    cfg: TransformerConfig, layer: int, names: Mapping[str, str],
    pre: Callable[[str], Convert | None] | None = None,
) -> list[Spec]:
    """Q/K/V/O (+ biases, q/k norms), one source tensor each. ``names`` maps our roles to source
    names; ``pre`` maps a role to a conversion applied first (GGUF's Q/K un-permutation)."""
    d, H, G, dk = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.d_head
    table: list[tuple[str, tuple[int, ...], str, Convert]] = [
        ("wq", (H * dk, d), "wq", in_heads(H, dk)),
        ("wk", (G * dk, d), "wk", in_heads(G, dk)),
        ("wv", (G * dk, d), "wv", in_heads(G, dk)),
        ("wo", (d, H * dk), "wo", out_heads(H, dk)),
    ]
    if cfg.has_qkv_bias:
        table += [
            ("bq", (H * dk,), "bq", heads(H, dk)),
            ("bk", (G * dk,), "bk", heads(G, dk)),
            ("bv", (G * dk,), "bv", heads(G, dk)),
        ]
    if cfg.has_out_bias:
        table.append(("bo", (d,), "bo", same))
    if cfg.qk_norm:
        table += [("q_norm", (dk,), "q_norm_gain", same), ("k_norm", (dk,), "k_norm_gain", same)]
    return [
        Spec(names[role].format(i=layer), shape, target, layer,
             then(pre(role) if pre is not None else None, convert))
        for role, shape, target, convert in table
    ]


def ffn_specs(cfg: TransformerConfig, layer: int, names: Mapping[str, str]) -> list[Spec]:
    """The FFN's matrices (transposed) and biases, one source tensor each."""
    d, f = cfg.d_model, cfg.d_ff
    if cfg.ffn == "swiglu":
        table = [("w_gate", (f, d)), ("w_up", (f, d)), ("w_down", (d, f))]
        biases = [("b_gate", (f,)), ("b_up", (f,)), ("b_down", (d,))]
    else:
        table = [("w_in", (f, d)), ("w_out", (d, f))]
        biases = [("b_in", (f,)), ("b_out", (d,))]
    out = [Spec(names[r].format(i=layer), s, r, layer, transpose) for r, s in table]
    if cfg.has_ffn_bias:
        out += [Spec(names[r].format(i=layer), s, r, layer) for r, s in biases]
    return out


def norm_specs(
    cfg: TransformerConfig, layer: int | None, names: Mapping[str, str], roles: Iterable[str]
) -> list[Spec]:
    """Gains (and LayerNorm biases) of the Norms ``roles``, e.g. ``norm_attn`` ->
    ``norm_attn_gain`` [+ ``norm_attn_bias``]; ``layer=None`` for the stack's own Norm."""
    kinds = ["gain"] + (["bias"] if cfg.has_norm_bias else [])
    return [
        Spec(names[f"{role}_{kind}"].format(i=layer), (cfg.d_model,), f"{role}_{kind}", layer)
        for role in roles
        for kind in kinds
    ]


def layer_specs(
    cfg: TransformerConfig, names: Mapping[str, str],
    pre: Callable[[str], Convert | None] | None = None,
) -> list[Spec]:
    """Attention, FFN and the two per-layer Norms of every layer."""
    out = []
    for i in range(cfg.n_layers):
        out += attention_specs(cfg, i, names, pre)
        out += ffn_specs(cfg, i, names)
        out += norm_specs(cfg, i, names, ("norm_attn", "norm_ffn"))
    return out


def embedding_specs(cfg: TransformerConfig, names: Mapping[str, str]) -> list[Spec]:
    """Token (and position, token-type) embeddings, and an untied LM head (transposed)."""
    V, d = cfg.vocab_size, cfg.d_model
    out = [Spec(names["embed"], (V, d), "embed")]
    if cfg.n_positions:
        out.append(Spec(names["pos_embed"], (cfg.n_positions, d), "pos_embed"))
    if cfg.type_vocab_size:
        out.append(Spec(names["type_embed"], (cfg.type_vocab_size, d), "type_embed"))
    if cfg.lm_head and not cfg.tie_embeddings:
        out.append(Spec(names["unembed"], (V, d), "unembed", None, transpose))
    return out
