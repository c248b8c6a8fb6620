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
# # 7. A real language model as a dynamical system
#
# SmolLM2-135M-Instruct is a pre-norm Llama: 30 layers, $d = 576$. Each layer adds two branch
# outputs to the residual stream,
#
# $$ y_{l+1} = y_l + h\, A_l(\mathrm{Norm}(y_l)) \;\text{ then }\; + h\, F_l(\mathrm{Norm}(\cdot)),
# \qquad h = 1, $$
#
# which is *exactly* one step of a Lie-Trotter splitting of Euler steps of the ODE
# $\dot y = A_t(y) + F_t(y)$ whose coefficients are the weights of layer $l$ on
# $[l h, (l + 1) h)$ (`docs/theory.md`, "Real pre-norm models"). This notebook walks through
# what that statement means for a model trained without any thought of ODEs:
#
# 1. its own flow reproduces it to round-off;
# 2. **the step-size sweep**: every layer's step $h$ multiplied by $\alpha$, integrated by Euler
#    and by higher-order solvers;
# 3. **refinement**: the same flow with two Euler sub-steps per layer;
# 4. **the logit lens and an exact logit decomposition**: what each layer contributes to the
#    prediction.
#
# Everything is computed by the package's own functions (`svflow inspect` runs the same ones at
# a larger scale); here on a few dozen tokens so that it runs in about a minute on a CPU.

# %%
# ruff: noqa: E402
import sys

import jax

jax.config.update("jax_enable_x64", True)  # the exactness check runs in float64

import jax.numpy as jnp
import matplotlib
import numpy as np

if "ipykernel" not in sys.modules:  # run as a script: render off-screen
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

from svflow_jax import inspection
from svflow_jax.data import emma_opening
from svflow_jax.inspection.alpha_sweep import AlphaOptions, alpha_sweep
from svflow_jax.transformer.lens import decompose_logits, logit_lens

loaded = inspection.resolve_model("smollm2-135m-instruct")
windows = inspection.token_windows(loaded.tokenizer, emma_opening(), windows=1, window=32)
tokens, targets = jnp.asarray(windows[0, :-1]), jnp.asarray(windows[0, 1:])
cfg = loaded.config
print(f"{cfg.n_layers} layers, d = {cfg.d_model}, {cfg.n_heads} heads ({cfg.kv_heads} K/V), "
      f"block {cfg.block!r}, norm {cfg.norm!r} {cfg.norm_position}-norm")

# %% [markdown]
# ## 1. The model is exactly its flow
#
# `to_flow` turns the weights into the flow's parameters; solving that flow with the block's own
# scheme reproduces every hidden state. In float64 the gap is round-off:

# %%
exact = inspection.exactness(loaded, np.asarray(tokens[:16]))
print(f"largest relative difference, float64: {exact.figures['relative_float64']:.1e}")
print(f"                             float32: {exact.figures['relative_float32']:.1e}")

# %% [markdown]
# ## 2. The step-size sweep
#
# Each layer's branch outputs are linear in its output maps ($W_O$, $W_{down}$), so scaling
# those by $\alpha_l$ scales layer $l$'s field, i.e. its step: $y_{l+1} = y_l + \alpha_l h
# F_l(y_l)$. At $\alpha = 1$ Euler *is* the model. Heun and RK4 integrate the same scaled flow
# (the sum field $A + F$), one step per layer, every stage reading its own layer's weights.

# %%
options = AlphaOptions(alphas=(0.5, 0.9, 1.0, 1.1, 1.5),
                       schemes=("euler", "heun", "rk4"), layer_alphas=(0.0,), profiles=())
sweep = alpha_sweep(loaded, windows, options)
fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
for scheme in options.schemes:
    rows = [r for r in sweep.rows if r["kind"] == "global" and r["scheme"] == scheme]
    ax[0].plot([r["alpha"] for r in rows], [r["perplexity"] for r in rows], "o-", label=scheme)
ax[0].set(xlabel="alpha (step multiplier)", ylabel="perplexity", yscale="log",
          title="global step size")
ax[0].legend()
layer_rows = [r for r in sweep.rows if r["kind"] == "layer"]
ax[1].bar([r["layer"] for r in layer_rows], [r["loss_change"] for r in layer_rows])
ax[1].axhline(0, color="k", lw=0.5)
ax[1].set(xlabel="layer removed (alpha_l = 0)", ylabel="change of loss (nats)",
          title="one layer's step set to 0")
plt.tight_layout()
plt.show()
euler = {r["alpha"]: r["perplexity"] for r in sweep.rows
         if r["kind"] == "global" and r["scheme"] == "euler"}
print("Euler perplexity by alpha:", {a: round(p, 1) for a, p in euler.items()})
print("layers whose removal moves the loss most:", sweep.figures["layers_that_matter_most"])
print("layers whose removal lowers the loss:",
      [r["layer"] for r in layer_rows if r["loss_change"] < 0])

# %% [markdown]
# Euler near $\alpha = 1$ is the model and changes smoothly with $\alpha$; the higher-order
# solvers, which would be *better* integrators of an ODE whose solution the model approximates,
# are far worse. The weights of consecutive layers are unrelated (`svflow inspect`'s
# depth-smoothness: relative change 1.41, as for independent matrices), so the "flow" has
# coefficients that jump at every layer boundary, and the model uses each layer as one large,
# discrete move. Removing one of the first two layers or the last wrecks the prediction; removing
# one in the middle barely matters, and for several of them lowers the loss on these tokens (a
# published layer-surgery study of this model found the same for layers 14 and 17).
#
# ## 3. Refinement: the same flow, integrated more finely

# %%
refined = inspection.refinement(loaded, windows, substeps=(2,), schemes=())
for row in refined.rows:
    if "scheme" in row and "loss" in row:
        print(f"{row['scheme']:>9}: loss {row['loss']:.2f} nats, top-1 unchanged "
              f"{100 * row['top1_same']:.0f}%")

# %% [markdown]
# ## 4. The logit lens and an exact decomposition
#
# Pre-norm residual streams are sums: $y_L = y_0 + \sum_{l,b} h\, u_{l,b}$. The final RMSNorm
# divides by one number per token, $r(y_L)$; with that number read at the final state, the
# logits split exactly into the embedding's and every branch's contribution,
# $\text{logits} = \sum_k W_U^\top (g \odot c_k)\, r(y_L)$. The lens reads the prediction after
# every sub-step.

# %%
lens = logit_lens(loaded.model, tokens, targets)
dec = decompose_logits(loaded.model, tokens, targets[:, None])
share = np.asarray(dec.contributions[:, :, 0]).mean(1)  # mean over tokens, target logit
fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
ax[0].plot(np.asarray(lens.loss), ".-")
ax[0].set(xlabel="state (0 = embedding, then after each sub-step)", ylabel="loss (nats)",
          yscale="log", title="logit lens")
ax[1].bar(np.arange(len(share)), share)
ax[1].set(xlabel="component (0 = embedding, then attn/ffn of each layer)",
          ylabel="mean contribution to the target logit", title="direct logit attribution")
plt.tight_layout()
plt.show()
top = np.argsort(-np.abs(share))[:5]
print("largest contributions to the target logit:",
      [(dec.names[k], round(float(share[k]), 2)) for k in top])
print(f"sum of contributions vs logits: largest relative gap {dec.remainder:.1e} (float32)")

# %% [markdown]
# ## Checks

# %%
assert exact.figures["relative_float64"] < 1e-12
# Euler's perplexity is smooth in alpha and within 0.2 nats of its best at alpha = 1
assert np.log(euler[1.0] / min(euler.values())) < 0.2 and euler[0.5] > euler[1.0] < euler[1.5]
rk4_at_1 = [r for r in sweep.rows if r["kind"] == "global" and r["scheme"] == "rk4"
            and r["alpha"] == 1.0][0]
assert rk4_at_1["perplexity"] > 10 * euler[1.0]  # a finer integrator is not the model
assert float(lens.loss[-1]) < float(lens.loss[0])  # the prediction is built up by the layers
assert dec.remainder < 1e-5
print("all checks passed")
