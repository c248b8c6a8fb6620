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
# # 3. A Transformer is an Euler step
#
# This notebook takes an ordinary Flax Transformer (queries, keys, values, softmax, residual,
# RMSNorm; `svflow_jax.transformer` knows nothing about flows) and shows, in numbers, that its
# forward pass **is** a numerical solver of an SVFlow:
#
# | Transformer | SVFlow |
# | --- | --- |
# | hidden state $x$, $\lVert x\rVert = \sqrt{d}$ after RMSNorm | point $x/\sqrt{d}$ of $S^{d-1}$ |
# | $W_Q, W_K$ of layer $l$ | kernel embeddings $A, B$ of $\theta(t_l)$, $t_l = l h$ |
# | score scale $1/\sqrt{d_k}$ | concentration $\beta = d/\sqrt{d_k}$ (states have norm $\sqrt d$) |
# | $W_V, W_O$ | natural parameters $\eta_j = x_j N M$ |
# | FFN $F$ | relaxed score $s(u) = F(\sqrt{d}\, u)/\sqrt{d}$ |
# | residual scale $h$, $L$ layers | time step $h$ on $[0, L h]$ |
#
# We go through the variants: post-norm with a tangent-projected branch (exactly retracted
# Euler), the standard post-norm layer (a variable step), pre-norm (Euler of an ambient ODE whose
# directions and radii form a coupled system), and blocks made of two sub-layers (splittings).
# The mathematics, with the definitions this code chose, is in `docs/theory.md`.

# %%
# ruff: noqa: E402
# (float64 must be switched on before anything creates a JAX array, hence imports below it)
import math
import sys

import jax

jax.config.update("jax_enable_x64", True)

import diffrax
import jax.numpy as jnp
import matplotlib
import numpy as np
from flax import nnx

if "ipykernel" not in sys.modules:  # run as a script: render off-screen
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

from svflow_jax import flow, solvers, sphere
from svflow_jax.bridge import correspondence
from svflow_jax.transformer import Transformer, TransformerConfig, layer_params

# %% [markdown]
# ## 1. A Transformer and its flow
#
# Exactness needs RMSNorm with $\varepsilon = 0$ and no gain (a gain $g$ maps onto an ellipsoid
# instead of a sphere: a "relaxed" retraction, see the end). We take $d = 16$, $L = 8$ layers,
# two heads, a GELU FFN, causal attention and residual scale $h = 1/L$, so the stack integrates
# over $[0, 1]$. The weights are drawn with NumPy and loaded with
# `Transformer.from_layer_params`.

# %%
d, L, n = 16, 8, 6
rho = math.sqrt(d)  # the radius of RMSNorm's sphere


def make_config(n_layers=L, **settings):
    return TransformerConfig(
        d_model=d, n_layers=n_layers, n_heads=2, d_head=8, d_ff=32, norm_eps=0.0,
        norm_gain=False, causal=True, residual_scale=1.0 / n_layers, param_dtype=jnp.float64,
        init_std=1 / math.sqrt(d), **settings,
    )


def random_transformer(seed=0, **settings):
    """A Transformer with N(0, 1/d) weights drawn by NumPy (shapes from an abstract model)."""
    config = make_config(**settings)
    shapes = jax.eval_shape(lambda: layer_params(Transformer(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    params = {name: jnp.asarray(config.init_std * rng.standard_normal(s.shape))
              for name, s in sorted(shapes.items())}
    return config, Transformer.from_layer_params(config, params)


config, model = random_transformer(block="parallel", project_branches=True)
x_in = jnp.asarray(np.random.default_rng(1).standard_normal((n, d)))
states = model.hidden_states(x_in)  # (L + 1, n, d): after the input Norm, then every layer
svf = correspondence.to_flow(config, layer_params(model))
print("parameters:", {k: tuple(v.shape) for k, v in layer_params(model).items()})
norms = np.linalg.norm(states, axis=-1) / rho
print(f"hidden-state norms / sqrt(d): from {norms.min():.15f} to {norms.max():.15f}")
print(f"flow: {svf.num_layers} layers, step h = {svf.step}, radius {svf.radius}, "
      f"kernel concentration beta = {float(svf.attention.params(0.0).concentration[0]):.4f}")

# %% [markdown]
# ## 2. Attention weights are a posterior
#
# Layer $l$'s softmax matrix of head $h$ is the vMF-kernel posterior of the flow at time $t_l$,
#
# $$q(j \mid x_i, h) = \operatorname{softmax}_j\big(\beta_h \langle x_i A_h, x_j B_h\rangle\big),
# \qquad j \le i \text{ (causal)},$$
#
# evaluated at the unit-sphere state $x/\sqrt{d}$. The flow's parameters are a function of time:
# `svf.attention.params(t)` returns the `AttentionParams` of the layer that covers $t$.

# %%
posteriors, weights = [], []
for l in range(L):
    z = states[l]
    weights.append(model.layer(l).attn.attention_weights(z))
    posteriors.append(flow.attention_posterior(svf.attention.params(l * svf.step), z / rho,
                                               causal=True))
posterior_error = float(jnp.max(jnp.abs(jnp.stack(weights) - jnp.stack(posteriors))))
print(f"max |softmax weights - posterior| over layers and heads: {posterior_error:.1e}")

fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
panels = [(weights, 0, 0, "Transformer softmax"), (posteriors, 0, 0, "SVFlow posterior"),
          (weights, L - 1, 1, "Transformer softmax"), (posteriors, L - 1, 1, "SVFlow posterior")]
for ax, (mats, l, head, what) in zip(axes, panels, strict=True):
    ax.imshow(mats[l][head], cmap="Blues", vmin=0, vmax=1)
    ax.set(title=f"{what}\nlayer {l}, head {head}", xlabel="context position j",
           ylabel="token i")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. The stack is retracted Euler
#
# With the branch projected onto the tangent space (`project_branches=True`:
# $u \mapsto P_x u$), a post-norm layer is $x \leftarrow \mathrm{Norm}(x + h\, P_x F(x))$; on the
# unit sphere that is one step of **retracted Euler**,
#
# $$x_{l+1} = R\big(x_l + h\, v_{t_l}(x_l)\big), \qquad R(y) = y/|y|, \quad
#   v_t = v^{\text{attention}}_t + v^{\text{FFN}}_t \text{ (parallel block)}.$$
#
# We integrate the flow with `solvers.solve(..., solver=RetractedEuler(), num_steps=L)`, save
# every step, scale back by $\sqrt{d}$ and compare with the hidden states, layer by layer.
# (`correspondence.discrepancy(model, x)` does the same in one call.)

# %%
sol = solvers.solve(svf.field, states[0] / rho, 0.0, svf.t1, solver=solvers.RetractedEuler(),
                    num_steps=L, saveat=diffrax.SaveAt(steps=True))
per_layer = np.max(np.abs(np.asarray(sol.ys) * rho - np.asarray(states[1:])), axis=(1, 2))
exact_projected = float(per_layer.max())
print("per-layer max |Transformer - RetractedEuler|:", np.array2string(per_layer, precision=1))
print("correspondence.discrepancy:", correspondence.discrepancy(model, x_in)["max_abs_diff"])

# %% [markdown]
# ## 4. The standard layer takes a variable step
#
# Real Transformers do not project the branch: $x \leftarrow R(x + h u)$ with the full
# $u = F(x)$. Split $u$ into its radial and tangent parts,
# $x + h u = (1 + h\, x^\top u)\, x + h\, P_x u$; the retraction forgets the positive factor, so
#
# $$R(x + h u) = R\big(x + h' P_x u\big), \qquad h' = \frac{h}{1 + h\, x^\top u}\quad
#   (\text{whenever } 1 + h\, x^\top u > 0).$$
#
# A standard layer is retracted Euler along the *same* tangent field with a per-token step
# $h' = h + O(h^2)$: consistent with the same ODE, first order; the radial part of $u$ only
# rescales the step, and drops out in the limit. `correspondence.VariableStepRetractedEuler` is this
# solver; we check the identity on one state, then on a whole standard Transformer.

# %%
x_unit = states[0] / rho
h = svf.step
u = svf.field.drift(0.0, x_unit)  # the unprojected branch output, in flow units
h_prime = h / (1 + h * jnp.sum(x_unit * u, axis=-1, keepdims=True))
identity_error = float(jnp.max(jnp.abs(
    sphere.retract(x_unit + h * u)
    - sphere.retract(x_unit + h_prime * sphere.project_tangent(x_unit, u)))))
print(f"|R(x + h u) - R(x + h' P_x u)| = {identity_error:.1e}")

config_std, model_std = random_transformer(block="parallel", project_branches=False)
exact_standard = correspondence.discrepancy(model_std, x_in)["max_abs_diff"]
print(f"standard post-norm Transformer vs VariableStepRetractedEuler: {exact_standard:.1e}")

# h'/h of every token in every layer of the standard model
svf_std = correspondence.to_flow(config_std, layer_params(model_std))
std_states = model_std.hidden_states(x_in)[:-1] / rho  # the input of each layer
radial = jnp.stack([jnp.sum(std_states[l] * svf_std.field.drift(l * h, std_states[l]), axis=-1)
                    for l in range(L)])
step_ratio = np.asarray(1 / (1 + h * radial))

# %% [markdown]
# ### Depth to infinity
#
# To let depth grow we need $\theta(t)$ for every $t$, not only at 8 layers. We interpolate the
# eight layers' weights in time with a polynomial (`flow.ChebyshevInterpolation`, anchors at
# Chebyshev points of $[0, 1]$): a smooth SVFlow. Sampling $\theta(t)$ at $t_l = l/L$ gives
# standard Transformers of any depth $L$ (`correspondence.to_transformer_params` turns the
# flow's parameters back into weights). Deeper Transformers converge to the continuous flow
# (a tight Tsit5 solve) at order 1, and each one equals the variable-step Euler solve with
# $L$ steps.
#
# Note that the depth-8 member of this family is **not** the 8-layer model we started from. Its
# layer $l$ has the weights $\theta(l T / 8)$ of the smooth path through the anchors, and the
# anchors (the original layers' weights) sit at the Chebyshev points
# $t_k = T(1 - \cos(\pi k / 7))/2$, not at $l T / 8$: only layer 0 ($t = 0$) coincides. The
# original model is the flow with the piecewise-constant $\theta$ of sections 2 and 3; the family
# below is a different flow, chosen smooth so that its discretisations converge.

# %%
T = 1.0
attn = flow.AttentionField(flow.ChebyshevInterpolation(svf.attention.params.anchors, 0.0, T),
                           causal=True)
ffn = flow.ExpertsField(flow.ChebyshevInterpolation(svf.experts.params.anchors, 0.0, T),
                        radius=rho)
smooth = flow.SumField(attn, ffn)
x0 = states[0] / rho
reference = solvers.solve(smooth, x0, 0.0, T, solver=solvers.Retracted(diffrax.Tsit5()),
                          stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12),
                          max_steps=10_000).ys[-1]


def runner(field, solver):
    """Fixed steps on [0, T] from x0; the step size is traced: one compilation per solver."""
    @jax.jit
    def run(dt0):
        return solvers.solve(field, x0, 0.0, T, solver=solver, dt0=dt0, max_steps=1024).ys[-1]

    return run


def error(y):
    return float(jnp.max(sphere.geodesic_distance(y, reference)))


def slope(steps, errors, last=4):
    """Least-squares order over the `last` smallest steps."""
    return float(np.polyfit(np.log(steps[-last:]), np.log(errors[-last:]), 1)[0])


depths = [8, 16, 32, 64, 128]
run_projected = runner(smooth, solvers.RetractedEuler())
run_variable = runner(diffrax.ODETerm(lambda t, y, args: smooth.drift(t, y)),
                      correspondence.VariableStepRetractedEuler())
deep_err, projected_err, variable_err, deep_vs_solver = [], [], [], []
for depth in depths:
    cfg = make_config(n_layers=depth, block="parallel", project_branches=False)
    t_layers = jnp.arange(depth) / depth
    layer_flow = correspondence.LayerFlow(  # theta(t_l) stacked on a layer axis
        attention=flow.AttentionField(flow.PiecewiseConstant(jax.vmap(attn.params)(t_layers),
                                                             1 / depth), causal=True),
        experts=flow.ExpertsField(flow.PiecewiseConstant(jax.vmap(ffn.params)(t_layers),
                                                         1 / depth), radius=rho),
        passthrough={}, step=1 / depth, num_layers=depth, radius=rho,
    )
    deep = Transformer.from_layer_params(cfg, correspondence.to_transformer_params(layer_flow, cfg))
    y_transformer = deep(x0 * rho) / rho
    y_variable = run_variable(jnp.asarray(1 / depth))
    deep_err.append(error(y_transformer))
    variable_err.append(error(y_variable))
    projected_err.append(error(run_projected(jnp.asarray(1 / depth))))
    deep_vs_solver.append(float(jnp.max(jnp.abs(y_transformer - y_variable))))
inv_depths = 1 / np.array(depths)
# The depth-8 member against the original 8 layers: equal at layer 0 only.
member8 = jax.vmap(attn.params)(jnp.arange(L) * T / L).kernel_query
original = svf.attention.params.anchors.kernel_query
member8_gap = np.max(np.abs(np.asarray(member8 - original)).reshape(L, -1), axis=1)
print("depth-8 member vs original layers, max |W_Q difference| per layer:",
      np.array2string(member8_gap, precision=2))
deep_order = slope(inv_depths, deep_err, last=3)
projected_order = slope(inv_depths, projected_err, last=3)
print("depth:", depths, " error of the standard Transformer:",
      np.array2string(np.array(deep_err), precision=3))
print(f"orders: standard Transformer {deep_order:.3f}, projected (RetractedEuler) "
      f"{projected_order:.3f}; max |Transformer - variable-step solve| = {max(deep_vs_solver):.1e}")

fig, axes = plt.subplots(1, 3, figsize=(15, 4))
axes[0].bar(np.arange(1, L + 1), np.maximum(per_layer, 1e-17), color="C0")
axes[0].axhline(1e-12, color="C3", ls="--", label="1e-12")
axes[0].set(yscale="log", ylim=(1e-17, 1e-10), xlabel="layer",
            ylabel="max |Transformer - flow|", title="post-norm, projected = RetractedEuler")
axes[0].legend()
axes[1].hist(step_ratio.ravel(), bins=20, color="C1")
axes[1].axvline(1, color="k", lw=1)
axes[1].set(xlabel="h' / h  (per token and layer)", ylabel="count",
            title=f"standard layer: variable step, h = {h}")
axes[2].loglog(inv_depths, deep_err, "o-", label=f"standard Transformer: {deep_order:.2f}")
axes[2].loglog(inv_depths, projected_err, "s--",
               label=f"projected layer (RetractedEuler): {projected_order:.2f}")
axes[2].loglog(inv_depths, 0.5 * deep_err[-1] / inv_depths[-1] * inv_depths, "k:",
               label="slope 1")
axes[2].set(xlabel="h = 1 / L", ylabel="error at t = 1", title="depth to infinity: order 1")
axes[2].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Pre-norm: directions and radii are coupled
#
# Llama and Qwen put the Norm on the branch input: $y \leftarrow y + h\, F_t(\mathrm{Norm}(y))$.
# The residual stream $y$ is not normalised, and the layer is *exactly* forward Euler of an
# ambient ODE for all tokens at once ($F$ couples them, through attention),
#
# $$\frac{dY}{dt} = F_t\Big(\frac{y_1}{|y_1|}, \dots, \frac{y_n}{|y_n|}\Big)
#   \quad\text{in } \mathbb{R}^{n \times d}.$$
#
# Write $y_i = r_i u_i$ with $u_i$ on the sphere and $U = (u_1, \dots, u_n)$. The continuous limit
# is the **coupled** system
#
# $$\frac{du_i}{dt} = \frac{v_t(U)_i}{r_i}, \qquad \frac{dr_i}{dt} = u_i^\top F_t(U)_i,
#   \qquad v_t(U)_i = P_{u_i} F_t(U)_i .$$
#
# Each direction moves along the spherical field at the rate $1/r_i$, but this is *not* the
# spherical flow re-timed token by token: token $i$'s velocity depends on every other token's
# direction and on $t$ (through $\theta(t)$), and tokens moving at different rates meet each
# other, and the weights, at different stages. In general no clocks $\tau_i(t)$ with
# $u_i(t) = \varphi_{\tau_i(t)}(U_0)_i$ exist ($\varphi$ the spherical flow). So:
#
# * with **unprojected** branches (the radii then move, $dr_i/dt = u_i^\top F_t(U)_i \ne 0$) or
#   **unequal** radii, the pre-norm directions do **not** converge to the spherical flow
#   $du/dt = v_t(u)$, however small the step; they converge, at order 1, to the coupled system;
# * with **projected** branches ($F$ tangent, so $dr_i/dt = 0$) and **unit** radii
#   ($|y_i| = \sqrt{d}$ in the Transformer's units), $r \equiv 1$ and the coupled system *is* the
#   spherical flow: pre-norm converges to it at order 1. (In the stack, $|y + h P v|^2 = |y|^2 +
#   h^2 |v|^2$: the radii drift by $O(h)$ over $[0, T]$, an $O(h)$ error like Euler's own.)
#
# Below: exactness of the pre-norm stack, the radii along its layers, and the direction errors
# as $h \to 0$ of: post-norm against the spherical flow; unprojected pre-norm from radii in
# $[0.5, 1.5]$ against the spherical flow and against the coupled system (solved by diffrax's
# Dopri8 at a tolerance of $10^{-12}$); projected pre-norm from unit radii against the spherical
# flow.

# %%
config_pre, model_pre = random_transformer(norm_position="pre", block="parallel")
exact_prenorm = correspondence.discrepancy(model_pre, x_in)["max_abs_diff"]
radii_layers = np.linalg.norm(model_pre.hidden_states(x_in), axis=-1) / rho  # (L + 1, n)
print(f"pre-norm Transformer vs diffrax.Euler of dy/dt = F(y/|y|): {exact_prenorm:.1e}")

r0 = jnp.asarray(1 + 0.5 * np.random.default_rng(2).uniform(-1, 1, (n, 1)))  # unequal radii


def prenorm_runner(branch, radii):
    """Pre-norm stack of step dt0 on the smooth flow, from the given radii; returns directions."""
    @jax.jit
    def run(dt0):
        s = diffrax.diffeqsolve(diffrax.ODETerm(lambda t, y, args: branch(t, y)),
                                diffrax.Euler(), 0.0, T, dt0, radii * x0, max_steps=1024)
        return sphere.retract(s.ys[-1])

    return run


prenorm = prenorm_runner(smooth.ambient, r0)  # F(y / |y|), unprojected
prenorm_projected = prenorm_runner(lambda t, y: smooth(t, sphere.retract(y)), 1.0)  # P F, r = 1


def coupled_system(t, state, args):
    """du_i/dt = v_t(U)_i / r_i,  dr_i/dt = u_i . F_t(U)_i."""
    u, r = state
    drift = smooth.drift(t, u)
    radial = jnp.sum(u * drift, axis=-1, keepdims=True)
    return (drift - radial * u) / r, radial


coupled = diffrax.diffeqsolve(
    diffrax.ODETerm(coupled_system), diffrax.Dopri8(), 0.0, T, None, (x0, r0),
    stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12), max_steps=10_000,
).ys[0][-1]
coupled = sphere.retract(coupled)

steps = 1 / np.array([8, 16, 32, 64, 128, 256, 512])
post_err = np.array([error(run_projected(jnp.asarray(s))) for s in steps])
pre_runs = [prenorm(jnp.asarray(s)) for s in steps]
pre_err = np.array([error(y) for y in pre_runs])
pre_coupled_err = np.array([float(jnp.max(sphere.geodesic_distance(y, coupled)))
                            for y in pre_runs])
pre_projected_err = np.array([error(prenorm_projected(jnp.asarray(s))) for s in steps])
post_order = slope(steps, post_err)
pre_coupled_order = slope(steps, pre_coupled_err)
pre_projected_order = slope(steps, pre_projected_err)
limit_gap = error(coupled)  # coupled system vs spherical flow at t = T
for label, errs in [("post-norm error:                ", post_err),
                    ("pre-norm error (sphere flow):   ", pre_err),
                    ("pre-norm error (coupled system):", pre_coupled_err),
                    ("projected pre-norm, unit radii: ", pre_projected_err)]:
    print(label, np.array2string(errs, formatter={"float_kind": "{:.1e}".format}))
print(f"orders: post-norm {post_order:.2f}, pre-norm vs coupled system {pre_coupled_order:.2f}, "
      f"projected pre-norm {pre_projected_order:.2f}; coupled system vs sphere flow at T: "
      f"{limit_gap:.2e}")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
ax1.plot(radii_layers, "o-", ms=3)
ax1.set(xlabel="layer", ylabel=r"$|y_i| / \sqrt{d}$", title="pre-norm: radii of the 6 tokens")
ax2.loglog(steps, post_err, "o-", label=f"post-norm vs sphere flow ({post_order:.2f})")
ax2.loglog(steps, pre_err, "s-", label="pre-norm, radii in [0.5, 1.5], vs sphere flow")
ax2.loglog(steps, pre_coupled_err, "^-",
           label=f"the same vs coupled system ({pre_coupled_order:.2f})")
ax2.loglog(steps, pre_projected_err, "v--",
           label=f"projected pre-norm, unit radii, vs sphere flow ({pre_projected_order:.2f})")
ax2.set(xlabel="step h", ylabel="direction error at t = 1",
        title="pre-norm converges to the coupled system")
ax2.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 6. Blocks are splittings
#
# A sequential block applies two residual sub-layers, attention then FFN. Each is a retracted
# Euler step of one field, so the block is the **Lie-Trotter splitting** of
# $v = v_A + v_F$: `solvers.LieTrotter(RetractedEuler())` on a `diffrax.MultiTerm` (a tuple of two
# fields for `solvers.solve`). A Macaron block (half FFN, attention, half FFN) is the **Strang
# splitting** `solvers.Strang(RetractedEuler())`. Both are exact (first the numbers).
#
# Orders: Lie-Trotter is first order whatever the sub-step. Strang is second order only if its
# sub-steps are: with Euler sub-steps the local error keeps an $h^2$ term,
# $-(A'A/2 + F'F/4 + \dots)\,h^2$, which does not cancel, so the Macaron block is still first
# order. With second-order sub-steps (`Retracted(diffrax.Heun())`) Strang reaches order 2.

# %%
exact_split = {}
for block in ("sequential", "macaron"):
    _, model_b = random_transformer(block=block, project_branches=True)
    exact_split[block] = correspondence.discrepancy(model_b, x_in)["max_abs_diff"]
print("sequential = LieTrotter(RetractedEuler), macaron = Strang(RetractedEuler):", exact_split)

heun = solvers.Retracted(diffrax.Heun())
splittings = {
    "Lie-Trotter, Euler sub-steps (sequential block)": solvers.LieTrotter(solvers.RetractedEuler()),
    "Strang, Euler sub-steps (Macaron block)": solvers.Strang(solvers.RetractedEuler()),
    "Lie-Trotter, Heun sub-steps": solvers.LieTrotter(heun),
    "Strang, Heun sub-steps": solvers.Strang(heun),
}
split_err, split_order = {}, {}
for name, solver in splittings.items():
    run = runner((attn, ffn), solver)  # a tuple of two fields = diffrax.MultiTerm(A, F)
    split_err[name] = np.array([error(run(jnp.asarray(s))) for s in steps])
    split_order[name] = slope(steps, split_err[name], last=3)
    print(f"{name:50s} fitted order {split_order[name]:.2f}")

fig, ax = plt.subplots(figsize=(7, 4.5))
for (name, errs), marker in zip(split_err.items(), "os^v", strict=True):
    ax.loglog(steps, errs, marker + "-", label=f"{name}: {split_order[name]:.2f}")
ax.loglog(steps, 0.5 * steps, "k:", lw=1, label="slopes 1 and 2")
ax.loglog(steps, 3 * steps**2, "k:", lw=1)
ax.set(xlabel="step h", ylabel="error at t = 1", title="splittings: measured orders")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 7. A gain makes an ellipsoid
#
# RMSNorm with a gain $g$ maps onto $\{x : |x / g| = \sqrt{d}\}$, an ellipsoid: the relaxed
# retraction $R_g(y) = g \odot \sqrt{d}\, y / |y|$. `correspondence.ellipsoid_residual` measures
# the distance to it; $g = 1$ recovers the sphere, where the flow above lives.

# %%
gain = jnp.asarray(np.random.default_rng(3).uniform(0.5, 2.0, d))
on_ellipsoid = gain * rho * sphere.retract(x_in)  # what RMSNorm with gain g outputs
ellipsoid_error = float(jnp.max(correspondence.ellipsoid_residual(on_ellipsoid, gain)))
sphere_residual = float(jnp.max(correspondence.ellipsoid_residual(on_ellipsoid, jnp.ones(d))))
print(f"residual on the ellipsoid: {ellipsoid_error:.1e};  as seen from the sphere: "
      f"{sphere_residual:.2f}")

# %% [markdown]
# ## Checks

# %%
tol = 1e-12
assert posterior_error <= tol and exact_projected <= tol
assert identity_error <= 1e-14 and exact_standard <= tol and exact_prenorm <= tol
assert all(v <= tol for v in exact_split.values())
assert max(deep_vs_solver) <= tol  # a depth-L standard Transformer = L variable Euler steps
assert abs(deep_order - 1) <= 0.2 and abs(projected_order - 1) <= 0.2
assert abs(np.mean(step_ratio) - 1) <= 0.2
assert abs(post_order - 1) <= 0.2 and pre_err[-1] >= 10 * post_err[-1]
assert abs(np.log(pre_err[-1] / pre_err[-2])) <= 0.05  # the pre-norm error has stopped falling
assert abs(pre_coupled_order - 1) <= 0.2 and limit_gap >= 10 * pre_coupled_err[-1]
assert abs(pre_projected_order - 1) <= 0.2  # projected branches, unit radii: it converges
assert member8_gap[0] <= 1e-12 and np.all(member8_gap[1:] >= 1e-3)  # not the original model
orders = list(split_order.values())
assert abs(orders[0] - 1) <= 0.2 and abs(orders[1] - 1) <= 0.2  # Lie-Trotter, Strang + Euler
assert abs(orders[2] - 1) <= 0.2 and abs(orders[3] - 2) <= 0.2  # Lie-Trotter, Strang + Heun
assert ellipsoid_error <= 1e-12 and sphere_residual > 0.1
print("all checks passed")
