"""The central claim, in numbers: a standard Transformer is the forward-Euler discretisation of
an SVFlow on the sphere (``SVFLOW.md`` sections 3-5). Letters follow the issue's claims a-h.

Both sides are run and compared; no expected value is hard-coded:

* equalities (a-e, g): the Transformer's forward pass (``svflow_jax.transformer``) against a
  diffrax solve of the flow built by ``svflow_jax.correspondence`` from the same weights, which
  are drawn by the Transformer's OWN initialiser (``init_std = 0.3``, large enough that tokens
  travel about a radian; the default 0.02 would barely move them) and converted to the flow;
* orders (b, c, d): the Transformer stacks (and the splittings) against a tight reference solve
  (``Retracted(Dopri8())`` / ``Dopri8`` with PID ``rtol = atol = 1e-12``) of the continuous flow
  on a smooth, Chebyshev-interpolated ``theta(t)``; order = least-squares slope of ``log err``
  against ``log h``;
* h: a bitwise comparison of parameters after a round trip.

Exactness conditions: RMSNorm with ``norm_eps = 0``, no gains (claim f adds them on purpose), no
biases, float64 (claim g: float32 with a stated bound). Each test prints its figures as lines
``FIGURE | claim | quantity | value`` (``pytest -s`` shows them). Shapes are shared (n = 5
tokens, d = 8, 2 heads of width 4, d_ff = 16, 16 layers) so that the initialiser and the
compiled functions are reused: the file takes about 60 s of CPU (55-65 s wall on the 2-core
machine when it is quiet, up to ~80 s when other jobs share it); nearly all of it is XLA
compilation, one per configuration.

Domain: the standard post-norm identity of claim b needs ``1 + h x.u > 0`` at every sub-step;
the tests report that factor and show the equality break exactly where it turns negative.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax.numpy as jnp
import numpy as np
import pytest

from svflow_jax import claims, sphere
from svflow_jax.transformer import Transformer, TransformerConfig

F64, F32 = jnp.float64, jnp.float32
EXACT = 1e-12  # float64 agreement of the two sides (measured: a few 1e-15)
ORDER_TOL = 0.15  # fitted orders within expected +- 0.15

D, N_TOKENS, DEPTH, STEP = 8, 5, 16, 0.5
RHO = math.sqrt(D)
BASE = TransformerConfig(
    d_model=D, n_layers=DEPTH, n_heads=2, d_head=4, d_ff=16, residual_scale=STEP,
    norm="rms", norm_eps=0.0, norm_gain=False, use_bias=False, init_std=0.3, param_dtype=F64,
)

# Smooth theta(t) for the convergence tests: the first K layers of the initialiser's draw as
# Chebyshev anchors on [0, T]; depths L, steps h = T / L.
ANCHORS, T_END = 4, 1.0
DEPTHS = (8, 16, 32, 64, 128)


# Grouped-query attention: 4 query heads reading 2 key/value heads (head h reads h // 2).
GQA = dict(n_heads=4, d_head=2, n_kv_heads=2)


def config(**changes) -> TransformerConfig:
    return dataclasses.replace(BASE, **changes)


def _inputs() -> np.ndarray:
    """Tokens ``x_i = rho r_i u_i``: random directions, radii r_i in [0.5, 1.5] (unequal, which
    matters for pre-norm; post-norm normalises them away)."""
    rng = np.random.default_rng(1)
    u = rng.standard_normal((N_TOKENS, D))
    u /= np.linalg.norm(u, axis=-1, keepdims=True)
    return RHO * rng.uniform(0.5, 1.5, (N_TOKENS, 1)) * u


X = _inputs()


def report(claim: str, quantity: str, value) -> None:
    text = f"{value:.3g}" if isinstance(value, float) else str(value)
    print(f"FIGURE | {claim} | {quantity} | {text}")


def first_layers(params: dict, num: int) -> dict:
    return {name: value[:num] for name, value in params.items()}


@pytest.fixture(scope="module")
def params() -> dict:
    """16 layers drawn by ``Transformer(BASE, rngs=nnx.Rngs(0))``: never built from a flow."""
    return claims.init_layer_params(BASE, seed=0)


@pytest.fixture(scope="module")
def smooth(params) -> claims.SmoothFlow:
    return claims.smooth_flow(config(n_layers=ANCHORS, residual_scale=1.0),
                              first_layers(params, ANCHORS), T_END)


@pytest.fixture(scope="module")
def sphere_flow(smooth):
    """``u(T)`` of ``du/dt = (v_A + v_F)_t(u)`` from the directions of ``X``."""
    return claims.sphere_reference(smooth.field, sphere.retract(jnp.asarray(X)), T_END)


# ============================================================================================
# a, b, c, d: every block is the splitting of its solver, exactly
# ============================================================================================

# (claim, norm_position, project_branches): the solver each kind of stack is.
KINDS = {
    "a:post-projected": ("post", True),  # RetractedEuler sub-steps
    "b:post-standard": ("post", False),  # per-token step h' = h / (1 + h x.u)
    "c:pre-norm": ("pre", False),  # diffrax Euler on dy/dt = F(y / |y|)
}
BLOCKS = ("sequential", "parallel", "macaron")  # claim d: Lie-Trotter, Euler, Strang
# The parallel block of kinds a and c is tested against a plain diffrax solve further below.
GRID = [(kind, block) for kind in KINDS for block in BLOCKS
        if not (block == "parallel" and kind != "b:post-standard")]


@pytest.mark.parametrize(("kind", "block"), GRID)
def test_abcd_every_block_is_its_splitting_of_euler_steps(params, kind, block):
    """Per layer, ``max |x_l - rho y_l| <= 1e-12`` (l = 1..16): the Transformer's states ``x_l``
    against the flow's discrete trajectory ``y_l`` (``flow_states``) with, for each block,
    Lie-Trotter / Euler / Strang of the kind's Euler step. Entry ``l`` is also the output of the
    depth-``l`` stack of the first ``l`` layers, so every depth 1..16 is covered."""
    position, projected = KINDS[kind]
    cfg = config(norm_position=position, project_branches=projected, block=block)
    out = claims.layer_differences(cfg, params, X)
    for depth in (1, 4, 16):
        report(kind[0] + ",d", f"{kind[2:]} {block}, L={depth}, max abs diff",
               float(out["per_layer"][depth - 1]))
    report(kind[0] + ",d", f"{kind[2:]} {block}, max token travel (rad)", out["moved"])
    if kind == "b:post-standard":  # the per-token step needs 1 + h x.u > 0 (see below)
        factor = claims.radial_factors(cfg, params, out["substep_states"]).min()
        report("b", f"{block}, min over sub-steps and tokens of 1 + h x.u", float(factor))
        assert factor > 0
    assert out["moved"] > 0.3, "the tokens must actually move for the equality to mean much"
    assert out["max"] <= EXACT, out["per_layer"]


def test_b_per_token_step_refuses_a_step_that_crosses_the_origin(params):
    """The domain of claim b. With a large step (``h = 2``) one sub-step of these weights has
    ``1 + h x.u < 0``: ``x + h u`` crosses the origin and the layer returns the antipode of any
    per-token step. The flow side must say so rather than return a wrong state (at h = 1 and
    below the factor stays positive here)."""
    cfg = config(residual_scale=2.0)
    model = Transformer.from_layer_params(cfg, params)
    substeps = model.hidden_states(X, substeps=True)
    factors = claims.radial_factors(cfg, params, substeps).min(axis=1)
    assert np.any(factors <= 0), "this test needs a sub-step with 1 + h x.u <= 0"
    first = int(np.argmax(factors <= 0))  # layer index (0-based) of the first such sub-step
    report("b", "h=2: first layer with 1 + h x.u < 0 / its min factor",
           f"{first + 1} / {factors[first]:.3g}")
    with pytest.raises(Exception, match="crossed the origin"):
        claims.layer_differences(cfg, params, X)


def test_b_variant_causal_gqa_swiglu(params):
    """The same equality with causal attention, grouped-query attention (4 query heads reading
    2 key/value heads: the head order matters) and a SwiGLU FFN, standard post-norm."""
    cfg = config(causal=True, ffn="swiglu", **GQA)
    out = claims.layer_differences(cfg, claims.init_layer_params(cfg, seed=2), X)
    report("b", "post-standard sequential causal GQA swiglu, L=16, max abs diff", out["max"])
    assert out["moved"] > 0.3
    assert out["max"] <= EXACT, out["per_layer"]


@pytest.mark.parametrize("depth", [1, 4, 16])
def test_a_parallel_postnorm_is_a_plain_retracted_euler_solve(params, depth):
    """``solve(flow.field, y0, 0, L h, solver=RetractedEuler(), num_steps=L)`` reproduces the
    depth-L projected post-norm stack (the first L layers of the initialiser's draw), every
    layer: ``y_{l+1} = R(y_l + h v_{t_l}(y_l))``."""
    cfg = config(project_branches=True, block="parallel", n_layers=depth)
    diff = claims.euler_solve_differences(cfg, first_layers(params, depth), X)
    report("a", f"parallel, diffrax RetractedEuler solve, L={depth}, max abs diff",
           float(diff.max()))
    assert diff.max() <= EXACT, diff


def test_c_parallel_prenorm_is_a_plain_ambient_euler_solve(params):
    """``diffrax.Euler`` on ``dy/dt = (F_A + F_F)_t(y / |y|)`` reproduces the pre-norm stack."""
    diff = claims.euler_solve_differences(config(norm_position="pre", block="parallel"),
                                          params, X)
    report("c", "parallel, diffrax Euler on dy/dt = F(y/|y|), L=16, max abs diff",
           float(diff.max()))
    assert diff.max() <= EXACT, diff


# ============================================================================================
# b: the standard post-norm layer: a per-token step, O(h^2) from the plain step, order 1
# ============================================================================================


def test_b_one_step_gap_to_the_plain_retracted_euler_step_is_second_order(params):
    """One standard layer ``R(x + h u)`` vs ``R(x + h P_x u)``: gap ``~ |x.u| |P_x u| h^2``.
    Five steps over two decades; the gaps are far above 1e-12, so the per-token step of the
    equality test above is really needed."""
    steps = np.geomspace(1e-3, 1e-1, 5)
    out = claims.one_step_gap(config(block="sequential"), params, X, steps)
    for h, gap in zip(out["steps"], out["gaps"], strict=True):
        report("b", f"one-step gap, h={h:.3g}", gap)
    report("b", "one-step gap, fitted order (95% CI)", out["fit"])
    assert min(out["gaps"]) > 1e3 * EXACT
    assert abs(out["fit"].slope - 2) <= ORDER_TOL


def test_b_standard_postnorm_stack_converges_at_order_one(params, sphere_flow):
    """L-layer standard post-norm Transformers with weights ``theta(l T / L)`` and ``h = T / L``
    (built through ``to_transformer_params``; their forward pass runs) converge to the flow."""
    out = claims.postnorm_convergence(
        config(n_layers=ANCHORS, residual_scale=1.0), first_layers(params, ANCHORS), X, T_END,
        DEPTHS, reference=sphere_flow)
    for depth, err in zip(out["depths"], out["errors"], strict=True):
        report("b", f"post-norm stack vs flow, L={depth}, geodesic error", err)
    report("b", "post-norm stack, fitted order (95% CI)", out["fit"])
    assert np.all(np.diff(out["errors"]) < 0)
    assert abs(out["fit"].slope - 1) <= ORDER_TOL


# ============================================================================================
# c: pre-norm directions follow the spherical flow on per-token clocks
# ============================================================================================


def test_c_prenorm_directions_converge_to_the_clock_system_not_the_sphere_flow(
    params, sphere_flow
):
    """Directions of pre-norm stacks against (i) the solution of ``du_i/dt = v_t(U)_i / r_i``,
    ``dr_i/dt = u_i . F_t(U)_i`` (order 1) and (ii) the plain spherical flow from the same
    directions (no convergence: the error stays O(1) because the radii differ)."""
    out = claims.prenorm_convergence(
        config(norm_position="pre", n_layers=ANCHORS, residual_scale=1.0),
        first_layers(params, ANCHORS), X, T_END, DEPTHS, sphere_flow=sphere_flow)
    for depth, clock, plain in zip(out["depths"], out["errors_clock"], out["errors_sphere"],
                                   strict=True):
        report("c", f"pre-norm vs clock system, L={depth}, geodesic error", clock)
        report("c", f"pre-norm vs plain sphere flow, L={depth}, geodesic error", plain)
    sphere_fit = claims.fit_order(out["steps"], out["errors_sphere"])
    report("c", "pre-norm vs clock system, fitted order (95% CI)", out["fit"])
    report("c", "pre-norm vs plain sphere flow, fitted slope (95% CI)", sphere_fit)
    report("c", "distance between the two limits (clock system vs sphere flow) at T",
           out["limit_gap"])
    report("c", "initial radii r_i", [round(r, 3) for r in out["radii"]])
    assert max(out["radii"]) - min(out["radii"]) > 0.3
    assert abs(out["fit"].slope - 1) <= ORDER_TOL
    # No convergence to the plain flow: the stacks converge to the clock system, whose solution
    # is O(1) away from the sphere flow's, so their error against the sphere flow tends to that
    # distance (|err_sphere - gap| <= err_clock, triangle inequality) instead of to 0.
    assert out["limit_gap"] > 0.1
    assert out["errors_sphere"][-1] > 10 * out["errors_clock"][-1]
    assert min(out["errors_sphere"]) > 0.5 * out["limit_gap"]


# ============================================================================================
# d: orders of the splittings on a smooth theta(t)
# ============================================================================================


def test_d_splitting_orders(smooth, sphere_flow):
    """Euler sub-steps (the Transformer blocks) give order 1 for parallel, Lie-Trotter and
    Strang (Strang's h^2 terms ``-A'A/2 - F'F/4 - ...`` do not cancel); second-order sub-steps
    (retracted Heun or midpoint) in all three Strang sub-steps restore order 2."""
    u0 = sphere.retract(jnp.asarray(X))
    out = claims.splitting_orders(smooth, u0, DEPTHS, reference=sphere_flow)
    for name, row in out.items():
        report("d", f"{name}, errors at L={DEPTHS}",
               [float(f"{e:.3g}") for e in row["errors"]])
        report("d", f"{name}, fitted order (95% CI)", row["fit"])
    for name in ("parallel, Euler", "Lie-Trotter, Euler", "Strang, Euler"):
        assert abs(out[name]["fit"].slope - 1) <= ORDER_TOL, name
    for name in ("Strang, Heun", "Strang, midpoint"):
        assert abs(out[name]["fit"].slope - 2) <= ORDER_TOL, name


# ============================================================================================
# e: MoE with top-k routing
# ============================================================================================


@pytest.fixture(scope="module")
def moe_params() -> dict:
    return claims.init_layer_params(config(ffn="moe", n_experts=4, top_k=2), seed=3)


@pytest.mark.parametrize("top_k", [1, 2])
def test_e_moe_block_is_an_euler_step_of_the_moe_field(moe_params, top_k):
    """Top-k of 4 experts, renormalised softmax: the standard post-norm stack equals the flow
    (per-token step) of ``v_A + v_MoE``. The routing changes across tokens and layers, with
    logit margins far above round-off, so the two sides really make the same top-k choices."""
    cfg = config(ffn="moe", n_experts=4, top_k=top_k)
    out = claims.layer_differences(cfg, moe_params, X)
    routing = claims.routing_summary(cfg, moe_params, out["substep_states"])
    report("e", f"top-{top_k} of 4, post-standard sequential, L=16, max abs diff", out["max"])
    report("e", f"top-{top_k} of 4, distinct expert sets / smallest logit margin",
           f"{routing['selections']} / {routing['margin']:.2g}")
    assert routing["selections"] >= 3
    assert routing["margin"] > 1e-6
    assert out["max"] <= EXACT


def test_e_moe_parallel_is_a_plain_retracted_euler_solve(moe_params):
    """Projected parallel MoE stack (top-2 of 4) == ``solve(v_A + v_MoE, RetractedEuler())``."""
    cfg = config(ffn="moe", n_experts=4, top_k=2, project_branches=True, block="parallel")
    diff = claims.euler_solve_differences(cfg, moe_params, X)
    report("e", "top-2 of 4, parallel, diffrax RetractedEuler solve, L=16, max abs diff",
           float(diff.max()))
    assert diff.max() <= EXACT


# ============================================================================================
# f: RMSNorm gains retract onto an ellipsoid
# ============================================================================================


@pytest.fixture(scope="module")
def gain_params() -> dict:
    return claims.init_layer_params(config(norm_gain=True), seed=5)


@pytest.mark.parametrize("block", BLOCKS)
def test_f_gains_retract_onto_an_ellipsoid(gain_params, block):
    """Every post-norm state (each sub-step) satisfies ``|x / g| = sqrt(d)`` for the gain of the
    Norm that produced it, with random gains in [0.5, 1.5]; the states are off the sphere."""
    rng = np.random.default_rng(6)
    weights = {k: v for k, v in gain_params.items() if not k.endswith("_gain")}
    names = ["norm_gain"] if block == "parallel" else ["norm_attn_gain", "norm_ffn_gain"]
    gains = {k: jnp.asarray(rng.uniform(0.5, 1.5, (DEPTH, D))) for k in names}
    out = claims.ellipsoid_residual_max(config(norm_gain=True, block=block),
                                        weights | gains, jnp.asarray(rng.uniform(0.5, 1.5, D)),
                                        X)
    report("f", f"{block}, max | |x/g| - sqrt(d) | (ellipsoid)", out["ellipsoid"])
    report("f", f"{block}, max | |x| - sqrt(d) | (sphere, for contrast)", out["sphere"])
    assert out["sphere"] > 0.1
    assert out["ellipsoid"] <= EXACT


def test_f_departure_from_the_sphere_flow_is_first_order_in_the_gain(gain_params):
    """Every gain ``g = 1 + eps r`` (r fixed, standard normal) in a 4-layer standard post-norm
    stack (its first 4 layers): the directions of the final states leave those of the g = 1
    stack (the sphere flow's discretisation) by ``O(eps)``. Fitted on eps <= 1e-2, the linear
    regime; eps = 0.1 shows the onset of nonlinearity."""
    r = jnp.asarray(np.random.default_rng(7).standard_normal(D))
    epsilons = [1e-5, 1e-4, 1e-3, 1e-2, 1e-1]
    out = claims.gain_departure(config(norm_gain=True, n_layers=4), first_layers(gain_params, 4),
                                X, r, epsilons, fit_up_to=1e-2)
    for eps, dep in zip(epsilons, out["departures"], strict=True):
        report("f", f"departure from sphere flow, L=4, eps={eps:g}", dep)
    report("f", "departure, fitted slope on eps <= 1e-2 (95% CI)", out["fit"])
    assert abs(out["fit"].slope - 1) <= ORDER_TOL


# ============================================================================================
# g: float32
# ============================================================================================

# Bound: per-layer differences d_l <= C * l * eps32 * s, with s the largest token norm along
# the trajectory (rho = 2.83 for post-norm) and C = 4. Why: each side rounds a layer's new state
# with a relative error of about one to two eps32 (RMSNorm over d = 8, dot products of at most
# d_ff = 16 terms whose rounding errors add like a random walk, the residual sum), so two
# independently ordered evaluations differ by at most ~4 eps32 s per layer; the layers do not
# amplify differences on this problem (the float64 per-layer differences above grow linearly in
# l, from ~4e-16 to ~3e-15), so the budget adds up linearly. Measured: C_eff = 0.56 (a) and
# 0.41 (c); 0.85 for a post-norm macaron stack tried while writing this.
C_FLOAT32 = 4.0
FLOAT32_CASES = {
    "a:post-projected sequential": dict(project_branches=True),
    "c:pre-norm sequential": dict(norm_position="pre"),
}


@pytest.mark.parametrize("case", list(FLOAT32_CASES))
def test_g_float32_equality_within_c_l_eps(params, case):
    cfg = config(param_dtype=F32, **FLOAT32_CASES[case])
    params32 = {k: v.astype(F32) for k, v in params.items()}  # the initialiser's draw, rounded
    out = claims.layer_differences(cfg, params32, X.astype(np.float32))
    eps = float(np.finfo(np.float32).eps)
    layers = np.arange(1, DEPTH + 1)
    c_eff = float(np.max(out["per_layer"] / (layers * eps * out["scale"])))
    report("g", f"float32 {case[2:]}, L=16, max abs diff", out["max"])
    report("g", f"float32 {case[2:]}, max_l d_l / (l eps32 s)  (bound C = {C_FLOAT32:g})",
           c_eff)
    assert out["max"] > 1e-9, "float32 round-off should be visible: did it run in float64?"
    assert c_eff <= C_FLOAT32


# ============================================================================================
# The fit used by every order above, against an independent implementation
# ============================================================================================


def test_fit_order_agrees_with_scipy():
    """Slope and 95% interval against ``scipy.stats.linregress`` and ``scipy.stats.t``."""
    stats = pytest.importorskip("scipy.stats")
    h = np.geomspace(1e-3, 1e-1, 6)
    err = 3 * h**2 * (1 + 0.2 * np.sin(np.arange(6.0)))  # order 2 with a wobble
    fit = claims.fit_order(h, err)
    ref = stats.linregress(np.log(h), np.log(err))
    half = stats.t.ppf(0.975, 4) * ref.stderr
    assert fit.slope == pytest.approx(ref.slope, abs=1e-12)
    assert fit.low == pytest.approx(ref.slope - half, abs=1e-3)
    assert fit.high == pytest.approx(ref.slope + half, abs=1e-3)
    assert claims.fit_order(h, h**1.5).slope == pytest.approx(1.5, abs=1e-12)


# ============================================================================================
# h: the conversion in both directions, and the round trip
# ============================================================================================


def test_h_equality_tests_start_from_the_transformer_initialiser(params):
    """The weights of the equality tests are the initialiser's ``N(0, init_std^2)`` draw."""
    flat = np.concatenate([np.ravel(v) for v in params.values()])
    report("h", f"sample std of the initialiser's weights (init_std {BASE.init_std})",
           float(flat.std()))
    assert abs(flat.std() / BASE.init_std - 1) < 0.05
    assert abs(flat.mean()) < 0.05 * BASE.init_std


def test_h_round_trip_is_bit_identical():
    """``to_transformer_params(to_flow(config, params), config) == params`` bit for bit, for
    every block x FFN (gelu, swiglu, MoE with gelu/swiglu experts) x MHA/GQA (4 query heads, 2
    key/value heads) x gains or not x post/pre-norm, with weights from the initialiser; and
    two variants in float32 (where ``d / sqrt(d_head)`` is not a float32 round number)."""
    failures, count = [], 0
    for block, ffn, kv, gain, position in itertools.product(
        BLOCKS, ["gelu", "swiglu", "moe-gelu", "moe-swiglu"], [{}, GQA], [False, True],
        ["post", "pre"],
    ):
        moe = ffn.startswith("moe")
        kinds = dict(ffn="moe", n_experts=4, top_k=2, expert_ffn=ffn[4:]) if moe else dict(ffn=ffn)
        cfg = config(block=block, norm_gain=gain, norm_position=position, **kv, **kinds)
        p = claims.init_layer_params(cfg, seed=count)
        if gain:  # gains other than 1 must survive as well
            p = {k: (v * 1.25 if k.endswith("_gain") else v) for k, v in p.items()}
        bad = claims.round_trip_mismatches(cfg, p)
        if bad:
            failures.append((cfg, bad))
        count += 1
    for changes in (GQA, dict(ffn="moe", n_experts=4, top_k=1, norm_gain=True)):
        p32 = {k: v.astype(F32) for k, v in claims.init_layer_params(config(**changes), 0).items()}
        cfg32 = config(param_dtype=F32, **changes)
        if bad := claims.round_trip_mismatches(cfg32, p32):
            failures.append((cfg32, bad))
        count += 1
    report("h", f"round trip, variants not bit-identical (of {count})", len(failures))
    assert not failures, failures
