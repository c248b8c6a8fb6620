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
# # 2. SVFlow on $S^2$: tokens under attention
#
# The smallest SVFlow that shows the main phenomenon: $n = 12$ tokens on the sphere $S^2$
# ($d = 3$, so we can look at it), moved by one attention head whose query, key, value and output
# maps are all the identity. In SVFlow words (`docs/theory.md`, "The flow" and "Attention"):
#
# * the latent of token $i$ is a context position $j$, with the **vMF-kernel posterior**
#   $q(j \mid x_i) = \operatorname{softmax}_j(\beta\, x_i^\top x_j)$;
# * position $j$ explains $x$ by a vMF likelihood with natural parameter $\eta_j = x_j$, whose
#   Euclidean score is $x_j$;
# * the field is the posterior expectation of the Riemannian scores,
#
# $$\frac{dx_i}{dt} = v(x_i) = P_{x_i} \sum_j q(j \mid x_i)\, x_j .$$
#
# Each token climbs the kernel density of all the tokens: this is *mean shift* on the sphere
# (and the model of Geshkovski, Letrouit, Polyanskiy and Rigollet's "A mathematical perspective
# on Transformers"). With $Z_i = \sum_j e^{\beta x_i^\top x_j}$, the energy
#
# $$E_\beta(X) = \frac{1}{2\beta n^2} \sum_{i,j} e^{\beta x_i^\top x_j}, \qquad
# \frac{dE_\beta}{dt} = \sum_i \Big\langle \frac{\partial E_\beta}{\partial x_i},
#   \dot x_i \Big\rangle = \frac{1}{n^2}\sum_i Z_i\, |v(x_i)|^2 \;\ge\; 0,$$
#
# never decreases ($\partial E_\beta / \partial x_i = Z_i\, \mathbb{E}_q[x_j] / n^2$ and
# $\dot x_i = P_{x_i}\mathbb{E}_q[x_j]$): the tokens **cluster**, and $E_\beta$ is largest
# when they all coincide. Below we solve this ODE accurately, then with forward Euler: the
# Transformer.

# %%
# ruff: noqa: E402
# (float64 must be switched on before anything creates a JAX array, hence imports below it)
import sys

import jax

jax.config.update("jax_enable_x64", True)

import diffrax
import jax.numpy as jnp
import matplotlib
import numpy as np

if "ipykernel" not in sys.modules:  # run as a script: render off-screen
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

from svflow_jax import flow, solvers, sphere

# %% [markdown]
# ## The field, from the library's attention
#
# `flow.AttentionParams` stores, per head $h$: the query and key embeddings $A_h, B_h$ of the
# kernel, its concentration $\beta_h$, and the maps $N_h, M_h$ with $\eta_{hj} = x_j N_h M_h$.
# Identity maps and $\beta = 3$ give the field above; we check it against the formula written
# out by hand.

# %%
n, d, beta, T = 12, 3, 3.0, 30.0
eye = jnp.eye(d)[:, None, :]  # (d, heads=1, k=d): the identity embedding
params = flow.AttentionParams(kernel_query=eye, kernel_key=eye, concentration=jnp.array([beta]),
                              natural_in=eye, natural_out=jnp.eye(d)[None])
field = flow.AttentionField(params)

x0 = sphere.retract(jnp.asarray(np.random.default_rng(1).standard_normal((n, d))))
by_hand = sphere.project_tangent(x0, jax.nn.softmax(beta * x0 @ x0.T, axis=-1) @ x0)
field_error = float(jnp.max(jnp.abs(field(0.0, x0) - by_hand)))
print(f"library field vs P_x sum_j softmax_j(beta x.x_j) x_j: {field_error:.1e}")


def energy(xs):
    """E_beta of every saved state (axis -2: tokens)."""
    gram = jnp.einsum("...id,...jd->...ij", xs, xs)
    return jnp.sum(jnp.exp(beta * gram), axis=(-2, -1)) / (2 * beta * n**2)


def count_clusters(xs, radius=0.05):
    """Greedy count of groups of tokens within `radius` of each other."""
    xs, left, count = np.asarray(xs), np.ones(len(xs), bool), 0
    for i in range(len(xs)):
        if left[i]:
            left &= np.linalg.norm(xs - xs[i], axis=-1) >= radius
            count += 1
    return count


# %% [markdown]
# ## The continuous flow: retracted Tsit5, adaptive
#
# `solvers.Retracted(diffrax.Tsit5())` is Tsitouras' fifth-order Runge-Kutta method with every
# stage read at the retracted state and the output put back on the sphere; its embedded error
# estimate drives a PID step-size controller (relative and absolute tolerance $10^{-10}$). We save
# the dense output at 301 times (retracted too, so the saved states lie on the sphere) and the
# accepted steps, to see where the controller spends its effort.

# %%
ts = jnp.linspace(0.0, T, 301)
sol = solvers.solve(
    field, x0, 0.0, T, solver=solvers.Retracted(diffrax.Tsit5()),
    stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-10),
    saveat=diffrax.SaveAt(subs=[diffrax.SubSaveAt(ts=ts), diffrax.SubSaveAt(steps=True)]),
    max_steps=4096,
)
traj, _ = sol.ys
step_times = np.asarray(sol.ts[1])
step_times = np.concatenate([[0.0], step_times[np.isfinite(step_times)]])
E = energy(traj)
clusters = [count_clusters(x) for x in traj]
exact_drift = float(sphere.norm_drift(traj))
print(f"accepted steps: {len(step_times) - 1},  max | |x| - 1 | = {exact_drift:.1e}")
print("clusters at t = 0, 2, 5, 10, 20, 30:", [clusters[i] for i in (0, 20, 50, 100, 200, 300)])


def wire_sphere(ax, elev=20, azim=-60):
    u, w = np.meshgrid(np.linspace(0, 2 * np.pi, 25), np.linspace(0, np.pi, 13))
    ax.plot_wireframe(np.cos(u) * np.sin(w), np.sin(u) * np.sin(w), np.cos(w), color="0.8",
                      lw=0.4)
    ax.set_box_aspect((1, 1, 1), zoom=1.3)
    ax.view_init(elev=elev, azim=azim)
    ax.set_axis_off()


colours = plt.cm.tab20(np.arange(n) % 20)
X = np.asarray(traj)
snap_times = [0, 20, 50, 100, 300]
fig = plt.figure(figsize=(15, 3.4))
for k, i in enumerate(snap_times):
    ax = fig.add_subplot(1, len(snap_times), k + 1, projection="3d")
    wire_sphere(ax)
    start = max(0, i - 20)
    for j in range(n):
        ax.plot(*X[start:i + 1, j].T, color=colours[j], lw=1)
    ax.scatter(*X[i].T, c=colours, s=25, depthshade=False)
    ax.set_title(f"t = {float(ts[i]):g}: {clusters[i]} cluster(s)")
fig.tight_layout()
plt.show()

fig = plt.figure(figsize=(15, 4.5))
ax = fig.add_subplot(1, 3, 1, projection="3d")
wire_sphere(ax)
for j in range(n):
    ax.plot(*X[:, j].T, color=colours[j], lw=1.2)
ax.scatter(*X[0].T, c=colours, s=18, marker="o", depthshade=False)
ax.scatter(*X[-1].T, c="k", s=60, marker="*", depthshade=False)
ax.set_title("trajectories (o: start, *: t = 30)")
ax = fig.add_subplot(1, 3, 2)
ax.plot(ts, E, "C0")
ax.set(xlabel="t", ylabel=r"$E_\beta$", title=r"energy never decreases; clusters merge")
ax2 = ax.twinx()
ax2.step(ts, clusters, "C3", where="post")
ax2.set_ylabel("number of clusters", color="C3")
ax = fig.add_subplot(1, 3, 3)
ax.semilogy(step_times[1:], np.diff(step_times), ".-", ms=3)
ax.set(xlabel="t", ylabel="accepted step size",
       title=f"adaptive Tsit5: {len(step_times) - 1} steps, small while tokens meet")
fig.tight_layout()
plt.show()

# %% [markdown]
# Above: snapshots, each token with the last two time units of its path. Below: the whole
# trajectories, the energy and the cluster count, and the step sizes chosen by the controller.
#
# This is what is known for this model: clusters form quickly, then sit for a long time
# (metastable states) before merging, until a single cluster remains.
#
# ## Forward Euler is the Transformer
#
# One retracted Euler step
#
# $$x_i \leftarrow R\big(x_i + h\, v(x_i)\big) = \frac{x_i + h\, v(x_i)}{|x_i + h\, v(x_i)|}$$
#
# is one post-norm attention layer with residual scale $h$ (and tangent-projected branch, see
# notebook 3); the same weights in every layer make the flow autonomous, and a stack of $L$
# layers integrates it up to $T = L h$. So a 30-layer weight-tied Transformer is Euler with
# $h = 1$ on $[0, 30]$. How good is that? Below, Euler with $h = 2, 1, \dots, 1/32$ (one compiled
# program: the step size is a traced argument) against the continuous solution.

# %%
hs = np.array([2.0, 1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125])


@jax.jit
def euler(dt0):
    """Retracted Euler with constant step dt0, saved (dense output) at the times ts."""
    return solvers.solve(field, x0, 0.0, T, solver=solvers.RetractedEuler(), dt0=dt0,
                         saveat=diffrax.SaveAt(ts=ts), max_steps=1024).ys


@jax.jit
def plain_euler(dt0):
    """The same steps without the normalisation: diffrax.Euler in R^3."""
    return diffrax.diffeqsolve(diffrax.ODETerm(field), diffrax.Euler(), 0.0, T, dt0, x0,
                               saveat=diffrax.SaveAt(ts=ts), max_steps=1024).ys


euler_runs = np.stack([np.asarray(euler(jnp.asarray(h))) for h in hs])  # (len(hs), 301, n, 3)
errors = np.asarray(jnp.max(sphere.geodesic_distance(euler_runs, traj), axis=-1))  # (hs, 301)
euler_drift = float(sphere.norm_drift(jnp.asarray(euler_runs)))
i_err = 20  # t = 2, before the first tokens meet
euler_order = np.polyfit(np.log(hs), np.log(errors[:, i_err]), 1)[0]
print(f"Euler error at t = {float(ts[i_err]):g}:", np.array2string(errors[:, i_err], precision=2))
print(f"fitted order: {euler_order:.3f};  max | |x| - 1 | of every Euler run: {euler_drift:.1e}")

# %% [markdown]
# Left: two tokens, exact (black) and Euler at three step sizes: a coarse "Transformer" cuts
# corners but ends in the right place, because clustering forgives. Middle: the error along the
# whole trajectory; it jumps when clusters meet (near a saddle, a small error decides which way a
# token goes), so long horizons need small steps. Right: at $t = 2$, before any meeting, the
# error halves when $h$ halves: **first order**.

# %%
fig = plt.figure(figsize=(15, 4.5))
ax = fig.add_subplot(1, 3, 1, projection="3d")
wire_sphere(ax, elev=25, azim=-40)
worst = np.argsort(np.max(np.linalg.norm(euler_runs[1] - X, axis=-1), axis=0))[-2:]
for j in worst:  # the two tokens that Euler with h = 1 gets most wrong
    ax.plot(*X[:, j].T, "k", lw=2)
    for hi, c in zip((0, 1, 3), ("C3", "C1", "C2"), strict=True):
        ax.plot(*euler_runs[hi, :, j].T, color=c, lw=1,
                label=f"h = {hs[hi]:g}" if j == worst[0] else None)
ax.legend(loc="upper left", fontsize=8)
ax.set_title("two tokens: exact (black) and Euler")
ax = fig.add_subplot(1, 3, 2)
for hi, h in enumerate(hs):
    ax.semilogy(ts, np.maximum(errors[hi], 1e-16), color=plt.cm.viridis(hi / len(hs)),
                label=f"h = {h:g}")
ax.axvline(float(ts[i_err]), color="k", ls=":", lw=1)
ax.set(xlabel="t", ylabel="max geodesic error over tokens", title="Euler error along the flow")
ax.legend(fontsize=7, ncol=2)
ax = fig.add_subplot(1, 3, 3)
ax.loglog(hs, errors[:, i_err], "o-", label="retracted Euler (the Transformer)")
ax.loglog(hs, errors[-1, i_err] * hs / hs[-1], "k--", lw=1, label="slope 1")
ax.set(xlabel="step h (= T / depth)", ylabel="error at t = 2",
       title=f"first order: fitted slope {euler_order:.2f}")
ax.legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Accuracy per unit of work
#
# Euler's error is $O(h)$, so each extra digit costs ten times more layers. A higher-order solver
# buys digits far more cheaply: Tsit5's error is $O(h^5)$ for six field evaluations per step. We
# solve on $[0, 2]$ with Tsit5 at several tolerances (a traced tolerance: one compiled program)
# and count field evaluations, against Euler whose evaluations are its $2/h$ steps. The reference
# is the same solver at a tolerance of $10^{-13}$. (Notebook 4 turns such solvers into layers.)

# %%
t_err = float(ts[i_err])


@jax.jit
def tsit5_to_t_err(tol):
    s = solvers.solve(field, x0, 0.0, t_err, solver=solvers.Retracted(diffrax.Tsit5()),
                      stepsize_controller=diffrax.PIDController(rtol=tol, atol=tol),
                      max_steps=4096)
    return s.ys[-1], s.stats["num_steps"]


reference, _ = tsit5_to_t_err(jnp.asarray(1e-13))
tols = 10.0 ** -np.arange(3, 12)
tsit5_err, tsit5_evals = [], []
for tol in tols:
    y, steps = tsit5_to_t_err(jnp.asarray(tol))
    tsit5_err.append(float(jnp.max(sphere.geodesic_distance(y, reference))))
    tsit5_evals.append(6 * int(steps))
euler_err_ref = np.asarray(jnp.max(sphere.geodesic_distance(euler_runs[:, i_err], reference),
                                   axis=-1))
tsit5_vs_dense = float(jnp.max(sphere.geodesic_distance(traj[i_err], reference)))

plain = np.asarray(plain_euler(jnp.asarray(0.5)))
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
ax1.loglog(t_err / hs, euler_err_ref, "o-", label="retracted Euler")
ax1.loglog(tsit5_evals, tsit5_err, "s-", label="retracted Tsit5 (adaptive)")
ax1.set(xlabel="field evaluations on [0, 2]", ylabel="error at t = 2",
        title="work against precision")
ax1.legend()
ax2.plot(ts, np.linalg.norm(plain, axis=-1) - 1, color="C3", lw=0.8)
ax2.plot(ts, np.linalg.norm(euler_runs[2], axis=-1) - 1, color="C0", lw=0.8)
ax2.set(xlabel="t", ylabel=r"$|x_i| - 1$", title="h = 0.5: without Norm (red), with Norm (blue)")
fig.tight_layout()
plt.show()
print(f"Tsit5 evaluations for error ~1e-8: {tsit5_evals[5]}; "
      f"Euler would need ~{int(t_err / hs[-1] * euler_err_ref[-1] / 1e-8):.1e}")

# %% [markdown]
# ## Checks

# %%
assert field_error <= 1e-14
assert exact_drift <= 1e-12 and euler_drift <= 1e-12
assert float(jnp.min(jnp.diff(E))) >= -1e-9  # the energy never decreases
assert clusters[0] == n and clusters[-1] == 1
assert abs(euler_order - 1) <= 0.2, euler_order
assert np.all(np.diff(errors[:, i_err]) < 0)  # smaller steps, smaller errors
assert tsit5_vs_dense <= 1e-8  # the dense output of the tol-1e-10 solve, at t = 2
assert tsit5_err[-1] <= 1e-10 and tsit5_evals[-1] < 2000
assert float(np.max(np.abs(np.linalg.norm(plain, axis=-1) - 1))) >= 1e-3  # plain Euler drifts
print("all checks passed")
