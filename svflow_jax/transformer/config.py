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
* ``rope`` is ``None`` (no position information inside the stack) or a :class:`RoPE`: rotary
  position embeddings in the Llama/Qwen convention (rotate-half on the head dimension).
* Biases: ``use_bias`` switches every bias on (Q/K/V/O, FFN, LayerNorm); ``qkv_bias``,
  ``out_bias``, ``ffn_bias`` and ``norm_bias`` override it per group when not ``None`` (Qwen2:
  ``qkv_bias=True`` alone). ``any_bias`` says whether the stack has any bias at all.
* ``qk_norm``: a per-head RMSNorm (with gains, epsilon ``norm_eps``) of the queries and keys,
  before RoPE (Qwen3).
* ``qk_stop_gradient`` is an experimental control, not an architecture: the forward pass is
  unchanged, only the gradient of the attention posterior with respect to the token states is
  cut (the posterior and the values no longer share a gradient path through the tokens).
* The embedding fields (``vocab_size``, ``n_positions``, ``type_vocab_size``,
  ``tie_embeddings``, ``lm_head``) only concern ``TransformerLM``; the stack ignores them.
* ``init_std``: every weight matrix (Q/K/V/O, FFN, router, expert weights, embeddings) is drawn
  from ``N(0, init_std^2)`` (nanoGPT/GPT-2 style, default 0.02); biases start at 0, gains at 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

__all__ = ["TransformerConfig", "RoPE"]

NormPosition = Literal["post", "pre"]
BlockKind = Literal["sequential", "parallel", "macaron"]
NormKind = Literal["rms", "layer"]
FFNKind = Literal["gelu", "swiglu", "moe"]
ExpertFFNKind = Literal["gelu", "swiglu"]

RopeType = Literal["default", "llama3"]
Activation = Literal["gelu", "gelu_tanh", "silu"]
RouterGate = Literal["renormalised", "switch"]

_SUBSTEPS = {"sequential": 2, "parallel": 1, "macaron": 3}


@dataclass(frozen=True)
class RoPE:
    """Rotary position embeddings, Llama/Qwen convention ("rotate half").

    Head dimension ``dk`` (even) is split into halves; coordinate ``i < dk/2`` and ``i + dk/2``
    form a pair rotated by the angle ``position * inv_freq[i]``, with
    ``inv_freq[i] = theta^(-2i/dk)`` (``rope_type="default"``). ``rope_type="llama3"`` rescales
    these frequencies as Llama 3.1 does (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``): wavelengths ``2 pi / inv_freq`` shorter than
    ``original / high_freq_factor`` are kept, those longer than ``original / low_freq_factor``
    are divided by ``factor``, and those in between interpolate smoothly.
    ``freq_factors`` (llama.cpp's ``rope_freqs`` tensor), if given, divides the frequencies
    afterwards, one factor per pair.

    ``rotary_dim`` (even, ``<= dk``; GPT-NeoX's partial rotary embeddings) rotates only the
    first ``rotary_dim`` coordinates of each head, rotate-half within them (pairs ``(i, i +
    rotary_dim/2)``, ``inv_freq[i] = theta^(-2i/rotary_dim)``); the others pass unrotated.
    ``None``: all ``dk``.
    """

    theta: float = 10000.0
    rope_type: RopeType = "default"
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    freq_factors: tuple[float, ...] | None = None
    rotary_dim: int | None = None

    def __post_init__(self) -> None:
        if self.rotary_dim is not None:
            _check_positive_int("rotary_dim", self.rotary_dim)
            if self.rotary_dim % 2:
                raise ValueError(f"rope rotary_dim must be even, got {self.rotary_dim}")
        if not _is_real(self.theta) or not self.theta > 0:
            raise ValueError(f"rope theta must be a float > 0, got {self.theta!r}")
        _check_choice("rope_type", self.rope_type, ("default", "llama3"))
        llama3 = ("factor", "low_freq_factor", "high_freq_factor")
        if self.rope_type == "llama3":
            for name in llama3:
                value = getattr(self, name)
                if not _is_real(value) or not value > 0:
                    raise ValueError(f"rope_type='llama3' needs {name} > 0, got {value!r}")
            _check_positive_int(
                "original_max_position_embeddings", self.original_max_position_embeddings
            )
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(
                    f"rope high_freq_factor={self.high_freq_factor} must exceed "
                    f"low_freq_factor={self.low_freq_factor}"
                )
        elif any(
            getattr(self, n) is not None for n in (*llama3, "original_max_position_embeddings")
        ):
            raise ValueError(
                "factor/low_freq_factor/... are llama3 settings; set rope_type='llama3'"
            )
        if self.freq_factors is not None:
            object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))

    def inv_freq(self, d_head: int) -> np.ndarray:
        """The ``rotary_dim // 2`` (default ``d_head // 2``) angular frequencies (float64
        NumPy, computed once per config)."""
        if self.rotary_dim is not None:
            if self.rotary_dim > d_head:
                raise ValueError(f"rope rotary_dim={self.rotary_dim} exceeds d_head={d_head}")
            d_head = self.rotary_dim
        inv = self.theta ** (-np.arange(0, d_head, 2, dtype=np.float64) / d_head)
        if self.rope_type == "llama3":
            factor, lo, hi = self.factor, self.low_freq_factor, self.high_freq_factor
            old = self.original_max_position_embeddings
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > old / lo, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old / hi) & (wavelen <= old / lo)
            inv = np.where(medium, smoothed, scaled)
        if self.freq_factors is not None:
            if len(self.freq_factors) != d_head // 2:
                raise ValueError(
                    f"rope freq_factors has {len(self.freq_factors)} entries, need d_head/2 = "
                    f"{d_head // 2}"
                )
            inv = inv / np.asarray(self.freq_factors, np.float64)
        return inv


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
        router_gate: MoE only: ``"renormalised"`` (the softmax renormalised over the top-k:
            with ``top_k = 1`` the weight is exactly 1 and no task gradient reaches the router)
            or ``"switch"`` (the full softmax's probabilities of the selected experts, not
            renormalised, as in the Switch Transformer: the router is trained by the task).
        expert_ffn: MoE only: the FFN each expert is (``"gelu"`` or ``"swiglu"``).
        activation: the FFN's nonlinearity ``phi``: ``"gelu"`` (exact, erf), ``"gelu_tanh"``
            (the tanh approximation ``x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``: GPT-2's
            ``gelu_new``, Gemma's ``gelu_pytorch_tanh``) or ``"silu"``; in a gated FFN
            (``"swiglu"``) it acts on the gate: ``W_down (phi(W_gate x) * W_up x)`` (GeGLU
            with a GELU). ``None``: ``"gelu"`` for ``ffn="gelu"``, ``"silu"`` for
            ``"swiglu"``.
        embed_scale: ``TransformerLM`` only: the token embeddings are multiplied by this (in the
            computation dtype) before the stack (Gemma: ``sqrt(d_model)``); a tied LM head
            still uses the unscaled ``embed``.
        use_bias: biases on Q/K/V/O, the FFN/expert matrices and LayerNorm (never on the router,
            never on RMSNorm); the default of the four overrides below.
        qkv_bias: biases on Q, K and V (``None``: ``use_bias``).
        out_bias: bias on the attention output O (``None``: ``use_bias``).
        ffn_bias: biases of the FFN/expert matrices (``None``: ``use_bias``).
        norm_bias: LayerNorm bias (``None``: ``use_bias``; must not be ``True`` with RMSNorm).
        qk_norm: per-head RMSNorm of queries and keys, with gains ``(d_head,)``, before RoPE.
        qk_stop_gradient: queries and keys read the branch input through a stop-gradient,
            ``q_h = sg(x) W_Q[:, h]``, ``k_g = sg(x) W_K[:, g]`` (``sg`` the identity forward,
            zero derivative), while ``v_g = x W_V[:, g]``. The function computed is unchanged;
            the loss gradient with respect to the branch input ``x`` keeps only the value
            path, ``dL/dx = sum_g (dL/dv_g) W_V[:, g]^T``: the attention posterior
            ``softmax(q k^T / sqrt(d_head))`` no longer moves the token representations
            (nor anything upstream of them), while ``W_Q`` and ``W_K`` still train
            (``dL/dW_Q = x^T dL/dq``, as without it). Default ``False``.
        rope: ``None`` or a :class:`RoPE` (rotary position embeddings on queries and keys).
        vocab_size: ``TransformerLM`` only: token vocabulary.
        n_positions: ``TransformerLM`` only: learned absolute position embeddings (BERT) of this
            many positions; ``None``: none.
        type_vocab_size: ``TransformerLM`` only: token-type (segment) embeddings (BERT).
        tie_embeddings: ``TransformerLM`` only: logits use the token embedding transposed.
        lm_head: ``TransformerLM`` only: produce logits; ``False``: the final hidden states
            (an encoder such as BERT's ``BertModel``).
        head_bias: ``TransformerLM`` only: a bias ``unembed_bias (V,)`` added to the logits.
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
    router_gate: RouterGate = "renormalised"
    expert_ffn: ExpertFFNKind = "gelu"
    activation: Activation | None = None
    use_bias: bool = False
    qkv_bias: bool | None = None
    out_bias: bool | None = None
    ffn_bias: bool | None = None
    norm_bias: bool | None = None
    qk_norm: bool = False
    qk_stop_gradient: bool = False
    rope: RoPE | None = None
    vocab_size: int | None = None
    n_positions: int | None = None
    type_vocab_size: int | None = None
    tie_embeddings: bool = False
    lm_head: bool = True
    head_bias: bool = False
    embed_scale: float = 1.0
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
        if self.activation is not None:
            _check_choice("activation", self.activation, ("gelu", "gelu_tanh", "silu"))
        if not _is_real(self.embed_scale) or not (
            math.isfinite(self.embed_scale) and self.embed_scale > 0
        ):
            raise ValueError(f"embed_scale must be a finite float > 0, got {self.embed_scale!r}")

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
            _check_choice("router_gate", self.router_gate, ("renormalised", "switch"))
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
            if not isinstance(self.rope, RoPE):
                raise ValueError(f"rope must be None or a RoPE, got {self.rope!r}")
            if self.d_head % 2:
                raise ValueError(f"rope needs an even d_head, got {self.d_head}")
            self.rope.inv_freq(self.d_head)  # validates freq_factors against d_head
        for name in ("use_bias", "qk_norm", "qk_stop_gradient", "tie_embeddings", "lm_head",
                     "head_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("qkv_bias", "out_bias", "ffn_bias", "norm_bias"):
            if not (getattr(self, name) is None or isinstance(getattr(self, name), bool)):
                raise ValueError(f"{name} must be None or a bool, got {getattr(self, name)!r}")
        if self.norm == "rms" and self.norm_bias:
            raise ValueError("norm_bias=True needs norm='layer' (RMSNorm has no bias)")
        for name in ("vocab_size", "n_positions", "type_vocab_size"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
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

    def _bias(self, override: bool | None) -> bool:
        return self.use_bias if override is None else override

    @property
    def has_qkv_bias(self) -> bool:
        """Whether Q, K and V have biases."""
        return self._bias(self.qkv_bias)

    @property
    def has_out_bias(self) -> bool:
        """Whether the attention output O has a bias."""
        return self._bias(self.out_bias)

    @property
    def has_ffn_bias(self) -> bool:
        """Whether the FFN (expert) matrices have biases."""
        return self._bias(self.ffn_bias)

    @property
    def has_norm_bias(self) -> bool:
        """Whether the Norms have a bias (LayerNorm only)."""
        return self.norm == "layer" and self._bias(self.norm_bias)

    @property
    def any_bias(self) -> bool:
        """Whether the stack has any bias (attention, FFN or Norm)."""
        return self.has_qkv_bias or self.has_out_bias or self.has_ffn_bias or self.has_norm_bias

    @property
    def n_substeps(self) -> int:
        """Residual updates per layer: 2 (sequential), 1 (parallel), 3 (macaron)."""
        return _SUBSTEPS[self.block]

    @property
    def expert_kind(self) -> Literal["gelu", "swiglu"]:
        """The FFN kind of the dense FFN or, for MoE, of each expert."""
        return self.expert_ffn if self.ffn == "moe" else self.ffn  # type: ignore[return-value]

    @property
    def ffn_activation(self) -> Activation:
        """The FFN's nonlinearity (``activation``, or the default of the FFN kind)."""
        if self.activation is not None:
            return self.activation
        return "gelu" if self.expert_kind == "gelu" else "silu"


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
