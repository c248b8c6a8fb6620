"""von Mises-Fisher: normaliser against mpmath, density against scipy and quadrature, sampler
against exact marginals and scipy's sampler, estimator round trips, float32, bad input.

Every expected value comes from an independent source: mpmath at 40 digits (Bessel functions),
scipy (``vonmises_fisher``, ``vonmises``), closed forms, quadrature, finite differences.
Arrays share a few fixed shapes on purpose: every new shape is a new XLA compilation, and
compilation dominates the run time of this file.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
import scipy.stats
from scipy.special import roots_legendre

from svflow_jax import sphere, vmf

mpmath.mp.dps = 40

D_GRID = [2, 3, 4, 5, 8, 10, 17, 32, 64, 100, 101, 255, 256, 512, 1000, 1023, 2048, 4095, 4096]
# kappa = 0 and 25 log-spaced values in [1e-6, 1e6]
KAPPAS = np.concatenate([[0.0], np.logspace(-6.0, 6.0, 25)])
# the branch switch (power series <-> recurrence at kappa = 2 sqrt 2) and a spread of others
SWITCH_KAPPAS = np.concatenate(
    [2 * math.sqrt(2) * (1 + np.array([-1e-9, 0.0, 1e-9])), np.logspace(-6, 6, 9)]
)
EPS = float(np.finfo(np.float64).eps)
EPS32 = float(jnp.finfo(jnp.float32).eps)


def _besseli(nu, x):
    # maxterms: the default gives up on e.g. nu ~ 2047, x ~ 3e4 (slow hypergeometric series).
    return mpmath.besseli(nu, x, maxterms=10**6)


def _mp_log_c(kappa: float, d: int):
    nu, k = mpmath.mpf(d) / 2 - 1, mpmath.mpf(float(kappa))
    half_d = mpmath.mpf(d) / 2
    if k == 0:  # -log |S^{d-1}| = log Gamma(d/2) - log 2 - (d/2) log pi
        return mpmath.loggamma(half_d) - mpmath.log(2) - half_d * mpmath.log(mpmath.pi)
    return nu * mpmath.log(k) - half_d * mpmath.log(2 * mpmath.pi) - mpmath.log(_besseli(nu, k))


def _mp_a(kappa: float, d: int):
    nu, k = mpmath.mpf(d) / 2 - 1, mpmath.mpf(float(kappa))
    if k == 0:
        return mpmath.mpf(0)
    return _besseli(nu + 1, k) / _besseli(nu, k)


def _rel(got, ref) -> float:
    return float(abs(mpmath.mpf(float(got)) - ref) / abs(ref))


def _unit(seed, d, dtype=jnp.float64):
    return sphere.uniform(jax.random.PRNGKey(seed), (), d, dtype)


def _slope(f, k):
    """Elementwise derivative of an elementwise function, by one forward-mode pass."""
    return jax.jvp(f, (k,), (jnp.ones_like(k),))[1]


# --------------------------------------------------------------------------------------------
# Normaliser, Bessel function, mean resultant length
# --------------------------------------------------------------------------------------------


def test_log_normalizer_matches_mpmath_on_the_grid():
    worst, worst_scaled, where = 0.0, 0.0, None
    for d in D_GRID:
        got = np.asarray(vmf.log_normalizer(jnp.asarray(KAPPAS), d))
        assert np.all(np.isfinite(got)), d
        for kappa, g in zip(KAPPAS, got, strict=True):
            ref = _mp_log_c(kappa, d)
            err = abs(mpmath.mpf(float(g)) - ref)
            worst_scaled = max(worst_scaled, float(err / max(abs(ref), 1)))
            if float(err / abs(ref)) > worst:
                worst, where = float(err / abs(ref)), (d, kappa)
    print(f"log C_d vs mpmath: worst relative error {worst:.2e} at (d, kappa) = {where}; "
          f"worst error / max(|log C|, 1) {worst_scaled:.2e}")
    assert worst <= 1e-10
    assert worst_scaled <= 1e-10


def test_log_normalizer_near_its_zero_crossing():
    """For d >= 20, log C_d has one zero, where the *relative* error is ill-conditioned.

    The absolute error must stay at round-off of the terms (~eps (d + kappa), times the ~10
    operations that add them); relative to max(|log C_d|, 1) it is then below 1e-10.
    """
    ds = [64, 1000, 4096]
    lo, hi = jnp.ones(3), jnp.full(3, 1e5)  # bisection (log C_d decreases in kappa) ...
    for _ in range(60):
        mid = jnp.sqrt(lo * hi)
        pos = vmf.log_normalizer(mid, jnp.asarray(ds)) > 0
        lo, hi = jnp.where(pos, mid, lo), jnp.where(pos, hi, mid)
    for d, k0 in zip(ds, np.asarray(lo), strict=True):  # ... then checked by mpmath
        kappas = k0 * (1.0 + np.array([-1e-3, -1e-7, 0.0, 1e-7, 1e-3]))
        got = np.asarray(vmf.log_normalizer(jnp.asarray(kappas), d))
        for kappa, g in zip(kappas, got, strict=True):
            ref = _mp_log_c(kappa, d)
            err = abs(mpmath.mpf(float(g)) - ref)
            assert float(err) <= 1e-14 * (d + kappa), (d, kappa, float(err))
            assert float(err / max(abs(ref), 1)) <= 1e-10


def test_log_normalizer_integer_array_d_matches_static_d():
    kappa = jnp.asarray(KAPPAS)[:, None]
    d_arr = jnp.asarray(D_GRID)
    static = np.stack([vmf.log_normalizer(KAPPAS, d) for d in D_GRID], axis=-1)
    a_static = np.stack([vmf.mean_resultant_length(KAPPAS, d) for d in D_GRID], axis=-1)
    got = vmf.log_normalizer(kappa, d_arr)
    assert got.shape == (len(KAPPAS), len(D_GRID))
    # same arithmetic, masked differently: agreement to round-off
    np.testing.assert_allclose(got, static, rtol=1e-14, atol=0)
    np.testing.assert_allclose(
        vmf.mean_resultant_length(kappa, d_arr), a_static, rtol=1e-14, atol=0
    )
    jitted = jax.jit(vmf.log_normalizer)(kappa, d_arr)  # d traced
    np.testing.assert_allclose(jitted, static, rtol=1e-14, atol=0)


@pytest.mark.parametrize("nu", [0.0, 0.5, 1.0, 7.5, 31.5, 32.0, 100.0, 1023.5, 2047.0])
def test_log_bessel_iv_matches_mpmath(nu):
    got = np.asarray(vmf.log_bessel_iv(nu, jnp.asarray(KAPPAS)))
    assert got[0] == (0.0 if nu == 0.0 else -np.inf)  # I_0(0) = 1, I_nu(0) = 0
    for kappa, g in zip(KAPPAS[1::2], got[1::2], strict=True):  # kappa = 1e-6, 1e-5, ..., 1e6
        ref = mpmath.log(_besseli(mpmath.mpf(nu), mpmath.mpf(float(kappa))))
        err = float(abs(mpmath.mpf(float(g)) - ref))
        # log I_nu crosses 0 for nu > 0: measure against max(|ref|, 1) there.
        scale = float(abs(ref)) if nu == 0.0 else max(float(abs(ref)), 1.0)
        assert err <= 1e-13 * scale, (nu, kappa, err / scale)


def test_log_bessel_iv_relative_accuracy_of_log_i0_near_zero():
    # log I_0(x) = x^2/4 - x^4/64 + ...: full relative accuracy, not just absolute. Power
    # series up to x = 2 sqrt 2; beyond it ~32 summed logs of size ~3 give ~1e-14 absolute
    # error, and |log I_0| >= 1.5 there.
    x = SWITCH_KAPPAS[SWITCH_KAPPAS < 10]
    got = np.asarray(vmf.log_bessel_iv(0, jnp.asarray(SWITCH_KAPPAS)))[SWITCH_KAPPAS < 10]
    for xi, g in zip(x, got, strict=True):
        assert _rel(g, mpmath.log(mpmath.besseli(0, mpmath.mpf(xi)))) <= 2e-14, xi


@pytest.mark.parametrize("d", [2, 3, 64, 65, 66, 1000, 4096])
def test_gradient_is_minus_mean_resultant_length(d):
    kappas = jnp.asarray(SWITCH_KAPPAS)
    grad = jax.vmap(jax.grad(lambda k: vmf.log_normalizer(k, d)))(kappas)
    a = vmf.mean_resultant_length(kappas, d)
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad, -a, rtol=1e-15, atol=0)  # the custom JVP is -A_d
    worst = max(_rel(ai, _mp_a(k, d)) for k, ai in zip(SWITCH_KAPPAS, np.asarray(a), strict=True))
    assert worst <= 1e-13, worst
    # central finite differences of the value (independent of the custom JVP), h = 1e-5 kappa:
    # truncation h^2 |f'''| / 6 ~ 1e-10 relative, round-off ~ eps |f| / h.
    h = 1e-5 * kappas
    fd = (vmf.log_normalizer(kappas + h, d) - vmf.log_normalizer(kappas - h, d)) / (2 * h)
    tol = 1e-7 * jnp.abs(grad) + 10 * EPS * jnp.abs(vmf.log_normalizer(kappas, d)) / h
    assert bool(jnp.all((jnp.abs(fd - grad) <= tol) | (kappas < 1e-3))), (fd, grad)


@pytest.mark.parametrize("d", [2, 3, 100, 4096])
def test_mean_resultant_length_limits_and_derivative(d):
    # kappa -> 0: A_d ~ kappa / d (next term kappa^3 / (d^2 (d + 2)))
    np.testing.assert_allclose(vmf.mean_resultant_length(1e-6, d), 1e-6 / d, rtol=1e-11)
    assert float(vmf.mean_resultant_length(0.0, d)) == 0.0
    # A_d' = 1 - A^2 - (d-1) A / kappa (the variance of mu^T x) by mpmath; 1/d at kappa = 0.
    # A_d' ~ (d-1) / (2 kappa^2) at large kappa, where any formula for it cancels: absolute
    # accuracy ~eps there, relative 1e-13 at moderate kappa.
    kappas = jnp.asarray(np.concatenate([[0.0], SWITCH_KAPPAS[1:]]))
    slope = _slope(lambda k: vmf.mean_resultant_length(k, d), kappas)
    for k, s in zip(np.asarray(kappas), np.asarray(slope), strict=True):
        a, kk = _mp_a(k, d), mpmath.mpf(float(k))
        ref = 1 / mpmath.mpf(d) if k == 0 else 1 - a**2 - (d - 1) * a / kk
        assert float(abs(s - ref)) <= 1e-15 + 1e-13 * float(abs(ref)), (k, s, float(ref))


def test_second_derivative_and_gradients_finite_everywhere():
    """grad and Hessian of log C_d, jitted and vmapped, at 0 and over 1e-8..1e7 (branch switches
    included), for static and integer-array d. The Hessian is -A_d' (checked by mpmath above)."""
    kappas = jnp.concatenate([jnp.zeros(1), jnp.logspace(-8, 7, 301), jnp.asarray(SWITCH_KAPPAS)])
    ds = (2, 65, 4096)  # 32 recurrence steps, 1 step at nu = 31.5, 1 step at nu = 2047
    d_arr = jnp.asarray(ds)

    @jax.jit
    def derivatives(k):
        out = []
        for d in ds:
            def f(kk, d=d):
                return vmf.log_normalizer(kk, d)

            out.append((jax.vmap(jax.grad(f))(k), jax.vmap(jax.grad(jax.grad(f)))(k)))
        g_arr = jax.vmap(jax.jacfwd(lambda kk: vmf.log_normalizer(kk, d_arr)))(k)
        return out, g_arr, vmf.mean_resultant_length(k[:, None], d_arr)

    out, g_arr, a_arr = derivatives(kappas)
    for d, (grad, hess) in zip(ds, out, strict=True):
        assert np.all(np.isfinite(grad)) and np.all(grad <= 0), d
        assert np.all(np.isfinite(hess)) and np.all(hess < 0), d  # -A_d' = -Var(mu^T x) < 0
        slope = _slope(lambda k, d=d: vmf.mean_resultant_length(k, d), kappas)
        # jit may fuse differently from eager mode; A_d' cancels at large kappa (absolute
        # accuracy ~eps, see above), so compare to 4 eps absolute.
        np.testing.assert_allclose(hess, -slope, rtol=1e-14, atol=4 * EPS)
    np.testing.assert_allclose(g_arr, -a_arr, rtol=1e-14, atol=0)
    # log I_nu: derivative nu/kappa + A, and 0 (not NaN) for nu = 0 at kappa = 0
    assert float(jax.grad(lambda k: vmf.log_bessel_iv(0, k))(0.0)) == 0.0
    gi = _slope(lambda k: vmf.log_bessel_iv(2.5, k), kappas[1:])
    ref = 2.5 / kappas[1:] + vmf.mean_resultant_length(kappas[1:], 7)
    np.testing.assert_allclose(gi, ref, rtol=1e-14)


def test_order_is_not_differentiable():
    with pytest.raises(ValueError, match="not differentiable"):
        jax.grad(lambda nu: vmf.log_bessel_iv(nu, 2.0))(1.5)


# --------------------------------------------------------------------------------------------
# Density and scores
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [2, 3, 5, 10, 50])
def test_logpdf_matches_scipy(d):
    kappas = np.array([1e-3, 1.0, 10.0, 100.0, 1000.0])
    mu = np.asarray(_unit(0, d))
    x = np.asarray(sphere.uniform(jax.random.PRNGKey(1), (7,), d))
    x = np.concatenate([x, mu[None]])  # include the mode
    got = vmf.logpdf(x, mu, kappas[:, None])
    assert got.shape == (5, 8)
    for kappa, g in zip(kappas, np.asarray(got), strict=True):
        ref = scipy.stats.vonmises_fisher(mu, kappa).logpdf(x)
        np.testing.assert_allclose(g, ref, rtol=1e-11, atol=1e-11 * (1 + kappa))


def test_logpdf_broadcasts():
    d = 4
    x = sphere.uniform(jax.random.PRNGKey(2), (5, 3), d)
    mu = sphere.uniform(jax.random.PRNGKey(3), (3,), d)
    kappa = jnp.asarray([0.5, 2.0, 30.0])
    got = vmf.logpdf(x, mu, kappa)
    assert got.shape == (5, 3)
    for j in range(3):
        ref = scipy.stats.vonmises_fisher(np.asarray(mu[j]), float(kappa[j])).logpdf(x[:, j])
        np.testing.assert_allclose(got[:, j], ref, rtol=1e-12)


@pytest.mark.parametrize("kappa", [0.0, 0.5, 10.0, 100.0])
def test_density_integrates_to_one_on_the_circle(kappa):
    # Periodic analytic integrand: the trapezoid rule converges geometrically.
    theta = jnp.linspace(0.0, 2 * jnp.pi, 2048, endpoint=False)
    x = jnp.stack([jnp.cos(theta), jnp.sin(theta)], -1)
    mu = jnp.asarray([math.cos(1.0), math.sin(1.0)])
    total = jnp.sum(jnp.exp(vmf.logpdf(x, mu, kappa))) * (2 * jnp.pi / theta.size)
    assert abs(float(total) - 1.0) <= 1e-13


@pytest.mark.parametrize("kappa", [0.0, 0.5, 10.0, 100.0])
def test_density_integrates_to_one_on_the_two_sphere(kappa):
    # Product rule in (cos theta, phi) about e3, with mu NOT aligned to e3, so the integrand is
    # genuinely two-dimensional: Gauss-Legendre in cos theta, trapezoid in phi.
    c, wc = roots_legendre(400)
    phi = np.linspace(0.0, 2 * np.pi, 800, endpoint=False)
    s = np.sqrt(1 - c**2)[:, None]
    x = np.stack(
        [s * np.cos(phi), s * np.sin(phi), np.broadcast_to(c[:, None], (400, 800))], -1
    )
    mu = np.asarray(_unit(4, 3))
    dens = np.exp(np.asarray(vmf.logpdf(x, mu, kappa)))
    total = np.sum(wc[:, None] * dens) * (2 * np.pi / phi.size)
    assert abs(total - 1.0) <= 1e-10


def test_scores_match_autodiff():
    d = 6
    x = sphere.uniform(jax.random.PRNGKey(5), (4, 3), d)
    mu = sphere.uniform(jax.random.PRNGKey(6), (3,), d)
    kappa = jnp.asarray([0.0, 1.5, 40.0])

    @jax.jit
    def grads(x, kappa):
        gx = jax.grad(lambda x: jnp.sum(vmf.logpdf(x, mu, kappa)))(x)
        gk = jax.grad(lambda k: jnp.sum(vmf.logpdf(x, mu, k)))(kappa)
        return gx, gk, vmf.euclidean_score(x, mu, kappa), vmf.riemannian_score(x, mu, kappa)

    grad_x, grad_k, eucl, riem = grads(x, kappa)
    assert eucl.shape == riem.shape == x.shape
    np.testing.assert_allclose(eucl, grad_x, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(riem, sphere.project_tangent(x, grad_x), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(jnp.sum(riem * x, -1), 0.0, atol=1e-13)
    # d/dkappa logpdf = mu^T x - A_d(kappa) (score of the natural parameter's length)
    ref = jnp.sum(jnp.sum(x * mu, -1) - vmf.mean_resultant_length(kappa, d), axis=0)
    np.testing.assert_allclose(grad_k, ref, rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------

N_SAMPLES = 20_000


def _draw(d, kappa, seed=0, dtype=jnp.float64):
    mu = _unit(100 + d, d, dtype)
    x = vmf.sample(jax.random.PRNGKey(seed), mu, kappa, (N_SAMPLES,))
    return mu, x, np.asarray(x @ mu, dtype=np.float64)


def _d3_cosine_cdf(kappa):
    """CDF of w = mu^T x for d = 3, where w has density proportional to e^{kappa w} on [-1, 1]."""
    if kappa == 0:
        return lambda t: (t + 1) / 2
    # (e^{kappa (t+1)} - 1) / (e^{2 kappa} - 1), multiplied through by e^{-2 kappa}
    return lambda t: np.exp(kappa * (t - 1)) * -np.expm1(-kappa * (t + 1)) / -np.expm1(
        -2 * kappa
    )


@pytest.mark.parametrize("d", [2, 3, 10, 100])
@pytest.mark.parametrize("kappa", [0.0, 0.5, 10.0, 1000.0])
def test_sample_moments_and_marginal(d, kappa):
    mu, x, w = _draw(d, kappa)
    assert x.shape == (N_SAMPLES, d) and x.dtype == jnp.float64
    assert float(sphere.norm_drift(x)) <= 1e-14
    a = float(_mp_a(kappa, d))
    # E[w] = A_d: the mean of w within 5 standard errors
    se = np.std(w) / math.sqrt(N_SAMPLES)
    assert abs(np.mean(w) - a) <= 5 * se, (np.mean(w), a, se)
    # mean direction: the tangent part of xbar is noise of size sqrt((1 - E w^2) / N), and
    # the mean resultant length |xbar| is A_d up to that noise and the error of mean(w).
    xbar = np.asarray(jnp.mean(x, 0))
    t_scale = math.sqrt((1 - np.mean(w**2)) / N_SAMPLES)
    tangent = np.linalg.norm(xbar - (xbar @ np.asarray(mu)) * np.asarray(mu))
    assert tangent <= 5 * t_scale
    assert abs(np.linalg.norm(xbar) - a) <= 5 * se + 5 * t_scale
    # the marginal of w: exact laws for d = 2 (von Mises angle) and d = 3 (w ~ e^{kappa w}),
    # scipy's independent sampler (two-sample KS) otherwise.
    if d == 2:
        perp = np.array([-mu[1], mu[0]])
        angle = np.arctan2(np.asarray(x) @ perp, w)
        p = scipy.stats.kstest(angle, scipy.stats.vonmises(kappa).cdf).pvalue
    elif d == 3:
        p = scipy.stats.kstest(w, _d3_cosine_cdf(kappa)).pvalue
    else:
        law = (
            scipy.stats.vonmises_fisher(np.asarray(mu), kappa)
            if kappa > 0
            else scipy.stats.uniform_direction(d)
        )
        ref = law.rvs(N_SAMPLES, random_state=np.random.default_rng(d))
        p = scipy.stats.ks_2samp(w, ref @ np.asarray(mu)).pvalue
    assert p > 1e-3, p


def test_sample_batched_parameters_jit_and_vmap():
    d = 5
    mu = sphere.uniform(jax.random.PRNGKey(7), (3,), d)
    kappa = jnp.asarray([1.0, 50.0, 2000.0])

    @jax.jit
    def draw(key):
        many = vmf.sample(key, mu, kappa, (4000, 3))  # mu, kappa broadcast along axis -1
        keys = jax.random.split(key, 4)
        per_key = jax.vmap(lambda k: vmf.sample(k, mu[0], 3.0, (10,)))(keys)
        return many, per_key

    x, xs = draw(jax.random.PRNGKey(8))
    assert x.shape == (4000, 3, d) and xs.shape == (4, 10, d)
    w = np.asarray(jnp.sum(x * mu, -1))
    for j in range(3):
        a = float(_mp_a(float(kappa[j]), d))
        assert abs(w[:, j].mean() - a) <= 5 * w[:, j].std() / math.sqrt(4000)


# --------------------------------------------------------------------------------------------
# Estimation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [2, 3, 10, 100, 4096])
def test_estimate_concentration_round_trip(d):
    kappas = np.logspace(-4, 5, 10)
    r = np.array([float(_mp_a(k, d)) for k in kappas])  # R from mpmath, not from our A_d
    est = vmf.estimate_concentration(jnp.asarray(r), d)
    a_prime = _slope(lambda k: vmf.mean_resultant_length(k, d), est)
    # conditioning of kappa(R): (dkappa/kappa) / (dR/R) = R / (kappa A_d'). The error in R
    # is its rounding (eps/2) plus that of our A_d inside Newton (<= ~5 eps measured): allow
    # 10 eps * cond.
    cond = r / (kappas * np.asarray(a_prime))
    rel = np.abs(np.asarray(est) / kappas - 1)
    print(f"d={d}: worst kappa round-trip {rel.max():.2e}, cond <= {cond.max():.1e}")
    assert np.all(rel <= 1e-12 + 10 * EPS * cond)
    assert np.all(rel[kappas <= 1e4] <= 1e-10)
    residual = np.abs(np.asarray(vmf.mean_resultant_length(est, d)) / r - 1)
    assert residual.max() <= 1e-14
    assert float(vmf.estimate_concentration(0.0, d)) == 0.0  # R = 0 -> kappa = 0
    # derivative dkappa/dR = 1 / A_d'(kappa) vs central finite differences, h = 1e-7
    r_mid, h = jnp.asarray(np.clip(r, 0.05, 0.95)), 1e-7
    fd = (vmf.estimate_concentration(r_mid + h, d) - vmf.estimate_concentration(r_mid - h, d))
    grad = _slope(lambda q: vmf.estimate_concentration(q, d), r_mid)
    np.testing.assert_allclose(grad, fd / (2 * h), rtol=1e-6)


@pytest.mark.parametrize(
    "d,kappa", [(2, 1000.0), (3, 0.5), (3, 10.0), (10, 10.0), (100, 1000.0)]
)
def test_fit_recovers_parameters(d, kappa):
    mu, x, _ = _draw(d, kappa, seed=11)
    mu_hat, kappa_hat = vmf.fit(x)
    a = float(_mp_a(kappa, d))
    a_prime = 1 - a**2 - (d - 1) * a / kappa
    # kappa_hat - kappa ~ (|xbar| - A) / A'; sd(|xbar|) ~ sqrt(A'/N), and the tangent noise
    # biases |xbar| by (1 - E w^2) / (2 N A) = (d-1) / (2 N kappa).
    sd = 1 / math.sqrt(N_SAMPLES * a_prime)
    bias = (d - 1) / (2 * N_SAMPLES * kappa) / a_prime
    assert abs(float(kappa_hat) - kappa - bias) <= 5 * sd, (float(kappa_hat), kappa, sd, bias)
    # angle(mu_hat, mu) ~ |tangent part of xbar| / A ~ sqrt((d-1) A / (kappa N)) / A
    angle = float(sphere.geodesic_distance(mu_hat, mu))
    assert angle <= 5 * math.sqrt((d - 1) * a / (kappa * N_SAMPLES)) / a
    # batched: (..., n, d)
    mus, kappas = vmf.fit(jnp.stack([x, x[::-1]]))
    assert mus.shape == (2, d) and kappas.shape == (2,)
    np.testing.assert_allclose(kappas, kappa_hat, rtol=1e-10)


# --------------------------------------------------------------------------------------------
# float32
# --------------------------------------------------------------------------------------------


def test_float32_log_normalizer():
    """float32 tolerance: the computation adds ~50 rounded terms whose sizes are bounded by
    ``scale = (d/2) log(2 pi) + kappa + |log C_d| + 1``, so we require
    ``|err| <= 64 eps32 * scale``; the reference is float64 at the same (float32-rounded)
    kappa, itself checked against mpmath above. A_d: relative 64 eps32."""
    k32 = jnp.asarray(KAPPAS, jnp.float32)
    worst = 0.0
    for d in [2, 3, 10, 17, 66, 100, 1000, 4096]:
        got = vmf.log_normalizer(k32, d)
        assert got.dtype == jnp.float32 and np.all(np.isfinite(got))
        ref = np.asarray(vmf.log_normalizer(k32.astype(jnp.float64), d))
        scale = d / 2 * math.log(2 * math.pi) + np.asarray(k32, float) + np.abs(ref) + 1
        err = np.abs(np.asarray(got, float) - ref)
        worst = max(worst, float(np.max(err / scale)))
        assert np.all(err <= 64 * EPS32 * scale), d
        a32 = vmf.mean_resultant_length(k32, d)
        a64 = vmf.mean_resultant_length(k32.astype(jnp.float64), d)
        np.testing.assert_allclose(a32, a64, rtol=64 * EPS32, atol=0)
    print(f"float32 log C_d: worst |err| / scale = {worst:.2e} (eps32 = {EPS32:.2e})")


@pytest.mark.parametrize("d,kappa", [(3, 10.0), (3, 1e6), (100, 1e4)])
def test_float32_sample(d, kappa):
    mu, x, w = _draw(d, np.float32(kappa), seed=3, dtype=jnp.float32)
    assert x.dtype == jnp.float32
    # unit norm to float32 round-off of a d-vector
    assert float(sphere.norm_drift(x)) <= 4 * math.sqrt(d) * EPS32
    a = float(_mp_a(kappa, d))
    assert abs(np.mean(w) - a) <= 5 * np.std(w) / math.sqrt(N_SAMPLES) + 4 * EPS32
    # E |P_mu x|^2 = 1 - E[w^2] = (d - 1) A_d / kappa. At kappa = 1e6 this is 2e-6, only ~30
    # float32 ulps of w near 1: it tests the cancellation-free form of the sampler.
    x64, mu64 = np.asarray(x, np.float64), np.asarray(mu, np.float64)
    t2 = np.sum((x64 - (x64 @ mu64)[:, None] * mu64) ** 2, -1)
    expected = (d - 1) * a / kappa
    assert abs(t2.mean() - expected) <= 5 * t2.std() / math.sqrt(N_SAMPLES) + 1e-3 * expected


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def test_bad_input_raises():
    mu3 = np.array([0.0, 0.0, 1.0])
    x3 = np.array([[1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="d >= 2"):
        vmf.log_normalizer(1.0, 1)
    with pytest.raises(ValueError, match="d >= 2"):
        vmf.log_normalizer(1.0, jnp.asarray([3, 1]))
    with pytest.raises(ValueError, match="integer"):
        vmf.log_normalizer(1.0, 2.5)
    with pytest.raises(ValueError, match="kappa must be >= 0"):
        vmf.log_normalizer(-1.0, 3)
    with pytest.raises(ValueError, match="kappa contains NaN"):
        vmf.log_normalizer(jnp.asarray([1.0, jnp.nan]), 3)
    with pytest.raises(ValueError, match="finite"):
        vmf.mean_resultant_length(jnp.inf, 3)
    with pytest.raises(ValueError, match="nu must be finite and >= 0"):
        vmf.log_bessel_iv(-0.5, 1.0)
    with pytest.raises(ValueError, match="x contains NaN"):
        vmf.logpdf(np.array([[np.nan, 0.0, 1.0]]), mu3, 1.0)
    with pytest.raises(ValueError, match="same last axis"):
        vmf.logpdf(x3, np.array([0.0, 1.0]), 1.0)
    with pytest.raises(ValueError, match="unit sphere"):
        vmf.logpdf(2 * x3, mu3, 1.0)
    with pytest.raises(ValueError, match="mu must lie on the unit sphere"):
        vmf.riemannian_score(x3, 2 * mu3, 1.0)
    with pytest.raises(ValueError, match="kappa must be >= 0"):
        vmf.euclidean_score(x3, mu3, -3.0)
    with pytest.raises(ValueError, match="d >= 2"):
        vmf.sample(jax.random.PRNGKey(0), np.array([1.0]), 1.0, (3,))
    with pytest.raises(ValueError, match="kappa contains NaN"):
        vmf.sample(jax.random.PRNGKey(0), mu3, np.nan, (3,))
    with pytest.raises(ValueError, match="broadcast"):
        vmf.sample(jax.random.PRNGKey(0), np.stack([mu3, mu3]), 1.0, (3,))
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        vmf.estimate_concentration(1.0, 3)
    with pytest.raises(ValueError, match="shape"):
        vmf.fit(mu3)


def test_bad_input_raises_under_jit():
    f = eqx.filter_jit(lambda k: vmf.log_normalizer(k, 3))
    assert np.isfinite(f(jnp.asarray(2.0)))
    with pytest.raises(Exception, match="kappa must be >= 0"):
        jax.block_until_ready(f(jnp.asarray(-2.0)))
    g = eqx.filter_jit(vmf.logpdf)
    with pytest.raises(Exception, match="unit sphere"):
        jax.block_until_ready(g(jnp.asarray([0.0, 2.0]), jnp.asarray([1.0, 0.0]), 1.0))
    with pytest.raises(ValueError, match="same last axis"):  # shapes are static: plain ValueError
        g(jnp.ones((2, 3)) / math.sqrt(3), jnp.asarray([1.0, 0.0]), 1.0)
