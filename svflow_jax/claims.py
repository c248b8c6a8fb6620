"""Measuring the claim: a standard Transformer IS the forward-Euler discretisation of an SVFlow.

Each function below measures one claim of ``SVFLOW.md`` sections 3-5 by running both sides from
the same weights (the Transformer forward pass, and a diffrax solve of the flow built by
:mod:`svflow_jax.correspondence`), and returns figures as plain Python data: maximum differences,
errors, and fitted orders with 95% intervals. The tests assert on these figures; ``svflow
verify`` can print them.

Units and metrics
-----------------
* Transformer states: post-norm rows have ``|x_i| = rho = sqrt(d)``; the flow lives on the unit
  sphere, ``x_i / rho``. Pre-norm rows live in ``R^d``; the flow state is ``y = x / rho``.
* "max abs difference": the largest coordinate difference, in the Transformer's units.
* "geodesic error": ``max_i 2 atan2(|a_i - b_i|, |a_i + b_i|)`` between unit directions (full
  relative accuracy near 0, unlike ``arccos``).
* Fitted order: the ordinary least-squares slope of ``log err`` against ``log h`` with the 95%
  interval ``slope +- t_{0.975, k-2} * se`` (k points, Student-t quantile from a table).

Claims (letters of the issue)
-----------------------------
a. Post-norm, projected branches: the stack is a diffrax ``RetractedEuler`` solve (per block:
   Euler / Lie-Trotter / Strang with retracted-Euler sub-steps)        :func:`layer_differences`,
   :func:`euler_solve_differences`.
b. Post-norm, standard (unprojected): a retracted Euler step with the per-token step
   ``h' = h / (1 + h x.u)``, valid while ``1 + h x.u > 0`` (:func:`radial_factors`); its
   one-step gap to ``R(x + h P_x u)`` is ``O(h^2)`` (:func:`one_step_gap`); the stack converges
   at order 1 to the flow on a smooth ``theta(t)`` (:func:`postnorm_convergence`).
c. Pre-norm: forward Euler of ``dy/dt = F(y/|y|)``; directions converge to the spherical flow
   on per-token clocks and not to the plain spherical flow (:func:`prenorm_convergence`).
d. Blocks = splittings; orders of the splittings with Euler and second-order sub-steps
   (:func:`splitting_orders`).
e. MoE = Euler of the MoE field, top-k routing included (:func:`layer_differences`,
   :func:`routing_summary`).
f. RMSNorm gains retract onto an ellipsoid (:func:`ellipsoid_residual_max`); departure from the
   sphere flow as the gain leaves 1 (:func:`gain_departure`).
g. Float32: the same differences, bounded by ``C L eps32`` (:func:`layer_differences`).
h. Round trip Transformer -> flow -> Transformer is bit-identical (:func:`round_trip_mismatches`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from diffrax import AbstractSolver, MultiTerm, ODETerm
from flax import nnx
from jaxtyping import Array, Float

from . import sphere
from .correspondence import (
    LayerFlow,
    ellipsoid_residual,
    flow_states,
    to_flow,
    to_transformer_params,
)
from .fitting import Fit, fit_order
from .flow import (
    AttentionField,
    ChebyshevInterpolation,
    ExpertsField,
    PiecewiseConstant,
    SumField,
)
from .solvers import LieTrotter, Retracted, RetractedEuler, Strang, solve
from .transformer import Transformer, TransformerConfig, layer_params

__all__ = [
    "Fit",
    "fit_order",
    "init_layer_params",
    "geodesic_error",
    "layer_differences",
    "euler_solve_differences",
    "radial_factors",
    "one_step_gap",
    "SmoothFlow",
    "smooth_flow",
    "discretise",
    "sphere_reference",
    "clock_reference",
    "postnorm_convergence",
    "prenorm_convergence",
    "splitting_solvers",
    "splitting_orders",
    "routing_summary",
    "ellipsoid_residual_max",
    "gain_departure",
    "round_trip_mismatches",
]

REFERENCE_TOLERANCE = 1e-12
MAX_REFERENCE_STEPS = 100_000


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def init_layer_params(config: TransformerConfig, seed: int) -> dict[str, Array]:
    """Weights drawn by the Transformer's own initialiser (``N(0, init_std^2)``, gains 1)."""
    return layer_params(Transformer(config, rngs=nnx.Rngs(seed)))


def geodesic_error(a: Float[Array, "... n d"], b: Float[Array, "... n d"]) -> float:
    """``max_i dist(R(a_i), R(b_i))``: the largest geodesic distance between directions."""
    return float(jnp.max(sphere.geodesic_distance(sphere.retract(a), sphere.retract(b))))


def _radius(config: TransformerConfig) -> float:
    return math.sqrt(config.d_model)


def _block_solver(block: str, step: AbstractSolver) -> AbstractSolver:
    """The splitting each block is (parallel: the step itself on ``v_A + v_F``)."""
    return {"sequential": LieTrotter(step), "parallel": step, "macaron": Strang(step)}[block]


def _block_terms(attention, experts, block: str):
    """``v_A + v_F`` (parallel) or ``MultiTerm(v_A, v_F)`` (the splittings)."""
    if block == "parallel":
        return ODETerm(SumField(attention, experts))
    return MultiTerm(ODETerm(attention), ODETerm(experts))


@functools.partial(jax.jit, static_argnums=0)
def _hidden_states(config: TransformerConfig, params, x, outer=None):
    """The Transformer's ``(L + 1, n, d)`` hidden states (one compilation per config)."""
    return Transformer.from_layer_params(config, params, outer).hidden_states(x)


@functools.partial(jax.jit, static_argnums=0)
def _output(config: TransformerConfig, params, x, outer=None):
    """The Transformer's output (post-norm: last state; pre-norm: after the final Norm)."""
    return Transformer.from_layer_params(config, params, outer)(x)


# ---------------------------------------------------------------------------------------------
# a, b, c, d, e, g: equality of the two sides
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=0)
def _layer_gap(config, params, x):
    substeps = Transformer.from_layer_params(config, params).hidden_states(x, substeps=True)
    states = substeps[:: config.n_substeps]
    ys = flow_states(to_flow(config, params), config, states[0])
    per_layer = jnp.max(jnp.abs(ys - states[1:]).reshape(config.n_layers, -1), axis=1)
    moved = jnp.max(sphere.geodesic_distance(sphere.retract(states[0]), sphere.retract(states[-1])))
    scale = jnp.max(jnp.linalg.norm(states, axis=-1))
    return per_layer, moved, scale, substeps


def layer_differences(
    config: TransformerConfig, params: Mapping[str, Array], x: Float[Array, "n d"]
) -> dict[str, Any]:
    """``max |x_l - rho y_l|`` for each layer ``l = 1..L`` (Transformer units).

    ``x_l``: the Transformer's hidden states; ``y_l``: the discrete trajectory of the flow
    ``to_flow(config, params)`` under the solver the block is (``flow_states``):

    * post-norm, projected: ``y <- R(y + h v(y))`` (RetractedEuler) inside Euler / Lie-Trotter /
      Strang (claims a, d);
    * post-norm, standard: ``y <- R(y + h' P_y u)``, ``h' = h / (1 + h y.u)`` per token (b);
    * pre-norm: ``y <- y + h u(y / |y|)`` (diffrax Euler on the ambient ODE) (c).

    Entry ``l - 1`` of ``per_layer`` is also the output difference of the depth-``l`` stack made
    of the first ``l`` layers (the first ``l`` steps of either side never see later layers).
    Also returns ``max`` (over layers), ``moved`` (the largest geodesic distance a token's
    direction travels from the first to the last state: the equality is not between two
    standing-still trajectories), ``scale`` (the largest token norm along the trajectory) and
    ``substep_states`` (the Transformer's states after every residual sub-step).
    """
    per_layer, moved, scale, substeps = _layer_gap(config, params, x)
    per_layer = np.asarray(per_layer)
    return {"per_layer": per_layer, "max": float(per_layer.max()), "moved": float(moved),
            "scale": float(scale), "substep_states": substeps}


@functools.partial(jax.jit, static_argnums=0)
def _euler_solve_gap(config, params, x):
    states = Transformer.from_layer_params(config, params).hidden_states(x)
    flow = to_flow(config, params)
    y0 = states[0] / flow.radius
    saveat = diffrax.SaveAt(steps=True)
    if config.norm_position == "post":
        # The plain statement: L steps of retracted Euler on v = v_A + v_F over [0, L h].
        ys = solve(flow.field, y0, 0.0, flow.t1, solver=RetractedEuler(),
                   num_steps=config.n_layers, saveat=saveat).ys
    else:
        # Forward Euler of the ambient ODE dy/dt = F(y / |y|) in R^d.
        ts = jnp.arange(config.n_layers + 1, dtype=y0.dtype) * flow.step
        ys = diffrax.diffeqsolve(
            ODETerm(flow.field.ambient), diffrax.Euler(), ts[0], ts[-1], None, y0,
            saveat=saveat, stepsize_controller=diffrax.StepTo(ts=ts), max_steps=config.n_layers,
        ).ys
    return jnp.max(jnp.abs(ys * flow.radius - states[1:]).reshape(config.n_layers, -1), axis=1)


def euler_solve_differences(
    config: TransformerConfig, params: Mapping[str, Array], x: Float[Array, "n d"]
) -> np.ndarray:
    """Per-layer ``max |x_l - rho y_l|`` for a PARALLEL block against a plain diffrax solve.

    Post-norm with projected branches: ``solve(flow.field, ..., solver=RetractedEuler(),
    num_steps=L)``, i.e. ``y_{l+1} = R(y_l + h (v_A + v_F)(t_l, y_l))`` (claim a; with
    ``ffn="moe"`` claim e). Pre-norm: ``diffrax.Euler`` on ``dy/dt = (F_A + F_F)(y / |y|)``
    (claim c). Written out here, independently of ``flow_states``' choice of solver.
    """
    if config.block != "parallel":
        raise ValueError("euler_solve_differences is the parallel-block statement")
    if config.norm_position == "post" and not config.project_branches:
        raise ValueError("post-norm needs project_branches=True to be plain retracted Euler")
    if config.norm_position == "pre" and config.project_branches:
        raise ValueError("the pre-norm statement is about the unprojected branch F")
    return np.asarray(_euler_solve_gap(config, params, x))


def radial_factors(
    config: TransformerConfig, params: Mapping[str, Array], substep_states: Float[Array, "m n d"]
) -> np.ndarray:
    """``min_i (1 + c x_i . u(x_i))`` for every residual sub-step of a standard post-norm stack.

    ``c`` is the sub-step's step (``h``, or ``h / 2`` for the macaron FFN halves), ``x`` the
    sub-step's input on the unit sphere and ``u`` its unprojected branch. The identity
    ``R(x + c u) = R(x + c' P_x u)``, ``c' = c / (1 + c x.u)``, needs this factor to be
    positive: where it is negative, ``x + c u`` lies on the far side of the origin and the layer
    returns the ANTIPODE of the per-token step (a step too large to be an Euler step of
    anything). Returns an ``(L, S)`` array (``S`` sub-steps per layer).
    """
    if config.norm_position != "post" or config.project_branches:
        raise ValueError("radial factors concern post-norm stacks with unprojected branches")
    return np.asarray(_radial_factors(config, params, substep_states))


@functools.partial(jax.jit, static_argnums=0)
def _radial_factors(config, params, substep_states):
    flow = to_flow(config, params)
    h = flow.step
    plan = {"sequential": [(flow.attention, h), (flow.experts, h)],
            "parallel": [(flow.field, h)],
            "macaron": [(flow.experts, h / 2), (flow.attention, h), (flow.experts, h / 2)]}
    subs = plan[config.block]
    y = jnp.asarray(substep_states) / flow.radius
    times = jnp.arange(config.n_layers, dtype=y.dtype) * h  # layer l reads theta(t_l)
    columns = []
    for j, (field, c) in enumerate(subs):
        x = y[j :: len(subs)][: config.n_layers]  # input of sub-step j of every layer
        radial = jnp.sum(x * jax.vmap(field.drift)(times, x), axis=-1)
        columns.append(jnp.min(1 + c * radial, axis=-1))
    return jnp.stack(columns, axis=1)


# ---------------------------------------------------------------------------------------------
# b: the one-step gap between the per-token step and the plain step
# ---------------------------------------------------------------------------------------------


def _plain_step(attention, experts, block: str, y, h):
    """One layer of plain-step retracted Euler sub-steps ``y <- R(y + c v(y))`` (written out)."""
    def sub(field, y, c):
        return sphere.retract(y + c * field(0.0, y))

    if block == "parallel":
        return sub(SumField(attention, experts), y, h)
    if block == "sequential":
        return sub(experts, sub(attention, y, h), h)
    return sub(experts, sub(attention, sub(experts, y, h / 2), h), h / 2)  # macaron


def one_step_gap(
    config: TransformerConfig, params: Mapping[str, Array], x: Float[Array, "n d"],
    steps: Sequence[float],
) -> dict[str, Any]:
    """Gap between one standard post-norm layer and one plain-step retracted Euler step.

    The layer computes ``R(x + h u) = R(x + h' P_x u)``, ``h' = h / (1 + h x.u)``; the plain
    step is ``R(x + h P_x u)`` (each sub-step of the block's splitting). Since ``h' - h =
    -h^2 x.u / (1 + h x.u)``, the gap is ``|x.u| |P_x u| h^2 + O(h^3)``: consistent, same ODE,
    order 2 locally.

    Uses layer 1 of ``params`` with ``residual_scale = h`` for each ``h`` in ``steps``. Returns
    ``steps``, ``gaps`` (geodesic, unit sphere) and ``fit`` (expected slope 2).
    """
    if config.norm_position != "post" or config.project_branches:
        raise ValueError("the one-step gap concerns post-norm layers with unprojected branches")
    first = {k: v[:1] for k, v in params.items()}
    flow = to_flow(dataclasses.replace(config, n_layers=1), first)  # theta constant on [0, h]
    gaps = []
    for h in steps:
        states = _hidden_states(
            dataclasses.replace(config, n_layers=1, residual_scale=float(h)), first, x)
        plain = _plain_step(flow.attention, flow.experts, config.block,
                            states[0] / flow.radius, float(h))
        gaps.append(geodesic_error(states[1], plain))
    return {"steps": [float(h) for h in steps], "gaps": gaps, "fit": fit_order(steps, gaps)}


# ---------------------------------------------------------------------------------------------
# A smooth theta(t) from Transformer weights, and its discretisations
# ---------------------------------------------------------------------------------------------


class SmoothFlow(eqx.Module):
    """An SVFlow whose parameters are the Chebyshev interpolant of ``K`` layers' weights.

    Anchor ``k`` (layer ``k`` of a ``K``-layer Transformer) sits at the ``k``-th Chebyshev point
    of ``[0, t1]``, so ``theta(t)`` is a C-infinity polynomial path and every solver can show
    its full order on it.
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
    """``theta(t)`` through the ``K = config.n_layers`` layers of ``anchor_params`` on ``[0,
    t1]`` (their flow parameters via ``to_flow``)."""
    anchors = to_flow(config, anchor_params)
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
    """An ``L``-layer Transformer whose layer ``l`` has the weights ``theta(l T / L)``.

    ``residual_scale = h = T / L``. The weights go through ``to_transformer_params``, so the
    Transformer forward pass (not the flow code) is what later runs.
    """
    if config.norm_gain:
        raise ValueError("discretise builds gain-free Transformers (norm_gain=False)")
    h = smooth.t1 / num_layers
    times = jnp.arange(num_layers, dtype=jnp.result_type(float)) * h
    attention = jax.vmap(smooth.attention.params)(times)
    experts = jax.vmap(smooth.experts.params)(times)
    cfg = dataclasses.replace(config, n_layers=num_layers, residual_scale=h)
    flow = LayerFlow(
        attention=AttentionField(PiecewiseConstant(attention, h), causal=config.causal),
        experts=ExpertsField(PiecewiseConstant(experts, h), top_k=smooth.experts.top_k,
                             radius=smooth.radius),
        passthrough={}, step=h, num_layers=num_layers, radius=smooth.radius,
    )
    return cfg, to_transformer_params(flow, cfg)


def sphere_reference(
    field: Callable, u0: Float[Array, "n d"], t1: float, tolerance: float = REFERENCE_TOLERANCE
) -> Array:
    """``u(t1)`` of ``du/dt = v_t(u)`` on the sphere: ``Retracted(Dopri8())``, PID at
    ``rtol = atol = tolerance``."""
    controller = diffrax.PIDController(rtol=tolerance, atol=tolerance)
    return solve(field, u0, 0.0, t1, solver=Retracted(diffrax.Dopri8()),
                 stepsize_controller=controller, max_steps=MAX_REFERENCE_STEPS).ys[-1]


def clock_reference(
    field: SumField, y0: Float[Array, "n d"], t1: float, tolerance: float = REFERENCE_TOLERANCE
) -> tuple[Array, Array]:
    """The continuous limit of a pre-norm stack, in directions and radii.

    With ``y_i = r_i u_i`` and ``dy/dt = F_t(U)`` (``F = field.drift`` read at the directions
    ``U``):

        du_i/dt = P_{u_i} F_t(U)_i / r_i = v_t(U)_i / r_i,      dr_i/dt = u_i . F_t(U)_i,

    each direction follows the spherical flow on its own clock ``d tau_i = dt / r_i``. Solved in
    ``R^{n x d} x R^n`` by plain ``diffrax.Dopri8`` (PID, ``rtol = atol = tolerance``).
    Returns ``(U(t1) retracted, r(t1))``.
    """

    def vector_field(t, state, args):
        u, r = state
        drift = field.drift(t, u)
        radial = jnp.sum(u * drift, axis=-1)
        return (drift - radial[..., None] * u) / r[..., None], radial

    r0 = jnp.linalg.norm(y0, axis=-1)
    sol = diffrax.diffeqsolve(
        ODETerm(vector_field), diffrax.Dopri8(), 0.0, t1, None, (y0 / r0[..., None], r0),
        stepsize_controller=diffrax.PIDController(rtol=tolerance, atol=tolerance),
        max_steps=MAX_REFERENCE_STEPS,
    )
    u, r = sol.ys
    return sphere.retract(u[-1]), r[-1]


# ---------------------------------------------------------------------------------------------
# b, c: convergence of Transformer stacks as L -> infinity
# ---------------------------------------------------------------------------------------------


def postnorm_convergence(
    config: TransformerConfig, anchor_params: Mapping[str, Array], x: Float[Array, "n d"],
    t1: float, depths: Sequence[int], reference: Array | None = None,
) -> dict[str, Any]:
    """Order of convergence of post-norm stacks to the flow ``du/dt = (v_A + v_F)_t(u)``.

    For each ``L`` in ``depths`` the Transformer of :func:`discretise` runs on ``x``; its output
    ``/ rho`` is compared with a tight reference solve from ``R(x)`` (geodesic error).
    Returns ``depths``, ``steps`` (``T / L``), ``errors``, ``fit`` (expected order 1) and the
    ``reference`` used.
    """
    if config.norm_position != "post":
        raise ValueError("postnorm_convergence needs a post-norm config")
    smooth = smooth_flow(config, anchor_params, t1)
    if reference is None:
        reference = sphere_reference(smooth.field, sphere.retract(x), t1)
    errors = []
    for num_layers in depths:
        cfg, params = discretise(smooth, config, num_layers)
        errors.append(geodesic_error(_output(cfg, params, x), reference))
    steps = [t1 / L for L in depths]
    return {"depths": list(depths), "steps": steps, "errors": errors,
            "fit": fit_order(steps, errors), "reference": reference}


def prenorm_convergence(
    config: TransformerConfig, anchor_params: Mapping[str, Array], x: Float[Array, "n d"],
    t1: float, depths: Sequence[int], sphere_flow: Array | None = None,
) -> dict[str, Any]:
    """Pre-norm stacks: directions converge to the clock system, not to the spherical flow.

    For each ``L``, the direction of the pre-norm Transformer's output (its final Norm is
    ``rho`` times the direction) is compared with (i) :func:`clock_reference` from ``y0 = x /
    rho`` and (ii) the plain spherical flow from the same directions (``sphere_flow``, solved
    here if not given). Returns ``errors_clock`` with ``fit`` (expected order 1),
    ``errors_sphere`` (expected to stay O(1) when the radii differ), ``limit_gap`` (the
    geodesic distance between the two limits, clock system and sphere flow, at ``t1``),
    ``radii`` (initial) and ``final_radii`` (of the reference).
    """
    if config.norm_position != "pre" or config.project_branches or not config.final_norm:
        raise ValueError("prenorm_convergence needs a pre-norm config, unprojected, final_norm")
    smooth = smooth_flow(config, anchor_params, t1)
    y0 = x / smooth.radius
    clock, final_radii = clock_reference(smooth.field, y0, t1)
    if sphere_flow is None:
        sphere_flow = sphere_reference(smooth.field, sphere.retract(y0), t1)
    errors_clock, errors_sphere = [], []
    for num_layers in depths:
        cfg, params = discretise(smooth, config, num_layers)
        out = _output(cfg, params, x)
        errors_clock.append(geodesic_error(out, clock))
        errors_sphere.append(geodesic_error(out, sphere_flow))
    steps = [t1 / L for L in depths]
    return {
        "depths": list(depths), "steps": steps, "errors_clock": errors_clock,
        "fit": fit_order(steps, errors_clock), "errors_sphere": errors_sphere,
        "limit_gap": geodesic_error(clock, sphere_flow),
        "radii": np.asarray(jnp.linalg.norm(y0, axis=-1)).tolist(),
        "final_radii": np.asarray(final_radii).tolist(),
    }


# ---------------------------------------------------------------------------------------------
# d: orders of the block splittings on a smooth theta(t)
# ---------------------------------------------------------------------------------------------


def splitting_solvers() -> dict[str, tuple[str, AbstractSolver, int]]:
    """``name -> (block, solver, expected order)`` measured by :func:`splitting_orders`.

    Euler sub-steps are the Transformer blocks; ``Retracted(Heun())`` / ``Retracted(Midpoint())``
    sub-steps are the second-order variants. Lie-Trotter stays first order whatever the
    sub-step (not measured by default); Strang's ``h^2`` terms cancel only when every sub-step
    is itself second order.
    """
    heun, midpoint = Retracted(diffrax.Heun()), Retracted(diffrax.Midpoint())
    return {
        "parallel, Euler": ("parallel", RetractedEuler(), 1),
        "Lie-Trotter, Euler": ("sequential", LieTrotter(RetractedEuler()), 1),
        "Strang, Euler": ("macaron", Strang(RetractedEuler()), 1),
        "Strang, Heun": ("macaron", Strang(heun), 2),
        "Strang, midpoint": ("macaron", Strang(midpoint), 2),
    }


def splitting_orders(
    smooth: SmoothFlow, u0: Float[Array, "n d"], depths: Sequence[int],
    reference: Array | None = None, solvers: Mapping[str, tuple] | None = None,
) -> dict[str, dict[str, Any]]:
    """Global error against ``L`` for each solver of :func:`splitting_solvers` on the smooth
    flow (fields read at their true sub-step times). One compilation per solver: the step
    ``T / L`` is a traced argument. Returns, per name, ``errors``, ``fit`` and ``expected``."""
    if reference is None:
        reference = sphere_reference(smooth.field, u0, smooth.t1)
    solvers = splitting_solvers() if solvers is None else solvers
    max_steps = max(depths) + 1
    out = {}
    for name, (block, solver, expected) in solvers.items():
        terms = _block_terms(smooth.attention, smooth.experts, block)

        @jax.jit
        def run(dt0, terms=terms, solver=solver):
            return solve(terms, u0, 0.0, smooth.t1, solver=solver, dt0=dt0,
                         max_steps=max_steps).ys[-1]

        errors = [geodesic_error(run(jnp.asarray(smooth.t1 / L, u0.dtype)), reference)
                  for L in depths]
        steps = [smooth.t1 / L for L in depths]
        out[name] = {"errors": errors, "fit": fit_order(steps, errors), "expected": expected}
    return out


def routing_summary(
    config: TransformerConfig, params: Mapping[str, Array],
    substep_states: Float[Array, "m n d"],
) -> dict[str, Any]:
    """How the top-k router of a post-norm SEQUENTIAL MoE stack routes along its trajectory.

    ``substep_states``: the states after every sub-step (``layer_differences``' output). The FFN
    of layer ``l`` reads the state after its attention sub-step; its router logits are
    ``x W_r[l]``. Returns ``selections`` (the number of distinct top-k expert sets over tokens
    and layers: routing that never changes would not test top-k) and ``margin`` (the smallest
    gap between the k-th and (k+1)-th logits: far above round-off, so both sides must select
    the same experts).
    """
    if config.ffn != "moe" or config.block != "sequential" or config.norm_position != "post":
        raise ValueError("routing_summary reads a post-norm sequential MoE stack")
    ffn_inputs = substep_states[1::2]  # after each layer's attention sub-step
    logits = jnp.einsum("lnd,lde->lne", ffn_inputs, params["router"])
    k = config.top_k
    top = np.sort(np.asarray(jax.lax.top_k(logits, k)[1]), axis=-1).reshape(-1, k)
    margin = math.inf
    if k < config.n_experts:
        ordered = jnp.sort(logits, axis=-1)
        margin = float(jnp.min(ordered[..., -k] - ordered[..., -k - 1]))
    return {"selections": len({tuple(row) for row in top.tolist()}), "margin": margin}


# ---------------------------------------------------------------------------------------------
# f: RMSNorm gains
# ---------------------------------------------------------------------------------------------


def _substep_gains(config: TransformerConfig, params: Mapping[str, Array]) -> Array:
    """The gain of the Norm after each residual sub-step, ``(L * S, d)`` in hidden-state order."""
    names = {"sequential": ["norm_attn_gain", "norm_ffn_gain"], "parallel": ["norm_gain"],
             "macaron": ["norm_ffn_gain", "norm_attn_gain", "norm_ffn_gain"]}[config.block]
    per_layer = jnp.stack([params[name] for name in names], axis=1)  # (L, S, d)
    return per_layer.reshape(-1, config.d_model)


def ellipsoid_residual_max(
    config: TransformerConfig, params: Mapping[str, Array], input_gain: Array,
    x: Float[Array, "n d"],
) -> dict[str, float]:
    """``max | |x / g| - sqrt(d) |`` over every post-norm sub-step state, each against the gain
    ``g`` of the Norm that produced it: ``R_g(y) = g * sqrt(d) y / |y|`` lies on the ellipsoid
    ``{x : |x / g| = sqrt(d)}`` (the sphere when ``g = 1``).

    Returns ``ellipsoid`` (that maximum) and ``sphere`` (``max | |x| - sqrt(d) |``: how far the
    same states are from the sphere, so that the first figure is not vacuous).
    """
    if config.norm_position != "post" or not config.norm_gain:
        raise ValueError("the ellipsoid statement concerns post-norm stacks with gains")
    model = Transformer.from_layer_params(config, params, {"input_norm_gain": input_gain})
    states = model.hidden_states(x, substeps=True)
    gains = jnp.concatenate([input_gain[None], _substep_gains(config, params)])
    off_sphere = jnp.abs(jnp.linalg.norm(states, axis=-1) - _radius(config))
    return {"ellipsoid": float(jnp.max(ellipsoid_residual(states, gains[:, None, :]))),
            "sphere": float(jnp.max(off_sphere))}


def gain_departure(
    config: TransformerConfig, params: Mapping[str, Array], x: Float[Array, "n d"],
    direction: Float[Array, " d"], epsilons: Sequence[float], fit_up_to: float = math.inf,
) -> dict[str, Any]:
    """How far a post-norm stack with every gain ``g = 1 + eps r`` leaves the sphere flow.

    The ``g = 1`` stack is the flow's discretisation (claims a, b). Every Norm (input Norm and
    all layers' Norms) gets the gain ``g``; the departure is the geodesic error between the
    directions of the two stacks' final states. To first order in ``eps`` the gained state is
    ``(1 + eps r) * x``, so the departure is ``O(eps)`` (expected slope 1, asymptotically:
    ``fit`` uses the ``eps <= fit_up_to``). Returns ``epsilons``, ``departures`` and ``fit``.
    """
    if config.norm_position != "post" or not config.norm_gain:
        raise ValueError("gain_departure needs a post-norm config with norm_gain=True")
    gain_names = [k for k in params if k.endswith("_gain")]

    def run(g):
        p = dict(params)
        p.update({k: jnp.broadcast_to(g, params[k].shape) for k in gain_names})
        return _output(config, p, x, {"input_norm_gain": g})

    base = run(jnp.ones_like(direction))
    departures = []
    for eps in epsilons:
        departures.append(geodesic_error(run(1.0 + eps * direction), base))
    used = [i for i, eps in enumerate(epsilons) if eps <= fit_up_to]
    fit = fit_order([epsilons[i] for i in used], [departures[i] for i in used])
    return {"epsilons": list(epsilons), "departures": departures, "fit": fit}


# ---------------------------------------------------------------------------------------------
# h: round trip
# ---------------------------------------------------------------------------------------------


def round_trip_mismatches(
    config: TransformerConfig, params: Mapping[str, Array]
) -> list[str]:
    """Names whose array does not come back BIT-identical from ``to_transformer_params(to_flow(
    config, params), config)`` (missing, extra, other shape/dtype, or any differing bit)."""
    back = to_transformer_params(to_flow(config, params), config)
    bad = sorted(set(params) ^ set(back))
    for name in sorted(set(params) & set(back)):
        a, b = np.asarray(params[name]), np.asarray(back[name])
        same = a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
        if not same:
            bad.append(name)
    return bad
