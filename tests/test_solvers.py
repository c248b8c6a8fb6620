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

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
from fields_for_tests import (
    attention_field,
    linear_field,
    make_params,
    rotation_field,
    skew,
    total_field,
)

from svflow_jax import sphere
from svflow_jax.solvers import (
    RK4,
    RKMK4,
    CrouchGrossman3,
    GeodesicEuler,
    LieTrotter,
    Retracted,
    RetractedEuler,
    SolveError,
    Strang,
    solve,
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
    # 5.3-6 until the error is ~1e-12 (below the reference accuracy), on every seed we tried.
    # So only the lower bound (order at least 5) is asserted, as for Tsit5 in the brief.
    "Retracted(Tsit5)": (Retracted(diffrax.Tsit5()), False, (8, 12, 16, 24, 32), (4.8, np.inf)),
    "Retracted(Dopri5)": (Retracted(diffrax.Dopri5()), False, (8, 12, 16, 24, 32), (4.8, np.inf)),
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
    if np.isfinite(hi):
        assert abs(fitted - declared) <= 0.4, (declared, fitted)
    else:
        assert fitted >= declared - 0.2, (declared, fitted)


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
