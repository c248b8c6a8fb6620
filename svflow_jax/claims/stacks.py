"""Transformer stacks as depth grows: the standard layer, pre-norm, Norm gains.

The stacks are real Transformers (:mod:`svflow_jax.transformer`, their own forward pass) whose
layer ``l`` has the weights ``theta(l T / L)`` of the run's smooth path
(:func:`.problem.discretise`), with ``h = T / L``. As ``L`` grows they approach a continuous
limit, measured against a tight float64 reference with the geodesic error.
"""

from __future__ import annotations

import dataclasses

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..bridge import correspondence
from ..flow import AttentionField, Constant, ExpertsField
from ..solvers import LieTrotter, RetractedEuler
from .core import Context, Evidence, claim
from .measure import (
    EXACT_FLOAT64,
    ORDER_TOLERANCE,
    _fixed_steps,
    _geodesic_error,
    coupled_reference,
    fit_window,
    geodesic_error,
)
from .measure import order_passes as _passes
from .problem import (
    _to_device,
    discretise,
    first_layers,
    hidden_states,
    output,
    random_params,
    reference,
    test_problem,
    transformer_config,
)

__all__: list[str] = []


def _order(steps, errors, expected: float) -> tuple[dict, bool]:
    fit = fit_window(steps, errors, floor=0.0)
    return fit, _passes(fit["fitted_order"], expected, fit["order_ci"][0])


@claim("standard-layer/one-step-gap", "stacks",
       "One standard post-norm layer R(x + h u) is the per-token step R(x + h' P_x u), "
       "h' = h / (1 + h x.u): it differs from the plain retracted Euler step R(x + h P_x u) by "
       "O(h^2) (consistent: same ODE).")
def one_step_gap(ctx: Context) -> Evidence:
    problem = test_problem(ctx)
    config = dataclasses.replace(problem.config, n_layers=1)
    steps = tuple(float(h) for h in np.geomspace(1e-3, 1e-1, 5))
    gaps = np.asarray(_one_step_gaps(config, problem.anchor_params, problem.x, steps))
    if np.isnan(gaps).any():
        raise FloatingPointError("a one-step solve produced NaN")
    rows = [{"step_size": h, "gap": float(g)} for h, g in zip(steps, gaps, strict=True)]
    fit, passed = _order([r["step_size"] for r in rows], [r["gap"] for r in rows], 2)
    visible = min(r["gap"] for r in rows) > 1e3 * EXACT_FLOAT64
    return Evidence(passed and visible, {"expected_order": 2, **_clean(fit)},
                    f"|fitted slope - 2| <= {ORDER_TOLERANCE:g}, every gap > "
                    f"{1e3 * EXACT_FLOAT64:g}", rows,
                    headline="fitted_order")


@eqx.filter_jit
def _one_step_gaps(config, anchor_params, x, steps):
    """Per step ``h``: the geodesic distance between one standard post-norm layer of residual
    scale ``h`` (the first anchor layer) and one plain retracted Lie-Trotter Euler step of its
    flow; one program."""
    first = first_layers(anchor_params, 1)
    layer = correspondence.to_flow(dataclasses.replace(config, residual_scale=1.0), first)
    index0 = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
    terms = diffrax.MultiTerm(
        diffrax.ODETerm(AttentionField(Constant(index0(layer.attention.params.anchors)),
                                       causal=config.causal)),
        diffrax.ODETerm(ExpertsField(Constant(index0(layer.experts.params.anchors)),
                                     top_k=config.top_k, radius=layer.radius)))
    gaps = []
    for h in steps:
        states = hidden_states(dataclasses.replace(config, residual_scale=h), first, x)
        plain = _fixed_steps(terms, LieTrotter(RetractedEuler()), states[0] / layer.radius,
                             jnp.asarray(h, x.dtype), jnp.asarray(1))
        gaps.append(_geodesic_error(states[1], plain))
    return jnp.stack(gaps)


def _clean(fit: dict) -> dict:
    return {k: v for k, v in fit.items() if k != "in_fit"}


def _stack_errors(ctx: Context, config, x, references: dict) -> list[dict]:
    """Per depth: the geodesic error of the stack's output against each reference."""
    problem = test_problem(ctx)
    depths = tuple(ctx.options.depths)
    outputs = _stack_outputs(problem.smooth, config, x, depths)  # every depth, one program
    return [{"depth": L, "step_size": problem.t1 / L,
             **{f"error_{k}": geodesic_error(out, ref) for k, ref in references.items()}}
            for L, out in zip(depths, outputs, strict=True)]


@eqx.filter_jit
def _stack_outputs(smooth, config, x, depths):
    """The outputs of the stacks :func:`.problem.discretise` makes, one per depth."""
    outputs = []
    for L in depths:
        cfg, params = discretise(smooth, config, L)
        outputs.append(output(cfg, params, x))
    return outputs


@claim("standard-layer/stack-order", "stacks",
       "Standard post-norm Transformers with weights theta(l T / L) and h = T / L converge to "
       "the spherical flow du/dt = v_t(u) at order 1.")
def postnorm_stack(ctx: Context) -> Evidence:
    problem = test_problem(ctx)
    config = dataclasses.replace(problem.config, norm_position="post", block="sequential",
                                 project_branches=False)
    rows = _stack_errors(ctx, config, problem.x, {"sphere_flow": reference(ctx)})
    fit, passed = _order([r["step_size"] for r in rows], [r["error_sphere_flow"] for r in rows],
                         1)
    return Evidence(passed, {"expected_order": 1, **_clean(fit)},
                    f"|fitted order - 1| <= {ORDER_TOLERANCE:g}", rows,
                    headline="fitted_order")


def _prenorm_rows(ctx: Context) -> dict:
    """Unprojected pre-norm stacks from tokens of unequal radii, against the coupled system
    and against the plain spherical flow (shared by two claims)."""

    def build():
        problem = test_problem(ctx)
        config = dataclasses.replace(problem.config, norm_position="pre", block="sequential",
                                     project_branches=False, final_norm=True)
        y0 = np.asarray(problem.x) / problem.smooth.radius  # NumPy: no program for it
        coupled, radii = coupled_reference(problem.field, y0, problem.t1)
        sphere_flow = reference(ctx)
        rows = _stack_errors(ctx, config, problem.x,
                             {"coupled": coupled, "sphere_flow": sphere_flow})
        r0 = np.linalg.norm(np.asarray(y0), axis=-1)
        return {"rows": rows, "limit_gap": geodesic_error(coupled, sphere_flow),
                "radii": [float(r) for r in r0], "final_radii": np.asarray(radii).tolist()}

    return ctx.shared("prenorm-stacks", build)


@claim("prenorm/coupled-limit", "stacks",
       "Unprojected pre-norm stacks (forward Euler of dy/dt = F_t(y / |y|)) converge at order 1 "
       "to the coupled system du_i/dt = v_t(U)_i / r_i, dr_i/dt = u_i . F_t(U)_i.")
def prenorm_coupled(ctx: Context) -> Evidence:
    out = _prenorm_rows(ctx)
    rows = out["rows"]
    fit, passed = _order([r["step_size"] for r in rows], [r["error_coupled"] for r in rows], 1)
    return Evidence(passed, {"expected_order": 1, **_clean(fit), "radii": out["radii"]},
                    f"|fitted order - 1| <= {ORDER_TOLERANCE:g}", rows,
                    headline="fitted_order")


@claim("prenorm/not-the-sphere-flow", "stacks",
       "With unprojected branches and tokens of unequal radii, pre-norm directions do NOT "
       "converge to the spherical flow du/dt = v_t(u): their error tends to the distance between "
       "the two limits instead of 0.")
def prenorm_not_sphere(ctx: Context) -> Evidence:
    out = _prenorm_rows(ctx)
    rows, gap = out["rows"], out["limit_gap"]
    finest = rows[-1]
    spread = max(out["radii"]) - min(out["radii"])
    passed = (spread > 0.3 and gap > 3 * finest["error_coupled"]
              and min(r["error_sphere_flow"] for r in rows) > 0.5 * gap)
    figures = {"limit_gap": gap, "error_finest": finest["error_sphere_flow"],
               "error_coupled_finest": finest["error_coupled"], "radius_spread": spread}
    return Evidence(passed, figures,
                    "error against the sphere flow > half the limit gap at every depth; the gap "
                    "> 3x the coupled error at the finest depth (resolved); radii spread > 0.3",
                    rows,
                    headline="limit_gap")


@claim("prenorm/projected-unit-radii", "stacks",
       "With projected branches and unit radii (r = 1 + O(h) along the stack), pre-norm "
       "directions converge to the spherical flow at order 1.")
def prenorm_projected(ctx: Context) -> Evidence:
    problem = test_problem(ctx)
    config = dataclasses.replace(problem.config, norm_position="pre", block="sequential",
                                 project_branches=True, final_norm=True)
    rows = _stack_errors(ctx, config, np.asarray(problem.u0) * problem.smooth.radius,
                         {"sphere_flow": reference(ctx)})
    fit, passed = _order([r["step_size"] for r in rows], [r["error_sphere_flow"] for r in rows],
                         1)
    return Evidence(passed, {"expected_order": 1, **_clean(fit)},
                    f"|fitted order - 1| <= {ORDER_TOLERANCE:g}", rows,
                    headline="fitted_order")


@claim("gains/departure", "stacks",
       "A post-norm stack whose every Norm gain is g = 1 + eps r leaves the sphere flow's "
       "discretisation (g = 1) by O(eps).")
def gain_departure(ctx: Context) -> Evidence:
    config = transformer_config(ctx, norm_gain=True, n_layers=4)
    params = random_params(config, ctx.options.seed + 23)
    r = np.random.default_rng(ctx.options.seed + 29).standard_normal(config.d_model)
    r = _to_device(r, config.param_dtype)
    x = test_problem(ctx).x
    epsilons = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1)
    departures = np.asarray(_departures(config, params, x, r, epsilons))
    rows = [{"eps": eps, "departure": float(d)} for eps, d in zip(epsilons, departures,
                                                                   strict=True)]
    used = [row for row in rows if row["eps"] <= 1e-2]  # the linear regime
    fit, passed = _order([u["eps"] for u in used], [u["departure"] for u in used], 1)
    return Evidence(passed, {"expected_slope": 1, **_clean(fit)},
                    f"|fitted slope on eps <= 1e-2 - 1| <= {ORDER_TOLERANCE:g}", rows,
                    headline="fitted_order")


@eqx.filter_jit
def _departures(config, params, x, r, epsilons):
    """Per ``eps``: the geodesic distance between the outputs of the stack with every gain
    ``1 + eps r`` and with gains 1; one program."""
    x = x.astype(config.param_dtype)

    def run(g):
        return output(config, correspondence.with_gains(config, params, g), x,
                      correspondence.input_norm(g))

    base = run(jnp.ones_like(r))
    return jnp.stack([_geodesic_error(run(1.0 + eps * r), base) for eps in epsilons])
