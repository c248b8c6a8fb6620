"""One way to build the test problems: random Transformer weights, and the smooth flow through
them.

* :func:`transformer_config` is the one Transformer shape of a run (``d = dim``, two heads of
  width ``d / 2``, ``d_ff = 2 d``, RMSNorm without eps or gains, causal), varied per claim
  with ``dataclasses.replace``.
* :func:`random_params` draws its weights ``N(0, init_std^2)`` with NumPy's
  ``default_rng(seed)`` (reproducible, and no PRNG kernel to compile per shape);
  ``init_std = strength / sqrt(d)`` keeps the flow's speed of order ``strength`` whatever ``d``.
* :func:`smooth_flow`: the ``C^infinity`` path ``theta(t)`` through ``K`` layers' weights
  (Chebyshev anchors on ``[0, T]``), the ODE that deeper and deeper Transformers
  (:func:`discretise`) converge to, and on which every solver can show its full order.
* :func:`test_problem`: the run's smooth flow and its initial directions (shared by the solver
  sweeps, the splittings, the drift study and the stack claims).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ..bridge import correspondence
from ..flow import AttentionField, ChebyshevInterpolation, ExpertsField, PiecewiseConstant, SumField
from ..transformer import Transformer, TransformerConfig, layer_params
from .core import Context

__all__ = [
    "ANCHORS",
    "transformer_config",
    "random_params",
    "checkpoint_like",
    "first_layers",
    "inputs",
    "SmoothFlow",
    "smooth_flow",
    "discretise",
    "TestProblem",
    "test_problem",
    "reference",
    "hidden_states",
    "output",
]

ANCHORS = 4  # layers (Chebyshev anchors) of the smooth theta(t)


def transformer_config(ctx: Context, **changes) -> TransformerConfig:
    """The run's Transformer shape; ``changes`` override any field."""
    o = ctx.options
    base = dict(
        d_model=o.dim, n_layers=o.layers, n_heads=2, d_head=o.dim // 2, d_ff=2 * o.dim,
        residual_scale=o.t1 / o.layers, norm="rms", norm_eps=0.0, norm_gain=False,
        use_bias=False, causal=True, param_dtype=o.jnp_dtype,
        init_std=o.strength / math.sqrt(o.dim),
    )
    return TransformerConfig(**{**base, **changes})


def _to_device(value, dtype) -> Array:
    """A NumPy value as a JAX array of ``dtype``, cast in NumPy and copied to the device (in
    ``jax 0.10`` ``jnp.asarray`` of a NumPy array compiles a program per shape and dtype)."""
    return jax.device_put(np.asarray(value, dtype))


def random_params(config: TransformerConfig, seed: int) -> dict[str, Array]:
    """Every weight ``N(0, init_std^2)`` (NumPy ``default_rng(seed)``), Norm gains 1."""
    shapes = layer_params(Transformer.abstract(config))
    rng = np.random.default_rng(seed)
    params = {name: config.init_std * rng.standard_normal(a.shape)
              for name, a in sorted(shapes.items())}
    if config.norm_gain:  # in NumPy: a JAX operation per array would compile a program each
        params.update({name: np.ones(shapes[name].shape)
                       for name in correspondence._gain_names(config)})
    return {name: _to_device(v, shapes[name].dtype) for name, v in params.items()}


def checkpoint_like(config: TransformerConfig, params: Mapping[str, Array], seed: int
                    ) -> dict[str, Array]:
    """``params`` with what trained checkpoints have and random draws lack: Norm gains and
    per-head query/key Norm gains ``U(0.5, 1.5)``, biases (LayerNorm's too) ``N(0, 0.5^2)``
    (a bias comparable to ``x W`` for ``|x| = sqrt(d)``)."""
    rng = np.random.default_rng(seed)
    out = dict(params)
    for name, a in sorted(params.items()):
        if name.endswith("gain"):
            out[name] = _to_device(rng.uniform(0.5, 1.5, a.shape), a.dtype)
        elif name.startswith("b") or name.endswith("_bias"):  # (LayerNorm biases too)
            out[name] = _to_device(0.5 * rng.standard_normal(a.shape), a.dtype)
    return out


def first_layers(params: Mapping[str, Array], num: int) -> dict[str, Array]:
    """The first ``num`` layers of stacked weights."""
    return {name: value[:num] for name, value in params.items()}


def inputs(ctx: Context, spread: float = 0.5) -> Float[Array, "n d"]:
    """Tokens ``x_i = sqrt(d) r_i u_i``: random directions, radii ``r_i`` in ``[1 - spread,
    1 + spread]`` (unequal, which matters for pre-norm; post-norm normalises them away)."""
    o = ctx.options
    rng = np.random.default_rng(o.seed + 7)
    u = rng.standard_normal((o.tokens, o.dim))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    r = 1.0 + spread * rng.uniform(-1.0, 1.0, (o.tokens, 1))
    return _to_device(math.sqrt(o.dim) * r * u, o.jnp_dtype)


class SmoothFlow(eqx.Module):
    """An SVFlow whose parameters are the Chebyshev interpolant of ``K`` layers' weights.

    Anchor ``k`` (layer ``k`` of a ``K``-layer Transformer) sits at the ``k``-th Chebyshev point
    of ``[0, t1]``, so ``theta(t)`` is a polynomial path and every solver shows its full order.
    """

    attention: AttentionField
    experts: ExpertsField
    t1: float = eqx.field(static=True)
    radius: float = eqx.field(static=True)

    @property
    def field(self) -> SumField:
        return SumField(self.attention, self.experts)


def smooth_flow(
    config: TransformerConfig, anchor_params: Mapping[str, Array], t1: float
) -> SmoothFlow:
    """``theta(t)`` through the ``K = config.n_layers`` layers of ``anchor_params`` on
    ``[0, t1]`` (their flow parameters by ``correspondence.to_flow``)."""
    return _smooth_flow(config, dict(anchor_params), float(t1))


@eqx.filter_jit
def _smooth_flow(config, anchor_params, t1):  # one program, not one per operation
    anchors = correspondence.to_flow(config, anchor_params)
    return SmoothFlow(
        attention=AttentionField(
            ChebyshevInterpolation(anchors.attention.params.anchors, 0.0, t1),
            causal=config.causal),
        experts=ExpertsField(
            ChebyshevInterpolation(anchors.experts.params.anchors, 0.0, t1),
            top_k=anchors.experts.top_k, radius=anchors.radius),
        t1=float(t1), radius=anchors.radius,
    )


def discretise(
    smooth: SmoothFlow, config: TransformerConfig, num_layers: int
) -> tuple[TransformerConfig, dict[str, Array]]:
    """An ``L``-layer Transformer whose layer ``l`` has the weights ``theta(l T / L)`` and
    ``residual_scale = h = T / L``. The weights go through ``to_transformer_params``, so the
    Transformer's own forward pass (not the flow code) is what later runs."""
    cfg = dataclasses.replace(config, n_layers=num_layers, residual_scale=smooth.t1 / num_layers)
    return cfg, _discretise(smooth, cfg)


@eqx.filter_jit
def _discretise(smooth: SmoothFlow, cfg: TransformerConfig) -> dict[str, Array]:
    h = cfg.residual_scale
    times = jnp.arange(cfg.n_layers, dtype=jnp.float64) * h
    attention = jax.vmap(smooth.attention.params)(times)
    experts = jax.vmap(smooth.experts.params)(times)
    flow = correspondence.LayerFlow(
        attention=AttentionField(PiecewiseConstant(attention, h), causal=cfg.causal),
        experts=ExpertsField(PiecewiseConstant(experts, h), top_k=smooth.experts.top_k,
                             radius=smooth.radius),
        passthrough={}, step=h, num_layers=cfg.n_layers, radius=smooth.radius,
    )
    return correspondence.to_transformer_params(flow, cfg)


@dataclasses.dataclass(frozen=True)
class TestProblem:
    """The run's smooth flow (attention + FFN), its anchor Transformer and initial tokens."""

    config: TransformerConfig  # the K-anchor Transformer shape (post-norm)
    anchor_params: dict[str, Array]
    smooth: SmoothFlow
    x: Array  # Transformer input, (n, d), unequal radii
    u0: Array  # its directions on the unit sphere

    @property
    def field(self) -> SumField:
        return self.smooth.field

    @property
    def t1(self) -> float:
        return self.smooth.t1


TestProblem.__test__ = False  # not a pytest class


def test_problem(ctx: Context) -> TestProblem:
    """The smooth flow through ``ANCHORS`` random layers and the run's tokens (shared)."""

    def build() -> TestProblem:
        o = ctx.options
        config = transformer_config(ctx, n_layers=ANCHORS, residual_scale=1.0)
        params = random_params(config, o.seed)
        x = inputs(ctx)
        x_host = np.asarray(x)
        u0 = _to_device(x_host / np.linalg.norm(x_host, axis=-1, keepdims=True), x.dtype)
        return TestProblem(config, params, smooth_flow(config, params, o.t1), x, u0)

    return ctx.shared("test-problem", build)


test_problem.__test__ = False  # not a pytest test


def reference(ctx: Context) -> Array:
    """``u(T)`` of the test problem's spherical flow from its directions (shared)."""
    from .measure import sphere_reference

    def build():
        p = test_problem(ctx)
        return sphere_reference(p.field, p.u0, p.t1)

    return ctx.shared("sphere-reference", build)


def hidden_states(config: TransformerConfig, params, x, outer=None, substeps=False) -> Array:
    """The Transformer's hidden states, ``(L + 1, n, d)`` (``substeps``: after every residual
    sub-step, ``(L S + 1, n, d)``); one compilation per shape."""
    return _hidden(config, dict(params), x, dict(outer or {}), substeps)


@eqx.filter_jit
def _hidden(config, params, x, outer, substeps):
    return Transformer.from_layer_params(config, params, outer or None).hidden_states(
        x, substeps=substeps)


def output(config: TransformerConfig, params, x, outer=None) -> Array:
    """The Transformer's output (post-norm: the last state; pre-norm: after the final Norm)."""
    return _output(config, dict(params), x, dict(outer or {}))


@eqx.filter_jit
def _output(config, params, x, outer):
    return Transformer.from_layer_params(config, params, outer or None)(x)
