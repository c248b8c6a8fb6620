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
# # 6. Training layer designs
#
# Notebook 4 read every sphere solver as a layer design and measured its order on a given flow.
# Here the flow is *learned*: a design becomes a causal language model (`designs.SolverLM`)
# whose stack integrates $\dot y = v_{\theta(t)}(y)$ on $[0, T]$ with the design's solver, and
# optax trains the weights $\theta$ on Jane Austen's prose, byte by byte.
#
# We compare two designs **at equal compute**: 8 Euler blocks (the post-norm Transformer layer,
# one field evaluation each) against 2 classical RK4 blocks (four evaluations each), both with
# the **same parameters**: four weight anchors interpolated linearly in depth, so a stage at
# time $t + c_i h$ reads $\theta(t + c_i h)$. Then we move each trained model to other depths,
# and check that the Euler design with per-layer weights *is* the project's Transformer.
#
# Everything measured here comes from `svflow_jax.training` (`train`, `evaluate`,
# `compare.depth_transfer`), the functions that `svflow train` and
# `experiments/layer_designs.py` use.

# %%
import sys
import time

import jax.numpy as jnp
import matplotlib
import numpy as np
from flax import nnx

if "ipykernel" not in sys.modules:  # run as a script: render off-screen
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

from svflow_jax.designs import DesignConfig, evaluations
from svflow_jax.solvers import catalogue
from svflow_jax.training import TrainConfig, get_task, train
from svflow_jax.training.compare import count_parameters, depth_transfer

# %% [markdown]
# ## Two designs, one budget
#
# Width 32, two heads, FFN 64, context 32 bytes, depth-time $T = 8$ (the Euler block has the
# standard residual step $h = 1$). The cost of a forward pass is counted, not declared:
# `evaluations` runs the stack's integration loop on a small field and counts the calls.

# %%
model = DesignConfig(d_model=32, n_heads=2, d_head=16, d_ff=64, context=32, weights="linear",
                     num_anchors=4, duration=8.0)
plan = {"euler": 8, "rk4": 2}
for name, blocks in plan.items():
    print(f"{name:6s} {blocks} blocks: {evaluations(catalogue.get(name), blocks):g} field "
          f"evaluations per forward pass")

# %% [markdown]
# ## Training
#
# AdamW with a warm-up and a cosine decay, gradient clipping at 1, 120 steps of 16 windows; the
# same batches for both designs (a batch is a function of the seed and the step). Validation is
# on *Persuasion*, a novel the models never see, in bits per character.

# %%
runs = {}
for name, blocks in plan.items():
    config = TrainConfig(model=model.replace(design=name, num_steps=blocks), steps=120,
                         batch_size=16, lr=3e-3, warmup=10, eval_every=30, eval_sequences=64,
                         log_every=30, seed=0)
    start = time.perf_counter()
    runs[name] = train(config, progress=False)
    print(f"{name:6s} {count_parameters(runs[name].model)} parameters, "
          f"{time.perf_counter() - start:5.1f} s, validation "
          f"{runs[name].final['val_bpc']:.3f} bits/char")

fig, ax = plt.subplots(figsize=(6, 4))
for name, run in runs.items():
    rows = [r for r in run.history if "val_bpc" in r]
    ax.plot([r["step"] for r in rows], [r["val_bpc"] for r in rows], "o-", label=name)
ax.set(xlabel="optimiser step", ylabel="validation bits per character",
       title="equal compute: 8 Euler blocks vs 2 RK4 blocks")
ax.legend()
ax.grid(alpha=0.3)
fig.tight_layout()
plt.show()

# %% [markdown]
# A uniform guess costs 8 bits per character; both designs learn the byte statistics and
# start to use context. Which design wins at this tiny scale is what
# `experiments/layer_designs.py` measures with several seeds and intervals; one seed here.

# %% [markdown]
# ## Depth transfer
#
# The weights are a function of depth, so a trained stack can run at any number of blocks.
# A design that learned a *flow* should degrade gracefully when its step changes; one that
# learned a particular discretisation will not.

# %%
task = get_task("austen", 32)
factors = (0.5, 4.0)
transfer = {name: depth_transfer(run.model, task, factors, 64) for name, run in runs.items()}
print("design  trained   " + "   ".join(f"{f:g}x" for f in factors))
for name, rows in transfer.items():
    trained = runs[name].final["val_bpc"]
    print(f"{name:6s}  {trained:.3f}   " + "   ".join(f"{r['bpc']:.3f} ({r['num_steps']})"
                                                       for r in rows))

# %% [markdown]
# ## The Euler design is the Transformer
#
# With per-layer weights and one block per layer, the Euler post-norm design is the
# parallel-block post-norm `TransformerLM` with projected branches and RMSNorm without gain:
# `to_transformer()` copies the trained weights into one, and the logits agree to float32
# round-off.

# %%
per_layer = TrainConfig(model=model.replace(design="euler", weights="per_layer", num_steps=4),
                        steps=20, batch_size=16, warmup=2, eval_every=0)
trained = train(per_layer, progress=False).model
tokens = jnp.asarray(task.eval_batches(8, 8)[0][0])
ours = nnx.jit(lambda m, t: m(t))(trained, tokens)
theirs = nnx.jit(lambda m, t: m(t))(trained.to_transformer(), tokens)
gap = float(jnp.max(jnp.abs(ours - theirs)))
scale = float(jnp.max(jnp.abs(theirs)))
print(f"max |design - Transformer| = {gap:.2e} (logits up to {scale:.1f})")

# %% [markdown]
# ## Checks

# %%
for name, run in runs.items():
    first = next(r["val_bpc"] for r in run.history if "val_bpc" in r)
    assert run.final["val_bpc"] < 5.0, (name, run.final)  # from 8 bits at a uniform guess
    assert run.final["val_bpc"] <= first, (name, first, run.final)
assert evaluations(catalogue.get("euler"), 8) == evaluations(catalogue.get("rk4"), 2) == 8
assert count_parameters(runs["euler"].model) == count_parameters(runs["rk4"].model)
assert all(np.isfinite(r["bpc"]) for rows in transfer.values() for r in rows)
assert gap <= 1e-5 * scale
print("all checks passed")
