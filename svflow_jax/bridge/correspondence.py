"""The correspondence layer: a Transformer's weights are an SVFlow's parameters on a time grid.

This is the only module that speaks both vocabularies. It converts the stacked weights of a
:class:`svflow_jax.transformer.Transformer` into time-dependent SVFlow fields and back, runs
both sides, and reports how far apart they are.

Dictionary (``d`` the width, ``dk`` the head width, ``rho = sqrt(d)`` the radius of RMSNorm's
sphere, layer ``l`` at time ``t_l = l h``):

=========================================  ==================================================
Transformer                                SVFlow
=========================================  ==================================================
hidden state ``x`` (post-norm: ``|x|=rho``)  point ``x / rho`` of S^{d-1}
``wq``, ``wk`` of layer ``l``              ``kernel_query``, ``kernel_key`` of ``theta(t_l)``
score scale ``1 / sqrt(dk)``               ``concentration = rho^2 / sqrt(dk)`` per head
``wv``, ``wo``                             ``natural_in``, ``natural_out`` (``eta = x N M``)
FFN / experts ``F(x)``                     relaxed scores ``s(u) = F(rho u) / rho``
router ``x W_r``                           router posterior ``softmax(rho u W_r)``
residual step ``h``, ``L`` layers          step ``h`` on ``[0, L h]``, ``PiecewiseConstant``
=========================================  ==================================================

Post-norm exactness needs RMSNorm with ``norm_eps = 0`` and gains of 1 (a gain ``g`` maps
onto an ellipsoid instead, :func:`ellipsoid_residual`). Pre-norm stacks are exact with what
real checkpoints use: ``norm_eps`` (the field reads ``y / sqrt(|y|^2 + eps)``), gains (folded
into the first linear maps), Q/K/V/O and FFN biases (offsets), RoPE (the kernel's position
rotation; partial rotary embeddings after permuting each head's coordinates), per-head Q/K
RMSNorm (a kernel on the sphere), a LayerNorm in front of each branch (the field reads the
centred point ``y - mean(y)``; its bias becomes offsets ``b W``) and the FFN's own
nonlinearity (GeGLU's GELU gate); see :func:`to_flow` and docs/theory.md, section 16. A
post-norm LayerNorm is refused. Which solver the stack *is* depends on the block:

=====================  ==============================  ======================================
block                  post-norm (on the sphere)       pre-norm (ambient ``dy/dt = F(y/|y|)``)
=====================  ==============================  ======================================
sequential             ``LieTrotter(step)``            ``LieTrotter(Euler())``
parallel               ``step`` on ``v_A + v_F``       ``Euler()`` on ``F_A + F_F``
macaron                ``Strang(step)``                ``Strang(Euler())``
=====================  ==============================  ======================================

with ``step = RetractedEuler()`` for projected branches and :class:`VariableStepRetractedEuler`
(step ``h' = h / (1 + h x.u)`` per token) for standard, unprojected ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
from diffrax import AbstractSolver, MultiTerm, ODETerm
from jaxtyping import Array, Float

from .. import sphere
from ..flow import (
    AttentionField,
    AttentionParams,
    ExpertsField,
    ExpertsParams,
    PiecewiseConstant,
    RouterPosterior,
    ScoreNetworks,
    SumField,
)
from ..flow.experts import Nonlinearity
from ..solvers import (
    LieTrotter,
    RetractedEuler,
    SolveError,
    Strang,
    VariableStepRetractedEuler,
    WithinStep,
    fixed_step_scan,
    solve,
)
from ..transformer import Transformer, TransformerConfig, layer_params, outer_norm_params
from . import readout

__all__ = [
    "LayerFlow",
    "check_supported",
    "kernel_concentrations",
    "to_flow",
    "to_transformer_params",
    "VariableStepRetractedEuler",
    "flow_states",
    "discrepancy",
    "layer_gaps",
    "radial_factors",
    "router_logits",
    "substep_gains",
    "with_gains",
    "input_norm",
    "ellipsoid_residual",
]

# Transformer-only parameters that have no flow counterpart but must survive a round trip.
_PASSTHROUGH = ("norm_attn_gain", "norm_ffn_gain", "norm_gain", "norm_attn_bias",
                "norm_ffn_bias", "norm_bias")


class LayerFlow(eqx.Module):
    """An SVFlow with per-layer parameters: ``theta(t) = theta_l`` on ``[l h, (l + 1) h)``.

    Attributes:
        attention: the attention field (vMF-kernel posterior x scores).
        experts: the FFN / MoE field (router posterior x relaxed scores).
        step: the layer step ``h``.
        num_layers: ``L``; the flow runs on ``[0, L h]``.
        radius: ``rho``, the radius of the sphere the Transformer's states live on.
        passthrough: Transformer-only arrays (norm gains), kept for the round trip.
        eps: the pre-norm field reads ``y / sqrt(|y|^2 + eps)`` (the Norm's epsilon; 0: the
            retraction ``y / |y|``).
        centred: the pre-norm field reads the centred point ``P y = y - mean(y) 1`` (a
            LayerNorm in front of each branch): ``P y / sqrt(|P y|^2 + eps)``.
    """

    attention: AttentionField
    experts: ExpertsField
    passthrough: dict[str, Array]
    step: float = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    radius: float = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=0.0)
    centred: bool = eqx.field(static=True, default=False)

    @property
    def t1(self) -> float:
        return self.num_layers * self.step

    @property
    def field(self) -> SumField:
        """``v_A + v_F``: what a parallel block integrates."""
        return SumField(self.attention, self.experts)


def check_supported(config: TransformerConfig) -> None:
    """Raises a ``ValueError`` naming every reason ``config`` is not a discretisation of an
    SVFlow that :func:`to_flow` can express (a post-norm LayerNorm; eps in a post-norm stack;
    a LayerNorm with projected branches or a biased LayerNorm in front of a router): the
    bridge's one check, :func:`svflow_jax.bridge.readout.check_supported` with ``flow=True``."""
    readout.check_supported(config, flow=True)


def _branch_gains(config: TransformerConfig, params: Mapping[str, Array]):
    """The (L, d) gains of the Norms in front of the attention and the FFN branch of a pre-norm
    stack (``None`` where there are none: post-norm gains are not in front of a branch)."""
    if config.norm_position != "pre" or not config.norm_gain:
        return None, None
    if config.block == "parallel":
        return params["norm_gain"], params["norm_gain"]
    return params["norm_attn_gain"], params["norm_ffn_gain"]


def _branch_biases(config: TransformerConfig, params: Mapping[str, Array]):
    """The (L, d) biases of the LayerNorms in front of the attention and the FFN branch of a
    pre-norm stack (``None`` where there are none)."""
    if config.norm_position != "pre" or not config.has_norm_bias:
        return None, None
    if config.block == "parallel":
        return params["norm_bias"], params["norm_bias"]
    return params["norm_attn_bias"], params["norm_ffn_bias"]


def _bias_image(bias: Array | None, w: Array) -> Array | None:
    """``b W``: a Norm bias ``b (L, d)`` carried through the first linear map ``w (L, d, ...)``
    (``None`` without a bias)."""
    return None if bias is None else jnp.einsum("ld,ld...->l...", bias, w)


def _add(a: Array | None, b: Array | None) -> Array | None:
    return b if a is None else a if b is None else a + b


def _rotary_order(config: TransformerConfig) -> Array | None:
    """Partial rotary embeddings as the kernel's whole-head rotation: the permutation of a
    head's coordinates that puts the model's rotated pairs ``(i, i + r/2)``, ``i < r/2``, at the
    kernel's pairs ``(i, i + k/2)`` and the ``k - r`` unrotated coordinates at the remaining
    pairs (frequency 0). Queries and keys are permuted alike, so every score is unchanged.
    ``None`` for whole-head rotations."""
    r, k = (config.rope.rotary_dim if config.rope else None), config.d_head
    if r is None or r == k:
        return None
    half, rest = r // 2, (k - r) // 2
    return jnp.concatenate([jnp.arange(half), r + jnp.arange(rest), half + jnp.arange(half),
                            r + rest + jnp.arange(rest)])


def _gain_axes(gain: Array, w: Array, experts: bool) -> Array:
    """``gain (L, d)`` shaped to multiply the ``d`` axis of ``w``: axis 1, or axis 2 after an
    expert axis."""
    g = gain[:, None] if experts else gain
    return g.reshape(g.shape + (1,) * (w.ndim - g.ndim))


def _fold(gain: Array | None, w: Array, experts: bool = False) -> Array:
    """``diag(g) W``: a Norm gain folded into the first linear map of a branch."""
    return w if gain is None else _gain_axes(gain, w, experts) * w


def _unfold(gain: Array | None, w: Array, experts: bool = False) -> Array:
    return w if gain is None else w / _gain_axes(gain, w, experts)


def _phi(config: TransformerConfig) -> Nonlinearity | None:
    """The FFN's nonlinearity where it is not the score networks' default (``None``)."""
    default = "gelu" if config.expert_kind == "gelu" else "silu"
    return None if config.ffn_activation == default else config.ffn_activation


def _expert_networks(
    config: TransformerConfig, p: Mapping[str, Array], gain: Array | None,
    norm_bias: Array | None,
) -> ScoreNetworks:
    moe = config.ffn == "moe"  # (a LayerNorm bias in front of experts is refused)
    expand = (lambda a: a) if moe else (lambda a: a[:, None])  # a dense FFN is one expert

    def first(name):  # a first linear map, with the gain of the Norm in front folded in
        return expand(_fold(gain, p[name], experts=moe))

    def bias(name, w=None):  # with a LayerNorm bias b in front: b_in + b W_in
        b = _add(p.get(name), None if w is None else _bias_image(norm_bias, p[w]))
        return None if b is None else expand(b)

    if config.expert_kind == "gelu":
        return ScoreNetworks(w1=first("w_in"), w2=expand(p["w_out"]), activation="gelu",
                             phi=_phi(config), b1=bias("b_in", "w_in"), b2=bias("b_out"))
    return ScoreNetworks(w1=first("w_gate"), w2=expand(p["w_down"]), w3=first("w_up"),
                         activation="swiglu", phi=_phi(config), b1=bias("b_gate", "w_gate"),
                         b2=bias("b_down"), b3=bias("b_up", "w_up"))


def to_flow(config: TransformerConfig, params: Mapping[str, Array]) -> LayerFlow:
    """Converts stacked Transformer weights (:func:`layer_params` layout) into a LayerFlow.

    The flow's state is ``y = x / rho``. What real (pre-norm) checkpoints add maps as follows
    (docs/theory.md, "Real pre-norm models"): the gains of the Norm in front of a branch fold
    into that branch's first linear maps (``W_Q``, ``W_K``, ``W_V``, ``W_gate``, ``W_up``,
    ``W_in``, the router); Q/K/V/O biases become the kernel's and the scores' offsets (divided
    by ``rho``); a per-head RMSNorm of queries and keys puts the kernel's embeddings on a
    sphere (concentration ``1 / sqrt(dk)`` times the gains, eps ``norm_eps / d``); RoPE is the
    kernel's position rotation; ``norm_eps`` stays with the stack (:func:`flow_states` reads the
    pre-norm field at ``y / sqrt(|y|^2 + eps)``). FFN biases pass unchanged (the score networks
    act on ``rho y``). A LayerNorm in front of a branch, ``g * n(P x) + b`` with ``P`` the
    centring: the field reads ``P y`` (``LayerFlow.centred``), ``g`` folds like a gain and
    ``b`` adds ``b W`` to the offsets of every first map ``W`` (``W`` before the gain). Partial
    rotary embeddings (pairs ``(i, i + r/2)`` of the first ``r`` coordinates): queries and keys
    are permuted alike onto the kernel's pairs (:func:`_rotary_order`), unrotated pairs at
    frequency 0. The FFN's nonlinearity is kept (``ScoreNetworks.phi``).
    """
    check_supported(config)
    d, h = config.d_model, float(config.residual_scale)
    if not h > 0:
        raise ValueError(f"the residual step h must be positive to be a time step, got {h}")
    radius = math.sqrt(d)
    L, H, k = config.n_layers, config.n_heads, config.d_head
    group = H // config.kv_heads
    dtype = params["wq"].dtype
    g_attn, g_ffn = _branch_gains(config, params)
    b_attn, _ = _branch_biases(config, params)
    order = _rotary_order(config)
    # Grouped-query attention: query head h reads key/value head h // group.
    kv = lambda a, axis=2: jnp.repeat(a, group, axis=axis)  # noqa: E731
    # Partial rotary: queries' and keys' coordinates (last axis) in the kernel's order.
    turn = (lambda a: a) if order is None else (lambda a: a[..., order])  # noqa: E731
    extra = {}
    if config.has_qkv_bias or b_attn is not None:
        # A LayerNorm bias b reaches the first maps as b W (W before the gain is folded).
        offsets = {name: _add(params.get(name), _bias_image(b_attn, params[w]))
                   for name, w in (("bq", "wq"), ("bk", "wk"), ("bv", "wv"))}
        extra.update(query_offset=turn(offsets["bq"]) / radius,
                     key_offset=turn(kv(offsets["bk"], 1)) / radius,
                     natural_offset=kv(offsets["bv"], 1) / radius)
    if config.has_out_bias:
        extra["score_offset"] = params["bo"] / radius
    if config.qk_norm:  # queries and keys on a sphere: the radius rho no longer enters
        standard = 1 / math.sqrt(k)
        extra.update(
            kernel_gain_query=turn(jnp.repeat(params["q_norm_gain"][:, None], H, axis=1)),
            kernel_gain_key=turn(jnp.repeat(params["k_norm_gain"][:, None], H, axis=1)),
            kernel_eps=config.norm_eps / d)
    else:
        standard = d / math.sqrt(k)
    if config.rope is not None:
        frequencies = jnp.asarray(config.rope.inv_freq(k), dtype)
        frequencies = jnp.zeros(k // 2, dtype).at[: frequencies.shape[0]].set(frequencies)
        extra["rotation_frequencies"] = jnp.broadcast_to(frequencies, (L, k // 2))
    attention = AttentionParams(
        kernel_query=turn(_fold(g_attn, params["wq"])),
        kernel_key=turn(kv(_fold(g_attn, params["wk"]))),
        concentration=jnp.full((L, H), standard, dtype),
        natural_in=kv(_fold(g_attn, params["wv"])), natural_out=params["wo"], **extra,
    )
    router = RouterPosterior(_fold(g_ffn, params["router"])) if config.ffn == "moe" else None
    _, b_ffn = _branch_biases(config, params)
    experts = ExpertsParams(experts=_expert_networks(config, params, g_ffn, b_ffn),
                            router=router)
    return LayerFlow(
        attention=AttentionField(PiecewiseConstant(attention, h), causal=config.causal),
        experts=ExpertsField(PiecewiseConstant(experts, h), top_k=config.top_k, radius=radius),
        passthrough={k: params[k] for k in _PASSTHROUGH if k in params},
        step=h,
        num_layers=config.n_layers,
        radius=radius,
        eps=config.norm_eps,
        centred=config.norm == "layer",
    )


def kernel_concentrations(
    config: TransformerConfig, params: Mapping[str, Array]
) -> dict[str, Float[Array, "L H"]]:
    """The vMF concentration of the attention kernel of a stack with per-head Q/K RMSNorm
    (Qwen3), per layer and query head (docs/theory.md, section 16).

    With queries and keys normalised to ``gamma * e`` (``e`` on the sphere of radius
    ``sqrt(dk)``), the exponent is ``sqrt(dk) <gamma_Q * e_q, R (gamma_K * e_k)>`` for unit
    ``e_q``, ``e_k``: a vMF kernel in ``e_q`` with concentration ``sqrt(dk) |gamma_Q * R (gamma_K *
    e_k)|``. Returns ``typical``, ``sqrt(dk) rms(gamma_Q) rms(gamma_K)`` (exact for constant
    gains) and ``bound``, ``sqrt(dk) max|gamma_Q| max|gamma_K|`` (its largest value).
    """
    if not config.qk_norm:
        raise ValueError("kernel concentrations are fixed by the gains only with qk_norm")
    group = config.n_heads // config.kv_heads
    g_q = params["q_norm_gain"]
    g_k = params["k_norm_gain"]
    if g_q.ndim == 2:  # one gain vector per layer, shared by the heads
        g_q, g_k = g_q[:, None], g_k[:, None]
    else:
        g_k = jnp.repeat(g_k, group, axis=1)
    root = math.sqrt(config.d_head)
    rms = lambda g: jnp.sqrt(jnp.mean(g * g, axis=-1))  # noqa: E731
    shape = (config.n_layers, config.n_heads)
    return {
        "typical": jnp.broadcast_to(root * rms(g_q) * rms(g_k), shape),
        "bound": jnp.broadcast_to(
            root * jnp.max(jnp.abs(g_q), axis=-1) * jnp.max(jnp.abs(g_k), axis=-1), shape),
    }


def to_transformer_params(flow: LayerFlow, config: TransformerConfig) -> dict[str, Array]:
    """The inverse of :func:`to_flow`: stacked weights in the :func:`layer_params` layout.

    A per-head concentration other than the Transformer's ``d / sqrt(dk)`` (``1 / sqrt(dk)``
    with ``qk_norm``) is folded into ``wq`` (a factor of exactly 1 when it matches, so round
    trips are bit-identical). Pre-norm gains are unfolded by division and biases multiplied
    back by ``rho``: those arrays come back within two roundings (``|w' - w| <= 2^-52 |w|`` in
    float64), the others bit-identical. A LayerNorm bias's image ``b W`` is subtracted from
    the offsets again (a few roundings); partial rotary coordinates are put back in order.
    """
    check_supported(config)
    group = config.n_heads // config.kv_heads
    radius = flow.radius
    theta: AttentionParams = flow.attention.params.anchors
    g_attn, g_ffn = _branch_gains(config, flow.passthrough)
    b_attn, b_ffn = _branch_biases(config, flow.passthrough)
    order = _rotary_order(config)
    if order is not None:  # the model's coordinate order again
        back = jnp.argsort(order)
        theta = eqx.tree_at(
            lambda t: [getattr(t, n) for n in _TURNED if getattr(t, n) is not None], theta,
            [getattr(theta, n)[..., back] for n in _TURNED if getattr(theta, n) is not None])
    # The same rounding as in to_flow; where the concentration IS that value the factor is set
    # to exactly 1 (in float32, XLA may divide via a rounded reciprocal: 0.99999994).
    value = 1 / math.sqrt(config.d_head) if config.qk_norm else config.d_model / math.sqrt(
        config.d_head)
    standard = jnp.asarray(value, theta.concentration.dtype)
    same = theta.concentration == standard
    fold = jnp.where(same, 1.0, theta.concentration / standard)[:, None, :, None]
    out = {
        "wq": _unfold(g_attn, theta.kernel_query * fold.astype(theta.kernel_query.dtype)),
        "wk": _unfold(g_attn, theta.kernel_key[:, :, ::group]),
        "wv": _unfold(g_attn, theta.natural_in[:, :, ::group]),
        "wo": theta.natural_out,
    }
    if config.has_qkv_bias:
        assert theta.query_offset is not None and theta.key_offset is not None
        assert theta.natural_offset is not None  # to_flow sets all three
        offsets = {"bq": theta.query_offset * radius,
                   "bk": theta.key_offset[:, ::group] * radius,
                   "bv": theta.natural_offset[:, ::group] * radius}
        for b, w in (("bq", "wq"), ("bk", "wk"), ("bv", "wv")):  # less a LayerNorm bias's b W
            out[b] = offsets[b] if b_attn is None else offsets[b] - _bias_image(b_attn, out[w])
    if theta.score_offset is not None:
        out["bo"] = theta.score_offset * radius
    if theta.kernel_gain_query is not None:
        out.update(q_norm_gain=theta.kernel_gain_query[:, 0],
                   k_norm_gain=theta.kernel_gain_key[:, 0])
    experts: ExpertsParams = flow.experts.params.anchors
    moe = config.ffn == "moe"
    squeeze = (lambda a: a) if moe else (lambda a: a[:, 0])
    nets = experts.experts

    def first(w):
        return _unfold(g_ffn, squeeze(w), experts=moe)

    if nets.activation == "gelu":
        out.update(w_in=first(nets.w1), w_out=squeeze(nets.w2))
        biases = {"b_in": (nets.b1, "w_in"), "b_out": (nets.b2, None)}
    else:
        out.update(w_gate=first(nets.w1), w_up=first(nets.w3), w_down=squeeze(nets.w2))
        biases = {"b_gate": (nets.b1, "w_gate"), "b_up": (nets.b3, "w_up"),
                  "b_down": (nets.b2, None)}
    if config.has_ffn_bias:
        for name, (b, w) in biases.items():  # less a LayerNorm bias's b W_in
            out[name] = squeeze(b) if w is None or b_ffn is None else (
                squeeze(b) - _bias_image(b_ffn, out[w]))
    if experts.router is not None:
        out["router"] = _unfold(g_ffn, experts.router.weight)
    out.update(flow.passthrough)
    return out


# The attention arrays whose last axis is a head's query/key coordinates (partial rotary).
_TURNED = ("kernel_query", "kernel_key", "query_offset", "key_offset", "kernel_gain_query",
           "kernel_gain_key")


def _block_solver(block: str, step: AbstractSolver) -> AbstractSolver:
    return {"sequential": LieTrotter(step), "macaron": Strang(step), "parallel": step}[block]


class _Branch(eqx.Module):
    """One branch of a block as a diffrax vector field, read as the Transformer reads it:
    ``riemannian`` ``v = P_y u``; ``drift`` the unprojected ``u``; ``ambient`` ``u(S(y))``;
    ``ambient-projected`` ``P_{R(y)} u(S(y))``, with ``S(y) = y / sqrt(|y|^2 + eps)`` the
    (soft) retraction of a pre-norm layer. A module (not a closure), so that a solver can
    restrict its parameter path to the step (``within_step``)."""

    field: SumField | AttentionField | ExpertsField
    kind: str = eqx.field(static=True)
    eps: float = eqx.field(static=True, default=0.0)
    centred: bool = eqx.field(static=True, default=False)

    def __call__(self, t, y, args):
        if self.kind == "riemannian":
            return self.field(t, y)
        if self.kind == "drift":
            return self.field.drift(t, y)
        u = self.field.ambient(t, y, eps=self.eps, centred=self.centred)
        if self.kind == "ambient":
            return u
        # ambient-projected: P at the direction of S(y), which is R(y) (never centred)
        return sphere.project_tangent(sphere.retract(y), u)


def _terms(flow: LayerFlow, block: str, kind: str):
    """The diffrax term(s) of each block: one field (parallel) or a MultiTerm (splittings)."""
    ambient = kind.startswith("ambient")
    read = dict(eps=flow.eps if ambient else 0.0, centred=ambient and flow.centred)
    if block == "parallel":
        return ODETerm(_Branch(flow.field, kind, **read))
    return MultiTerm(ODETerm(_Branch(flow.attention, kind, **read)),
                     ODETerm(_Branch(flow.experts, kind, **read)))


def flow_states(
    flow: LayerFlow,
    config: TransformerConfig,
    x0: Float[Array, "... n d"],
    solver: AbstractSolver | None = None,
    throw: bool = True,
    steps_per_layer: int = 1,
) -> Float[Array, "L ... n d"]:
    """The flow's discrete trajectory at ``t_1..t_L``, in the Transformer's units.

    ``x0`` is the Transformer's first hidden state (post-norm: after the input Norm, so
    ``|x0_i| = sqrt(d)``; pre-norm: the raw residual stream). ``solver`` defaults to the one the
    block *is* (module docstring); pass another to integrate the same flow differently, with
    ``steps_per_layer`` steps of ``h / steps_per_layer`` in each layer (every stage of a step
    reads that layer's weights: pre-norm solvers are wrapped in :class:`WithinStep`).
    ``throw=False`` (under ``jit``): no runtime checks in the program; a failed step (a
    standard post-norm step across the origin) comes back as NaN for the caller to check.

    Args:
        flow: the model's flow (:func:`to_flow`).
        config: the Transformer's configuration (block, norm position, projection).
        x0: the first hidden state, shape ``(..., n, d)``.
        solver: another solver for the same flow (default: the block's own).
        throw: check failed steps at run time (``False`` under ``jit``).
        steps_per_layer: solver steps in each layer.

    Returns:
        The states after each layer, shape ``(L, ..., n, d)``, in the Transformer's units.

    Raises:
        ValueError: ``steps_per_layer < 1``.
    """
    x0 = jnp.asarray(x0)
    m = int(steps_per_layer)
    if m < 1:
        raise ValueError(f"steps_per_layer must be >= 1, got {steps_per_layer}")
    every = slice(m - 1, None, m)  # the states at the layer times t_1..t_L
    grid = dict(num_steps=flow.num_layers * m, saveat=diffrax.SaveAt(steps=True))
    if config.norm_position == "post":
        if solver is None:
            step = (RetractedEuler() if config.project_branches
                    else VariableStepRetractedEuler(check=throw))
            solver = _block_solver(config.block, step)
        kind = "riemannian" if config.project_branches else "drift"
        sol = solve(_terms(flow, config.block, kind), x0 / flow.radius, 0.0, flow.t1,
                    solver=solver, throw=throw, **grid)
        return sol.ys[every] * flow.radius
    solver = WithinStep(_block_solver(config.block, diffrax.Euler()) if solver is None
                        else solver)
    # Pre-norm states are not on the sphere: the ambient ODE, stepped without a retraction.
    kind = "ambient-projected" if config.project_branches else "ambient"
    ys = fixed_step_scan(solver, _terms(flow, config.block, kind), x0 / flow.radius, 0.0,
                         flow.t1, flow.num_layers * m, save_steps=True)
    return ys[every] * flow.radius


def discrepancy(
    model: Transformer, x: Float[Array, "... n d"], solver: AbstractSolver | None = None
) -> dict[str, float | list[float]]:
    """Runs the Transformer and its flow from the same input and compares layer by layer.

    Returns ``max_abs_diff`` (over layers, tokens, coordinates, in the Transformer's units) and
    ``per_layer`` (the same maximum for each layer).
    """
    gaps = layer_gaps(model.config, layer_params(model), jnp.asarray(x),
                      outer_norm_params(model), solver)
    per_layer = gaps["per_layer"]
    return {"max_abs_diff": float(per_layer.max()), "per_layer": [float(v) for v in per_layer]}


def layer_gaps(
    config: TransformerConfig, params: Mapping[str, Array], x: Float[Array, "... n d"],
    outer: Mapping[str, Array] | None = None, solver: AbstractSolver | None = None,
) -> dict[str, Array]:
    """Both sides from the same input, layer by layer, in one compiled program per shape.

    Returns ``per_layer`` (``max |x_l - rho y_l|`` for ``l = 1..L``: entry ``l - 1`` is also the
    output difference of the depth-``l`` stack of the first ``l`` layers), ``relative``
    (``max_i |x_li - rho y_li| / |x_li|``, token by token, for ``l = 1..L``), ``moved`` (the
    largest geodesic distance a token's direction travels from the first to the last state: an
    equality between standing-still trajectories would mean little), ``scale`` (the largest
    token norm along the trajectory) and ``substep_states`` (the Transformer's states after
    every residual sub-step, ``(L S + 1, ..., n, d)``).
    """
    per_layer, relative, moved, scale, substeps = _layer_gaps(
        config, dict(params), dict(outer or {}), jnp.asarray(x), solver)
    if not bool(jnp.all(jnp.isfinite(per_layer))):  # checked here: the program stays cacheable
        raise SolveError(
            "the flow side returned NaN: a standard post-norm step with 1 + h x.u <= 0 (x + h u "
            "crossed the origin, so the layer is not a retracted Euler step of the flow: the "
            "step h is too large), or the field produced NaN")
    return {"per_layer": per_layer, "relative": relative, "moved": moved, "scale": scale,
            "substep_states": substeps}


@eqx.filter_jit
def _layer_gaps(config, params, outer, x, solver):
    substeps = Transformer.from_layer_params(config, params, outer or None).hidden_states(
        x, substeps=True)
    states = substeps[:: config.n_substeps]
    ys = flow_states(to_flow(config, params), config, states[0], solver, throw=False)
    per_layer = jnp.max(jnp.abs(ys - states[1:]).reshape(config.n_layers, -1), axis=1)
    token_relative = jnp.linalg.norm(ys - states[1:], axis=-1) / jnp.linalg.norm(states[1:],
                                                                                 axis=-1)
    relative = jnp.max(token_relative.reshape(config.n_layers, -1), axis=1)
    moved = jnp.max(sphere.geodesic_distance(sphere.retract(states[0]),
                                             sphere.retract(states[-1])))
    scale = jnp.max(jnp.linalg.norm(states, axis=-1))
    return per_layer, relative, moved, scale, substeps


def radial_factors(
    config: TransformerConfig, params: Mapping[str, Array], substep_states: Array
) -> Array:
    """``min_i (1 + c x_i . u(x_i))`` for every residual sub-step of a standard post-norm stack,
    an ``(L, S)`` array (``S`` sub-steps per layer).

    ``c`` is the sub-step's step (``h``, or ``h / 2`` for the macaron FFN halves), ``x`` the
    sub-step's input on the unit sphere and ``u`` its unprojected branch. The identity
    ``R(x + c u) = R(x + c' P_x u)``, ``c' = c / (1 + c x.u)``, holds while this factor is
    positive; where it is not, ``x + c u`` lies in the half-space ``y . x <= 0`` and the layer
    returns the antipode of any step along the sphere.
    """
    if config.norm_position != "post" or config.project_branches:
        raise ValueError("radial factors concern post-norm stacks with unprojected branches")
    return _radial_factors(config, dict(params), jnp.asarray(substep_states))


@eqx.filter_jit
def _radial_factors(config, params, substep_states):
    flow = to_flow(config, params)
    h = flow.step
    plan = {"sequential": [(flow.attention, h), (flow.experts, h)],
            "parallel": [(flow.field, h)],
            "macaron": [(flow.experts, h / 2), (flow.attention, h), (flow.experts, h / 2)]}
    subs = plan[config.block]
    y = substep_states / flow.radius
    times = jnp.arange(config.n_layers, dtype=y.dtype) * h  # layer l reads theta(t_l)
    columns = []
    for j, (field, c) in enumerate(subs):
        x = y[j :: len(subs)][: config.n_layers]  # input of sub-step j of every layer
        radial = jnp.sum(x * jax.vmap(field.drift)(times, x), axis=-1)
        columns.append(jnp.min(1 + c * radial, axis=-1))
    return jnp.stack(columns, axis=1)


def router_logits(
    config: TransformerConfig, params: Mapping[str, Array], ffn_inputs: Array
) -> Array:
    """Router logits ``x W_r[l]`` of a MoE stack for the FFN inputs ``(L, ..., n, d)`` of each
    layer: ``(L, ..., n, E)``."""
    if config.ffn != "moe":
        raise ValueError("router logits need ffn='moe'")
    return jnp.einsum("l...d,lde->l...e", ffn_inputs, params["router"])


def _gain_names(config: TransformerConfig) -> list[str]:
    """The per-layer Norm gains, in the order of a layer's sub-steps (macaron's two FFN halves
    share one Norm)."""
    return {"sequential": ["norm_attn_gain", "norm_ffn_gain"], "parallel": ["norm_gain"],
            "macaron": ["norm_ffn_gain", "norm_attn_gain", "norm_ffn_gain"]}[config.block]


def substep_gains(config: TransformerConfig, params: Mapping[str, Array]) -> Array:
    """The gain of the Norm after each residual sub-step, ``(L S, d)`` in hidden-state order."""
    per_layer = jnp.stack([params[name] for name in _gain_names(config)], axis=1)
    return per_layer.reshape(-1, config.d_model)


def with_gains(
    config: TransformerConfig, params: Mapping[str, Array], gain, input_gain=None
) -> dict[str, Array]:
    """``params`` with every layer Norm gain set to ``gain`` (a scalar, ``(d,)``, or a mapping
    sub-step index -> ``(L, d)``). Needs ``config.norm_gain``."""
    if not config.norm_gain:
        raise ValueError("this config has no Norm gains (norm_gain=False)")
    out = dict(params)
    names = sorted(set(_gain_names(config)))
    shape = (config.n_layers, config.d_model)
    for i, name in enumerate(names):
        g = gain[i] if isinstance(gain, (list, tuple)) else gain
        out[name] = jnp.broadcast_to(jnp.asarray(g, params[name].dtype), shape)
    return out


def input_norm(gain: Array) -> dict[str, Array]:
    """The stack's own (input, post-norm) Norm with gain ``gain``, as ``outer`` parameters."""
    return {"input_norm_gain": gain}


def ellipsoid_residual(x: Float[Array, "... d"], gain: Float[Array, " d"]) -> Float[Array, "..."]:
    """``| |x / g| - sqrt(d) |``: RMSNorm with gain ``g`` maps onto ``{x: |x / g| = sqrt(d)}``."""
    d = x.shape[-1]
    return jnp.abs(jnp.linalg.norm(x / gain, axis=-1) - math.sqrt(d))
