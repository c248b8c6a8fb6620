"""The standard Transformer, in deep-learning vocabulary (Q/K/V/O, softmax, residual, Norm).

Nothing here knows about spheres, flows or vMF kernels; the correspondence with the flow side is
made elsewhere, through the parameter accessors of ``svflow_jax.transformer.params``.
"""

from svflow_jax.transformer.config import RoPE, TransformerConfig
from svflow_jax.transformer.model import (
    FFN,
    Attention,
    Block,
    MoE,
    Norm,
    Transformer,
    TransformerLM,
    apply_rope,
    tangent_project,
)
from svflow_jax.transformer.params import (
    embedding_params,
    layer_params,
    outer_norm_params,
    set_embedding_params,
    set_layer_params,
    set_outer_norm_params,
)

__all__ = [
    "TransformerConfig",
    "RoPE",
    "Norm",
    "Attention",
    "FFN",
    "MoE",
    "Block",
    "Transformer",
    "TransformerLM",
    "tangent_project",
    "apply_rope",
    "layer_params",
    "set_layer_params",
    "outer_norm_params",
    "set_outer_norm_params",
    "embedding_params",
    "set_embedding_params",
]
