"""The step-size sweep of a pre-norm model's flow (:mod:`svflow_jax.inspection.alpha_sweep`).

Independent expected values: the Transformer's own forward pass (alpha = 1 is the model; a
one-layer parallel model with step alpha is ``x0 + alpha (c_attn + c_ffn)``, its branch
outputs read by :func:`svflow_jax.transformer.lens.residual_contributions`), and a tighter
reference solve (RK4 against 512 Euler sub-steps of the same scaled field).
"""

from __future__ import annotations

import types

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from svflow_jax.bridge import correspondence
from svflow_jax.inspection.alpha_sweep import (
    AlphaOptions,
    alpha_sweep,
    scale_field,
    scale_updates,
    scheme_states,
)
from svflow_jax.transformer import RoPE, TransformerConfig, TransformerLM, layer_params
from svflow_jax.transformer.lens import residual_contributions

jax.config.update("jax_enable_x64", True)


def _lm(seed=0, **kw) -> TransformerLM:
    base = dict(d_model=16, n_layers=3, n_heads=4, d_head=4, d_ff=24, norm_position="pre",
                causal=True, ffn="swiglu", rope=RoPE(theta=100.0), vocab_size=40,
                param_dtype=jnp.float64, init_std=0.3, use_bias=False)
    base.update(kw)
    return TransformerLM(TransformerConfig(**base), rngs=nnx.Rngs(seed))


def test_alpha_one_is_the_model_for_every_block():
    for block in ("sequential", "parallel", "macaron"):
        lm = _lm(block=block)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (2, 6)))
        x0 = lm.embeddings(tokens)
        ys = scheme_states(lm.config, layer_params(lm.transformer), x0, "euler", np.ones(3))
        np.testing.assert_allclose(np.asarray(ys), np.asarray(lm.hidden_states(tokens)[-1]),
                                   rtol=1e-12, atol=1e-12)


def test_one_parallel_layer_with_step_alpha_is_the_scaled_branch_sum():
    lm = _lm(block="parallel", n_layers=1, ffn="gelu", use_bias=True)
    tokens = jnp.asarray([3, 1, 4, 1, 5])
    c = np.asarray(residual_contributions(lm, tokens))  # embedding, attn, ffn
    for a in (0.0, 0.5, 1.7):
        ys = scheme_states(lm.config, layer_params(lm.transformer), lm.embeddings(tokens),
                           "euler", np.array([a]))
        np.testing.assert_allclose(np.asarray(ys), c[0] + a * (c[1] + c[2]), rtol=1e-12,
                                   atol=1e-12)


@pytest.mark.parametrize("kw", [dict(ffn="swiglu"), dict(ffn="gelu", use_bias=True),
                                dict(ffn="moe", n_experts=3, top_k=2, expert_ffn="swiglu",
                                     use_bias=True)], ids=["swiglu", "gelu-bias", "moe-bias"])
def test_scaling_the_flow_is_scaling_the_weights(kw):
    """The sweep scales the output maps of the flow it built once (``scale_field``); that is
    the flow of the weights scaled before the conversion (``scale_updates``), leaf by leaf: the
    output maps are passed through by ``to_flow`` (the output bias divided by ``rho``: the two
    orders round once each, hence 2 ulp), every other leaf untouched."""
    lm = _lm(block="sequential", **kw)
    rng = np.random.default_rng(1)  # biases start at 0: give them values that show a change
    params = {k: v + rng.normal(size=v.shape) if k.startswith("b") else v
              for k, v in layer_params(lm.transformer).items()}
    alpha = jnp.asarray([0.0, 0.7, 1.9])
    ours = scale_field(correspondence.to_flow(lm.config, params), alpha)
    theirs = correspondence.to_flow(lm.config, scale_updates(params, alpha))
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=4.5e-16, atol=0)
    changed = [not np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(ours), jax.tree.leaves(correspondence.to_flow(lm.config, params)),
        strict=True)]
    assert sum(changed) == 2 + 2 * kw.get("use_bias", False)  # W_O, W_2 (and b_O, b_2)


def test_rk4_and_heun_solve_the_scaled_flow_at_their_orders():
    """One step per layer of the scaled sum field, against RK4 with 64 steps per layer of the
    same flow: halving the step (2 steps per layer) divides RK4's error by about 2^4 and
    Heun's by about 2^2, so the scheme integrates the scaled ODE, not another one."""
    import dataclasses

    from svflow_jax.solvers import RK4

    lm = _lm(block="sequential", init_std=0.1)
    tokens = jnp.asarray([7, 2, 9, 4, 11, 3])
    params, x0 = layer_params(lm.transformer), lm.embeddings(tokens)
    alpha = np.array([0.6, 1.0, 1.4])
    flow = correspondence.to_flow(lm.config, scale_updates(params, jnp.asarray(alpha)))
    par = dataclasses.replace(lm.config, block="parallel")
    ref = correspondence.flow_states(flow, par, x0, RK4(), steps_per_layer=64)[-1]
    for scheme, solver, order in (("rk4", RK4(), 4), ("heun", diffrax.Heun(), 2)):
        e1 = float(jnp.max(jnp.abs(scheme_states(lm.config, params, x0, scheme, alpha) - ref)))
        two = correspondence.flow_states(flow, par, x0, solver, steps_per_layer=2)[-1]
        e2 = float(jnp.max(jnp.abs(two - ref)))
        assert 2 ** (order - 1) < e1 / e2 < 2 ** (order + 1), (scheme, e1, e2)


def test_sweep_rows_and_the_layers_that_matter():
    lm = _lm(block="sequential")
    loaded = types.SimpleNamespace(model=lm, config=lm.config)
    windows = np.random.default_rng(1).integers(0, 40, (2, 9))
    opts = AlphaOptions(alphas=(0.5, 1.0), schemes=("euler", "strang", "rk4"),
                        layer_alphas=(0.0,), profiles=(0.3,))
    res = alpha_sweep(loaded, windows, opts)
    glob = {(r["scheme"], r["alpha"]): r for r in res.rows if r["kind"] == "global"}
    assert set(glob) == {(s, a) for s in ("euler", "strang", "rk4") for a in (0.5, 1.0)}
    assert glob[("euler", 1.0)]["loss_change"] == pytest.approx(0.0, abs=1e-12)
    logp = jax.nn.log_softmax(lm(jnp.asarray(windows[:, :-1])))
    want = -float(jnp.take_along_axis(logp, jnp.asarray(windows[:, 1:])[..., None], -1).mean())
    # the loss is read in float32 (as inspect does): float32 round-off of a mean of logs
    assert res.figures["loss_model"] == pytest.approx(want, rel=2e-7)
    layer_rows = [r for r in res.rows if r["kind"] == "layer"]
    assert [r["layer"] for r in layer_rows] == [1, 2, 3]
    ranked = sorted(layer_rows, key=lambda r: -abs(r["loss_change"]))
    assert res.figures["layers_that_matter_most"] == [r["layer"] for r in ranked]
    with pytest.raises(ValueError, match="must include 1"):
        AlphaOptions(alphas=(0.5,))
    with pytest.raises(ValueError, match="schemes: unknown methods"):
        AlphaOptions(schemes=("nope",))
