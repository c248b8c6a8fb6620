"""Sphere solvers: convergence orders against a high-order reference, norm drift at every saved
point, closed forms, gradients against finite differences, and the checks of ``solve``.

Independent sources of truth:
* a reference solve by ``Retracted(Dopri8())`` with ``PIDController(rtol=1e-12, atol=1e-12)``
  (itself checked against the closed form ``expm(t S) x0`` of a rotation field);
* hand-written single steps (closed forms of R(y0 + h f) and exp_{y0}(h f));
* central finite differences of the same discrete solve (for gradients).

Every solver is compiled once: a single ``jit(vmap(...))`` over its step sizes returns the final
states, the values at off-grid ``SaveAt(ts)``, every step (``SaveAt(steps=True)``) and dense
evaluations, and both the order test and the drift test read them.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from fields_for_tests import (
    PathField,
    WithoutStepRestriction,
    attention_field,
    layer_anchors,
    layer_field,
    linear_field,
    make_params,
    rotation_field,
    skew,
    total_field,
)

from svflow_jax import sphere
from svflow_jax.fitting import fit_order
from svflow_jax.flow.paths import (
    ChebyshevInterpolation,
    Constant,
    LinearInterpolation,
    PiecewiseConstant,
)
from svflow_jax.solvers import (
    RK4,
    RKMK4,
    AbstractCrouchGrossman,
    AbstractSphereSolver,
    CrouchGrossman3,
    GeodesicEuler,
    LieTrotter,
    Retracted,
    RetractedEuler,
    SolveError,
    Strang,
    VariableStepRetractedEuler,
    count_evaluations,
    solve,
    stays_on_sphere,
    within_step,
)

N_TOKENS, D = 4, 6
T0, T1 = 0.0, 1.0
# Off-grid save times (never a multiple of 1/N for the N below) and a dense evaluation grid.
TS_OFF = np.array([0.0137, 0.2291, 0.4503, 0.6666, 0.8129, 0.9871])
TS_DENSE = np.linspace(T0, T1, 41)
DRIFT_TOL = 1e-12  # float64: a retraction leaves | |y| - 1 | of a few ulp (~1e-16)

PARAMS = make_params(jax.random.PRNGKey(1), D)
Y0 = sphere.uniform(jax.random.PRNGKey(2), (N_TOKENS,), D)
TERM = diffrax.ODETerm(total_field)
SPLIT_TERMS = diffrax.MultiTerm(diffrax.ODETerm(attention_field), diffrax.ODETerm(linear_field))


def _saveat(dense: bool = True) -> diffrax.SaveAt:
    return diffrax.SaveAt(
        subs=[
            diffrax.SubSaveAt(t1=True),
            diffrax.SubSaveAt(ts=TS_OFF),
            diffrax.SubSaveAt(steps=True),
        ],
        dense=dense,
    )


@functools.cache
def reference():
    """Final state and off-grid values of the reference solve, and its drift."""
    sol = diffrax.diffeqsolve(
        TERM,
        Retracted(diffrax.Dopri8()),
        T0,
        T1,
        None,
        Y0,
        args=PARAMS,
        saveat=_saveat(),
        # step_ts: land on TS_OFF, so the values there are step values (~1e-13), not Dopri8's
        # dense interpolant (~1e-10, see test_reference_solver_matches_closed_form_rotation).
        stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12, step_ts=TS_OFF),
        max_steps=1000,
    )
    assert sol.result == diffrax.RESULTS.successful
    return sol


# name: (solver, split terms?, step counts, (lowest, highest) accepted fitted order)
# Step counts keep every error between ~1e-4 and ~1e-11 (the reference is accurate to ~1e-13)
# and in the asymptotic regime; expected orders are the theory (see the solver docstrings).
CASES = {
    "RetractedEuler": (RetractedEuler(), False, (32, 64, 128, 256), (0.85, 1.15)),
    "GeodesicEuler": (GeodesicEuler(), False, (32, 64, 128, 256), (0.85, 1.15)),
    "Retracted(Heun)": (Retracted(diffrax.Heun()), False, (16, 32, 64, 128), (1.85, 2.15)),
    "Retracted(Midpoint)": (Retracted(diffrax.Midpoint()), False, (16, 32, 64, 128), (1.85, 2.15)),
    "Retracted(RK4)": (Retracted(RK4()), False, (8, 16, 32, 64), (3.85, 4.15)),
    # Tsit5 and Dopri5 have a very small principal error coefficient: their observed slope is
    # 5.3-6 until the error is ~1e-12 (below the reference accuracy), on every seed we tried
    # (here 5.70 and 5.62). So the band reaches one order above: a solver that were order 6
    # would fit ~6.5-7 and fail, as would one of order 4.
    "Retracted(Tsit5)": (Retracted(diffrax.Tsit5()), False, (8, 12, 16, 24, 32), (4.8, 6.0)),
    "Retracted(Dopri5)": (Retracted(diffrax.Dopri5()), False, (8, 12, 16, 24, 32), (4.8, 6.0)),
    # Dopri8: errors from 5e-7 (N = 3) down to 3e-11 (N = 10); only these 5 step sizes lie
    # between the pre-asymptotic range and the reference's ~1e-13 floor, and the local slope is
    # still settling (7.8 -> 7.95), hence the wider band.
    "Retracted(Dopri8)": (Retracted(diffrax.Dopri8()), False, (3, 4, 6, 8, 10), (7.6, 8.4)),
    "CrouchGrossman3": (CrouchGrossman3(), False, (16, 32, 64, 128), (2.85, 3.15)),
    "RKMK4": (RKMK4(), False, (8, 16, 32, 64), (3.85, 4.15)),
    "LieTrotter(RetractedEuler)": (
        LieTrotter(RetractedEuler()),
        True,
        (32, 64, 128, 256),
        (0.85, 1.15),
    ),
    "Strang(RetractedEuler)": (Strang(RetractedEuler()), True, (32, 64, 128, 256), (0.85, 1.15)),
    "Strang(Retracted(Heun))": (
        Strang(Retracted(diffrax.Heun())),
        True,
        (16, 32, 64, 128),
        (1.85, 2.15),
    ),
}


@functools.cache
def run_case(name: str) -> dict[str, np.ndarray]:
    """Solve the test problem with every step count of ``CASES[name]`` (one compilation)."""
    solver, split, steps, _ = CASES[name]
    terms = SPLIT_TERMS if split else TERM
    max_steps = max(steps) + 2

    @jax.jit
    @jax.vmap
    def run(dt0):
        sol = diffrax.diffeqsolve(
            terms,
            solver,
            T0,
            T1,
            dt0,
            Y0,
            args=PARAMS,
            saveat=_saveat(),
            max_steps=max_steps,
            adjoint=diffrax.RecursiveCheckpointAdjoint(),
        )
        y1, ys_off, ys_steps = sol.ys
        return dict(
            y1=y1[-1],
            ys_off=ys_off,
            ys_steps=ys_steps,
            ts_steps=sol.ts[2],
            dense=jax.vmap(sol.evaluate)(jnp.asarray(TS_DENSE)),
            result=sol.result._value,
            num_steps=sol.stats["num_steps"],
        )

    out = run((T1 - T0) / jnp.asarray(steps, dtype=jnp.float64))
    return jax.tree_util.tree_map(np.asarray, out)


def _max_dist(a, b) -> np.ndarray:
    """Max geodesic distance over tokens (and saved times), per step size."""
    dist = np.asarray(sphere.geodesic_distance(jnp.asarray(a), jnp.asarray(b)))
    return dist.reshape(dist.shape[0], -1).max(axis=1)


def _fit_order(steps, errors) -> float:
    return float(-np.polyfit(np.log(steps), np.log(errors), 1)[0])


def _drift_steps(ys_steps, ts_steps) -> float:
    """Drift over the saved steps, ignoring diffrax's inf padding after the last step."""
    saved = np.isfinite(ts_steps)
    assert saved.any()
    return float(np.max(np.abs(np.linalg.norm(ys_steps[saved], axis=-1) - 1.0)))


# ---------------------------------------------------------------------------------------------
# The reference
# ---------------------------------------------------------------------------------------------


def test_reference_solver_matches_closed_form_rotation():
    """dx/dt = S x (S skew) has the closed form x(t) = expm(t S) x0."""
    s = skew(jax.random.PRNGKey(3), D, scale=2.0)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(rotation_field),
        Retracted(diffrax.Dopri8()),
        T0,
        T1,
        None,
        Y0,
        args=s,
        saveat=diffrax.SaveAt(ts=TS_OFF, dense=True),
        stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12, step_ts=TS_OFF),
    )

    def exact(ts):
        return np.stack([np.asarray(Y0) @ scipy.linalg.expm(t * np.asarray(s)).T for t in ts])

    err = np.max(np.asarray(sphere.geodesic_distance(sol.ys, jnp.asarray(exact(TS_OFF)))))
    assert err < 1e-11, err
    assert float(sphere.norm_drift(sol.ys)) < DRIFT_TOL
    # Dopri8's dense interpolant is much less accurate than its steps (~1e-10 here).
    dense = jax.vmap(sol.evaluate)(jnp.asarray(TS_DENSE))
    err = np.max(np.asarray(sphere.geodesic_distance(dense, jnp.asarray(exact(TS_DENSE)))))
    assert err < 1e-9, err


def test_reference_moves_and_stays_on_sphere():
    ref = reference()
    y1, ys_off, ys_steps = ref.ys
    # The flow moves O(1): orders are measured on a non-trivial trajectory.
    assert 0.3 < float(jnp.max(sphere.geodesic_distance(Y0, y1[-1]))) < 3.0
    assert float(sphere.norm_drift(y1)) < DRIFT_TOL
    assert float(sphere.norm_drift(ys_off)) < DRIFT_TOL
    assert _drift_steps(np.asarray(ys_steps), np.asarray(ref.ts[2])) < DRIFT_TOL
    dense = jax.vmap(ref.evaluate)(jnp.asarray(TS_DENSE))
    assert float(sphere.norm_drift(dense)) < DRIFT_TOL


# ---------------------------------------------------------------------------------------------
# Orders and drift, every solver
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_convergence_order(name):
    solver, split, steps, (lo, hi) = CASES[name]
    out = run_case(name)
    assert np.all(out["result"] == 0)  # RESULTS.successful
    np.testing.assert_array_equal(out["num_steps"], steps)
    errors = _max_dist(out["y1"][:, None], np.asarray(reference().ys[0][-1])[None, None])
    assert np.all(np.diff(np.log(errors)) < 0), errors  # monotone convergence
    assert errors.min() > 1e-11, errors  # well above the reference's accuracy
    fitted = _fit_order(steps, errors)
    print(f"{name}: fitted order {fitted:.3f}, errors {errors}")
    assert lo <= fitted <= hi, (name, fitted, errors)
    # The declared order is the one measured.
    declared = solver.order(SPLIT_TERMS if split else TERM)
    if declared >= 5 and hi - lo > 1:  # the small-coefficient methods above
        assert declared - 0.2 <= fitted <= declared + 1.0, (declared, fitted)
    else:
        assert abs(fitted - declared) <= 0.4, (declared, fitted)


# Dense output (SaveAt(ts) off the step grid) converges too, with the smaller of the solver's
# order and its interpolation's: retracted chord (RetractedEuler, CG, RKMK, splittings) 2,
# cubic Hermite (Heun, Midpoint, RK4) 4, Tsit5/Dopri5 polynomials >= 4, and 6 for diffrax's
# Dopri8 interpolant (measured ~5.8-6.3 on the closed-form rotation for plain, unretracted
# Dopri8 too: a property of diffrax's interpolant, not of the retraction).
DENSE_ORDER = {
    "RetractedEuler": 1,
    "GeodesicEuler": 1,
    "Retracted(Heun)": 2,
    "Retracted(Midpoint)": 2,
    "Retracted(RK4)": 4,
    "Retracted(Tsit5)": 4,
    "Retracted(Dopri5)": 4,
    "Retracted(Dopri8)": 6,
    "CrouchGrossman3": 2,
    "RKMK4": 2,
    "LieTrotter(RetractedEuler)": 1,
    "Strang(RetractedEuler)": 1,
    "Strang(Retracted(Heun))": 2,
}


@pytest.mark.parametrize("name", list(CASES))
def test_dense_output_converges(name):
    _, _, steps, _ = CASES[name]
    out = run_case(name)
    errors = _max_dist(out["ys_off"], np.asarray(reference().ys[1])[None])
    fitted = _fit_order(steps, errors)
    print(f"{name}: dense-output order {fitted:.3f}, errors {errors}")
    assert fitted >= DENSE_ORDER[name] - 0.2, (name, fitted, errors)


@pytest.mark.parametrize("name", list(CASES))
def test_norm_drift_every_saved_point(name):
    out = run_case(name)
    drifts = {
        "t1": float(sphere.norm_drift(jnp.asarray(out["y1"]))),
        "ts": float(sphere.norm_drift(jnp.asarray(out["ys_off"]))),
        "steps": _drift_steps(out["ys_steps"], out["ts_steps"]),
        "dense": float(sphere.norm_drift(jnp.asarray(out["dense"]))),
    }
    print(f"{name}: drift {drifts}")
    assert max(drifts.values()) <= DRIFT_TOL, drifts
    # The dense output agrees with the step values at the step times: evaluate at t1.
    np.testing.assert_allclose(out["dense"][:, -1], out["y1"], atol=1e-13)


@pytest.mark.parametrize(
    "inner", [diffrax.Tsit5(), diffrax.Dopri5(), RK4()], ids=["Tsit5", "Dopri5", "RK4"]
)
def test_adaptive_retracted_solvers(inner):
    sol = diffrax.diffeqsolve(
        TERM,
        Retracted(inner),
        T0,
        T1,
        None,
        Y0,
        args=PARAMS,
        saveat=_saveat(),
        stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-8),
        max_steps=1000,
    )
    assert sol.result == diffrax.RESULTS.successful
    y1, ys_off, ys_steps = sol.ys
    dense = jax.vmap(sol.evaluate)(jnp.asarray(TS_DENSE))
    for ys in (y1, ys_off, dense):
        assert float(sphere.norm_drift(ys)) <= DRIFT_TOL
    assert _drift_steps(np.asarray(ys_steps), np.asarray(sol.ts[2])) <= DRIFT_TOL
    # The controller really adapts (rejections or uneven steps) and meets its tolerance.
    hs = np.diff(np.asarray(sol.ts[2])[np.isfinite(np.asarray(sol.ts[2]))])
    assert hs.max() > 1.2 * hs.min()
    ref = reference().ys
    assert float(jnp.max(sphere.geodesic_distance(y1[-1], ref[0][-1]))) < 1e-6
    # The dense derivative (jvp of the retracted interpolant) is tangent and is the field.
    t = 0.4567
    y, dy = sol.evaluate(t), sol.derivative(t)
    assert float(jnp.max(jnp.abs(jnp.sum(y * dy, axis=-1)))) < 1e-13
    np.testing.assert_allclose(dy, total_field(t, y, PARAMS), atol=1e-5)
    assert float(jnp.max(sphere.geodesic_distance(ys_off, ref[1]))) < 1e-6


# ---------------------------------------------------------------------------------------------
# Single steps against closed forms; the Transformer loop
# ---------------------------------------------------------------------------------------------


def _one_step(solver, terms, h):
    state = solver.init(terms, 0.3, 0.3 + h, Y0, PARAMS)
    y1, *_ = solver.step(terms, 0.3, 0.3 + h, Y0, PARAMS, state, False)
    return y1


def test_single_steps_closed_forms():
    h = 0.1
    f = total_field(0.3, Y0, PARAMS)
    # Retracted Euler: R(y0 + h f); Retracted(Euler()) is the same step.
    expected = (Y0 + h * f) / jnp.linalg.norm(Y0 + h * f, axis=-1, keepdims=True)
    np.testing.assert_allclose(_one_step(RetractedEuler(), TERM, h), expected, atol=1e-15)
    np.testing.assert_allclose(_one_step(Retracted(diffrax.Euler()), TERM, h), expected, atol=1e-15)
    # Geodesic Euler: cos|hf| y0 + sin|hf| f/|f|.
    theta = h * jnp.linalg.norm(f, axis=-1, keepdims=True)
    expected = jnp.cos(theta) * Y0 + jnp.sin(theta) * f / jnp.linalg.norm(f, axis=-1, keepdims=True)
    np.testing.assert_allclose(_one_step(GeodesicEuler(), TERM, h), expected, atol=1e-15)
    # Retracted(Heun()): R of Heun's step with stages read on the sphere.
    k1 = total_field(0.3, Y0, PARAMS)
    z = Y0 + h * k1
    k2 = total_field(0.3 + h, z / jnp.linalg.norm(z, axis=-1, keepdims=True), PARAMS)
    y = Y0 + 0.5 * h * (k1 + k2)
    expected = y / jnp.linalg.norm(y, axis=-1, keepdims=True)
    np.testing.assert_allclose(_one_step(Retracted(diffrax.Heun()), TERM, h), expected, atol=1e-15)


def _dense_rkmk4_step(h):
    """RKMK4's step written with ``d x d`` generators and SciPy's matrix exponential, token by
    token (the formulas of the RKMK4 docstring, without its coefficient space)."""
    def xi(t, y):
        k = h * np.asarray(total_field(t, jnp.asarray(y), PARAMS))
        k = k - np.sum(k * y, -1, keepdims=True) * y
        return np.einsum("ni,nj->nij", k, y) - np.einsum("ni,nj->nij", y, k)

    def act(u, y):
        z = np.stack([scipy.linalg.expm(u_i) @ y_i for u_i, y_i in zip(u, y, strict=True)])
        return z / np.linalg.norm(z, axis=-1, keepdims=True)

    def bracket(a, b):
        return a @ b - b @ a

    y0, t0 = np.asarray(Y0), 0.3
    k1 = xi(t0, y0)
    k2 = xi(t0 + h / 2, act(k1 / 2, y0))
    k3 = xi(t0 + h / 2, act(k2 / 2 - bracket(k1, k2) / 8, y0))
    k4 = xi(t0 + h, act(k3, y0))
    return act((k1 + 2 * k2 + 2 * k3 + k4) / 6 - bracket(k1, k4) / 12, y0)


@pytest.mark.parametrize("h", [0.5, 0.1, 0.01])
def test_rkmk4_step_equals_dense_exponentials(h):
    """RKMK4 acts with ``5 x 5`` exponentials in the span of ``y0`` and its stage values; the
    step is the one of dense ``d x d`` exponentials (SciPy), to round-off."""
    got = np.asarray(_one_step(RKMK4(), TERM, h))
    expected = _dense_rkmk4_step(h)
    assert np.abs(got - np.asarray(Y0)).max() > 1e-3 * h  # the step moves the state
    np.testing.assert_allclose(got, expected, rtol=0, atol=3e-15)


def test_lie_trotter_is_attention_then_ffn_layer():
    """One LieTrotter(RetractedEuler) step = R(x + h A), then R(. + h B): a Transformer block."""
    h = 0.1
    y = Y0 + h * attention_field(0.3, Y0, PARAMS)
    y = y / jnp.linalg.norm(y, axis=-1, keepdims=True)
    y = y + h * linear_field(0.3, y, PARAMS)
    y = y / jnp.linalg.norm(y, axis=-1, keepdims=True)
    np.testing.assert_allclose(
        _one_step(LieTrotter(RetractedEuler()), SPLIT_TERMS, h), y, atol=1e-15
    )


def _normalise(y):
    return y / jnp.linalg.norm(y, axis=-1, keepdims=True)


def test_strang_is_macaron_block():
    """One Strang step on MultiTerm(attention, ffn) = half FFN, attention, half FFN, each
    sub-step a retracted Euler step over its own time interval."""
    h, t0 = 0.1, 0.3
    y = _normalise(Y0 + 0.5 * h * linear_field(t0, Y0, PARAMS))
    y = _normalise(y + h * attention_field(t0, y, PARAMS))
    y = _normalise(y + 0.5 * h * linear_field(t0 + 0.5 * h, y, PARAMS))
    np.testing.assert_allclose(_one_step(Strang(RetractedEuler()), SPLIT_TERMS, h), y, atol=1e-15)


def test_fixed_steps_equal_transformer_layers():
    """solve(num_steps=L) with RetractedEuler is the L-layer loop x <- R(x + h v(l h, x)); with
    LieTrotter on (attention, ffn) it is the loop of post-norm blocks (two sub-layers each)."""
    layers = 12
    h = (T1 - T0) / layers
    ts = T0 + h * jnp.arange(layers)

    def layer(x, t):
        return _normalise(x + h * total_field(t, x, PARAMS)), None

    expected, _ = jax.lax.scan(layer, Y0, ts)
    sol = solve(total_field, Y0, T0, T1, solver=RetractedEuler(), num_steps=layers, args=PARAMS)
    np.testing.assert_allclose(sol.ys[-1], expected, atol=1e-14)
    assert int(sol.stats["num_steps"]) == layers

    def block(x, t):
        x = _normalise(x + h * attention_field(t, x, PARAMS))
        return _normalise(x + h * linear_field(t, x, PARAMS)), None

    expected, _ = jax.lax.scan(block, Y0, ts)
    sol = solve(
        (attention_field, linear_field),
        Y0,
        T0,
        T1,
        solver=LieTrotter(RetractedEuler()),
        num_steps=layers,
        args=PARAMS,
    )
    np.testing.assert_allclose(sol.ys[-1], expected, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "solver",
    [Retracted(diffrax.Heun()), RetractedEuler(), CrouchGrossman3()],
    ids=["Retracted(Heun)", "RetractedEuler", "CrouchGrossman3"],
)
def test_gradients_match_finite_differences(solver):
    c = jax.random.normal(jax.random.PRNGKey(5), Y0.shape)
    direction = jax.tree_util.tree_map(
        lambda p, k: jax.random.normal(k, p.shape),
        PARAMS,
        dict(zip(PARAMS, jax.random.split(jax.random.PRNGKey(6), len(PARAMS)), strict=True)),
    )
    y_dir = sphere.project_tangent(Y0, jax.random.normal(jax.random.PRNGKey(7), Y0.shape))

    def loss(params, y0):
        sol = diffrax.diffeqsolve(
            TERM,
            solver,
            T0,
            T1,
            0.125,
            y0,
            args=params,
            adjoint=diffrax.RecursiveCheckpointAdjoint(),
            max_steps=16,
        )
        return jnp.sum(c * sol.ys[-1])

    g_params, g_y0 = jax.jit(jax.grad(loss, argnums=(0, 1)))(PARAMS, Y0)
    ad = sum(jnp.sum(g_params[k] * direction[k]) for k in PARAMS) + jnp.sum(g_y0 * y_dir)

    eps = 1e-6
    loss_jit = jax.jit(loss)

    def shifted(s):
        params = jax.tree_util.tree_map(lambda p, q: p + s * q, PARAMS, direction)
        return loss_jit(params, Y0 + s * y_dir)

    fd = (shifted(eps) - shifted(-eps)) / (2 * eps)
    # Central differences: truncation ~eps^2 ~1e-12, round-off ~1e-16/eps ~1e-10.
    np.testing.assert_allclose(float(ad), float(fd), rtol=1e-7, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# solve: failures and inputs
# ---------------------------------------------------------------------------------------------


def test_max_steps_result_without_throw():
    kwargs = dict(args=PARAMS, throw=False)
    sol = diffrax.diffeqsolve(TERM, RetractedEuler(), T0, T1, 0.01, Y0, max_steps=10, **kwargs)
    assert sol.result == diffrax.RESULTS.max_steps_reached
    sol = diffrax.diffeqsolve(TERM, RetractedEuler(), T0, T1, 0.1, Y0, max_steps=16, **kwargs)
    assert sol.result == diffrax.RESULTS.successful


def test_solve_raises_on_max_steps():
    with pytest.raises(SolveError, match="max_steps=10"):
        solve(total_field, Y0, T0, T1, solver=RetractedEuler(), dt0=0.01, max_steps=10, args=PARAMS)
    # Adaptive: a tolerance that cannot be met in 5 steps.
    with pytest.raises(SolveError, match="max_steps"):
        solve(
            total_field,
            Y0,
            T0,
            T1,
            solver=Retracted(diffrax.Tsit5()),
            stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12),
            max_steps=5,
            args=PARAMS,
        )


def test_solve_raises_on_other_failures():
    # The controller cannot meet the tolerance without going below dtmin.
    controller = diffrax.PIDController(rtol=1e-13, atol=1e-13, dtmin=0.2, force_dtmin=False)
    with pytest.raises(SolveError, match="minimum step size"):
        solve(
            total_field,
            Y0,
            T0,
            T1,
            solver=Retracted(diffrax.Tsit5()),
            stepsize_controller=controller,
            args=PARAMS,
        )

    # A field that returns NaN: fixed-step solvers do not notice, solve does.
    def nan_field(t, x, args):
        return jnp.where(t > 0.5, jnp.nan, 1.0) * total_field(t, x, args)

    with pytest.raises(SolveError, match="NaN"):
        solve(nan_field, Y0, T0, T1, solver=RetractedEuler(), num_steps=8, args=PARAMS)
    with pytest.raises(Exception, match="contains NaN"):
        jax.block_until_ready(
            jax.jit(
                lambda y: (
                    solve(
                        nan_field, y, T0, T1, solver=RetractedEuler(), num_steps=8, args=PARAMS
                    ).ys
                )
            )(Y0)
        )


def test_solve_raises_on_max_steps_under_jit_and_vmap():
    def final(y0, dt0):
        return solve(
            total_field, y0, T0, T1, solver=RetractedEuler(), dt0=dt0, max_steps=10, args=PARAMS
        ).ys[-1]

    with pytest.raises(Exception, match="hit max_steps=10"):
        jax.block_until_ready(jax.jit(final)(Y0, 0.01))
    # Under vmap, one failing member is enough.
    with pytest.raises(Exception, match="hit max_steps=10"):
        jax.block_until_ready(
            jax.jit(jax.vmap(final, in_axes=(None, 0)))(Y0, jnp.array([0.5, 0.01]))
        )
    # And a successful jitted solve returns the eager result.
    np.testing.assert_allclose(jax.jit(final)(Y0, 0.125), final(Y0, 0.125), atol=1e-15)


def test_solve_rejects_bad_inputs():
    ok = dict(solver=RetractedEuler(), dt0=0.1, args=PARAMS)
    bad_y0 = Y0.at[0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match="NaN or inf"):
        solve(total_field, bad_y0, T0, T1, **ok)
    with pytest.raises(ValueError, match="unit vectors"):
        solve(total_field, 1.001 * Y0, T0, T1, **ok)
    with pytest.raises(ValueError, match="unit vectors"):
        solve(total_field, np.sqrt(D) * Y0, T0, T1, **ok)  # the RMSNorm sphere
    with pytest.raises(ValueError, match="d >= 2"):
        solve(total_field, jnp.ones((3, 1)), T0, T1, **ok)
    with pytest.raises(ValueError, match="floating-point"):
        solve(total_field, jnp.ones((3, 2), dtype=jnp.int32), T0, T1, **ok)
    with pytest.raises(ValueError, match="t1 must be greater than t0"):
        solve(total_field, Y0, 1.0, 1.0, **ok)
    with pytest.raises(ValueError, match="t1 must be greater than t0"):
        solve(total_field, Y0, 1.0, 0.0, **ok)
    with pytest.raises(ValueError, match="dt0 must be positive"):
        solve(total_field, Y0, T0, T1, solver=RetractedEuler(), dt0=-0.1)
    with pytest.raises(ValueError, match="no step size"):
        solve(total_field, Y0, T0, T1, solver=RetractedEuler())
    with pytest.raises(ValueError, match="not both"):
        solve(total_field, Y0, T0, T1, solver=RetractedEuler(), dt0=0.1, num_steps=4)
    with pytest.raises(ValueError, match="num_steps must be a positive"):
        solve(total_field, Y0, T0, T1, solver=RetractedEuler(), num_steps=0)
    with pytest.raises(ValueError, match="RecursiveCheckpointAdjoint"):
        solve(total_field, Y0, T0, T1, adjoint=diffrax.BacksolveAdjoint(), **ok)
    with pytest.raises(ValueError, match="diffrax.AbstractSolver"):
        solve(total_field, Y0, T0, T1, solver="euler", dt0=0.1)
    # Value checks on traced inputs become runtime errors with the same message.
    with pytest.raises(Exception, match="unit vectors"):
        jax.block_until_ready(jax.jit(lambda y: solve(total_field, y, T0, T1, **ok).ys)(2 * Y0))
    # A sample from sphere.uniform passes, in float64 and in float32, also for large d.
    for dtype in (jnp.float64, jnp.float32):
        y = sphere.uniform(jax.random.PRNGKey(9), (3,), 768, dtype)
        solve(lambda t, x, a: jnp.zeros_like(x), y, T0, T1, solver=RetractedEuler(), num_steps=1)


def test_float32_stays_float32_and_on_sphere():
    y0 = Y0.astype(jnp.float32)
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), PARAMS)
    sol = solve(
        total_field,
        y0,
        0.0,
        1.0,
        solver=RetractedEuler(),
        dt0=0.05,
        saveat=diffrax.SaveAt(ts=TS_OFF, steps=True),  # float64 ts, cast too
        args=params,
    )
    assert sol.ys.dtype == jnp.float32
    assert sol.ts.dtype == jnp.float32
    # Each step re-normalises, so drift does not accumulate: it stays at the rounding of one
    # y / |y| in float32, a few ulp (eps = 1.2e-7); 1e-6 is ~8 ulp.
    drift = _drift_steps(np.asarray(sol.ys), np.asarray(sol.ts))
    assert drift <= 1e-6, drift
    # Same solve in float64: round-off of 20 float32 steps, amplified by the flow (Lipschitz
    # constant ~3 over [0, 1]), stays below ~100 ulp.
    sol64 = solve(total_field, Y0, 0.0, 1.0, solver=RetractedEuler(), dt0=0.05, args=PARAMS)
    finite = np.isfinite(np.asarray(sol.ts))
    err = float(
        jnp.max(sphere.geodesic_distance(sol.ys[finite][-1].astype(jnp.float64), sol64.ys[-1]))
    )
    assert err < 1e-5, err


def test_solver_properties():
    assert isinstance(Retracted(diffrax.Tsit5()), diffrax.AbstractAdaptiveSolver)
    assert not isinstance(Retracted(diffrax.Euler()), diffrax.AbstractAdaptiveSolver)
    assert Retracted(diffrax.Tsit5()).order(TERM) == 5
    assert Strang(RetractedEuler()).order(SPLIT_TERMS) == 1
    assert Strang(Retracted(diffrax.Heun())).order(SPLIT_TERMS) == 2
    assert LieTrotter(Retracted(diffrax.Heun())).order(SPLIT_TERMS) == 1
    # The interpolation factory is hashable and stable (diffrax stores it as a static field).
    a, b = (
        Retracted(diffrax.Tsit5()).interpolation_cls,
        Retracted(diffrax.Tsit5()).interpolation_cls,
    )
    assert a == b and hash(a) == hash(b)


# ---------------------------------------------------------------------------------------------
# Per-layer weights: every stage of a step reads the weights of the layer the step covers
# ---------------------------------------------------------------------------------------------

PW_LAYERS = 4
PW_H = (T1 - T0) / PW_LAYERS
# scale 0.6: the flow moves ~0.4 rad over [0, 1]; RK4's errors with k = 1..8 steps per layer
# lie in 3e-5 .. 6e-9, in the asymptotic regime and far above the reference's ~1e-13.
PW_ANCHORS = layer_anchors(jax.random.PRNGKey(11), PW_LAYERS, D, scale=0.6)
PW_ANCHORS_B = layer_anchors(jax.random.PRNGKey(12), PW_LAYERS, D, scale=0.6)


def _layer(anchors, l):
    return jax.tree_util.tree_map(lambda a: a[l], anchors)


def _chain(field_fn, thetas, y0):
    """The exact ODE of a stack: on ``[t_l, t_{l+1}]`` the autonomous field
    ``field_fn(theta_l, x)``. Each layer solved on its own by ``Retracted(Dopri8())`` at
    ``rtol = atol = 1e-12`` (one compilation: weights and times are traced), then chained."""

    @jax.jit
    def piece(theta, y, ta, tb):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, x, th: field_fn(th, x)), Retracted(diffrax.Dopri8()),
            ta, tb, None, y, args=theta,
            stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12), max_steps=1000,
        )
        return sol.ys[-1], sol.result

    y = y0
    for l, theta in enumerate(thetas):
        y, result = piece(theta, y, T0 + l * PW_H, T0 + (l + 1) * PW_H)
        assert result == diffrax.RESULTS.successful
    return y


@functools.cache
def piecewise_reference():
    return _chain(layer_field, [_layer(PW_ANCHORS, l) for l in range(PW_LAYERS)], Y0)


def test_piecewise_reference_matches_closed_form():
    """The chained reference, on per-layer rotations ``x' = S_l x``, against the closed form
    ``x(T) = x0 expm(h S_0)^T ... expm(h S_{L-1})^T``."""
    skews = [skew(jax.random.PRNGKey(20 + l), D, scale=2.0) for l in range(PW_LAYERS)]
    got = _chain(lambda s, x: x @ s.T, skews, Y0)
    exact = np.asarray(Y0)
    for s in skews:
        exact = exact @ scipy.linalg.expm(PW_H * np.asarray(s)).T
    assert float(jnp.max(sphere.geodesic_distance(got, jnp.asarray(exact)))) < 1e-12
    # and the field's reference moves: orders are measured on a non-trivial trajectory
    assert 0.2 < float(jnp.max(sphere.geodesic_distance(piecewise_reference(), Y0))) < 2.0


def _piecewise_errors(solver, path_cls, steps_per_layer):
    """Final errors of fixed steps aligned with the layers (``k`` steps per layer), one
    compilation for every ``k``."""
    term = diffrax.ODETerm(PathField(path_cls(PW_ANCHORS, PW_H)))

    @jax.jit
    @jax.vmap
    def run(dt0):
        sol = diffrax.diffeqsolve(term, solver, T0, T1, dt0, Y0,
                                  max_steps=PW_LAYERS * max(steps_per_layer) + 2)
        return sol.ys[-1], sol.result._value

    ys, results = run(PW_H / jnp.asarray(steps_per_layer, dtype=jnp.float64))
    assert np.all(np.asarray(results) == 0)
    reference = piecewise_reference()
    errors = np.array([float(jnp.max(sphere.geodesic_distance(y, reference))) for y in ys])
    return PW_H / np.asarray(steps_per_layer, dtype=float), errors


@pytest.mark.parametrize(
    "solver", [Retracted(RK4()), RKMK4()], ids=["Retracted(RK4)", "RKMK4"]
)
def test_per_layer_weights_keep_order_4_with_aligned_steps(solver):
    """Steps aligned with the layers (k = 1, 2, 4, 8 per layer): order 4 when every stage reads
    the step's layer, order 1 when the stage at c = 1 reads the next layer (the path without
    ``within_step``)."""
    counts = (1, 2, 4, 8)
    h, fixed = _piecewise_errors(solver, PiecewiseConstant, counts)
    _, unfixed = _piecewise_errors(solver, WithoutStepRestriction, counts)
    fit_fixed, fit_unfixed = fit_order(h, fixed), fit_order(h, unfixed)
    print(f"fixed: order {fit_fixed}, errors {fixed}; without: order {fit_unfixed}, {unfixed}")
    assert fixed.min() > 1e-10, fixed  # far above the reference's accuracy
    assert abs(fit_fixed.slope - 4) <= 0.15, fit_fixed
    assert abs(fit_unfixed.slope - 1) <= 0.15, fit_unfixed
    assert np.all(unfixed > 100 * fixed), (fixed, unfixed)


def test_fsal_solver_keeps_its_order_on_per_layer_weights():
    """Tsit5 (FSAL): the cached last stage of a step was read with that step's layer, so the
    next step must re-evaluate its first stage (made_jump). Order >= 5 with the fix (as on a
    smooth field, see CASES), about 1 without."""
    solver = Retracted(diffrax.Tsit5())
    counts = (1, 2, 3, 4)
    h, fixed = _piecewise_errors(solver, PiecewiseConstant, counts)
    _, unfixed = _piecewise_errors(solver, WithoutStepRestriction, counts)
    fit_fixed, fit_unfixed = fit_order(h, fixed), fit_order(h, unfixed)
    print(f"fixed: order {fit_fixed}, errors {fixed}; without: order {fit_unfixed}, {unfixed}")
    assert fixed.min() > 1e-11, fixed
    assert fit_fixed.slope >= 4.8, fit_fixed
    assert fit_unfixed.slope <= 1.3, fit_unfixed


def _count_solve_evaluations(path, solver, num_steps, **kw):
    """Field evaluations of a whole fixed-step solve, counted at run time."""
    calls = []

    class Counting(PathField):
        def __call__(self, t, x, args):
            jax.debug.callback(lambda: calls.append(1))
            return super().__call__(t, x, args)

    solve(Counting(path), Y0, T0, T1, solver=solver, num_steps=num_steps, **kw)
    jax.effects_barrier()
    return len(calls)


def test_fsal_costs_one_more_evaluation_per_step_on_per_layer_weights():
    """In diffrax's loop an FSAL solver reuses its last stage unless the weights changed; the
    default fixed-step scan never reuses it (it evaluates the stages that y1 needs, the same
    number on smooth and per-layer weights)."""
    steps = 8
    loop = dict(adjoint=diffrax.RecursiveCheckpointAdjoint())
    for solver, extra, stages in [(Retracted(diffrax.Tsit5()), steps - 1, 6),
                                  (Retracted(RK4()), steps - 1, 4),
                                  (Retracted(diffrax.Heun()), 0, 2), (RKMK4(), 0, 4)]:
        smooth = _count_solve_evaluations(Constant(_layer(PW_ANCHORS, 0)), solver, steps, **loop)
        layered = _count_solve_evaluations(PiecewiseConstant(PW_ANCHORS, PW_H), solver, steps,
                                           **loop)
        assert layered - smooth == extra, (solver, smooth, layered)
        for path in (Constant(_layer(PW_ANCHORS, 0)), PiecewiseConstant(PW_ANCHORS, PW_H)):
            assert _count_solve_evaluations(path, solver, steps) == stages * steps, solver


# One aligned step over layer 1, [t_1, t_2]: on per-layer weights it equals the same step on the
# constant weights theta_1, for every solver. Without the fix the solvers with a stage at c = 1
# read theta_2 there and differ.
STAGE_AT_END = {"Retracted(Heun)", "Retracted(RK4)", "Retracted(Tsit5)", "RKMK4",
                "Strang(Retracted(Heun))", "LieTrotter(Retracted(RK4))"}
ONE_STEP_SOLVERS = {
    "RetractedEuler": RetractedEuler(),
    "GeodesicEuler": GeodesicEuler(),
    "VariableStepRetractedEuler": VariableStepRetractedEuler(),
    "Retracted(Heun)": Retracted(diffrax.Heun()),
    "Retracted(RK4)": Retracted(RK4()),
    "Retracted(Tsit5)": Retracted(diffrax.Tsit5()),
    "CrouchGrossman3": CrouchGrossman3(),
    "RKMK4": RKMK4(),
    "Strang(Retracted(Heun))": Strang(Retracted(diffrax.Heun())),
    "LieTrotter(Retracted(RK4))": LieTrotter(Retracted(RK4())),
}


def _aligned_step(solver, path_cls):
    split = isinstance(solver, (Strang, LieTrotter))

    def term(anchors):
        return diffrax.ODETerm(PathField(path_cls(anchors)))

    terms = diffrax.MultiTerm(term(PW_ANCHORS), term(PW_ANCHORS_B)) if split else term(PW_ANCHORS)
    t0, t1 = T0 + PW_H, T0 + 2 * PW_H
    state = solver.init(terms, t0, t1, Y0, None)
    return solver.step(terms, t0, t1, Y0, None, state, False)[0]


@pytest.mark.parametrize("name", list(ONE_STEP_SOLVERS))
def test_aligned_step_reads_the_weights_of_its_layer(name):
    solver = ONE_STEP_SOLVERS[name]
    own_layer = _aligned_step(solver, lambda a: Constant(_layer(a, 1)))
    per_layer = _aligned_step(solver, lambda a: PiecewiseConstant(a, PW_H))
    without = _aligned_step(solver, lambda a: WithoutStepRestriction(a, PW_H))
    np.testing.assert_allclose(per_layer, own_layer, rtol=0, atol=1e-15)
    gap = float(jnp.max(jnp.abs(without - own_layer)))
    if name in STAGE_AT_END:
        assert gap > 1e-3, gap
    else:  # Euler-type steps read t0 only; Crouch-Grossman 3 has c = (0, 3/4, 17/24)
        assert gap <= 1e-15, gap


def test_within_step_helper():
    anchors = _layer(PW_ANCHORS, slice(0, 3))
    smooth_paths = [
        Constant(_layer(PW_ANCHORS, 0)),
        LinearInterpolation(anchors, PW_H),
        ChebyshevInterpolation(anchors, T0, T1),
    ]
    for path in smooth_paths:
        terms = diffrax.ODETerm(PathField(path))
        restricted, changed = within_step(terms, 0.25, 0.5)
        assert changed is False
        assert restricted.vector_field.path is path  # the identity, not a copy
    # Per-layer weights: restricted, also nested in a MultiTerm, and under jit.
    layered = PathField(PiecewiseConstant(PW_ANCHORS, PW_H))
    terms = diffrax.MultiTerm(diffrax.ODETerm(linear_field), diffrax.ODETerm(layered))
    restricted, changed = within_step(terms, 0.25, 0.5)
    assert changed is True
    field = restricted.terms[1].vector_field
    np.testing.assert_array_equal(field.path(0.5)["A"], PW_ANCHORS["A"][1])  # not layer 2
    assert restricted.terms[0].vector_field is linear_field

    @jax.jit
    def value_at_end(t0, t1):
        restricted, changed = within_step(diffrax.ODETerm(layered), t0, t1)
        assert changed  # static
        return restricted.vector_field.path(t1)["A"]

    np.testing.assert_array_equal(value_at_end(0.5, 0.75), PW_ANCHORS["A"][2])
    # A field hidden in a closure is not seen (documented): nothing to restrict.
    _, changed = within_step(diffrax.ODETerm(lambda t, y, args: layered(t, y, args)), 0.25, 0.5)
    assert changed is False


def test_piecewise_within_step_values():
    path = PiecewiseConstant({"w": jnp.arange(4.0)}, PW_H)
    eps = float(jnp.finfo(jnp.float64).eps)
    for l in range(PW_LAYERS):
        # ends a few ulps off the grid, as a solver computes them
        t0, t1 = l * PW_H * (1 - 3 * eps), (l + 1) * PW_H * (1 + 3 * eps)
        restricted = path.within_step(t0, t1)
        for t in np.linspace(t0, t1, 7):
            assert float(restricted(t)["w"]) == l
    # Sub-steps inside a layer (Strang's halves) read that layer too.
    assert float(path.within_step(0.625, 0.75)(0.75)["w"]) == 2
    # A step that straddles a boundary reads the path at each time: an adaptive controller's
    # error estimate still sees the jump.
    straddling = path.within_step(0.2, 0.3)
    assert [float(straddling(t)["w"]) for t in (0.2, 0.26, 0.3)] == [0.0, 1.0, 1.0]
    # Beyond the grid (clamped like the path itself).
    assert float(path.within_step(1.0, 1.25)(1.25)["w"]) == 3
    assert float(path.within_step(-0.25, 0.0)(0.0)["w"]) == 0


def test_smooth_paths_are_read_as_before():
    """A smooth path is not restricted: solving with the path visible to the solver or hidden
    in a closure gives the same numbers (no extra FSAL evaluation either)."""
    path = ChebyshevInterpolation(_layer(PW_ANCHORS, slice(0, 3)), T0, T1)
    solver = Retracted(diffrax.Tsit5())
    seen = solve(PathField(path), Y0, T0, T1, solver=solver, num_steps=6).ys[-1]
    hidden = solve(lambda t, x, args: layer_field(path(t), x), Y0, T0, T1, solver=solver,
                   num_steps=6).ys[-1]
    np.testing.assert_allclose(seen, hidden, rtol=0, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# solve: solvers that leave the sphere, fields a solver cannot take
# ---------------------------------------------------------------------------------------------


class _OwnSolver(diffrax.AbstractSolver):
    """A solver written from scratch (not an AbstractSphereSolver): retracted Euler."""

    term_structure: ClassVar = diffrax.AbstractTerm
    interpolation_cls: ClassVar = diffrax.LocalLinearInterpolation
    stays_on_sphere: ClassVar[bool] = True

    def order(self, terms):
        return 1

    def init(self, terms, t0, t1, y0, args):
        return None

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        y1 = sphere.retract(y0 + terms.vf_prod(t0, y0, args, terms.contr(t0, t1)))
        return y1, None, dict(y0=y0, y1=y1), None, diffrax.RESULTS.successful

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)


class _OffSphereSphereSolver(AbstractSphereSolver):
    """An AbstractSphereSolver subclass that declares it leaves the sphere."""

    stays_on_sphere: ClassVar[bool] = False

    def order(self, terms):
        return 1

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        y1 = y0 + terms.vf_prod(t0, y0, args, terms.contr(t0, t1))
        return y1, None, dict(y0=y0, y1=y1), None, diffrax.RESULTS.successful


def test_stays_on_sphere():
    on = [RetractedEuler(), GeodesicEuler(), VariableStepRetractedEuler(), CrouchGrossman3(),
          RKMK4(), Retracted(diffrax.Heun()), Retracted(RK4()), LieTrotter(RetractedEuler()),
          Strang(Retracted(diffrax.Heun())), _OwnSolver()]
    off = [diffrax.Heun(), diffrax.Tsit5(), RK4(), LieTrotter(diffrax.Euler()),
           Strang(diffrax.Heun()), _OffSphereSphereSolver()]
    assert all(stays_on_sphere(s) for s in on)
    assert not any(stays_on_sphere(s) for s in off)


def test_solve_refuses_solvers_that_leave_the_sphere():
    kwargs = dict(num_steps=8, args=PARAMS)
    with pytest.raises(ValueError, match=r"wrap it as Retracted\(diffrax\.Heun\(\)\)") as info:
        solve(total_field, Y0, T0, T1, solver=diffrax.Heun(), **kwargs)
    assert "off_sphere=True" in str(info.value) and "~h^p" in str(info.value)
    with pytest.raises(ValueError, match=r"LieTrotter\(Retracted\(diffrax\.Euler\(\)\)\)"):
        solve((attention_field, linear_field), Y0, T0, T1, solver=LieTrotter(diffrax.Euler()),
              **kwargs)
    with pytest.raises(ValueError, match="does not stay on the sphere"):
        solve(total_field, Y0, T0, T1, solver=_OffSphereSphereSolver(), **kwargs)
    # Asked for: the ambient solve runs, and leaves the sphere by ~h^2 per step.
    y = solve(total_field, Y0, T0, T1, solver=diffrax.Heun(), off_sphere=True, **kwargs).ys[-1]
    assert 1e-8 < float(sphere.norm_drift(y)) < 1e-1
    # A solver of one's own with stays_on_sphere = True is accepted, and is retracted Euler.
    own = solve(total_field, Y0, T0, T1, solver=_OwnSolver(), **kwargs).ys[-1]
    ref = solve(total_field, Y0, T0, T1, solver=RetractedEuler(), **kwargs).ys[-1]
    np.testing.assert_allclose(own, ref, atol=1e-15)
    with pytest.raises(ValueError, match="off_sphere must be a bool"):
        solve(total_field, Y0, T0, T1, solver=RetractedEuler(), off_sphere="yes", **kwargs)


@pytest.mark.parametrize(
    "solver, name",
    [(RetractedEuler(), "RetractedEuler()"), (Retracted(diffrax.Heun()),
                                               "Retracted(diffrax.Heun())"),
     (_OwnSolver(), "_OwnSolver()")],
    ids=["RetractedEuler", "Retracted(Heun)", "own solver"],
)
def test_solve_rejects_two_fields_for_a_single_field_solver(solver, name):
    """A sequential block's (attention, ffn) given to a one-field solver: a ValueError that
    names the solver and the splittings (before: a TypeError about a tuple)."""
    with pytest.raises(ValueError, match="takes one field, but got 2") as info:
        solve((attention_field, linear_field), Y0, T0, T1, solver=solver, num_steps=4,
              args=PARAMS)
    message = str(info.value)
    assert f"{name} takes one field, but got 2" in message
    assert f"LieTrotter({name})" in message and f"Strang({name})" in message
    assert "parallel block" in message


def test_solve_rejects_one_field_for_a_splitting():
    with pytest.raises(ValueError, match=r"takes a tuple \(field_a, field_b\)") as info:
        solve(total_field, Y0, T0, T1, solver=Strang(RetractedEuler()), num_steps=4,
              args=PARAMS)
    assert "RetractedEuler() directly" in str(info.value)
    with pytest.raises(ValueError, match="exactly two fields, got 3"):
        solve((attention_field, linear_field, total_field), Y0, T0, T1,
              solver=LieTrotter(RetractedEuler()), num_steps=4, args=PARAMS)
    with pytest.raises(ValueError, match="needs at least two"):
        solve((total_field,), Y0, T0, T1, solver=RetractedEuler(), num_steps=4, args=PARAMS)


# ---------------------------------------------------------------------------------------------
# A Crouch-Grossman method of one's own: a subclass with a tableau
# ---------------------------------------------------------------------------------------------


class _CrouchGrossman2(AbstractCrouchGrossman):
    """The Crouch-Grossman analogue of Heun: c = (0, 1), a21 = 1, b = (1/2, 1/2)."""

    a_lower: ClassVar = ((1.0,),)
    b: ClassVar = (0.5, 0.5)
    c: ClassVar = (0.0, 1.0)
    method_order: ClassVar[int] = 2


class _SameAsCrouchGrossman3(AbstractCrouchGrossman):
    a_lower: ClassVar = ((3 / 4,), (119 / 216, 17 / 108))
    b: ClassVar = (13 / 51, -2 / 3, 24 / 17)
    c: ClassVar = (0.0, 3 / 4, 17 / 24)
    method_order: ClassVar[int] = 3


def test_own_crouch_grossman_tableau():
    # The order conditions up to 2 are the classical ones: sum b = 1, sum b c = 1/2.
    steps = (16, 32, 64, 128)
    target = np.asarray(reference().ys[0][-1])
    errors = [
        float(jnp.max(sphere.geodesic_distance(
            solve(TERM, Y0, T0, T1, solver=_CrouchGrossman2(), num_steps=n, args=PARAMS).ys[-1],
            target)))
        for n in steps
    ]
    fit = fit_order(1.0 / np.asarray(steps), errors)
    assert abs(fit.slope - 2) <= 0.15, (fit, errors)
    # CrouchGrossman3's tableau in a subclass of one's own gives the same step
    np.testing.assert_array_equal(_one_step(_SameAsCrouchGrossman3(), TERM, 0.1),
                                  _one_step(CrouchGrossman3(), TERM, 0.1))
    assert _CrouchGrossman2().order(TERM) == 2
    assert count_evaluations(_CrouchGrossman2()) == 2


def test_crouch_grossman_tableau_is_checked():
    with pytest.raises(TypeError, match="sum to 1"):
        class _BadWeights(AbstractCrouchGrossman):
            a_lower: ClassVar = ((1.0,),)
            b: ClassVar = (0.5, 0.6)
            c: ClassVar = (0.0, 1.0)
            method_order: ClassVar[int] = 2
    with pytest.raises(TypeError, match="row sum"):
        class _BadTimes(AbstractCrouchGrossman):
            a_lower: ClassVar = ((1.0,),)
            b: ClassVar = (0.5, 0.5)
            c: ClassVar = (0.0, 0.5)
            method_order: ClassVar[int] = 2
    with pytest.raises(TypeError, match="entries"):
        class _BadShape(AbstractCrouchGrossman):
            a_lower: ClassVar = ((0.5, 0.5),)
            b: ClassVar = (0.5, 0.5)
            c: ClassVar = (0.0, 1.0)
            method_order: ClassVar[int] = 2


def test_variable_step_retracted_euler_is_the_standard_post_norm_layer():
    """``R(y + h u)`` with an unprojected branch ``u`` (radial part y.u != 0), while
    ``1 + h y.u > 0``; an error once the step crosses the origin."""
    h = 0.1

    def unprojected(t, x, args):  # tangent part plus a radial part of either sign
        return total_field(t, x, args) + jnp.asarray([1.5, -2.0, 0.7, 3.0])[:, None] * x

    u = unprojected(0.3, Y0, PARAMS)
    expected = _normalise(Y0 + h * u)
    got = _one_step(VariableStepRetractedEuler(), diffrax.ODETerm(unprojected), h)
    np.testing.assert_allclose(got, expected, atol=1e-15)
    # 1 + h y.u <= 0 for the row with radial part -2 / h: the layer is no step on the sphere
    with pytest.raises(Exception, match="crossed the origin"):
        jax.block_until_ready(_one_step(
            VariableStepRetractedEuler(),
            diffrax.ODETerm(lambda t, x, a: unprojected(t, x, a) - (1 / h) * x), 2 * h))


def test_jitted_fixed_step_solve_without_throw_has_no_host_callback():
    """``solve(..., num_steps=L, throw=False)`` under ``jit`` in float64 puts no runtime check
    (a host callback) into the program, so JAX's persistent compilation cache can keep it;
    with ``throw=True`` the checks are there. Both give the same states."""

    def field(t, y, args):
        return sphere.project_tangent(y, jnp.roll(y, 1, axis=-1))

    y0 = sphere.retract(jnp.asarray(np.random.default_rng(0).standard_normal((3, 4))))

    def run(throw):
        return solve(field, y0, 0.0, 1.0, solver=RetractedEuler(), num_steps=7,
                     throw=throw).ys[-1]

    assert "callback" not in str(jax.make_jaxpr(lambda: run(False))())
    assert "callback" in str(jax.make_jaxpr(lambda: run(True))())
    np.testing.assert_array_equal(jax.jit(lambda: run(False))(), jax.jit(lambda: run(True))())


def test_adaptive_first_step_is_hairers_rule():
    """``solve`` starts an adaptive solve with Hairer-Norsett-Wanner's step (written out here in
    NumPy), not diffrax's fixed 0.01 (diffrax skips its own rule for wrapped terms): on a
    rotation with rtol = atol = 1e-6 the first step is the rule's, and the whole solve takes
    fewer steps than from 0.01."""
    skew = np.array([[0.0, 0.7, -0.4], [-0.7, 0.0, 0.3], [0.4, -0.3, 0.0]])
    y0 = np.array([[1.0, 0.3, -0.2], [0.1, -0.7, 0.5]])
    y0 /= np.linalg.norm(y0, axis=-1, keepdims=True)
    rtol = atol = 1e-6
    f = lambda y: y @ skew.T  # noqa: E731  (tangent: skew)
    rms = lambda a: np.sqrt(np.mean(a**2))  # noqa: E731
    scale = atol + rtol * np.abs(y0)
    d0, d1 = rms(y0 / scale), rms(f(y0) / scale)
    h0 = 0.01 * d0 / d1
    d2 = rms((f(y0 + h0 * f(y0)) - f(y0)) / scale) / h0
    expected = min(100 * h0, (0.01 / max(d1, d2)) ** (1 / 5), 2.0)
    controller = diffrax.PIDController(rtol=rtol, atol=atol)
    sol = solve(lambda t, y, args: y @ jnp.asarray(skew).T, jnp.asarray(y0), 0.0, 2.0,
                solver=Retracted(diffrax.Dopri5()), stepsize_controller=controller,
                saveat=diffrax.SaveAt(steps=True))
    assert float(sol.ts[0]) == pytest.approx(expected, rel=1e-12)
    from_001 = diffrax.diffeqsolve(
        diffrax.ODETerm(lambda t, y, args: y @ jnp.asarray(skew).T), Retracted(diffrax.Dopri5()),
        0.0, 2.0, None, jnp.asarray(y0), stepsize_controller=controller)
    assert int(sol.stats["num_steps"]) < int(from_001.stats["num_steps"])


def test_adaptive_fsal_solve_evaluates_the_first_slope_once():
    """``solve`` with a PID controller: two evaluations choose the first step (Hairer's rule,
    ``f(t0, y0)`` and one trial), then an FSAL solver reuses ``f(t0, y0)`` as its first stage,
    so Dopri5 costs ``2 + 6 x (steps tried)``, as torchdiffeq; the state is that of a solve that
    evaluates it again (diffrax's own first state) to round-off."""
    from svflow_jax.flow import AttentionField
    from svflow_jax.flow.attention import AttentionParams

    params = AttentionParams.random(jax.random.PRNGKey(3), 16, 2, 8)
    y0 = sphere.retract(jax.random.normal(jax.random.PRNGKey(4), (6, 16)))
    calls = []
    field = AttentionField(params)

    def counted(t, y, args):
        jax.debug.callback(lambda: calls.append(1))
        return field(t, y, args)

    pid = diffrax.PIDController(rtol=1e-6, atol=1e-6)
    sol = solve(counted, y0, 0.0, 1.0, solver=Retracted(diffrax.Dopri5()),
                stepsize_controller=pid)
    jax.effects_barrier()
    tried = int(sol.stats["num_accepted_steps"]) + int(sol.stats["num_rejected_steps"])
    assert len(calls) == 2 + 6 * tried, (len(calls), tried)
    from svflow_jax.solvers.solve import initial_step

    term, solver = diffrax.ODETerm(field), Retracted(diffrax.Dopri5())
    dt0 = initial_step(term, solver, 0.0, 1.0, y0, None, pid)
    again = diffrax.diffeqsolve(term, solver, 0.0, 1.0, dt0, y0, stepsize_controller=pid)
    assert again.stats["num_steps"] == sol.stats["num_steps"]
    np.testing.assert_allclose(sol.ys[-1], again.ys[-1], rtol=0, atol=1e-14)
