"""Orders of convergence: every method of the solver catalogue, the block splittings, per-layer
weights.

Each measurement integrates the run's smooth test problem (:func:`.problem.test_problem`) over
``[0, T]`` at a sequence of constant steps and compares the final state with the float64
reference (:func:`.problem.reference`) by the geodesic error; the order is the slope fitted over
the asymptotic window (:func:`.measure.fit_window`). The step size is a traced argument, so each
solver compiles once for all its step sizes.
"""

from __future__ import annotations

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import sphere
from ..flow import AttentionField, Constant, ExpertsField, PiecewiseConstant, SumField
from ..solvers import RK4, Retracted
from ..solvers import catalogue as _catalogue
from ..solvers.catalogue import Method
from .core import Claim, Context, Evidence, claim, claim_family
from .measure import (
    HIGH_ORDER_EXCESS,
    HIGH_ORDER_SHORTFALL,
    MIN_STEPS_IN_FIT,
    ORDER_TOLERANCE,
    _fixed_steps,
    _geodesic_error,
    fit_floor,
    fit_window,
    fixed_step_solve,
    geodesic_error,
    median_seconds,
    order_passes,
    sphere_reference,
    step_counts,
)
from .problem import ANCHORS, reference, test_problem

__all__ = ["order_claim", "solver_sweep", "sweep_counts", "drift_rows"]


def _in_run_dtype(ctx: Context):
    """The test problem's field and initial directions in the run's dtype."""
    problem = test_problem(ctx)
    dtype = ctx.options.jnp_dtype
    field = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating)
                         else a, problem.field)
    return field, problem.u0.astype(dtype)


_norm_drift = jax.jit(sphere.norm_drift)  # one program per shape, not one per operation


def sweep_counts(ctx: Context, spec: Method, step_range=None, num_sizes=None) -> list[int]:
    """The step counts of ``spec``'s sweep: its registered range times ``--step-scale``, or
    ``step_range`` as given; ``num_sizes`` (else the run's, else the solver's) sizes."""
    o = ctx.options
    num = num_sizes or o.num_sizes or spec.num_sizes
    if step_range is not None:
        return step_counts(*step_range, num)
    first, last = spec.step_range
    first = max(1, round(first * o.step_scale))
    return step_counts(first, max(first + num - 1, round(last * o.step_scale)), num)


def _order_verdict(ctx: Context, fit: dict, expected: float) -> tuple[bool, bool | None]:
    """``(resolved, passed)``: fewer than 3 points in the window is a failure in float64 and
    unresolved (``None``) in float32, where round-off hides orders above ~2."""
    resolved = fit["fit_points"] >= 3
    if not resolved and not ctx.options.float64:
        return resolved, None
    return resolved, order_passes(fit["fitted_order"], expected, fit["order_ci"][0])


def solver_sweep(
    ctx: Context, spec: Method, step_range: tuple[int, int] | None = None,
    num_sizes: int | None = None,
) -> Evidence:
    """Error, field evaluations, wall time and norm drift against step size; fitted order."""
    problem = test_problem(ctx)
    ref = reference(ctx)
    dtype = ctx.options.jnp_dtype
    field, y0 = _in_run_dtype(ctx)
    counts = sweep_counts(ctx, spec, step_range, num_sizes)
    solver, terms = spec.solver, diffrax.ODETerm(field)

    def run(count):
        return fixed_step_solve(terms, solver, y0, problem.t1, count)

    points = []
    for count in counts:
        y = run(count)
        points.append({
            "num_steps": count, "step_size": problem.t1 / count,
            "error": geodesic_error(y, ref),
            "evaluations": count * spec.evaluations_per_step,
            "seconds": median_seconds(lambda c=count: run(c), ctx.options.repeats),
            "norm_drift": float(_norm_drift(y)),
        })
    fit = fit_window([p["step_size"] for p in points], [p["error"] for p in points],
                     floor=fit_floor(dtype), max_step=problem.t1 / MIN_STEPS_IN_FIT)
    for p, used in zip(points, fit.pop("in_fit"), strict=True):
        p["in_fit"] = bool(used)
    resolved, passed = _order_verdict(ctx, fit, spec.order)
    figures = {"solver": spec.name, "description": spec.description,
               "expected_order": spec.order, **fit, "resolved": resolved,
               "max_norm_drift": max(p["norm_drift"] for p in points)}
    tolerance = (f"{spec.order - HIGH_ORDER_SHORTFALL:g} <= fitted order, lower end of its "
                 f"interval <= {spec.order + HIGH_ORDER_EXCESS:g}"
                 if spec.order >= 5 else f"|fitted order - {spec.order}| <= {ORDER_TOLERANCE:g}")
    return Evidence(passed, figures, tolerance, points,
                    headline="fitted_order")


def order_claim(spec: Method) -> Claim:
    """The claim ``order/<name>`` of a single-field method: its order on the smooth flow, on the
    sphere. Every method of the catalogue has one; ``svflow verify --methods
    package.module:Attr`` adds one for a user's method."""
    if spec.is_splitting or spec.order is None:
        raise ValueError(f"method {spec.name!r}: an order claim takes a single-field method of "
                         "known order (a splitting's claim is splitting/<name>: register it)")
    return Claim(f"order/{spec.name}", "orders",
                 f"{spec.description or spec.name}: global error O(h^{spec.order}) "
                 "on the smooth flow, on the sphere.",
                 lambda ctx: _shared_sweep(ctx, spec))


@claim_family
def _solver_claims() -> list[Claim]:
    """``order/<name>`` for every single-field method of the catalogue (a user's registered
    method too)."""
    return [order_claim(spec) for spec in _catalogue.methods(splitting=False)]


def _shared_sweep(ctx: Context, spec: Method) -> Evidence:
    """The sweep of ``spec``, kept in the context (the drift claim reads its drifts)."""
    return ctx.shared(("sweep", spec.name), lambda: solver_sweep(ctx, spec))


def _splitting(ctx: Context, method: Method) -> Evidence:
    """``method`` on the smooth problem's block: one field ``v_A + v_F`` for a parallel block,
    the attention and FFN fields separately for a splitting; error against the reference at
    the run's depths and the fitted order."""
    problem = test_problem(ctx)
    smooth = problem.smooth
    if method.is_splitting:
        terms = diffrax.MultiTerm(diffrax.ODETerm(smooth.attention),
                                  diffrax.ODETerm(smooth.experts))
    else:
        terms = diffrax.ODETerm(smooth.field)
    depths = list(ctx.options.depths)
    ref = reference(ctx)
    rows = []
    for L in depths:
        y = fixed_step_solve(terms, method.solver, problem.u0, problem.t1, L)
        rows.append({"num_steps": L, "step_size": problem.t1 / L, "error": geodesic_error(y, ref)})
    fit = fit_window([r["step_size"] for r in rows], [r["error"] for r in rows])
    expected = method.order
    _, passed = _order_verdict(ctx, fit, expected)
    return Evidence(passed, {"expected_order": expected, **{k: v for k, v in fit.items()
                                                            if k != "in_fit"}},
                    f"|fitted order - {expected}| <= {ORDER_TOLERANCE:g}", rows,
                    headline="fitted_order")


@claim_family
def _splitting_claims() -> list[Claim]:
    """``splitting/<name>`` for every splitting of the catalogue (a user's too), and
    ``splitting/parallel-euler``: the parallel block (retracted Euler on ``v_A + v_F``) on the
    same problem, for comparison."""
    def make(method: Method, name: str, statement: str) -> Claim:
        return Claim(f"splitting/{name}", "orders", statement,
                     lambda ctx: _splitting(ctx, method))

    euler = _catalogue.get("euler")
    claims = [make(euler, "parallel-euler",
                   "A parallel block (retracted Euler on v_A + v_F) is first order.")]
    for method in _catalogue.methods(splitting=True):
        claims.append(make(method, method.name, f"{method.description}: order {method.order} "
                           "on the smooth flow."))
    return claims


class _RightContinuousLayers(PiecewiseConstant):
    """Per-layer weights WITHOUT the stage rule: every stage reads ``theta(t)`` at its own time
    (a stage at the end of a step reads the next layer). For contrast only."""

    def within_step(self, t0, t1):
        return self


@claim("piecewise/aligned-rk4", "orders",
       "With per-layer weights (a real Transformer's theta), every stage of a step reads the "
       "layer that step covers, so retracted RK4 with steps aligned to the layers keeps order 4.")
def aligned_rk4(ctx: Context) -> Evidence:
    problem = test_problem(ctx)
    smooth = problem.smooth
    h = problem.t1 / ANCHORS
    layers = _layer_weights(smooth, h)

    def field(path):
        return SumField(AttentionField(path(layers[0], h), causal=smooth.attention.causal),
                        ExpertsField(path(layers[1], h), top_k=smooth.experts.top_k,
                                     radius=smooth.radius))

    # Reference: each layer's constant field solved over its own interval, chained.
    def build_reference():
        u = problem.u0
        for l in range(ANCHORS):  # layer l's weights, taken in NumPy (no program each)
            constant = [jax.tree.map(lambda a, l=l: np.asarray(a)[l], p) for p in layers]
            piece = SumField(
                AttentionField(Constant(constant[0]), causal=smooth.attention.causal),
                ExpertsField(Constant(constant[1]), top_k=smooth.experts.top_k,
                             radius=smooth.radius))
            u = sphere_reference(piece, u, h)  # autonomous: any interval of length h
        return u

    ref = ctx.shared("piecewise-reference", build_reference)
    per_layer = [1, 2, 4, 8, 16]
    solver = Retracted(RK4())
    counts = np.asarray([k * ANCHORS for k in per_layer])
    u0 = problem.u0
    # both fields at every step count in one program (four programs otherwise)
    errors = np.asarray(_aligned_errors(
        (diffrax.ODETerm(field(PiecewiseConstant)), diffrax.ODETerm(field(_RightContinuousLayers))),
        solver, u0, np.asarray(problem.t1, u0.dtype), counts, ref))
    if np.isnan(errors).any():  # checked here, not in the program (it stays cacheable)
        raise FloatingPointError("a fixed-step solve produced NaN")
    rows = [{"steps_per_layer": k, "step_size": problem.t1 / int(count),
             "error": float(staged), "error_without_stage_rule": float(naive)}
            for k, count, staged, naive in zip(per_layer, counts, *errors, strict=True)]
    steps = [r["step_size"] for r in rows]
    fit = fit_window(steps, [r["error"] for r in rows])
    naive_fit = fit_window(steps, [r["error_without_stage_rule"] for r in rows], floor=0.0)
    _, passed = _order_verdict(ctx, fit, 4)
    figures = {"expected_order": 4, "fitted_order": fit["fitted_order"],
               "order_ci": fit["order_ci"], "fit_points": fit["fit_points"],
               "order_without_stage_rule": naive_fit["fitted_order"]}
    return Evidence(passed, figures, f"|fitted order - 4| <= {ORDER_TOLERANCE:g}", rows,
                    headline="fitted_order")


@eqx.filter_jit
def _aligned_errors(terms, solver, y0, t1, counts, ref):
    """The geodesic error of ``solver`` on each of ``terms`` at each step count, against
    ``ref``: ``(len(terms), len(counts))``, one program."""
    return jnp.stack([jax.lax.map(
        lambda n, term=term: _geodesic_error(_fixed_steps(term, solver, y0, t1, n), ref), counts)
        for term in terms])


@eqx.filter_jit
def _layer_weights(smooth, h):
    """``theta(l h)`` of the attention and FFN paths, ``l = 0..ANCHORS-1``, in one program."""
    times = jnp.arange(ANCHORS, dtype=jnp.float64) * h
    return [jax.vmap(f.params)(times) for f in (smooth.attention, smooth.experts)]


def drift_rows(ctx: Context, spec: Method, num_sizes: int = 6) -> dict:
    """``max | |y(T)| - 1 |`` of ``spec``'s method WITHOUT retraction (its step in ``R^d``); a
    method on the sphere by construction reports the drift of its own sweep."""
    return _drift_tables(ctx, [spec], num_sizes)[0]


def _drift_tables(ctx: Context, specs: list[Method], num_sizes: int = 6) -> list[dict]:
    """:func:`drift_rows` of every method in ``specs``; the methods in ``R^d`` all run in one
    program (one per method otherwise)."""
    problem = test_problem(ctx)
    field, y0 = _in_run_dtype(ctx)
    ambient = [spec for spec in specs if spec.ambient is not None]
    counts = [step_counts(*spec.step_range, num_sizes) for spec in ambient]
    drifts = np.asarray(_ambient_drifts(diffrax.ODETerm(field), tuple(s.ambient for s in ambient),
                                        y0, np.asarray(problem.t1, y0.dtype),
                                        np.asarray(counts)) if ambient else [])
    if np.isnan(drifts).any():  # checked here, not in the program (it stays cacheable)
        raise FloatingPointError("a fixed-step solve produced NaN")
    tables = []
    for spec in specs:
        if spec.ambient is None:
            sweep = _shared_sweep(ctx, spec)
            points = [{k: p[k] for k in ("num_steps", "step_size", "norm_drift")}
                      for p in sweep.rows]
            tables.append({"solver": spec.name, "retracted": True, "points": points})
            continue
        row = ambient.index(spec)
        points = [{"num_steps": count, "step_size": problem.t1 / count,
                   "norm_drift": float(drift)}
                  for count, drift in zip(counts[row], drifts[row], strict=True)]
        tables.append({"solver": spec.name, "retracted": False, "points": points})
    return tables


@eqx.filter_jit
def _ambient_drifts(terms, solvers, y0, t1, counts):
    """``norm_drift(y(t1))`` of each solver (in ``R^d``) at each of its step counts (a row of
    ``counts``): every solve in one program."""
    return jnp.stack([jax.lax.map(
        lambda n, solver=solver: sphere.norm_drift(_fixed_steps(terms, solver, y0, t1, n)), row)
        for solver, row in zip(solvers, counts, strict=True)])


@claim("drift", "orders",
       "Without the retraction (plain diffrax in R^d) every method drifts off the sphere; the "
       "sphere solvers stay on it to round-off.")
def drift(ctx: Context) -> Evidence:
    single = _catalogue.methods(splitting=False)
    rows = _drift_tables(ctx, single)
    tolerance = sphere.unit_tolerance(ctx.options.jnp_dtype, ctx.options.dim)
    # Every solver's drift on the sphere comes from its sweep (the retracted solves).
    on_sphere = max(_shared_sweep(ctx, spec).figures["max_norm_drift"]
                    for spec in single)
    off = [r["points"][0]["norm_drift"] for r in rows if not r["retracted"]]
    passed = on_sphere <= tolerance and all(v > tolerance for v in off)
    figures = {"max_drift_on_sphere": on_sphere,
               "min_coarsest_drift_off_sphere": min(off) if off else None}
    flat = [{"solver": r["solver"], "retracted": r["retracted"], **p}
            for r in rows for p in r["points"]]
    return Evidence(passed, figures,
                    f"sphere solvers' drift <= {tolerance:.1e}; plain methods' drift above it",
                    flat,
                    headline="max_drift_on_sphere")

