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

Exactness needs RMSNorm with ``norm_eps = 0`` and gains of 1 (a gain ``g`` maps onto an
ellipsoid instead, :func:`ellipsoid_residual`); biases and rotary embeddings have no flow
counterpart here and are refused. Which solver the stack *is* depends on the block:

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
import jax.numpy as jnp
from diffrax import RESULTS, AbstractSolver, MultiTerm, ODETerm
from jaxtyping import Array, Float

from . import sphere
from .flow import (
    AttentionField,
    AttentionParams,
    ExpertsField,
    ExpertsParams,
    PiecewiseConstant,
    RouterPosterior,
    ScoreNetworks,
    SumField,
)
from .solvers import AbstractSphereSolver, LieTrotter, RetractedEuler, Strang, solve
from .transformer import Transformer, TransformerConfig, layer_params, outer_norm_params

__all__ = [
    "LayerFlow",
    "to_flow",
    "to_transformer_params",
    "VariableStepRetractedEuler",
    "flow_states",
    "transformer_states",
    "discrepancy",
]

# Transformer-only parameters that have no flow counterpart but must survive a round trip.
_PASSTHROUGH = ("norm_attn_gain", "norm_ffn_gain", "norm_gain")


class LayerFlow(eqx.Module):
    """An SVFlow with per-layer parameters: ``theta(t) = theta_l`` on ``[l h, (l + 1) h)``.

    Attributes:
        attention: the attention field (vMF-kernel posterior x scores).
        experts: the FFN / MoE field (router posterior x relaxed scores).
        step: the layer step ``h``.
        num_layers: ``L``; the flow runs on ``[0, L h]``.
        radius: ``rho``, the radius of the sphere the Transformer's states live on.
        passthrough: Transformer-only arrays (norm gains), kept for the round trip.
    """

    attention: AttentionField
    experts: ExpertsField
    passthrough: dict[str, Array]
    step: float = eqx.field(static=True)
    num_layers: int = eqx.field(static=True)
    radius: float = eqx.field(static=True)

    @property
    def t1(self) -> float:
        return self.num_layers * self.step

    @property
    def field(self) -> SumField:
        """``v_A + v_F``: what a parallel block integrates."""
        return SumField(self.attention, self.experts)


def _check_supported(config: TransformerConfig) -> None:
    problems = []
    if config.norm != "rms":
        problems.append(f"norm={config.norm!r} (need 'rms': LayerNorm also centres)")
    if config.norm_eps != 0:
        problems.append(f"norm_eps={config.norm_eps} (need 0 for an exact retraction)")
    if config.use_bias:
        problems.append("use_bias=True (biases have no flow counterpart yet)")
    if config.rope is not None:
        problems.append("rope is set (rotary embeddings have no flow counterpart yet)")
    if problems:
        raise ValueError("this Transformer is not an SVFlow discretisation: " + "; ".join(problems))


def _expert_networks(config: TransformerConfig, p: Mapping[str, Array]) -> ScoreNetworks:
    moe = config.ffn == "moe"
    expand = (lambda a: a) if moe else (lambda a: a[:, None])  # a dense FFN is one expert
    if config.expert_kind == "gelu":
        return ScoreNetworks(w1=expand(p["w_in"]), w2=expand(p["w_out"]), activation="gelu")
    return ScoreNetworks(
        w1=expand(p["w_gate"]), w2=expand(p["w_down"]), w3=expand(p["w_up"]),
        activation="swiglu",
    )


def to_flow(config: TransformerConfig, params: Mapping[str, Array]) -> LayerFlow:
    """Converts stacked Transformer weights (:func:`layer_params` layout) into a LayerFlow."""
    _check_supported(config)
    d, h = config.d_model, float(config.residual_scale)
    if not h > 0:
        raise ValueError(f"the residual step h must be positive to be a time step, got {h}")
    radius = math.sqrt(d)
    group = config.n_heads // config.kv_heads
    # Grouped-query attention: query head h reads key/value head h // group.
    kv = lambda a: jnp.repeat(a, group, axis=2)  # noqa: E731
    concentration = jnp.full(
        (config.n_layers, config.n_heads), d / math.sqrt(config.d_head), params["wq"].dtype
    )
    attention = AttentionParams(
        kernel_query=params["wq"], kernel_key=kv(params["wk"]), concentration=concentration,
        natural_in=kv(params["wv"]), natural_out=params["wo"],
    )
    router = RouterPosterior(params["router"]) if config.ffn == "moe" else None
    experts = ExpertsParams(experts=_expert_networks(config, params), router=router)
    return LayerFlow(
        attention=AttentionField(PiecewiseConstant(attention, h), causal=config.causal),
        experts=ExpertsField(PiecewiseConstant(experts, h), top_k=config.top_k, radius=radius),
        passthrough={k: params[k] for k in _PASSTHROUGH if k in params},
        step=h,
        num_layers=config.n_layers,
        radius=radius,
    )


def to_transformer_params(flow: LayerFlow, config: TransformerConfig) -> dict[str, Array]:
    """The inverse of :func:`to_flow`: stacked weights in the :func:`layer_params` layout.

    A per-head concentration other than the Transformer's ``d / sqrt(dk)`` is folded into
    ``wq`` (a factor of exactly 1 when it matches, so round trips are bit-identical).
    """
    _check_supported(config)
    group = config.n_heads // config.kv_heads
    theta: AttentionParams = flow.attention.params.anchors
    # The same rounding as in to_flow; where the concentration IS that value the factor is set
    # to exactly 1 (in float32, XLA may divide via a rounded reciprocal: 0.99999994).
    standard = jnp.asarray(config.d_model / math.sqrt(config.d_head), theta.concentration.dtype)
    same = theta.concentration == standard
    fold = jnp.where(same, 1.0, theta.concentration / standard)[:, None, :, None]
    out = {
        "wq": theta.kernel_query * fold.astype(theta.kernel_query.dtype),
        "wk": theta.kernel_key[:, :, ::group],
        "wv": theta.natural_in[:, :, ::group],
        "wo": theta.natural_out,
    }
    experts: ExpertsParams = flow.experts.params.anchors
    squeeze = (lambda a: a) if config.ffn == "moe" else (lambda a: a[:, 0])
    nets = experts.experts
    if nets.activation == "gelu":
        out.update(w_in=squeeze(nets.w1), w_out=squeeze(nets.w2))
    else:
        out.update(w_gate=squeeze(nets.w1), w_up=squeeze(nets.w3), w_down=squeeze(nets.w2))
    if experts.router is not None:
        out["router"] = experts.router.weight
    out.update(flow.passthrough)
    return out


class VariableStepRetractedEuler(AbstractSphereSolver):
    """Retracted Euler with a per-token step: ``y1 = R(y0 + h' P_y u)``, ``h' = h/(1 + h y.u)``.

    The term must return the *unprojected* drift ``u`` (``VectorField.drift``). This is the
    standard post-norm layer ``R(y + h u)`` written as a step along the tangent field: since
    ``y + h u = (1 + h y.u) y + h P_y u``, the two are equal whenever ``1 + h y.u > 0``. The
    radial part of ``u`` only rescales the step, ``h' = h + O(h^2)``: first order, same ODE.

    Where ``1 + h y.u <= 0`` the point ``y + h u`` lies beyond the origin and the layer returns
    the antipode of any step along the sphere: no retracted Euler step describes it. The solver
    then raises (also under ``jit``) instead of returning a wrong state.
    """

    def order(self, terms):
        return 1

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        h = t1 - t0
        u = terms.vf(t0, y0, args)
        radial = sphere.dot(y0, u)
        factor = 1 + h * radial
        y1 = sphere.retract(y0 + (h / factor) * sphere.project_tangent(y0, u))
        y1 = eqx.error_if(
            y1, jnp.any(factor <= 0),
            "standard post-norm step with 1 + h x.u <= 0: x + h u crossed the origin, so the "
            "layer is not a retracted Euler step of the flow (the step h is too large)",
        )
        return y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful


def _block_solver(block: str, step: AbstractSolver) -> AbstractSolver:
    return {"sequential": LieTrotter(step), "macaron": Strang(step), "parallel": step}[block]


def _terms(flow: LayerFlow, block: str, kind: str):
    """The diffrax term(s) of each block: one field (parallel) or a MultiTerm (splittings)."""
    pick = {
        "riemannian": lambda f: f,  # v = P_x u
        "drift": lambda f: (lambda t, y, args: f.drift(t, y)),
        "ambient": lambda f: (lambda t, y, args: f.ambient(t, y)),  # u(y / |y|)
        "ambient-projected": lambda f: (lambda t, y, args: f(t, sphere.retract(y))),
    }[kind]
    if block == "parallel":
        return ODETerm(pick(flow.field))
    return MultiTerm(ODETerm(pick(flow.attention)), ODETerm(pick(flow.experts)))


def flow_states(
    flow: LayerFlow,
    config: TransformerConfig,
    x0: Float[Array, "... n d"],
    solver: AbstractSolver | None = None,
) -> Float[Array, "L ... n d"]:
    """The flow's discrete trajectory at ``t_1..t_L``, in the Transformer's units.

    ``x0`` is the Transformer's first hidden state (post-norm: after the input Norm, so
    ``|x0_i| = sqrt(d)``; pre-norm: the raw residual stream). ``solver`` defaults to the one the
    block *is* (module docstring); pass another to integrate the same flow differently.
    """
    x0 = jnp.asarray(x0)
    grid = dict(num_steps=flow.num_layers, saveat=diffrax.SaveAt(steps=True))
    if config.norm_position == "post":
        if solver is None:
            step = RetractedEuler() if config.project_branches else VariableStepRetractedEuler()
            solver = _block_solver(config.block, step)
        kind = "riemannian" if config.project_branches else "drift"
        sol = solve(_terms(flow, config.block, kind), x0 / flow.radius, 0.0, flow.t1,
                    solver=solver, **grid)
        return sol.ys * flow.radius
    if solver is None:
        solver = _block_solver(config.block, diffrax.Euler())
    # Pre-norm states are not on the sphere: plain diffrax on the ambient ODE.
    dtype = x0.dtype
    times = jnp.arange(flow.num_layers + 1, dtype=dtype) * jnp.asarray(flow.step, dtype)
    kind = "ambient-projected" if config.project_branches else "ambient"
    sol = diffrax.diffeqsolve(
        _terms(flow, config.block, kind), solver, times[0], times[-1], None,
        x0 / flow.radius, saveat=diffrax.SaveAt(steps=True),
        stepsize_controller=diffrax.StepTo(ts=times), max_steps=flow.num_layers,
    )
    return sol.ys * flow.radius


def transformer_states(model: Transformer, x: Float[Array, "... n d"]) -> Float[Array, "L1 ..."]:
    """``(L + 1, ..., n, d)`` hidden states: the first one enters layer 1."""
    return model.hidden_states(x)


def discrepancy(
    model: Transformer, x: Float[Array, "... n d"], solver: AbstractSolver | None = None
) -> dict[str, float | list[float]]:
    """Runs the Transformer and its flow from the same input and compares layer by layer.

    Returns ``max_abs_diff`` (over layers, tokens, coordinates, in the Transformer's units) and
    ``per_layer`` (the same maximum for each layer).
    """
    per_layer = _layer_gaps(model.config, layer_params(model), outer_norm_params(model),
                            jnp.asarray(x), solver)
    return {"max_abs_diff": float(per_layer.max()), "per_layer": [float(v) for v in per_layer]}


@eqx.filter_jit
def _layer_gaps(config, params, outer, x, solver):
    """Both sides in one compiled program (one compilation per configuration)."""
    states = transformer_states(Transformer.from_layer_params(config, params, outer), x)
    ys = flow_states(to_flow(config, params), config, states[0], solver)
    return jnp.max(jnp.abs(ys - states[1:]).reshape(config.n_layers, -1), axis=1)


def ellipsoid_residual(x: Float[Array, "... d"], gain: Float[Array, " d"]) -> Float[Array, "..."]:
    """``| |x / g| - sqrt(d) |``: RMSNorm with gain ``g`` maps onto ``{x: |x / g| = sqrt(d)}``."""
    d = x.shape[-1]
    return jnp.abs(jnp.linalg.norm(x / gain, axis=-1) - math.sqrt(d))
