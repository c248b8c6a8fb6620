"""Geometry of S^{d-1}: checked against scipy's matrix exponential, mpmath and closed forms."""

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
import scipy.linalg

from svflow_jax import sphere


def _points(seed, shape, d, dtype=jnp.float64):
    return sphere.uniform(jax.random.PRNGKey(seed), shape, d, dtype)


def _tangent(seed, x, scale=1.0):
    g = scale * jax.random.normal(jax.random.PRNGKey(seed), x.shape, x.dtype)
    return sphere.project_tangent(x, g)


@pytest.mark.parametrize("d", [2, 3, 17])
def test_projection_retraction_basics(d):
    x = _points(0, (4, 3), d)
    assert sphere.norm_drift(x) < 1e-15
    v = jax.random.normal(jax.random.PRNGKey(1), x.shape)
    pv = sphere.project_tangent(x, v)
    np.testing.assert_allclose(jnp.sum(pv * x, -1), 0.0, atol=1e-15)
    np.testing.assert_allclose(sphere.project_tangent(x, pv), pv, atol=1e-15)  # idempotent
    y = 3.7 * x
    np.testing.assert_allclose(sphere.retract(y), x, atol=1e-15)


@pytest.mark.parametrize("d", [2, 3, 10])
def test_exp_log_are_inverse_and_follow_great_circles(d):
    x = _points(2, (50,), d)
    w = _tangent(3, x)
    angles = jax.random.uniform(jax.random.PRNGKey(4), (50, 1), minval=1e-3, maxval=3.0)
    w = angles * w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    y = sphere.exp_map(x, w)
    assert sphere.norm_drift(y) < 1e-15
    # |w| < pi here, so log recovers w and the distance is |w|
    theta = jnp.linalg.norm(w, axis=-1)
    assert float(theta.max()) < np.pi
    np.testing.assert_allclose(sphere.geodesic_distance(x, y), theta, rtol=1e-12)
    np.testing.assert_allclose(sphere.log_map(x, y), w, atol=1e-12)
    # closed form on S^1: rotating (1, 0) by angle a
    if d == 2:
        a = 0.3
        np.testing.assert_allclose(
            sphere.exp_map(jnp.array([1.0, 0.0]), jnp.array([0.0, a])),
            [np.cos(a), np.sin(a)], atol=1e-16,
        )


def test_exp_map_is_smooth_at_zero():
    x = _points(4, (), 5)
    jac = jax.jacobian(lambda w: sphere.exp_map(x, w))(jnp.zeros(5))
    # d/dw exp_x(w) at 0 is P_x
    np.testing.assert_allclose(jac, np.eye(5) - np.outer(x, x), atol=1e-15)


def test_geodesic_distance_is_accurate_near_zero_and_pi():
    mpmath.mp.dps = 50
    x = np.array([1.0, 0.0, 0.0])
    for angle in [1e-12, 1e-8, 1e-4, 0.5, np.pi - 1e-6]:
        y = np.array([np.cos(angle), np.sin(angle), 0.0])
        # reference: the exact angle between the two (rounded) vectors, by mpmath
        ref = mpmath.atan2(mpmath.mpf(y[1]), mpmath.mpf(y[0]))
        got = sphere.geodesic_distance(jnp.array(x), jnp.array(y))
        assert abs(float(got) - float(ref)) <= 4e-16 * float(ref) + 1e-300, angle
    # arccos of the dot product would have lost these digits:
    y = jnp.array([np.cos(1e-8), np.sin(1e-8), 0.0])
    assert abs(float(jnp.arccos(jnp.dot(jnp.array(x), y))) - 1e-8) > 1e-10


@pytest.mark.parametrize("d", [3, 6])
def test_plane_rotation_is_the_so_d_exponential(d):
    x = _points(5, (3,), d)
    w = _tangent(6, x, scale=0.9)
    y = _points(7, (3,), d)
    for i in range(3):
        generator = np.outer(w[i], x[i]) - np.outer(x[i], w[i])
        expected = scipy.linalg.expm(generator) @ np.asarray(y[i])
        np.testing.assert_allclose(sphere.plane_rotation(x[i], w[i], y[i]), expected, atol=1e-14)
    # acting on x itself it is the exponential map, and it is an isometry
    np.testing.assert_allclose(sphere.plane_rotation(x, w, x), sphere.exp_map(x, w), atol=1e-15)
    assert sphere.norm_drift(sphere.plane_rotation(x, w, y)) < 1e-14
    # smooth at w = 0 (derivative is the generator applied to y)
    jac = jax.jacobian(lambda v: sphere.plane_rotation(x[0], v, y[0]))(jnp.zeros(d))
    p = np.eye(d) - np.outer(x[0], x[0])
    expected_jac = (np.outer(np.ones(d), 0) + np.eye(d) * float(x[0] @ y[0])
                    - np.outer(np.asarray(x[0]), np.asarray(y[0]))) @ p
    np.testing.assert_allclose(jac, expected_jac, atol=1e-14)


def test_uniform_samples_are_uniform():
    d, n = 4, 40000
    x = _points(8, (n,), d)
    assert sphere.norm_drift(x) < 1e-15
    # E[x] = 0 and E[x x^T] = I/d for the uniform distribution
    np.testing.assert_allclose(x.mean(0), 0.0, atol=5 / np.sqrt(n))
    np.testing.assert_allclose((x.T @ x) / n, np.eye(d) / d, atol=5 / np.sqrt(n))


def test_float32_paths():
    x = _points(9, (10,), 8, jnp.float32)
    w = _tangent(10, x)
    y = sphere.exp_map(x, w)
    assert y.dtype == jnp.float32
    # float32 round-off: a few ulps (eps32 = 1.2e-7) on unit vectors
    assert sphere.norm_drift(y) < 1e-6
    assert sphere.geodesic_distance(x, y).dtype == jnp.float32


def test_bad_dimension():
    with pytest.raises(ValueError, match="d >= 2"):
        sphere.uniform(jax.random.PRNGKey(0), (3,), 1)


# --------------------------------------------------------------------------------------------
# What counts as a unit vector: one definition, used by the solvers and by vmf
# --------------------------------------------------------------------------------------------


def test_unit_tolerance_closed_form():
    # 32 sqrt(d) eps, with eps = 2^-52 (float64) and 2^-23 (float32)
    assert sphere.unit_tolerance(jnp.float64, 64) == 32 * 8 * 2.0**-52
    assert sphere.unit_tolerance(jnp.float32, 4) == 32 * 2 * 2.0**-23
    np.testing.assert_allclose(sphere.unit_tolerance(jnp.float32, 768), 1.0571e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="positive"):
        sphere.unit_tolerance(jnp.float64, 0)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_normalised_vectors_are_on_the_sphere(dtype):
    for d in (2, 3, 64, 768, 4096):
        x = _points(d, (50,), d, dtype)
        assert not bool(jnp.any(sphere.off_sphere(x))), d
        # large raw vectors normalised, and a few rotations of them
        big = sphere.retract(1e3 * jax.random.normal(jax.random.PRNGKey(d), (50, d), dtype))
        rotated = sphere.plane_rotation(x, _tangent(d + 1, x), big)
        assert not bool(jnp.any(sphere.off_sphere(rotated))), d
    # float64 points cast to float32
    x64 = _points(3, (50,), 768)
    assert not bool(jnp.any(sphere.off_sphere(x64.astype(jnp.float32))))


def test_off_sphere_flags_rows():
    d = 16
    x = _points(4, (5,), d)
    tol = sphere.unit_tolerance(x.dtype, d)
    scaled = x * jnp.asarray([1.0, 1 + 0.5 * tol, 1 - 0.5 * tol, 1 + 2 * tol, 1 - 2 * tol])[:, None]
    np.testing.assert_array_equal(sphere.off_sphere(scaled), [False, False, False, True, True])
    assert sphere.off_sphere(scaled).shape == (5,)
    # the RMSNorm sphere, NaN, inf and zero rows are off the sphere
    bad = jnp.stack([np.sqrt(d) * x[0], x[1].at[0].set(jnp.nan), x[2].at[0].set(jnp.inf),
                     jnp.zeros(d)])
    assert bool(jnp.all(sphere.off_sphere(bad)))
    # an explicit tolerance
    assert not bool(sphere.off_sphere(1.01 * x[0], tol=0.02))
    with pytest.raises(ValueError, match="floating-point"):
        sphere.off_sphere(jnp.ones((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="scalar"):
        sphere.off_sphere(jnp.asarray(1.0))


def test_solve_and_vmf_share_the_definition():
    """A state just inside the tolerance is accepted by both, just outside refused by both."""
    from svflow_jax import vmf
    from svflow_jax.solvers import RetractedEuler, solve

    d = 5
    x = _points(5, (3,), d)
    mu = _points(6, (), d)
    tol = sphere.unit_tolerance(x.dtype, d)

    def zero(t, y, args):
        return jnp.zeros_like(y)

    inside, outside = (1 + 0.5 * tol) * x, (1 + 2 * tol) * x
    assert jnp.all(jnp.isfinite(vmf.logpdf(inside, mu, 2.0)))
    solve(zero, inside, 0.0, 1.0, solver=RetractedEuler(), num_steps=1)
    with pytest.raises(ValueError, match="unit sphere"):
        vmf.logpdf(outside, mu, 2.0)
    with pytest.raises(ValueError, match="unit vectors"):
        solve(zero, outside, 0.0, 1.0, solver=RetractedEuler(), num_steps=1)
