"""Transformer stacks as depth grows: the standard layer, pre-norm, Norm gains.

The stacks are real Transformers (:mod:`svflow_jax.transformer`, their own forward pass) whose
layer ``l`` has the weights ``theta(l T / L)`` of the run's smooth path
(:func:`.problem.discretise`), with ``h = T / L``. As ``L`` grows they approach a continuous
limit, measured against a tight float64 reference with the geodesic error.
"""

from __future__ import annotations

import dataclasses

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

from .. import correspondence
from ..flow import AttentionField, Constant, ExpertsField
from ..solvers import LieTrotter, RetractedEuler
from .core import Context, Evidence, claim
from .measure import EXACT_FLOAT64, coupled_reference, fit_window, fixed_step_solve, geodesic_error
from .measure import order_passes as _passes
from .problem import (
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
    return fit, _passes(fit["fitted_order"], expected)


@claim("standard-layer/one-step-gap", "stacks",
       "One standard post-norm layer R(x + h u) is the per-token step R(x + h' P_x u), "
       "h' = h / (1 + h x.u): it differs from the plain retracted Euler step R(x + h P_x u) by "
       "O(h^2) (consistent: same ODE).")
def one_step_gap(ctx: Context) -> Evidence:
    problem = test_problem(ctx)
    config = dataclasses.replace(problem.config, n_layers=1)
    first = first_layers(problem.anchor_params, 1)
    layer = correspondence.to_flow(dataclasses.replace(config, residual_scale=1.0), first)
    index0 = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731
    terms = diffrax.MultiTerm(
        diffrax.ODETerm(AttentionField(Constant(index0(layer.attention.params.anchors)),
                                       causal=config.causal)),
        diffrax.ODETerm(ExpertsField(Constant(index0(layer.experts.params.anchors)),
                                     top_k=config.top_k, radius=layer.radius)))
    rows = []
    for h in np.geomspace(1e-3, 1e-1, 5):
        states = hidden_states(dataclasses.replace(config, residual_scale=float(h)), first,
                               problem.x)
        plain = fixed_step_solve(terms, LieTrotter(RetractedEuler()),
                                 states[0] / layer.radius, h, 1)
        rows.append({"step_size": float(h), "gap": geodesic_error(states[1], plain)})
    fit, passed = _order([r["step_size"] for r in rows], [r["gap"] for r in rows], 2)
    visible = min(r["gap"] for r in rows) > 1e3 * EXACT_FLOAT64
    return Evidence(passed and visible, {"expected_order": 2, **_clean(fit)},
                    "|fitted slope - 2| <= 0.15, every gap > 1e-9", rows)


def _clean(fit: dict) -> dict:
    return {k: v for k, v in fit.items() if k != "in_fit"}


def _stack_errors(ctx: Context, config, x, references: dict) -> list[dict]:
    """Per depth: the geodesic error of the stack's output against each reference."""
    problem = test_problem(ctx)
    rows = []
    for L in ctx.options.depths:
        cfg, params = discretise(problem.smooth, config, L)
        out = output(cfg, params, x)
        rows.append({"depth": L, "step_size": problem.t1 / L,
                     **{f"error_{k}": geodesic_error(out, ref) for k, ref in references.items()}})
    return rows


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
                    "|fitted order - 1| <= 0.15", rows)


def _prenorm_rows(ctx: Context) -> dict:
    """Unprojected pre-norm stacks from tokens of unequal radii, against the coupled system
    and against the plain spherical flow (shared by two claims)."""

    def build():
        problem = test_problem(ctx)
        config = dataclasses.replace(problem.config, norm_position="pre", block="sequential",
                                     project_branches=False, final_norm=True)
        y0 = problem.x / problem.smooth.radius
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
                    "|fitted order - 1| <= 0.15", rows)


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
                    rows)


@claim("prenorm/projected-unit-radii", "stacks",
       "With projected branches and unit radii (r = 1 + O(h) along the stack), pre-norm "
       "directions converge to the spherical flow at order 1.")
def prenorm_projected(ctx: Context) -> Evidence:
    problem = test_problem(ctx)
    config = dataclasses.replace(problem.config, norm_position="pre", block="sequential",
                                 project_branches=True, final_norm=True)
    rows = _stack_errors(ctx, config, problem.u0 * problem.smooth.radius,
                         {"sphere_flow": reference(ctx)})
    fit, passed = _order([r["step_size"] for r in rows], [r["error_sphere_flow"] for r in rows],
                         1)
    return Evidence(passed, {"expected_order": 1, **_clean(fit)},
                    "|fitted order - 1| <= 0.15", rows)


@claim("gains/departure", "stacks",
       "A post-norm stack whose every Norm gain is g = 1 + eps r leaves the sphere flow's "
       "discretisation (g = 1) by O(eps).")
def gain_departure(ctx: Context) -> Evidence:
    config = transformer_config(ctx, norm_gain=True, n_layers=4)
    params = random_params(config, ctx.options.seed + 23)
    r = jnp.asarray(np.random.default_rng(ctx.options.seed + 29).standard_normal(config.d_model),
                    config.param_dtype)
    x = test_problem(ctx).x.astype(config.param_dtype)

    def run(g):
        return output(config, correspondence.with_gains(config, params, g), x,
                      correspondence.input_norm(g))

    base = run(jnp.ones_like(r))
    epsilons = [1e-5, 1e-4, 1e-3, 1e-2, 1e-1]
    rows = [{"eps": eps, "departure": geodesic_error(run(1.0 + eps * r), base)}
            for eps in epsilons]
    used = [row for row in rows if row["eps"] <= 1e-2]  # the linear regime
    fit, passed = _order([u["eps"] for u in used], [u["departure"] for u in used], 1)
    return Evidence(passed, {"expected_slope": 1, **_clean(fit)},
                    "|fitted slope on eps <= 1e-2 - 1| <= 0.15", rows)
