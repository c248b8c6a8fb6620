"""The one reader of a Transformer's internals, in flow words.

The diagnostics (:mod:`svflow_jax.diagnose.extract`) and the objective
(:mod:`svflow_jax.objective.bridge`) read the same things off a
:class:`~svflow_jax.transformer.TransformerLM`: for each residual update of each layer, the
stream entering it (whose direction ``x_i = y_i / |y_i|`` is the explained point), the branch
input ``z`` (``Norm(y)`` pre-norm, ``y`` post-norm) and the branches evaluated there. They get
them from the forward pass itself: :func:`read_layers` runs the model's stack once, and each
block reports its sub-steps through its recording hook (``Block.states(record=...)``, a
:class:`~svflow_jax.transformer.model.SubStep` per residual update), so every block the
Transformer builds (sequential, parallel, macaron; pre- or post-norm; dense or MoE) is read
the way it computes, with no replay of its structure here.

The attention branch in flow words: component ``(h, j)`` has the natural parameter

    eta_hj = (z_j W_V^{g(h)} + b_V^{g(h)}) W_O^h + b_O / H        (:func:`natural_parameters`)

(``g(h)`` the key/value group of query head ``h``), and the branch is its posterior mean
``sum_h sum_j q_h(j | x_i) eta_hj`` with ``q_h`` the model's softmax
(``Attention.attention_weights``).

:func:`check_supported` is the one statement of what the bridge reads: everything the
Transformer builds, without a padding mask; and, for an exact map onto a flow
(:mod:`svflow_jax.bridge.correspondence`), a stack that is a discretisation of an SVFlow.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from ..transformer.config import TransformerConfig
from ..transformer.model import Block, SubStep, TransformerLM

__all__ = ["check_supported", "read_layers", "attention_substep", "natural_parameters",
           "head_values", "SubStep"]


def check_supported(model: TransformerLM | TransformerConfig, *, flow: bool = False) -> None:
    """Raises a ``ValueError`` naming every reason the bridge cannot read ``model``.

    The readout (diagnostics, objective) reads every block, Norm and FFN the Transformer
    builds. ``flow=True`` asks more: that the stack be an SVFlow discretisation which
    :func:`svflow_jax.bridge.correspondence.to_flow` expresses exactly. A LayerNorm is one only in
    front of a branch (pre-norm: the branch reads the unit sphere of the centred hyperplane,
    its gain and bias fold into the first linear maps); after the update (post-norm) it puts
    the state on an affine ellipsoid of that hyperplane, not a sphere. A post-norm stack also
    needs ``eps = 0``, without which the Norm is not the retraction. Projected branches are
    read on the sphere of R^d, so not behind a LayerNorm; a LayerNorm's bias in front of a
    router is not expressed (no family has one)."""
    config = model.config if isinstance(model, TransformerLM) else model
    if not isinstance(config, TransformerConfig):
        raise ValueError(f"the bridge reads a TransformerLM or TransformerConfig, got "
                         f"{type(model).__name__}")
    if config.block not in ("sequential", "parallel", "macaron"):
        raise ValueError(f"block={config.block!r}: the bridge reads sequential, parallel and "
                         "macaron blocks")
    if not flow:
        return
    problems = []
    if config.norm != "rms" and config.norm_position == "post":
        problems.append(
            f"norm={config.norm!r} after the update (a post-norm LayerNorm with gain and bias "
            "maps onto an affine ellipsoid of the centred hyperplane, not a sphere; measure the "
            "departure with ellipsoid_residual / sphere_departure)")
    if config.norm != "rms" and config.project_branches:
        problems.append(f"norm={config.norm!r} with projected branches (they are projected "
                        "on the sphere of R^d, the LayerNorm reads the centred hyperplane)")
    if config.ffn == "moe" and config.router_gate != "renormalised":
        problems.append(f"router_gate={config.router_gate!r} (the gate weights do not sum to 1: "
                        "not a router posterior)")
    if config.has_norm_bias and config.ffn == "moe":
        problems.append("a LayerNorm bias in front of a MoE router (the router posterior has "
                        "no offset)")
    if config.norm_position == "post" and config.norm_eps != 0:
        problems.append(f"norm_eps={config.norm_eps} in a post-norm stack (need 0: with eps > 0 "
                        "the Norm is not the retraction onto the sphere)")
    if problems:
        raise ValueError("this Transformer is not an SVFlow discretisation: " + "; ".join(problems))


def read_layers(
    model: TransformerLM,
    tokens: Int[Array, "... n"],
    read: Callable[[Block, list[SubStep], Any], Any],
    per_layer: Any = None,
    *,
    branch: Callable[[Any, Block, str, Array, Array], Array] | None = None,
) -> tuple[Float[Array, "... n d"], Any]:
    """Runs the stack of ``model`` on ``tokens`` once and reads each layer.

    Args:
        read: ``read(layer, substeps, per_layer_t)``: a pytree of arrays computed from the
            layer's recorded :class:`SubStep` list (stacked over layers in the result).
        per_layer: a pytree with a leading layer axis, sliced for each layer (e.g. the
            objective's perturbations); ``None``: nothing.
        branch: ``branch(per_layer_t, layer, name, z, x)`` evaluates the branches (input ``z``,
            stream ``x``) in place of the blocks' own (``Block.states(branch=...)``); the
            blocks' structure is kept.

    Returns:
        ``(y, reads)``: the stack's output before the final Norm, and the stacked reads.
    """
    check_supported(model)
    stack = model.transformer
    x = stack._input(model.embeddings(tokens))
    # A plain lax.scan over the stacked layer state (merged per step): composes with jax.grad
    # and jax.jit of a split model without nnx's trace bookkeeping.
    graphdef, state = nnx.split(stack.layers)

    def step(y, xs):
        layer_state, extra = xs
        layer = nnx.merge(graphdef, layer_state)
        recorded: list[SubStep] = []
        evaluate = None if branch is None else functools.partial(branch, extra)
        y = layer.states(y, record=recorded.append, branch=evaluate)[-1]
        return y, read(layer, recorded, extra)

    return jax.lax.scan(step, x, (state, per_layer))


def attention_substep(substeps: list[SubStep]) -> SubStep:
    """The recorded sub-step that holds the attention branch (the second of a macaron
    block, after the first FFN half-step)."""
    return next(s for s in substeps if "attn" in s.names)


def head_values(attn, z: Float[Array, "... n d"]) -> Float[Array, "... H n k"]:
    """``z_j W_V^{g(h)} + b_V^{g(h)}`` per query head."""
    v = jnp.einsum("...nd,dgk->...gnk", z, attn.wv[...].astype(z.dtype))
    if attn.bv is not None:
        v = v + attn.bv[...].astype(z.dtype)[:, None, :]
    return jnp.repeat(v, attn.n_heads // attn.n_kv_heads, axis=-3)


def natural_parameters(attn, z: Float[Array, "... n d"]) -> Float[Array, "... H n d"]:
    """``eta_hj = (z_j W_V^g + b_V^g) W_O^h + b_O / H`` of an ``Attention`` at branch input
    ``z`` (module docstring)."""
    eta = jnp.einsum("...hnk,hkd->...hnd", head_values(attn, z), attn.wo[...].astype(z.dtype))
    if attn.bo is not None:
        eta = eta + attn.bo[...].astype(z.dtype) / attn.n_heads
    return eta
