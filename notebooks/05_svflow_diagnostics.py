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
# # 5. SVFlow diagnostics of a pretrained language model under prefix shuffling
#
# Notebook 3 showed that a Transformer layer *is* a step of an SVFlow: attention is a
# variational posterior $q_h(j \mid x_i)$ over context positions, and each position $j$ explains
# the token direction $x_i$ with a von Mises-Fisher component of natural parameter
# $\eta_{hj}$. Here we read those objects off a real model, SmolLM2-135M-Instruct (30 layers,
# $d = 576$, 9 heads), and ask the paper's empirical question: when the beginning of the context
# is scrambled, do the SVFlow quantities of each layer move together with the model's
# perplexity and calibration?
#
# Per layer $t$, head $h$ and scored token $i$ (definitions in `docs/theory.md`, section 19):
#
# * component: $\eta_{hj} = (z_j W_V^{g(h)} + b_V) W_O^h + b_O/H$ with $z = \mathrm{Norm}(y)$,
#   concentration $\kappa_{hj} = \lVert\eta_{hj}\rVert$;
# * evidence: $\log p_h(x_i) = \log \sum_{j \le i} \frac{1}{i+1} C_d(\kappa_{hj})
#   e^{\eta_{hj} \cdot x_i}$, and the true posterior
#   $p_h(j \mid x_i) \propto C_d(\kappa_{hj}) e^{\eta_{hj}\cdot x_i}$;
# * gap: $\mathrm{KL}(q_h(\cdot \mid x_i) \,\Vert\, p_h(\cdot \mid x_i))$;
# * perturbation: $\mathrm{KL}(q^{\text{clean}}_h \,\Vert\, q^{\text{shuffled}}_h)$ over the
#   same context tokens.
#
# Everything is measured by `svflow_jax.diagnose` (the same functions `svflow diagnose` runs);
# this notebook only calls them, at a small scale (a few short windows).

# %%
# ruff: noqa: E402
import sys

import jax

jax.config.update("jax_enable_x64", True)  # metrics in float64 (the model stays float32)

import matplotlib
import numpy as np

if "ipykernel" not in sys.modules:  # run as a script: render off-screen
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

from svflow_jax.diagnose import extract, study

config = study.StudyConfig(context=48, scored=16, windows=3, levels=(0.0, 0.5, 1.0),
                           permutations=1, bootstrap=200, ece_bins=4,
                           scaling_factors=(0.5, 1.0, 3.0), scaling_windows=2)
loaded = study.load_model(config.model)
ids = study.token_ids(loaded.tokenizer, study.default_text().read_text(encoding="utf-8"))
print(loaded.config.n_layers, "layers;", len(ids), "tokens of Emma")

# %% [markdown]
# ## One window, clean and with its prefix shuffled
#
# A window holds 48 tokens and the next one; the last 16 positions are *scored* (their
# next-token predictions and their SVFlow metrics are measured) and never move. The shuffled
# copy permutes the first 32 positions. `window_diagnostics` runs both through the model in one
# jitted call and returns per-layer, per-head summaries.

# %%
window = study.make_windows(ids, config, 1, lm=True)[0]
plan = study.shuffle_plan(config, 0)  # [(level index, permutation)], clean first
perms = np.stack([p for _, p in plan])
res = extract.window_diagnostics(
    loaded.model, window[:-1][perms], np.argsort(perms, axis=1), config.scored,
    np.tile(window[-config.scored:], (len(plan), 1)))
print("levels in this window:", [config.levels[k] for k, _ in plan])
print("next-token NLL, clean vs fully shuffled:", -res.target_logp.mean(1).round(3)[[0, -1]])

fig, axes = plt.subplots(1, 3, figsize=(13, 3.5))
layers = np.arange(loaded.config.n_layers)
axes[0].plot(layers, res.kl_clean[:, -1].mean(-1), "o-")
axes[0].set_title("KL(q_clean || q_shuffled), fully shuffled")
for p, label in ((0, "clean"), (-1, "shuffled")):
    axes[1].plot(layers, res.entropy[:, p].mean(-1), "o-", label=label)
    axes[2].plot(layers, res.kl_q_p[:, p].mean(-1), "o-", label=label)
axes[1].set_title("attention entropy (nats)")
axes[2].set_title("KL(q || p): attention vs vMF posterior (flow units)")
for ax in axes:
    ax.set_xlabel("layer")
axes[2].legend()
fig.tight_layout()
plt.show()

# %% [markdown]
# ## A small shuffle study
#
# Three windows at levels 0, 0.5 and 1 (the shuffled fraction of the prefix): perplexity and
# ECE of the scored tokens per level, and Spearman's rho of each layer-mean metric with them,
# with bootstrap intervals over windows. Three windows and three levels make a rho of
# $\pm 1$ or $\pm 0.5$ and intervals that span nearly everything: this is the mechanics, not
# the result (the table of the documentation's results page, "Diagnostics under prefix
# shuffling", comes from `svflow diagnose`'s default run).

# %%
data = study.run_shuffle_study(loaded, ids, config)
analysis = study.analyse_shuffle(data, config)
task = analysis["task"]
for k, level in enumerate(config.levels):
    print(f"level {level:.1f}: perplexity {task['perplexity'][k]:6.2f}   ECE {task['ece'][k]:.3f}")
print()
for name, e in analysis["rho"].items():
    r = e["perplexity"]
    print(f"{name:<16} rho(ppl) {r['rho']:+.2f}  95% [{r['ci'][0]:+.2f}, {r['ci'][1]:+.2f}]")

# %% [markdown]
# ## Sharper attention: the concentration-scaling experiment
#
# The paper says that models whose attention is very concentrated (Qwen3) have divergences that
# explode under perturbation and are over-confident. We cannot load Qwen3 here, so we make
# SmolLM2's attention more or less concentrated: every layer's logits times $c$ (its query
# weights scaled by $c$), and measure on clean windows and on fully shuffled copies.

# %%
scaling = study.run_scaling(loaded, ids, config)
print(f"{'c':>4} {'ppl':>7} {'ECE':>6} {'conf-acc':>9} {'KL clean||shuf':>15} {'entropy':>8}")
for r in scaling["rows"]:
    print(f"{r['factor']:4.1f} {r['perplexity']:7.2f} {r['ece']:6.3f} {r['overconfidence']:+9.3f} "
          f"{r['kl_clean']:15.3f} {r['entropy']:8.3f}")

# %% [markdown]
# ## Checks

# %%
rows = {r["factor"]: r for r in scaling["rows"]}
kl_levels = np.asarray(analysis["level_means"]["kl_clean"])
assert np.all(kl_levels[0] == 0) and np.all(kl_levels[-1] > 0)  # no shuffle, no divergence
assert task["perplexity"][-1] > task["perplexity"][0]  # a scrambled prefix hurts prediction
assert res.kl_clean[:, -1].mean() > 0.1  # the attention posteriors move
# sharper attention: lower entropy, larger clean-vs-shuffled divergence
assert rows[0.5]["entropy"] > rows[1.0]["entropy"] > rows[3.0]["entropy"]
assert rows[0.5]["kl_clean"] < rows[1.0]["kl_clean"] < rows[3.0]["kl_clean"]
print("all checks passed")
