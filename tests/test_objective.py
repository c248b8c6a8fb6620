"""The hybrid objective's terms against independent NumPy/SciPy evaluations, the bridge against
the model and against ``svflow diagnose``, and the gradient coupling on a tiny model."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from scipy.special import ive, logsumexp

from svflow_jax.objective import (
    attention_j_var,
    class_logits,
    forward_terms,
    gradient_coupling,
    j_align,
    j_var,
    moe_j_var,
    population_kl,
    switch_loss,
    usage_stats,
)
from svflow_jax.transformer import TransformerConfig, TransformerLM


def log_c(kappa, d):
    """log C_d(kappa) by SciPy (exponentially scaled Bessel function)."""
    nu = d / 2 - 1
    return nu * np.log(kappa) - d / 2 * np.log(2 * np.pi) - (np.log(ive(nu, kappa)) + kappa)


def unit(rng, *shape):
    x = rng.normal(size=shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_j_align_is_cross_entropy_and_normalised_logits_are_vmf_loglik():
    rng = np.random.default_rng(0)
    x, eta = unit(rng, 5, 7), rng.normal(size=(4, 7)) * 3
    targets = rng.integers(0, 4, 5)
    logits = class_logits(jnp.asarray(x), jnp.asarray(eta))
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(targets))
    np.testing.assert_allclose(j_align(logits, jnp.asarray(targets)), np.mean(expected), rtol=1e-12)
    w = rng.random(5)
    np.testing.assert_allclose(j_align(logits, jnp.asarray(targets), jnp.asarray(w)),
                               np.sum(w * expected) / w.sum(), rtol=1e-12)
    kappa = np.linalg.norm(eta, axis=-1)
    ref = log_c(kappa, 7)[None, :] + x @ eta.T
    np.testing.assert_allclose(class_logits(jnp.asarray(x), jnp.asarray(eta), normalised=True),
                               ref, rtol=1e-10)


def test_j_var_zero_exactly_at_the_true_posterior():
    rng = np.random.default_rng(1)
    loglik = jnp.asarray(rng.normal(size=(2, 3, 5, 5)) * 4)
    context = jnp.tril(jnp.ones((5, 5), bool))
    from svflow_jax.flow.diagnostics import true_posterior_log
    log_p = true_posterior_log(loglik, context)
    assert np.all(np.asarray(j_var(log_p, loglik, context)) == 0.0)
    other = true_posterior_log(loglik * 0.5, context)
    assert np.all(np.asarray(j_var(other, loglik, context))[..., 1:] > 1e-3)


def test_attention_j_var_against_numpy():
    rng = np.random.default_rng(2)
    H, n, d = 2, 4, 6
    x, eta = unit(rng, n, d), rng.normal(size=(H, n, d)) * 2
    logits = rng.normal(size=(H, n, n))
    context = np.tril(np.ones((n, n), bool))
    probs = np.exp(np.where(context, logits, -np.inf) - logsumexp(
        np.where(context, logits, -np.inf), axis=-1, keepdims=True))
    got = attention_j_var(jnp.asarray(probs), jnp.asarray(x), jnp.asarray(eta),
                          jnp.asarray(context))
    kl = []
    for h in range(H):
        for i in range(n):
            js = np.arange(i + 1)
            ll = np.array([log_c(np.linalg.norm(eta[h, j]), d) + eta[h, j] @ x[i] for j in js])
            logp = ll - logsumexp(ll)  # uniform prior cancels
            q = probs[h, i, js]
            kl.append(np.sum(q * (np.log(q) - logp)))
    np.testing.assert_allclose(got, np.mean(kl), rtol=1e-10)


def test_moe_j_var_against_numpy_and_its_kappa_gradient():
    rng = np.random.default_rng(3)
    T, E, d = 5, 4, 8
    x, scores = unit(rng, T, d), rng.normal(size=(T, E, d)) * 2
    logits = rng.normal(size=(T, E))
    got = moe_j_var(jnp.asarray(logits), jnp.asarray(x), jnp.asarray(scores))
    for t in range(T):
        ll = log_c(np.linalg.norm(scores[t], axis=-1), d) + scores[t] @ x[t]
        logp = ll - logsumexp(ll)
        logq = logits[t] - logsumexp(logits[t])
        np.testing.assert_allclose(got[t], np.sum(np.exp(logq) * (logq - logp)), rtol=1e-10)

    # d J_var / d c at scores * c (every kappa_e scaled by c): jax.grad (exact d log C_d /
    # d kappa = -A_d) against a central finite difference in float64.
    def f(c):
        return jnp.sum(moe_j_var(jnp.asarray(logits), jnp.asarray(x), jnp.asarray(scores) * c))

    h = 1e-5
    fd = (f(1.3 + h) - f(1.3 - h)) / (2 * h)
    np.testing.assert_allclose(jax.grad(f)(1.3), fd, rtol=1e-7)


def test_population_kl_and_switch_loss_by_hand():
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [3.0, 0.0, 1.0], [0.0, 0.0, 0.5]])
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    qbar = probs.mean(0)
    np.testing.assert_allclose(population_kl(jnp.asarray(probs)),
                               np.sum(qbar * np.log(3 * qbar)), rtol=1e-12)
    # top-1: experts 0, 1, 0, 2 -> f = (1/2, 1/4, 1/4); loss = 3 sum_e f_e P_e.
    f = np.array([0.5, 0.25, 0.25])
    np.testing.assert_allclose(switch_loss(jnp.asarray(logits), 1), 3 * np.sum(f * qbar),
                               rtol=1e-12)
    # top-2 slots: {0,1},{1,0},{0,2},{2,0} (ties to the lower index) -> counts 4, 2, 2 of 8.
    np.testing.assert_allclose(switch_loss(jnp.asarray(logits), 2), 3 * np.sum(f * qbar),
                               rtol=1e-12)
    # the gradient flows through P only (f is a count): d/dlogits of 3 sum_e f_e P_e.
    g = jax.grad(lambda a: switch_loss(a, 1))(jnp.asarray(logits))
    jac = probs[:, :, None] * (np.eye(3)[None] - probs[:, None, :])  # dP_t,e / dlogit_t,k
    np.testing.assert_allclose(g, 3 * np.einsum("e,tek->tk", f, jac) / 4, rtol=1e-10)
    balanced = usage_stats(jnp.full((4,), 0.25))
    assert math.isclose(float(balanced["usage_entropy"]), math.log(4), rel_tol=1e-12)
    assert float(balanced["max_load"]) == 1.0 and int(balanced["dead"]) == 0
    collapsed = usage_stats(jnp.asarray([1.0, 0.0, 0.0, 0.0]))
    assert abs(float(collapsed["usage_entropy"])) < 1e-12
    assert float(collapsed["max_load"]) == 4.0 and int(collapsed["dead"]) == 3


@pytest.fixture(scope="module")
def tiny():
    def make(ffn, top_k=2, **kw):
        extra = dict(n_experts=4, top_k=top_k) if ffn == "moe" else {}
        cfg = TransformerConfig(d_model=16, n_layers=2, n_heads=2, d_head=8, d_ff=16,
                                norm_position=kw.pop("norm_position", "pre"), causal=True,
                                ffn=ffn, vocab_size=20, n_positions=8, **extra, **kw)
        return TransformerLM(cfg, rngs=nnx.Rngs(0))

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 20, (2, 9)))
    return make, tokens


def test_bridge_reproduces_the_model_and_the_diagnose_kl(tiny):
    from svflow_jax.diagnose.extract import window_diagnostics
    make, tokens = tiny
    inputs = tokens[:1, :-1]
    terms_of = nnx.jit(forward_terms)
    model = make("moe")
    logits, t = terms_of(model, inputs)
    np.testing.assert_allclose(logits, model(inputs), atol=1e-5)
    summ = window_diagnostics(model, np.asarray(inputs), np.arange(8)[None], scored=8)
    # the objective's J_var reads eta in the model's units (diagnose's kl_q_p_model; its
    # kl_q_p is defined in flow units, eta / sqrt(d))
    np.testing.assert_allclose(t.attn_j_var, summ.kl_q_p_model[:, 0].mean(-1), rtol=2e-3,
                               atol=1e-7)
    np.testing.assert_allclose(t.attn_entropy, summ.entropy[:, 0].mean(-1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(t.load).sum(-1), 1.0, rtol=1e-6)
    dense = make("gelu", norm_position="post", block="parallel")
    logits, t = terms_of(dense, inputs)
    np.testing.assert_allclose(logits, dense(inputs), atol=1e-5)
    assert t.moe_j_var is None and t.load is None


def test_coupling_on_a_tiny_model(tiny):
    make, tokens = tiny
    c = gradient_coupling(make("moe"), tokens[:, :-1], tokens[:, 1:])
    for a in (c.attn_cos, c.ffn_cos, c.attn_token_cos, c.ffn_token_cos):
        assert a.shape == (2,) and np.all(np.abs(a) <= 1 + 1e-6)
    assert np.all(c.attn_norm_ratio > 0) and np.all(c.ffn_norm_ratio > 0)
    # top-1 routing renormalised over one expert: the weight is exactly 1, so the posterior
    # path carries no gradient at all (ratio 0, cosine undefined).
    c1 = gradient_coupling(make("moe", top_k=1), tokens[:, :-1], tokens[:, 1:])
    assert np.all(c1.ffn_norm_ratio == 0) and np.all(np.isnan(c1.ffn_cos))
    # one token: the attention posterior is the constant 1 and moves nothing.
    c2 = gradient_coupling(make("gelu"), tokens[:, :1], tokens[:, 1:2])
    assert np.all(c2.attn_norm_ratio == 0) and np.all(np.isnan(c2.ffn_cos))


def test_macaron_blocks_are_read_by_the_objective_and_the_diagnostics(tiny):
    """A macaron block (F(h/2) A(h) F(h/2)) is read from its own forward pass: the objective's
    logits are the model's, and both readers' attention posteriors are those of the stream
    entering the attention sub-step (``hidden_states(substeps=True)``, an independent path),
    whose entropy is recomputed here with NumPy."""
    from svflow_jax.diagnose.extract import window_diagnostics

    make, tokens = tiny
    inputs = tokens[:1, :-1]
    model = make("moe", block="macaron")
    logits, t = nnx.jit(forward_terms)(model, inputs)
    np.testing.assert_allclose(logits, model(inputs), atol=1e-5)
    np.testing.assert_allclose(np.asarray(t.load).sum(-1), 1.0, rtol=1e-6)
    summ = window_diagnostics(model, np.asarray(inputs), np.arange(8)[None], scored=8)
    states = model.hidden_states(inputs, substeps=True)  # (3 L + 1, 1, n, d)
    causal = np.tril(np.ones((8, 8), bool))
    for layer_index in range(2):
        layer = model.transformer.layer(layer_index)
        q = np.asarray(layer.attn.attention_weights(layer.norm_attn(states[3 * layer_index + 1])),
                       np.float64)[0]  # (H, n, n)
        logq = np.log(np.where(causal, q, 1.0))
        entropy = -np.sum(np.where(causal, q * logq, 0.0), -1).mean(-1)  # (H,)
        np.testing.assert_allclose(summ.entropy[layer_index, 0], entropy, rtol=1e-5)
        np.testing.assert_allclose(t.attn_entropy[layer_index], entropy.mean(), rtol=1e-5)


def test_one_check_of_what_the_bridge_reads():
    """The diagnostics, the objective and the correspondence ask the same function."""
    from svflow_jax.bridge import correspondence, readout
    from svflow_jax.diagnose import extract
    from svflow_jax.objective import bridge

    assert extract.check_supported is bridge.check_supported is readout.check_supported
    config = TransformerConfig(d_model=16, n_layers=1, n_heads=2, d_head=8, d_ff=16,
                               norm="layer", block="macaron")
    readout.check_supported(config)  # the readout reads it
    with pytest.raises(ValueError, match="not an SVFlow discretisation: norm='layer'"):
        correspondence.check_supported(config)
    with pytest.raises(ValueError, match="not an SVFlow discretisation: norm='layer'"):
        readout.check_supported(config, flow=True)
    with pytest.raises(ValueError, match="reads a TransformerLM or TransformerConfig"):
        readout.check_supported("gpt2")


def test_coupling_proxies_against_a_hand_written_layer():
    """The three coupling proxies of one pre-norm attention layer against an independent
    computation: the model written out by hand (embeddings, RMSNorm, causal attention with the
    posterior reading ``z + d_post`` and the values ``z + d_score``, GELU FFN, final Norm,
    unembedding), its two input gradients by ``jax.grad`` and the proxies in NumPy. With the
    stop-gradient control the posterior path carries exactly no gradient."""
    cfg = TransformerConfig(d_model=8, n_layers=1, n_heads=2, d_head=4, d_ff=16,
                            norm_position="pre", causal=True, ffn="gelu", vocab_size=11,
                            n_positions=6, param_dtype=jnp.float64, init_std=0.5)
    model = TransformerLM(cfg, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 11, (3, 7)))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    layer = model.transformer.layer(0)
    p = {k: jnp.asarray(v) for k, v in dict(
        embed=model.embed[...], pos=model.pos_embed[...], g1=layer.norm_attn.gain[...],
        g2=layer.norm_ffn.gain[...], g3=model.transformer.final_norm.gain[...],
        wq=layer.attn.wq[...], wk=layer.attn.wk[...], wv=layer.attn.wv[...],
        wo=layer.attn.wo[...], w_in=layer.ffn.w_in[...], w_out=layer.ffn.w_out[...],
        unembed=model.unembed[...]).items()}

    def rms(x, g):
        return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * g

    def loss(d_post, d_score):
        x0 = p["embed"][inputs] + p["pos"][:6]
        z = rms(x0, p["g1"])
        q = jnp.einsum("bnd,dhk->bhnk", z + d_post, p["wq"])
        k = jnp.einsum("bnd,dhk->bhnk", z + d_post, p["wk"])
        v = jnp.einsum("bnd,dhk->bhnk", z + d_score, p["wv"])
        s = jnp.einsum("bhik,bhjk->bhij", q, k) / 2.0
        s = jnp.where(np.tril(np.ones((6, 6), bool)), s, -np.inf)
        a = jnp.einsum("bhij,bhjk,hkd->bid", jax.nn.softmax(s, -1), v, p["wo"])
        x1 = x0 + a
        x2 = x1 + jax.nn.gelu(rms(x1, p["g2"]) @ p["w_in"], approximate=False) @ p["w_out"]
        # the coupling's loss reads the logits in float32 (mechanism._coupling), so does this
        logp = jax.nn.log_softmax((rms(x2, p["g3"]) @ p["unembed"]).astype(jnp.float32), -1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    zero = jnp.zeros((3, 6, 8))
    gp, gs = (np.asarray(g, np.float64) for g in jax.grad(loss, argnums=(0, 1))(zero, zero))
    cos = np.sum(gp * gs) / np.sqrt(np.sum(gp**2) * np.sum(gs**2))
    token = np.mean(np.sum(gp * gs, -1) / np.sqrt(np.sum(gp**2, -1) * np.sum(gs**2, -1)))
    share = np.sum(gp * (gp + gs)) / np.sum((gp + gs) ** 2)
    c = gradient_coupling(model, inputs, targets)
    np.testing.assert_allclose(c.attn_cos[0], cos, rtol=1e-8)
    np.testing.assert_allclose(c.attn_token_cos[0], token, rtol=1e-8)
    np.testing.assert_allclose(c.attn_post_share[0], share, rtol=1e-8)
    np.testing.assert_allclose(c.attn_norm_ratio[0],
                               np.linalg.norm(gp) / np.linalg.norm(gs), rtol=1e-8)
    assert abs(cos - token) > 1e-3 and 0 < share < 1  # three different numbers
    assert np.all(np.isnan(c.ffn_post_share))  # a dense FFN has no posterior
    cut = TransformerLM(dataclasses.replace(cfg, qk_stop_gradient=True), rngs=nnx.Rngs(3))
    c_cut = gradient_coupling(cut, inputs, targets)
    assert c_cut.attn_post_share[0] == 0.0 and np.isnan(c_cut.attn_cos[0])
