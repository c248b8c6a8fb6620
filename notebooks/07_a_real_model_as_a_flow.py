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
#    and by other methods, each inside the model's own block structure and on the sum field
#    (with the controls that tell the structure's effect from the method's), and which layers
#    matter, by a derivative and by removal;
# 3. **refinement**: the same flow with two Euler sub-steps per layer;
# 4. **the logit lens and an exact logit decomposition**: what each layer contributes to the
#    prediction.
#
# Everything is computed by the package's own functions (`svflow inspect` runs the same ones at
# a larger scale); here on two windows of 32 tokens, small enough for a CPU.

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
windows = inspection.token_windows(loaded.tokenizer, emma_opening(), windows=2, window=32)
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
# ## 2. The step-size sweep, with its controls
#
# Each layer's branch outputs are linear in its output maps ($W_O$, $W_{down}$), so scaling
# those by $\alpha_l$ scales layer $l$'s field, i.e. its step: $y_{l+1} = y_l + \alpha_l h
# F_l(y_l)$. At $\alpha = 1$ Euler *is* the model. Comparing another method with the model
# changes two things at once unless we are careful: the model is a *sequential* block (a
# Lie-Trotter splitting: attention sub-step, then FFN sub-step), while "Heun on the ODE"
# usually means Heun on the *sum* field $A + F$, a *parallel* block. So every method is run
# in two variants: `split` (its steps inside the model's own splitting: only the method
# changes) and `sum` (on $A + F$: structure and method change). `euler/sum` is the control
# that changes the structure alone, and Strang is run in both orderings (half FFN, attention,
# half FFN as published; half attention, FFN, half attention swapped). Perplexities come with
# a 95% Student-t interval over the windows.

# %%
options = AlphaOptions(alphas=(0.9, 1.0, 1.1), schemes=("euler", "heun", "strang"),
                       layer_alphas=(0.0,), profiles=(), windows=2)
sweep = alpha_sweep(loaded, windows, options)
glob = [r for r in sweep.rows if r["kind"] == "global"]
at = {(r["scheme"], r["alpha"]): r for r in glob}
print(f"{'method/variant':<16} {'changes':<22} " + " ".join(f"a={a:<8g}" for a in
                                                            options.alphas))
for scheme in dict.fromkeys(r["scheme"] for r in glob):
    print(f"{scheme:<16} {at[(scheme, 1.0)]['changes']:<22} "
          + " ".join(f"{at[(scheme, a)]['perplexity']:<10.3g}" for a in options.alphas))

# %% [markdown]
# Order is a statement about $h \to 0$: a method of order $p$ has error $O(h^p)$ on a smooth
# field. Here each layer takes *one* step of size $\alpha$ with coefficients that jump at
# every layer boundary, so no limit is taken and the order predicts nothing; each row is just
# another map $y_l \mapsto y_{l+1}$ built from the same per-layer fields, and the weights were
# trained for one of them. What the rows show is which *change* costs what: the structure
# alone (`euler/sum`), the method alone (`heun/split`), both (`heun/sum`), and for Strang,
# which field is split in half.
#
# ## Which layers matter: a derivative and the removals
#
# $\partial\,\text{loss} / \partial \alpha_l$ at $\alpha = 1$ comes for every layer from
# one backward pass through the flow; $-\partial\,\text{loss} / \partial \alpha_l$ is the
# first-order prediction of removing layer $l$ ($\alpha_l = 0$), measured beside it.

# %%
deriv = [r for r in sweep.rows if r["kind"] == "derivative"]
layers = [r["layer"] for r in deriv]
fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
for scheme in dict.fromkeys(r["scheme"] for r in glob):
    rows = [r for r in glob if r["scheme"] == scheme]
    ax[0].plot([r["alpha"] for r in rows], [r["perplexity"] for r in rows],
               "o-" if rows[0]["variant"] == "split" else "s--", label=scheme)
ax[0].set(xlabel="alpha (step multiplier)", ylabel="perplexity", yscale="log",
          title="global step size")
ax[0].legend(fontsize=7)
ax[1].bar(np.array(layers) - 0.2, [-r["derivative"] for r in deriv], width=0.4,
          label="-d loss / d alpha_l")
ax[1].bar(np.array(layers) + 0.2, [r["removal_change"] for r in deriv], width=0.4,
          label="removal (alpha_l = 0)")
ax[1].axhline(0, color="k", lw=0.5)
ax[1].set(xlabel="layer", ylabel="change of loss (nats)", title="removing one layer")
ax[1].legend(fontsize=7)
plt.tight_layout()
plt.show()
f = sweep.figures
print("most important layers by derivative:", f["layers_by_derivative"],
      " by removal:", f["layers_by_removal"])
print(f"Spearman rank correlation, -derivative vs removal: "
      f"{f['spearman_derivative_removal']:.2f}")

# %% [markdown]
# On these 64 tokens the numbers are noisy; `svflow inspect` on 4 windows of 128 tokens
# (`docs/results/real-checkpoints.md`, 2026-12-07) finds the same pattern with intervals: the
# model 49.6, the structure alone (`euler/sum`) 3,950, the method alone (`heun/split`,
# `rk4/split`) 8.3e4 and 2.5e4, both (`heun/sum`, `rk4/sum`) 3.1e5 and 8.1e4; Strang as
# published 4.0e4 but with the attention halved instead of the FFN 100. Euler's global alpha
# is flat near 1. The derivative and the removals rank the layers differently (Spearman 0.36
# there): removal is a large move, far outside the derivative's first-order reach. A
# per-layer alpha fitted on *Emma* (`svflow inspect --fit-profile`) lowers the training loss
# by 0.08 nats but not the held-out loss on other Austen novels (-0.02 nats, interval
# [-0.11, +0.07]).
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
euler = {a: at[("euler/split", a)]["perplexity"] for a in options.alphas}
# Euler inside the model's splitting at alpha = 1 is the model: the best of the grid within
# 0.1 nats, and it changes smoothly with alpha
assert np.log(euler[1.0] / min(euler.values())) < 0.1
# the control changes the structure alone, and that alone costs more than a nat
assert np.log(at[("euler/sum", 1.0)]["perplexity"] / euler[1.0]) > 1
assert len(deriv) == cfg.n_layers and all(np.isfinite(r["derivative"]) for r in deriv)
assert float(lens.loss[-1]) < float(lens.loss[0])  # the prediction is built up by the layers
assert dec.remainder < 1e-5
print("all checks passed")
