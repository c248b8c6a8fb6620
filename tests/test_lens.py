"""The logit lens and the direct-logit decomposition (:mod:`svflow_jax.transformer.lens`).

Independent expected values: the model's own forward pass (its logits and its sub-step hidden
states) and a NumPy recomputation of the final Norm. The decomposition must sum to the logits to
float64 round-off on small random pre-norm models of every block type and both Norms, and each
branch's contribution must equal the change of the residual stream it makes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from svflow_jax.transformer import RoPE, TransformerConfig, TransformerLM
from svflow_jax.transformer.lens import (
    component_names,
    decompose_logits,
    logit_lens,
    residual_contributions,
)

jax.config.update("jax_enable_x64", True)


def _model(seed=0, **kw) -> TransformerLM:
    base = dict(d_model=16, n_layers=3, n_heads=4, d_head=4, d_ff=24, norm_position="pre",
                causal=True, ffn="swiglu", rope=RoPE(theta=100.0), vocab_size=40,
                param_dtype=jnp.float64, init_std=0.3)
    base.update(kw)
    model = TransformerLM(TransformerConfig(**base), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for path, p in nnx.iter_graph(model):  # random gains and biases (built as 1 and 0)
        if isinstance(p, nnx.Param) and (str(path[-1]).startswith("b") or "gain" in
                                           str(path[-1])):
            p[...] = p[...] + 0.2 * jnp.asarray(rng.normal(size=p.shape))
    if model.unembed_bias is not None:  # a head bias of the logits' own size
        model.unembed_bias[...] = jnp.asarray(rng.normal(size=model.unembed_bias.shape))
    return model


CASES = [
    dict(block="sequential"),
    dict(block="parallel", norm="layer", use_bias=True, ffn="gelu"),
    dict(block="macaron", tie_embeddings=True),
    dict(block="sequential", norm="layer", use_bias=True, final_norm=False),
    dict(block="sequential", head_bias=True),
    dict(block="parallel", norm="layer", use_bias=True, ffn="gelu", head_bias=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_contributions_sum_to_the_logits_in_float64(case):
    model = _model(**case)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 40, size=(2, 7)))
    dec = decompose_logits(model, tokens)
    np.testing.assert_allclose(np.asarray(dec.logits), np.asarray(model(tokens)), rtol=0)
    total = dec.contributions.sum(0) + dec.bias + dec.head_bias
    assert float(jnp.max(jnp.abs(total - dec.logits)) / jnp.max(jnp.abs(dec.logits))) < 1e-12
    assert dec.remainder < 1e-12 and dec.roundoff and dec.remainder <= dec.remainder_bound
    # the bound is float64 round-off of a sum of c + d + 2 parts, not a loose catch-all
    assert dec.remainder_bound < 1e-11
    beta = (np.zeros(40) if model.unembed_bias is None
            else np.asarray(model.unembed_bias[...]))
    np.testing.assert_array_equal(np.asarray(dec.head_bias),
                                  np.broadcast_to(beta, dec.head_bias.shape))
    if case.get("head_bias"):  # the head bias is a part of its own: without it, no sum
        gap = jnp.max(jnp.abs(dec.logits - dec.contributions.sum(0) - dec.bias))
        assert float(gap / jnp.max(jnp.abs(dec.logits))) > 100 * dec.remainder_bound
    assert dec.contributions.shape[0] == len(dec.names) == len(component_names(model))
    # every layer matters: no contribution is identically zero
    assert np.all(np.abs(np.asarray(dec.contributions)).max(axis=(1, 2, 3)) > 1e-3)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c["block"])
def test_branch_contributions_are_the_residual_increments(case):
    model = _model(**case)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 40, size=(5,)))
    c = np.asarray(residual_contributions(model, tokens))
    states = np.asarray(model.hidden_states(tokens, substeps=True))
    np.testing.assert_allclose(c[0], states[0], rtol=0, atol=0)
    per_state = 2 if case["block"] == "parallel" else 1  # parallel: both branches, one sub-step
    steps = c[1:].reshape(-1, per_state, *c.shape[1:]).sum(1)
    np.testing.assert_allclose(np.cumsum(steps, 0) + c[0], states[1:], rtol=1e-12, atol=1e-12)


def test_selected_token_ids_and_the_final_norm_by_hand():
    model = _model(block="sequential", norm="layer", use_bias=True)
    tokens = jnp.asarray([3, 9, 1, 22, 5])
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 40, size=(5, 3)))
    dec = decompose_logits(model, tokens, ids)
    full = decompose_logits(model, tokens)
    np.testing.assert_allclose(np.asarray(dec.contributions),
                               np.take_along_axis(np.asarray(full.contributions),
                                                  np.asarray(ids)[None], -1), rtol=1e-13)
    # the embedding's contribution by hand: centre, divide by the final state's spread, gain
    c = np.asarray(residual_contributions(model, tokens))
    xf = c.sum(0)
    xc = xf - xf.mean(-1, keepdims=True)
    norm = model.transformer.final_norm
    r = 1 / np.sqrt((xc ** 2).mean(-1, keepdims=True) + norm.eps)
    e = (c[0] - c[0].mean(-1, keepdims=True)) * r * np.asarray(norm.gain[...])
    w = np.asarray(model.unembed[...])
    np.testing.assert_allclose(np.asarray(full.contributions[0]), e @ w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(full.bias[0]), np.asarray(norm.bias[...]) @ w,
                               rtol=1e-12)


def test_a_remainder_above_its_bound_is_not_called_round_off():
    """``roundoff`` is decided by the computed bound, on both sides of it."""
    model = _model(block="sequential", head_bias=True)
    dec = decompose_logits(model, jnp.asarray([3, 9, 1]))
    assert dec.roundoff
    above = dataclasses.replace(dec, remainder=dec.remainder_bound * 1.01)
    at = dataclasses.replace(dec, remainder=dec.remainder_bound)
    assert not above.roundoff and at.roundoff
    # float32 rounding units: a bound in float32 epsilons is 2^29 times float64's
    wide = decompose_logits(model, jnp.asarray([3, 9, 1]), eps=float(np.finfo(np.float32).eps))
    assert wide.remainder_bound == pytest.approx(
        dec.remainder_bound * np.finfo(np.float32).eps / np.finfo(np.float64).eps, rel=1e-12)


def test_logit_lens_ends_at_the_model_and_reads_every_sub_step():
    model = _model(block="sequential")
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 40, size=(9,)))
    targets = jnp.roll(tokens, -1)
    lens = logit_lens(model, tokens, targets, top_k=4)
    L = model.config.n_layers
    assert lens.top_ids.shape == (2 * L + 1, 9, 4) and len(lens.labels) == 2 * L + 1
    logits = model(tokens)
    np.testing.assert_array_equal(np.asarray(lens.top_ids[-1]),
                                  np.asarray(jax.lax.top_k(logits, 4)[1]))
    logp = jax.nn.log_softmax(logits)
    want = -float(jnp.take_along_axis(logp, targets[:, None], -1).mean())
    assert float(lens.loss[-1]) == pytest.approx(want, rel=1e-12)
    assert lens.labels[0] == "embedding" and lens.labels[-1] == f"after layer {L} ffn"


def test_post_norm_is_refused():
    model = _model(block="sequential", norm_position="post")
    with pytest.raises(ValueError, match="pre-norm model"):
        decompose_logits(model, jnp.asarray([1, 2]))
