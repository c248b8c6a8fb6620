# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 1. The sphere and the von Mises-Fisher distribution
#
# SVFlow reads a Transformer as an ODE for $n$ tokens $x_1, \dots, x_n$, each a point of the
# unit sphere $S^{d-1} \subset \mathbb{R}^d$. (RMSNorm without gain puts hidden states on the
# sphere of radius $\sqrt{d}$: the same sphere, rescaled.) The vector field of that ODE is built
# from **scores of von Mises-Fisher (vMF) distributions**, the Gaussians of the sphere. This
# notebook is about those two ingredients:
#
# 1. the geometry of $S^{d-1}$: tangent spaces, the retraction $R(y) = y/|y|$, exponential and
#    logarithm maps, a geodesic distance that keeps its digits;
# 2. the vMF density and its normaliser $C_d(\kappa)$;
# 3. scores: the gradient of a log-density, drawn as tangent arrows;
# 4. mixtures: the posterior over components is a **softmax** (the one inside attention), and
#    the score of the mixture is the posterior expectation of the component scores;
# 5. the normaliser in high dimension ($d$ up to 4096), where naive formulas overflow.
#
# Everything runs in float64 on a CPU.

# %%
# ruff: noqa: E402
# (float64 must be switched on before anything creates a JAX array, hence imports below it)
import math
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import matplotlib
import numpy as np

if "ipykernel" not in sys.modules:  # run as a script: render off-screen
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

from svflow_jax import sphere, vmf

print("float64 on:", jnp.zeros(()).dtype == jnp.float64)

# %% [markdown]
# ## 1. The geometry of $S^{d-1}$
#
# At a point $x$ ($|x| = 1$) the tangent space is $T_x S^{d-1} = \{v : x^\top v = 0\}$ and
#
# $$P_x = I - x x^\top$$
#
# is the orthogonal projection onto it. Two ways of moving from $x$ along a tangent vector $w$:
#
# * the **retraction** $R(x + w) = \dfrac{x + w}{|x + w|}$: step in $\mathbb{R}^d$, then
#   normalise. This is what a normalisation layer does.
# * the **exponential map** $\exp_x(w) = \cos|w|\, x + \sin|w|\, \dfrac{w}{|w|}$: walk a
#   distance $|w|$ along the great circle. Its inverse is $\log_x(y)$.
#
# Both go along the same great circle; $R(x + w)$ stops at angle $\arctan|w|$ instead of $|w|$,
# so they differ by $|w| - \arctan|w| = |w|^3/3 + O(|w|^5)$. A retraction agrees with the
# exponential map to second order, which is why a normalisation layer is as good a
# "step on the sphere" as a geodesic one (notebook 4 measures it).
#
# The geodesic distance $\theta = \arccos(x^\top y)$ is a trap in floating point: near
# $\theta = 0$, $x^\top y = 1 - \theta^2/2$ rounds, and $\theta$ keeps only half of its digits
# (none below $\theta \approx 10^{-8}$). The library uses
# $\theta = 2\,\mathrm{atan2}(|x - y|, |x + y|)$, which is accurate everywhere.

# %%
rng = np.random.default_rng(0)
d = 5
x = sphere.retract(jnp.asarray(rng.standard_normal(d)))
v = sphere.project_tangent(x, jnp.asarray(rng.standard_normal(d)))
y = sphere.exp_map(x, 0.7 * v / jnp.linalg.norm(v))

tangency = float(jnp.abs(x @ v))
roundtrip = float(jnp.max(jnp.abs(sphere.exp_map(x, sphere.log_map(x, y)) - y)))
print(f"x . P_x v                  = {tangency:.1e}")
print(f"|exp_x(log_x y) - y|       = {roundtrip:.1e}")
print(f"geodesic distance |log_x y| = {float(jnp.linalg.norm(sphere.log_map(x, y))):.15f}"
      f"  (we walked 0.7)")

# Retraction against exponential map, along one tangent direction.
e = v / jnp.linalg.norm(v)
steps = jnp.logspace(-4, 0, 30)
gap = sphere.geodesic_distance(sphere.retract(x + steps[:, None] * e),
                               sphere.exp_map(x, steps[:, None] * e))
retraction_slope = np.polyfit(np.log(steps[:20]), np.log(gap[:20]), 1)[0]

# arccos against the atan2 form, for two points at a known angle theta.
theta = jnp.logspace(-12, 0, 60)
p0 = jnp.array([1.0, 0.0, 0.0])
p1 = jnp.stack([jnp.cos(theta), jnp.sin(theta), jnp.zeros_like(theta)], axis=-1)
err_atan2 = jnp.abs(sphere.geodesic_distance(p0, p1) - theta) / theta
err_arccos = jnp.abs(jnp.arccos(jnp.clip(p1 @ p0, -1, 1)) - theta) / theta

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
ax1.loglog(steps, gap, "o-", ms=3, label=r"$d(R(x + t e), \exp_x(t e))$")
ax1.loglog(steps, steps**3 / 3, "k--", lw=1, label=r"$t^3/3$")
ax1.set(xlabel="step length $t$", ylabel="geodesic distance",
        title=f"retraction vs exponential map: slope {retraction_slope:.2f}")
ax1.legend()
ax2.loglog(theta, np.maximum(err_arccos, 1e-17), "o-", ms=3, label=r"$\arccos(x^\top y)$")
ax2.loglog(theta, np.maximum(err_atan2, 1e-17), "s-", ms=3,
           label=r"$2\,\mathrm{atan2}(|x-y|, |x+y|)$")
ax2.set(xlabel=r"true angle $\theta$", ylabel="relative error (floored at 1e-17)",
        title="two formulas for the geodesic distance")
ax2.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 2. The von Mises-Fisher distribution
#
# $$\mathrm{vMF}(x; \mu, \kappa) = C_d(\kappa)\, e^{\kappa \mu^\top x}, \qquad
# C_d(\kappa) = \frac{\kappa^{d/2 - 1}}{(2\pi)^{d/2} I_{d/2-1}(\kappa)},$$
#
# with mean direction $\mu$, concentration $\kappa \ge 0$ ($\kappa = 0$: uniform) and natural
# parameter $\eta = \kappa\mu$. Near the mode, with $\theta$ the angle to $\mu$,
# $\kappa\mu^\top x = \kappa - \kappa\theta^2/2 + \dots$: a Gaussian in the tangent plane with
# variance $1/\kappa$ per direction. On $S^2$ ($d = 3$) the normaliser is elementary,
# $C_3(\kappa) = \kappa / (4\pi \sinh\kappa)$.
#
# Below: the density on $S^2$ for four concentrations, as a coloured sphere and on the
# Mollweide projection (equal-area, so the colour mass you see is probability mass), with
# samples drawn by Wood's rejection sampler (`vmf.sample`).

# %%
kappas = jnp.array([1.0, 4.0, 16.0, 64.0])
mu = jnp.array([0.0, 0.0, 1.0])


def sphere_points(lat, lon):
    """Unit vectors from latitude/longitude grids (radians)."""
    return jnp.stack([jnp.cos(lat) * jnp.cos(lon), jnp.cos(lat) * jnp.sin(lon), jnp.sin(lat)], -1)


lat3, lon3 = np.meshgrid(np.linspace(-np.pi / 2, np.pi / 2, 30), np.linspace(-np.pi, np.pi, 60),
                         indexing="ij")
latm, lonm = np.meshgrid(np.linspace(-np.pi / 2, np.pi / 2, 90), np.linspace(-np.pi, np.pi, 180),
                         indexing="ij")
grid3, gridm = sphere_points(lat3, lon3), sphere_points(latm, lonm)
dens3 = jnp.exp(vmf.logpdf(grid3[None], mu, kappas[:, None, None]))
densm = jnp.exp(vmf.logpdf(gridm[None], mu, kappas[:, None, None]))
samples = vmf.sample(jax.random.key(0), mu, kappas[:, None], (4, 10000))


def draw_sphere(ax, colours=None, alpha=1.0):
    """A unit sphere (optionally coloured), equal aspect, no axes."""
    xs, ys, zs = (np.asarray(c) for c in jnp.moveaxis(grid3, -1, 0))
    if colours is None:
        ax.plot_wireframe(xs, ys, zs, color="0.75", lw=0.3, rstride=4, cstride=4)
    else:
        ax.plot_surface(xs, ys, zs, facecolors=colours, rstride=1, cstride=1, linewidth=0,
                        antialiased=False, shade=False, alpha=alpha)
    ax.set_box_aspect((1, 1, 1), zoom=1.25)
    ax.set_axis_off()


def facing(points, elev, azim, margin=0.2):
    """Mask of the points on the side of the sphere that a 3-D view (elev, azim) shows."""
    el, az = np.radians(elev), np.radians(azim)
    camera = np.array([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)])
    return np.asarray(points) @ camera > -margin


fig = plt.figure(figsize=(14, 6.5))
for i, k in enumerate(np.asarray(kappas)):
    ax = fig.add_subplot(2, 4, i + 1, projection="3d")
    p = np.asarray(dens3[i])
    draw_sphere(ax, plt.cm.viridis(p / p.max()))
    ax.view_init(elev=20, azim=-60)
    ax.set_title(rf"$\kappa = {k:g}$, max density {p.max():.2f}")
    ax = fig.add_subplot(2, 4, i + 5, projection="mollweide")
    ax.pcolormesh(lonm, latm, np.asarray(densm[i]), cmap="viridis", shading="auto")
    s = np.asarray(samples[i, :300])
    ax.scatter(np.arctan2(s[:, 1], s[:, 0]), np.arcsin(np.clip(s[:, 2], -1, 1)), s=2, c="w",
               alpha=0.6)
    ax.set_xticklabels([])
    ax.set_yticklabels([])
fig.suptitle(r"vMF$(x; \mu = $ north pole$, \kappa)$ on $S^2$: surface colour and Mollweide "
             "map (equal-area), with 300 samples")
fig.tight_layout()
plt.show()

# %% [markdown]
# Three checks of what we just drew:
#
# * the density integrates to 1: with $\mu$ the north pole it depends on $t = \mu^\top x$
#   only, and $\int_{S^2} p = 2\pi \int_{-1}^1 C_3(\kappa) e^{\kappa t}\, dt$, which a 200-point
#   Gauss-Legendre rule computes to round-off;
# * `log_normalizer(kappa, 3)` equals $\log(\kappa / (4\pi\sinh\kappa))$;
# * the mean resultant length $E[\mu^\top x] = A_d(\kappa) = I_{d/2}(\kappa)/I_{d/2-1}(\kappa)$
#   (for $d = 3$: $\coth\kappa - 1/\kappa$) matches the samples, and `vmf.fit` recovers
#   $\kappa$ from them.

# %%
nodes, weights = np.polynomial.legendre.leggauss(200)
log_c3 = vmf.log_normalizer(kappas, 3)
mass = 2 * np.pi * np.exp(np.asarray(log_c3)[:, None] + np.outer(kappas, nodes)) @ weights
closed_form = np.log(np.asarray(kappas) / (4 * np.pi * np.sinh(np.asarray(kappas))))
mass_error = float(np.max(np.abs(mass - 1)))
log_c3_error = float(np.max(np.abs(np.asarray(log_c3) - closed_form) / np.abs(closed_form)))

a3 = vmf.mean_resultant_length(kappas, 3)
cos_mu = samples @ mu  # (4, 10000) values of mu^T x
sampled_a3 = jnp.mean(cos_mu, axis=1)
sigmas = jnp.abs(sampled_a3 - a3) / (jnp.std(cos_mu, axis=1) / math.sqrt(cos_mu.shape[1]))
_, fitted_kappa = vmf.fit(samples)
print(f"integral of the density - 1 : {mass_error:.1e}")
print(f"log C_3 vs closed form (rel): {log_c3_error:.1e}")
for k, a, sa, sg, fk in zip(kappas, a3, sampled_a3, sigmas, fitted_kappa, strict=True):
    print(f"kappa={float(k):5.1f}  A_3={float(a):.4f}  sample mean={float(sa):.4f} "
          f"({float(sg):.1f} sigma)  fitted kappa={float(fk):7.3f}")

# %% [markdown]
# ## 3. Scores are tangent vectors
#
# The **score** of a density is the gradient of its log. For the vMF the Euclidean gradient is
# constant, $\nabla_x \log \mathrm{vMF} = \kappa\mu = \eta$: the natural parameter. On the
# sphere only its tangent part matters; the Riemannian score is
#
# $$\operatorname{grad}_x \log \mathrm{vMF}(x; \mu, \kappa) = P_x\, \kappa\mu
#   = \kappa\big(\mu - (\mu^\top x)\, x\big),$$
#
# of length $\kappa\sin\theta$, pointing along the great circle towards $\mu$: it vanishes at the
# mode and at the anti-mode. Left, the Euclidean score (the same arrow everywhere, sticking out
# of the sphere); right, its projection (tangent arrows, a flow towards the mode).

# %%
def fibonacci_sphere(m):
    """m roughly evenly spread points on S^2."""
    i = np.arange(m) + 0.5
    z = 1 - 2 * i / m
    phi = np.pi * (1 + 5**0.5) * i
    r = np.sqrt(1 - z**2)
    return jnp.asarray(np.stack([r * np.cos(phi), r * np.sin(phi), z], -1))


kappa_s = 4.0
pts = fibonacci_sphere(160)
euclid = vmf.euclidean_score(pts, mu, kappa_s)
riem = vmf.riemannian_score(pts, mu, kappa_s)
# The Riemannian score is the projected gradient of logpdf (jax.grad through the normaliser):
grad_logpdf = jax.vmap(jax.grad(lambda x: vmf.logpdf(x, mu, kappa_s)))(pts)
score_vs_grad = float(jnp.max(jnp.abs(sphere.project_tangent(pts, grad_logpdf) - riem)))
score_tangency = float(jnp.max(jnp.abs(jnp.sum(pts * riem, axis=-1))))
print(f"max |x . score|                  = {score_tangency:.1e}")
print(f"max |P_x grad logpdf - score|    = {score_vs_grad:.1e}")

dens_s = np.exp(np.asarray(vmf.logpdf(grid3, mu, kappa_s)))
fig = plt.figure(figsize=(11, 5))
for j, (vec, title) in enumerate([(euclid, r"Euclidean score $\kappa\mu$"),
                                   (riem, r"Riemannian score $P_x \kappa\mu$")]):
    ax = fig.add_subplot(1, 2, j + 1, projection="3d")
    draw_sphere(ax, plt.cm.Blues(0.15 + 0.6 * dens_s / dens_s.max()), alpha=0.35)
    front = facing(pts, elev=15, azim=-60)  # arrows on the visible side only
    P, V = np.asarray(pts)[front], np.asarray(vec)[front] / kappa_s * 0.35
    ax.quiver(P[:, 0], P[:, 1], P[:, 2], V[:, 0], V[:, 1], V[:, 2], color="C3", lw=0.8,
              arrow_length_ratio=0.3)
    ax.scatter(*np.asarray(mu), color="k", s=30)
    ax.view_init(elev=15, azim=-60)
    ax.set_title(title + rf", $\kappa = {kappa_s:g}$")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 4. A mixture: the posterior is a softmax
#
# Take $K$ components with weights $\pi_z$, mean directions $\mu_z$ and a **shared**
# concentration $\kappa$: $p(x) = \sum_z \pi_z \mathrm{vMF}(x; \mu_z, \kappa)$. Bayes' rule gives
# the posterior over the latent component,
#
# $$q(z \mid x) = \frac{\pi_z C_d(\kappa)\, e^{\kappa\mu_z^\top x}}
#   {\sum_{z'} \pi_{z'} C_d(\kappa)\, e^{\kappa\mu_{z'}^\top x}}
#   = \operatorname{softmax}_z\big(\kappa\, \mu_z^\top x + \log\pi_z\big):$$
#
# the normalisers cancel and what is left is the softmax of attention, with $x$ as the query,
# the $\mu_z$ as keys and $\kappa$ as inverse temperature. The score of the mixture is
# (Fisher's identity)
#
# $$\nabla_x \log p(x) = \sum_z q(z \mid x)\, \nabla_x \log p(x \mid z)
#   = \mathbb{E}_{q(z \mid x)}[\kappa\mu_z],$$
#
# the posterior expectation of the component scores. Projected onto the tangent space, this is
# exactly the SVFlow field $v(x) = \mathbb{E}_{q(z|x)}[\operatorname{grad}_x \log p(x \mid z)]$
# with the *true* posterior; in a Transformer the posterior is a learned (variational) one.
#
# (With unequal $\kappa_z$ the normalisers do not cancel: $\log C_d(\kappa_z)$ becomes a
# per-component bias, and in high dimension it is huge, see section 5.)

# %%
mus = sphere.retract(jnp.array([[1.0, 0.2, 0.5], [-0.6, 0.9, 0.1], [-0.3, -0.8, -0.6]]))
log_pi = jnp.log(jnp.array([0.5, 0.3, 0.2]))
kappa_m = 6.0


def log_mixture(x):
    """log p(x) by brute force: log sum_z pi_z vMF(x; mu_z, kappa)."""
    return jax.nn.logsumexp(log_pi + vmf.logpdf(x[..., None, :], mus, kappa_m), axis=-1)


def posterior(x):
    """q(z | x) as attention computes it: a softmax of kappa mu_z . x + log pi_z."""
    return jax.nn.softmax(kappa_m * x @ mus.T + log_pi, axis=-1)


bayes = jnp.exp(log_pi + vmf.logpdf(gridm[..., None, :], mus, kappa_m) - log_mixture(gridm)[
    ..., None])
softmax_error = float(jnp.max(jnp.abs(bayes - posterior(gridm))))
field = sphere.project_tangent(pts, posterior(pts) @ (kappa_m * mus))  # P_x E_q[kappa mu_z]
fisher = sphere.project_tangent(pts, jax.vmap(jax.grad(log_mixture))(pts))
fisher_error = float(jnp.max(jnp.abs(field - fisher)))
print(f"Bayes posterior vs softmax       : {softmax_error:.1e}")
print(f"grad log p(x) vs E_q[score]      : {fisher_error:.1e}")

fig = plt.figure(figsize=(13, 5))
ax = fig.add_subplot(1, 2, 1, projection="mollweide")
rgb = np.asarray(posterior(gridm))  # one colour channel per component
ax.pcolormesh(lonm, latm, rgb, shading="auto")
for z, m in enumerate(np.asarray(mus)):
    ax.plot(np.arctan2(m[1], m[0]), np.arcsin(m[2]), "w*", ms=12, mec="k")
    ax.annotate(rf"$\mu_{z + 1}$", (np.arctan2(m[1], m[0]), np.arcsin(m[2])), color="w",
                xytext=(6, 6), textcoords="offset points")
ax.set_xticklabels([])
ax.set_yticklabels([])
ax.set_title(r"posterior $q(z \mid x)$ as RGB: a soft partition of the sphere")
ax = fig.add_subplot(1, 2, 2, projection="3d")
mix = np.exp(np.asarray(log_mixture(grid3)))
draw_sphere(ax, plt.cm.magma(0.2 + 0.75 * mix / mix.max()), alpha=0.6)
front = facing(pts, elev=20, azim=65, margin=0.1)
P, V = np.asarray(pts)[front], 0.07 * np.asarray(field)[front]
ax.quiver(P[:, 0], P[:, 1], P[:, 2], V[:, 0], V[:, 1], V[:, 2], color="k", lw=0.7,
          arrow_length_ratio=0.3)
m = np.asarray(mus)[facing(mus, elev=20, azim=65, margin=0.0)]
ax.scatter(*(1.02 * m).T, marker="*", s=120, color="w", edgecolors="k", depthshade=False)
ax.view_init(elev=20, azim=65)
ax.set_title(r"mixture density and its score $P_x\, \mathbb{E}_q[\kappa\mu_z]$ (*: modes)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. The normaliser in high dimension
#
# Hidden states of real models live in $d$ = 768 to 8192 dimensions. There
# $\log C_d(\kappa) = (d/2 - 1)\log\kappa - (d/2)\log 2\pi - \log I_{d/2-1}(\kappa)$ cannot be
# computed from $I_\nu$ itself: $I_{2047}(1) \approx 10^{-6500}$ underflows and
# $I_\nu(10^4) \approx e^{10^4}$ overflows (`np.exp(1e3)` is already `inf`). `vmf.log_normalizer`
# combines Debye's uniform asymptotic expansion, a backward recurrence in ratio form and a power
# series, and stays finite and accurate for $2 \le d \le 4096$ and $0 \le \kappa \le 10^6$.
#
# Three facts to read off the plots:
#
# * $\log C_d(0) - \log C_d(\kappa) = \log \mathbb{E}_{\text{uniform}}[e^{\kappa\mu^\top x}]$ is
#   the cumulant generating function of $\mu^\top x$ under the uniform law: $\approx
#   \kappa^2/(2d)$ for small $\kappa$ (the variance of $\mu^\top x$ is $1/d$), and $\kappa$ minus
#   a logarithm for large $\kappa$. From $\log I_\nu(\kappa) = \kappa - \tfrac12\log(2\pi\kappa)
#   \,-\, \frac{4\nu^2 - 1}{8\kappa} + O(\kappa^{-2})$ (Hankel's expansion, $\nu = d/2 - 1$ fixed),
#
#   $$\log C_d(\kappa) = -\kappa + \frac{d-1}{2}\log\frac{\kappa}{2\pi}
#     + \frac{(d-1)(d-3)}{8\kappa} + O(\kappa^{-2}), \qquad \kappa \gg d^2:$$
#
#   $\log C_d$ falls like $-\kappa$, but the $\frac{d-1}{2}\log\kappa$ term pulls it back up
#   (the density's peak $C_d(\kappa) e^{\kappa}$ grows like $\kappa^{(d-1)/2}$, a Gaussian of
#   variance $1/\kappa$ in $d - 1$ tangent directions), so the left-hand curves approach the line
#   $\kappa$ only relatively, at a distance $\frac{d-1}{2}\log\kappa$ + const. The expansion needs
#   $\kappa \gg d^2$: for $d = 4096$ not even $\kappa = 10^6$ is asymptotic. We check it below.
#   And $\log C_d(0) = -\log|S^{d-1}|$ is large and *positive* for large $d$ (the unit sphere of
#   $\mathbb{R}^{4096}$ has a tiny area).
# * $\dfrac{d}{d\kappa}\log C_d(\kappa) = -A_d(\kappa)$, the mean resultant length
#   $E[\mu^\top x]$, which `jax.grad` reproduces.
# * $A_d$ depends on $\kappa$ mainly through $\kappa/d$: a vMF in $d = 4096$ with $\kappa = 100$
#   is almost uniform ($A_d \approx 0.024$). Concentration is measured in units of $d$. With
#   $\nu = d/2 - 1$, Amos's bounds hold:
#   $\dfrac{\kappa}{\nu + 1 + \sqrt{\kappa^2 + (\nu+1)^2}} \le A_d(\kappa)
#   \le \dfrac{\kappa}{\nu + \frac12 + \sqrt{\kappa^2 + (\nu+\frac12)^2}}$.

# %%
ds = np.array([3, 8, 32, 128, 512, 4096])
kap = np.logspace(-3, 6, 250)
log_c = np.asarray(vmf.log_normalizer(jnp.asarray(kap)[None], jnp.asarray(ds)[:, None]))
log_c0 = np.asarray(vmf.log_normalizer(jnp.zeros(len(ds)), jnp.asarray(ds)))
a_d = np.asarray(vmf.mean_resultant_length(jnp.asarray(kap)[None], jnp.asarray(ds)[:, None]))

# -log |S^{d-1}| = lgamma(d/2) - log 2 - (d/2) log pi
log_area = np.array([math.log(2) + (k / 2) * math.log(math.pi) - math.lgamma(k / 2) for k in ds])
sphere_area_error = float(np.max(np.abs(log_c0 + log_area) / np.abs(log_area)))

# d/dkappa log C_d = -A_d, by autodiff, for a few (kappa, d) pairs (d as an array: one program)
k_test, d_test = jnp.array([0.5, 10.0, 1e3, 5e3, 2e5]), jnp.array([3, 64, 4096, 4096, 512])
dlogc = jax.vmap(jax.grad(vmf.log_normalizer))(k_test, d_test)
a_test = vmf.mean_resultant_length(k_test, d_test)
derivative_error = float(jnp.max(jnp.abs(dlogc + a_test) / a_test))

nu = ds[:, None] / 2 - 1
amos_lower = kap / (nu + 1 + np.sqrt(kap**2 + (nu + 1) ** 2))
amos_upper = kap / (nu + 0.5 + np.sqrt(kap**2 + (nu + 0.5) ** 2))
kappa_back = np.asarray(vmf.estimate_concentration(jnp.asarray(a_d), jnp.asarray(ds)[:, None]))
invertible = (a_d > 1e-6) & (a_d < 1 - 1e-6)  # where A_d carries enough digits to invert
inversion_error = float(np.max(np.abs(kappa_back / kap - 1)[invertible]))
# Large kappa: log C_d = -kappa + ((d-1)/2) log(kappa / 2 pi) + (d-1)(d-3)/(8 kappa) + ...,
# checked where kappa >= 100 d^2 (the next term is then O(d^4 / kappa^2) <= ~1e-4).
big = kap[None, :] >= 100 * ds[:, None] ** 2
leading = -kap[None, :] + (ds[:, None] - 1) / 2 * np.log(kap[None, :] / (2 * np.pi))
next_term = (ds[:, None] - 1) * (ds[:, None] - 3) / (8 * kap[None, :])
asymptotic_error = float(np.max(np.abs(log_c - leading - next_term)[big]))
without_log_term = float(np.min(np.abs(log_c + kap[None, :])[big & (ds[:, None] > 3)]))
print(f"log C_d(0) vs -log|S^(d-1)| (rel): {sphere_area_error:.1e}")
print(f"large-kappa expansion (abs)      : {asymptotic_error:.1e} "
      f"(log C_d + kappa alone is off by >= {without_log_term:.1f})")
print(f"d/dkappa log C_d + A_d (rel)     : {derivative_error:.1e}")
print(f"kappa -> A_d -> kappa (rel)      : {inversion_error:.1e}")
print("log C_d(0) =", dict(zip(ds.tolist(), np.round(log_c0, 1).tolist(), strict=True)))

fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
colours = plt.cm.plasma(np.linspace(0, 0.85, len(ds)))
for i, dd in enumerate(ds):
    axes[0].loglog(kap, log_c0[i] - log_c[i], color=colours[i], label=f"d = {dd}")
    axes[1].semilogx(kap, log_c[i], color=colours[i], label=f"d = {dd}")
    axes[2].semilogx(kap / dd, a_d[i], color=colours[i], label=f"d = {dd}")
    axes[2].fill_between(kap / dd, amos_lower[i], amos_upper[i], color=colours[i], alpha=0.2)
s = np.logspace(-6, 3, 200)
axes[0].loglog(kap, kap**2 / (2 * 4096), "k:", lw=1, label=r"$\kappa^2 / (2 \cdot 4096)$")
axes[0].loglog(kap, kap, "k--", lw=1, label=r"$\kappa$")
axes[0].set(ylim=(1e-9, 3e6), xlabel=r"$\kappa$", ylabel=r"$\log C_d(0) - \log C_d(\kappa)$",
            title="cumulant generating function of $\\mu^T x$")
axes[1].set_yscale("symlog", linthresh=10)
axes[1].set(xlabel=r"$\kappa$", ylabel=r"$\log C_d(\kappa)$",
            title=r"$\log C_d$: finite from $\kappa = 10^{-3}$ to $10^6$")
axes[2].semilogx(s, s / (0.5 + np.sqrt(0.25 + s**2)), "k--", lw=1,
                 label=r"$s / (\frac{1}{2} + \sqrt{\frac{1}{4} + s^2})$")
axes[2].set(xlim=(1e-4, 1e2), xlabel=r"$s = \kappa / d$", ylabel=r"$A_d(\kappa) = E[\mu^T x]$",
            title=r"$A_d$ against $\kappa/d$ (bands: Amos's bounds)")
for ax in axes:
    ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Checks
#
# The key numbers of this notebook, asserted so that a change that breaks the API or the
# mathematics fails here (CI executes every notebook).

# %%
assert tangency <= 1e-15 and roundtrip <= 1e-14
assert abs(retraction_slope - 3) <= 0.2, retraction_slope
assert float(jnp.max(err_atan2)) <= 1e-14  # atan2 form: full relative accuracy
assert float(err_arccos[0]) >= 0.5  # arccos: every digit lost at theta = 1e-12
assert mass_error <= 1e-12 and log_c3_error <= 1e-13
assert float(jnp.max(sigmas)) <= 5.0  # sample means within 5 standard errors of A_3
assert float(jnp.max(jnp.abs(fitted_kappa / kappas - 1))) <= 0.05
assert score_tangency <= 1e-12 and score_vs_grad <= 1e-12
assert softmax_error <= 1e-12 and fisher_error <= 1e-12
assert np.all(np.isfinite(log_c)) and np.all(np.isfinite(a_d))
assert sphere_area_error <= 1e-12 and derivative_error <= 1e-10
assert np.all(a_d >= amos_lower * (1 - 1e-13)) and np.all(a_d <= amos_upper * (1 + 1e-13))
assert np.all((a_d >= 0) & (a_d < 1)) and np.all(np.diff(a_d, axis=1) >= -1e-15)
assert inversion_error <= 1e-8
assert asymptotic_error <= 1e-3 and without_log_term >= 10  # the (d-1)/2 log kappa term matters
print("all checks passed")
