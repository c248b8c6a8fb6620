"""Hyper-parameters of the standard Transformer stack, validated once at construction.

Decisions worth knowing
-----------------------
* ``d_model != n_heads * d_head`` is **allowed** (as in T5): the attention projects ``d_model``
  to ``n_heads * d_head`` and ``W_O`` projects back, so nothing in the maths needs equality.
* ``n_kv_heads`` (grouped-query attention) defaults to ``n_heads`` (plain multi-head attention)
  and must divide ``n_heads``. Query head ``h`` reads key/value head ``h // (n_heads //
  n_kv_heads)`` (Llama's ``repeat_kv`` order).
* ``final_norm`` only concerns pre-norm stacks. A post-norm stack always normalises its input
  first (as BERT does after the embeddings) and ends on a Norm anyway, so the flag is ignored.
* The MoE fields (``n_experts``, ``top_k``) must be set for ``ffn="moe"`` and left ``None``
  otherwise, so that a forgotten ``ffn="moe"`` is an error rather than a silent dense FFN.
* ``rope`` is a hook: it must be ``None`` until rotary embeddings are implemented.
* ``init_std``: every weight matrix (Q/K/V/O, FFN, router, expert weights, embeddings) is drawn
  from ``N(0, init_std^2)`` (nanoGPT/GPT-2 style, default 0.02); biases start at 0, gains at 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import jax.numpy as jnp

__all__ = ["TransformerConfig"]

NormPosition = Literal["post", "pre"]
BlockKind = Literal["sequential", "parallel", "macaron"]
NormKind = Literal["rms", "layer"]
FFNKind = Literal["gelu", "swiglu", "moe"]
ExpertFFNKind = Literal["gelu", "swiglu"]

_SUBSTEPS = {"sequential": 2, "parallel": 1, "macaron": 3}


@dataclass(frozen=True)
class TransformerConfig:
    """Everything that fixes the function a Transformer stack computes (weights aside).

    Attributes:
        d_model: width ``d`` of the residual stream.
        n_layers: number of layers ``L``.
        n_heads: number of query heads ``H``.
        d_head: width of one head.
        d_ff: hidden width of the FFN (of each expert, for MoE).
        n_kv_heads: number of key/value heads (GQA); ``None`` means ``n_heads``.
        norm_position: ``"post"`` (Norm after each residual update) or ``"pre"`` (Norm on the
            branch input).
        block: ``"sequential"`` (attention then FFN), ``"parallel"`` (one residual for both,
            GPT-J/PaLM) or ``"macaron"`` (half FFN, attention, half FFN, same FFN weights).
        residual_scale: the step ``h`` of every residual update ``x + h * branch``.
        project_branches: replace each branch output ``u`` by ``u - (z.u / z.z) z``, its
            component tangent to the sphere at the branch input ``z``.
        norm: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm).
        norm_eps: the epsilon under the square root of the Norm.
        norm_gain: whether each Norm has a learnable gain (initialised to 1).
        final_norm: pre-norm only: apply a Norm after the last layer.
        causal: causal (autoregressive) attention mask.
        ffn: ``"gelu"``, ``"swiglu"`` or ``"moe"``.
        n_experts: MoE only: number of experts ``E``.
        top_k: MoE only: number of experts each token is routed to.
        expert_ffn: MoE only: the FFN each expert is (``"gelu"`` or ``"swiglu"``).
        use_bias: biases on Q/K/V/O, the FFN/expert matrices and LayerNorm (never on the router,
            never on RMSNorm).
        rope: hook for rotary position embeddings; must be ``None`` for now.
        vocab_size: only used by ``TransformerLM``.
        dtype: computation dtype; ``None`` promotes the input with ``param_dtype``.
        param_dtype: dtype the parameters are stored in.
        init_std: standard deviation of the normal initialiser of every weight matrix.
    """

    d_model: int
    n_layers: int
    n_heads: int
    d_head: int
    d_ff: int
    n_kv_heads: int | None = None
    norm_position: NormPosition = "post"
    block: BlockKind = "sequential"
    residual_scale: float = 1.0
    project_branches: bool = False
    norm: NormKind = "rms"
    norm_eps: float = 1e-6
    norm_gain: bool = True
    final_norm: bool = True
    causal: bool = False
    ffn: FFNKind = "gelu"
    n_experts: int | None = None
    top_k: int | None = None
    expert_ffn: ExpertFFNKind = "gelu"
    use_bias: bool = False
    rope: None = None
    vocab_size: int | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "d_head", "d_ff"):
            _check_positive_int(name, getattr(self, name))
        _check_choice("norm_position", self.norm_position, ("post", "pre"))
        _check_choice("block", self.block, tuple(_SUBSTEPS))
        _check_choice("norm", self.norm, ("rms", "layer"))
        _check_choice("ffn", self.ffn, ("gelu", "swiglu", "moe"))
        _check_choice("expert_ffn", self.expert_ffn, ("gelu", "swiglu"))

        if self.n_kv_heads is not None:
            _check_positive_int("n_kv_heads", self.n_kv_heads)
            if self.n_heads % self.n_kv_heads != 0:
                raise ValueError(
                    f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                    "(each key/value head serves a whole group of query heads)"
                )

        if self.ffn == "moe":
            if self.n_experts is None or self.top_k is None:
                raise ValueError("ffn='moe' needs both n_experts and top_k")
            _check_positive_int("n_experts", self.n_experts)
            _check_positive_int("top_k", self.top_k)
            if self.top_k > self.n_experts:
                raise ValueError(f"top_k={self.top_k} cannot exceed n_experts={self.n_experts}")
        elif self.n_experts is not None or self.top_k is not None:
            raise ValueError(
                f"n_experts/top_k are MoE settings but ffn={self.ffn!r}; set ffn='moe' or "
                "leave them None"
            )

        if not _is_real(self.residual_scale) or not math.isfinite(self.residual_scale):
            raise ValueError(f"residual_scale must be a finite float, got {self.residual_scale!r}")
        if not _is_real(self.norm_eps) or not self.norm_eps >= 0:
            raise ValueError(f"norm_eps must be a float >= 0, got {self.norm_eps!r}")
        if not _is_real(self.init_std) or not self.init_std >= 0:
            raise ValueError(f"init_std must be a float >= 0, got {self.init_std!r}")
        if self.rope is not None:
            raise NotImplementedError(
                "rope is a hook for rotary embeddings and is not implemented yet; use rope=None"
            )
        if self.vocab_size is not None:
            _check_positive_int("vocab_size", self.vocab_size)
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value is None and name == "dtype":
                continue
            try:
                dt = jnp.dtype(value)
            except TypeError as err:
                raise ValueError(f"{name}={value!r} is not a dtype") from err
            if not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"{name} must be a floating dtype, got {dt}")

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads actually used (``n_kv_heads`` or ``n_heads``)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def n_substeps(self) -> int:
        """Residual updates per layer: 2 (sequential), 1 (parallel), 3 (macaron)."""
        return _SUBSTEPS[self.block]

    @property
    def expert_kind(self) -> Literal["gelu", "swiglu"]:
        """The FFN kind of the dense FFN or, for MoE, of each expert."""
        return self.expert_ffn if self.ffn == "moe" else self.ffn  # type: ignore[return-value]


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
