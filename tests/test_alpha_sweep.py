"""The step-size sweep of a pre-norm model's flow (:mod:`svflow_jax.inspection.alpha_sweep`).

Independent expected values: the Transformer's own forward pass (alpha = 1 is the model; a
one-layer parallel model with step alpha is ``x0 + alpha (c_attn + c_ffn)``, its branch
outputs read by :func:`svflow_jax.transformer.lens.residual_contributions`; the splittings'
orderings and the parallel-Euler control are Transformers built from one layer's weights; a
layer's removal is the Transformer with that layer's output maps zeroed), a tighter reference
solve (RK4 with 64 steps per layer of the same scaled field), and for the figures: central
finite differences of the sweep's own rows (the derivative, the profiles' ramp) and a grid
whose best alpha is fixed by the sign of the loss's slope.
"""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from svflow_jax import checkpoints
from svflow_jax.bridge import correspondence
from svflow_jax.diagnose.stats import spearman
from svflow_jax.inspection.alpha_sweep import (
    OUTPUT_MAPS,
    AlphaOptions,
    alpha_sweep,
    inverse_sqrt_profile,
    layer_derivative,
    linear_profile,
    scale_field,
    scale_updates,
    scheme_states,
    sweep_figures,
    sweep_schemes,
)
from svflow_jax.transformer import (
    RoPE,
    TransformerConfig,
    TransformerLM,
    layer_params,
    set_layer_params,
)
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
    names = ("euler/split", "euler/sum", "strang/split", "strang/swapped", "rk4/split",
             "rk4/sum")
    assert set(glob) == {(s, a) for s in names for a in (0.5, 1.0)}
    assert glob[("euler/split", 1.0)]["loss_change"] == pytest.approx(0.0, abs=1e-12)
    changes = {s: glob[(s, 1.0)]["changes"] for s in names}
    assert changes == {"euler/split": "none", "euler/sum": "structure",
                       "strang/split": "structure", "strang/swapped": "structure",
                       "rk4/split": "method", "rk4/sum": "structure and method"}
    for r in glob.values():  # the interval over the 2 windows holds the mean
        assert r["perplexity_low"] < r["perplexity"] < r["perplexity_high"]
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


def _layer_stack(params: dict, layer: int, attention: list[float], ffn: list[float]) -> dict:
    """Layer ``layer``'s weights repeated ``len(attention)`` times, the attention output maps of
    copy ``k`` scaled by ``attention[k]`` and the FFN's by ``ffn[k]``: a Transformer whose
    sub-layers are the sub-steps of one layer of a splitting."""
    out = {k: jnp.stack([v[layer]] * len(attention)) for k, v in params.items()}
    for name, scale in (("wo", attention), ("bo", attention), ("w_down", ffn), ("b_down", ffn)):
        if name in out:
            out[name] = out[name] * jnp.asarray(scale).reshape(-1, *[1] * (out[name].ndim - 1))
    return out


def test_strang_orderings_and_the_parallel_control_are_these_transformers():
    """Independent of the solvers: one layer's ``strang/split`` (half FFN, attention, half FFN)
    is a three-layer sequential Transformer made of that layer's weights with its output maps
    scaled (attention 0, 1, 0; FFN 1/2, 0, 1/2), ``strang/swapped`` the same with (1/2, 0,
    1/2) and (0, 1, 0); ``euler/sum`` is the model with a parallel block. Float64, to
    round-off."""
    lm = _lm(block="sequential", n_layers=1)  # Norm gains 1: the parallel Norm is the same
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]])
    params, x0 = layer_params(lm.transformer), lm.embeddings(tokens)
    names = [s.name for s in sweep_schemes(lm.config, ("euler", "heun", "strang"))]
    assert names == ["euler/split", "euler/sum", "heun/split", "heun/sum", "strang/split",
                     "strang/swapped"]
    three = TransformerLM(dataclasses.replace(lm.config, n_layers=3), rngs=nnx.Rngs(1))
    for scheme, attention, ffn in (("strang/split", [0, 1, 0], [0.5, 0, 0.5]),
                                   ("strang/swapped", [0.5, 0, 0.5], [0, 1, 0])):
        set_layer_params(three.transformer, _layer_stack(params, 0, attention, ffn))
        want = np.asarray(three.transformer.hidden_states(x0)[-1])
        got = np.asarray(scheme_states(lm.config, params, x0, scheme, np.ones(1)))
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=scheme)
    parallel = TransformerLM(dataclasses.replace(lm.config, block="parallel"),
                             rngs=nnx.Rngs(2))
    # a parallel block has one Norm: the sum field is its block when the two gains agree
    shared = dict(params)
    gains = [shared.pop(k) for k in ("norm_attn_gain", "norm_ffn_gain")]
    np.testing.assert_array_equal(gains[0], gains[1])
    set_layer_params(parallel.transformer, {**shared, "norm_gain": gains[0]})
    got = np.asarray(scheme_states(lm.config, params, x0, "euler/sum", np.ones(1)))
    np.testing.assert_allclose(got, np.asarray(parallel.transformer.hidden_states(x0)[-1]),
                               rtol=1e-12, atol=1e-12)


def test_sweep_figures_read_the_argmin_and_the_rankings():
    """Rows whose answers are known: loss ``(alpha - 0.8)^2`` has its best alpha at 0.8 (not
    the argmax, 1.5, nor the first or last of the grid); the layer ranked first is the one with
    the largest ``|change|``, whatever its sign; Spearman of identical rankings is 1."""
    rows = [{"kind": "global", "scheme": "euler/split", "alpha": a, "loss": (a - 0.8) ** 2,
             "perplexity": float(np.exp((a - 0.8) ** 2))} for a in (0.5, 0.8, 1.0, 1.5)]
    rows += [{"kind": "layer", "layer": k, "alpha": 0.0, "loss_change": c}
             for k, c in ((1, 0.2), (2, -0.9), (3, 0.5), (4, 0.1))]
    rows += [{"kind": "derivative", "layer": k, "derivative": -c}
             for k, c in ((1, 0.25), (2, -0.7), (3, 0.45), (4, 0.05))]
    f = sweep_figures(rows)
    assert f["best_alpha"] == {"euler/split": 0.8}
    assert f["layers_by_removal"] == f["layers_that_matter_most"] == [2, 3, 1]
    assert f["layers_by_derivative"] == [2, 3, 1]
    assert f["spearman_derivative_removal"] == pytest.approx(1.0)
    assert f["one_layer_changes_that_lower_the_loss"] == 1


def test_window_interval_is_the_two_sided_t_interval_at_95_percent():
    """``window_interval``'s default level is 95% and two-sided: SciPy's Student-t interval of
    the mean with ``W - 1`` degrees of freedom and the standard error ``s / sqrt(W)``
    (``ddof = 1``), from two windows on; one window has no interval."""
    import scipy.stats

    from svflow_jax.inspection.alpha_sweep import window_interval

    for v in ([1.0, 2.0], [1.0, 2.0, 4.0, 7.0, 3.5]):
        mean, low, high = window_interval(v)
        lo, hi = scipy.stats.t.interval(0.95, len(v) - 1, loc=np.mean(v),
                                        scale=scipy.stats.sem(v))
        assert (mean, low, high) == pytest.approx((np.mean(v), lo, hi), rel=1e-12)
        lo, hi = scipy.stats.t.interval(0.8, len(v) - 1, loc=np.mean(v),
                                        scale=scipy.stats.sem(v))
        assert window_interval(v, 0.8)[1:] == pytest.approx((lo, hi), rel=1e-12)
    mean, low, high = window_interval([3.0])
    assert mean == 3.0 and np.isnan(low) and np.isnan(high)


def test_a_loss_row_pairs_the_windows():
    """The change from the model's loss has the paired interval (the t-interval of the
    per-window differences), not a difference of two intervals: a constant shift of every
    window has a zero-width interval although the windows' losses spread widely."""
    import scipy.stats

    from svflow_jax.inspection.alpha_sweep import _loss_row

    base = np.array([2.0, 3.0, 5.0, 4.0])
    row = _loss_row(base + 0.25, base)
    assert row["loss_change"] == pytest.approx(0.25)
    assert row["loss_change_low"] == pytest.approx(0.25)
    assert row["loss_change_high"] == pytest.approx(0.25)
    lo, hi = scipy.stats.t.interval(0.95, 3, loc=np.mean(base + 0.25),
                                    scale=scipy.stats.sem(base))
    assert row["loss"] == pytest.approx(3.75)
    assert row["perplexity"] == pytest.approx(np.exp(3.75))
    assert (row["perplexity_low"], row["perplexity_high"]) == pytest.approx(
        (np.exp(lo), np.exp(hi)))
    noisy = _loss_row(base + np.array([0.1, -0.1, 0.3, -0.3]), base)
    d = np.array([0.1, -0.1, 0.3, -0.3])
    lo, hi = scipy.stats.t.interval(0.95, 3, loc=d.mean(), scale=scipy.stats.sem(d))
    assert (noisy["loss_change_low"], noisy["loss_change_high"]) == pytest.approx((lo, hi))
    assert noisy["loss_change_low"] < 0 < noisy["loss_change_high"]


def test_sweep_figures_at_their_boundaries():
    """Each scheme its own argmin; a one-layer change of exactly 0 does not lower the loss (a
    tiny negative one does); the best profile is the argmin of its loss; two layers are
    enough for the rank correlations, one is not; ties in importance rank the lower layer
    first."""
    rows = [{"kind": "global", "scheme": s, "alpha": a, "loss": (a - best) ** 2,
             "perplexity": float(np.exp((a - best) ** 2))}
            for s, best in (("euler/split", 1.5), ("rk4", 0.5)) for a in (0.5, 1.0, 1.5)]
    rows += [{"kind": "layer", "layer": k, "alpha": a, "loss_change": c}
             for k, a, c in ((1, 0.0, 0.0), (2, 0.0, -1e-300), (1, 1.5, 0.3), (2, 1.5, 0.3))]
    rows += [{"kind": "derivative", "layer": k, "derivative": g} for k, g in ((1, 0.5),
                                                                           (2, -0.5))]
    rows += [{"kind": "profile", "slope": a, "loss": (a - 0.2) ** 2} for a in (-0.2, 0.2, 0.4)]
    f = sweep_figures(rows)
    assert f["best_alpha"] == {"euler/split": 1.5, "rk4": 0.5}
    assert f["best_perplexity"] == {"euler/split": 1.0, "rk4": 1.0}
    assert f["one_layer_changes_that_lower_the_loss"] == 1
    assert f["best_profile_slope"] == 0.2
    assert f["layers_that_matter_most"] == [1, 2]  # |0.3| both: the lower layer first
    assert f["layers_by_removal"] == [2, 1] and f["layers_by_derivative"] == [1, 2]
    assert f["spearman_derivative_removal"] == pytest.approx(-1.0)  # -g = (-0.5, 0.5)
    assert f["spearman_importance"] != f["spearman_importance"]  # |g| constant: NaN
    one = sweep_figures([r for r in rows if r.get("layer", 1) == 1])
    assert "spearman_derivative_removal" not in one and one["layers_by_removal"] == [1]
    assert "best_profile_slope" not in sweep_figures(rows[:3])


def test_profiles():
    a = linear_profile(0.3, 5)
    np.testing.assert_allclose(a, [0.7, 0.85, 1.0, 1.15, 1.3], rtol=0, atol=1e-15)
    b = inverse_sqrt_profile(4)
    assert b.mean() == pytest.approx(1.0) and b[0] == pytest.approx(2 * b[3])


# ---------------------------------------------------------------------------------------------
# The figures of one sweep of a golden model (float64), against independent computations
# ---------------------------------------------------------------------------------------------

GOLDEN = Path(__file__).parent / "golden" / "llama3_rope"
EPS = float(np.finfo(np.float64).eps)
# Central difference D_h = f' + h^2 f'''/6 + (d+ - d-)/(2 h), |d| <= e_f the round-off of one
# evaluation of the loss: |D_h - f'| <= h^2 M3 / 6 + e_f / h, smallest at h = (3 e_f / M3)^(1/3);
# with e_f ~ eps |f| and M3 ~ |f| (the loss and its third derivative are both O(1) here):
H = (3 * EPS) ** (1 / 3)  # 8.7e-6
H3 = 0.05  # the coarse step of the third differences that estimate M3
DELTA = 1e-3  # the global alpha grid 1 - DELTA, 1, 1 + DELTA


@pytest.fixture(scope="module")
def golden_sweep():
    """One sweep of the tiny Llama of tests/golden (3 layers, float64) on 3 windows of 16
    random tokens: the grid holds the finite differences the tests need (one-layer alphas
    ``1 +- H``, ``1 +- H3``, ``1 +- 2 H3`` and 0; profile slopes likewise), so every figure
    and every check comes from this one run (two compiled schemes: euler/split and the
    euler/sum control)."""
    loaded = checkpoints.load(GOLDEN, dtype=jnp.float64)
    windows = np.random.default_rng(0).integers(0, loaded.config.vocab_size, (3, 17))
    steps = (H, H3, 2 * H3)
    options = AlphaOptions(alphas=(1 - DELTA, 1.0, 1 + DELTA), schemes=("euler",),
                           layer_alphas=(0.0, *sorted(1 + s * d for s in steps
                                                      for d in (-1, 1))),
                           profiles=tuple(sorted(s * d for s in steps for d in (-1, 1))),
                           windows=3)
    return loaded, windows, alpha_sweep(loaded, windows, options)


def _differences(f: dict[float, float]) -> tuple[float, float]:
    """From ``f`` at offsets ``0, +-H, +-H3, +-2 H3``: the central difference with step ``H``
    and the central third difference with step ``H3`` (the estimate of ``M3``)."""
    first = (f[H] - f[-H]) / (2 * H)
    third = (f[2 * H3] - 2 * f[H3] + 2 * f[-H3] - f[-2 * H3]) / (2 * H3**3)
    return first, third


def _roundoff(res) -> float:
    """The round-off of one loss evaluation: the gap between two evaluations of the same loss
    in different operation orders (the model's forward pass and its flow at alpha = 1),
    at least the rounding of the result itself."""
    model = next(r for r in res.rows if r["kind"] == "global"
                 and r["scheme"] == "euler/split" and r["alpha"] == 1.0)
    return max(abs(model["loss"] - res.figures["loss_model"]), EPS * abs(model["loss"]))


def _offsets(rows, key: str, select) -> dict[float, float]:
    """The loss of the selected rows by offset (``key`` - its value at the model), matched to
    the grid's offsets so that ``1 + H - 1`` reads as ``H``."""
    grid = [0.0, H, -H, H3, -H3, 2 * H3, -2 * H3]
    out = {}
    for r in rows:
        if select(r):
            offset = r[key] - (1.0 if key == "alpha" else 0.0)
            match = min(grid, key=lambda g: abs(g - offset))
            if abs(match - offset) < 1e-12:
                out[match] = r["loss"]
    return out


def test_derivative_is_the_central_difference_of_the_per_layer_sweep(golden_sweep):
    """``d loss / d alpha_l`` (one backward pass) against the central difference of the
    sweep's one-layer rows at ``1 +- H``, within the bound ``H^2 M3 / 6 + e_f / H`` derived
    above (``M3`` of each layer from its third difference, ``e_f`` from :func:`_roundoff`);
    all layers agree to 1e-3 relative or better."""
    _, _, res = golden_sweep
    e_f = _roundoff(res)
    deriv = {r["layer"]: r["derivative"] for r in res.rows if r["kind"] == "derivative"}
    assert sorted(deriv) == [1, 2, 3]
    for layer, g in deriv.items():
        f = _offsets(res.rows, "alpha",
                     lambda r, layer=layer: r["kind"] == "layer" and r["layer"] == layer)
        first, third = _differences(f)
        bound = H**2 * abs(third) / 6 + e_f / H
        assert abs(g - first) <= bound, (layer, g, first, bound)
        assert abs(g - first) <= 1e-3 * abs(g), (layer, g, first)


def test_removal_effects_are_the_transformer_without_that_layer(golden_sweep):
    """Layer ``l``'s removal row (``alpha_l = 0``) is the loss of the Transformer itself with
    layer ``l``'s output maps zeroed (float64); the importance rankings by removal and by the
    derivative, and their rank correlation, are those of the rows."""
    loaded, windows, res = golden_sweep
    lm = loaded.model
    params = layer_params(lm.transformer)
    assert [n for n in OUTPUT_MAPS if n in params] == ["wo", "w_down"]
    tokens, targets = jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])
    removal = {}
    for layer in (1, 2, 3):
        cut = dict(params)
        for name in ("wo", "w_down"):
            cut[name] = params[name].at[layer - 1].set(0.0)
        copy = nnx.clone(lm)
        set_layer_params(copy.transformer, cut)
        logp = jax.nn.log_softmax(copy(tokens))
        loss = -float(jnp.take_along_axis(logp, targets[..., None], -1).mean())
        removal[layer] = loss - res.figures["loss_model"]
    rows = {r["layer"]: r for r in res.rows if r["kind"] == "layer" and r["alpha"] == 0.0}
    for layer, change in removal.items():
        assert rows[layer]["loss_change"] == pytest.approx(change, rel=1e-9, abs=1e-13)
    assert res.figures["layers_by_removal"] == sorted(removal, key=lambda k: -abs(removal[k]))
    deriv = {r["layer"]: r["derivative"] for r in res.rows if r["kind"] == "derivative"}
    assert res.figures["layers_by_derivative"] == sorted(deriv, key=lambda k: -abs(deriv[k]))
    np.testing.assert_array_equal(  # the function, as the sweep's rows report it
        layer_derivative(lm, loaded.config, lm.embeddings(tokens), targets),
        [deriv[k] for k in (1, 2, 3)])
    g = np.array([deriv[k] for k in (1, 2, 3)])
    d = np.array([removal[k] for k in (1, 2, 3)])
    assert res.figures["spearman_derivative_removal"] == pytest.approx(float(spearman(-g, d)))


def test_profile_rows_ramp_from_first_to_last_layer(golden_sweep):
    """A profile row with slope ``a`` runs from ``1 - a`` (layer 1) to ``1 + a`` (layer L),
    and its loss is the loss of that ramp: the central difference of the profile rows at
    ``+-H`` is the derivative along the ramp, ``sum_l (d loss / d alpha_l) r_l`` with ``r =
    (-1, 0, 1)`` (bound as for one layer, ``M3`` along the ramp from its third difference); a
    reversed ramp would give the opposite sign, far outside the bound."""
    _, _, res = golden_sweep
    for r in res.rows:
        if r["kind"] == "profile":
            assert (r["alpha_first"], r["alpha_last"]) == pytest.approx(
                (1 - r["slope"], 1 + r["slope"]), abs=1e-15)
    f = _offsets(res.rows, "slope", lambda r: r["kind"] == "profile")
    first, third = _differences(f)
    bound = H**2 * abs(third) / 6 + _roundoff(res) / H
    g = np.array([r["derivative"] for r in res.rows if r["kind"] == "derivative"])
    along = float(g @ np.array([-1.0, 0.0, 1.0]))
    assert abs(along) > 10 * bound  # a sign error shows
    assert abs(along - first) <= bound, (along, first, bound)


def test_best_alpha_follows_the_slope_of_the_loss(golden_sweep):
    """On the grid ``1 - DELTA, 1, 1 + DELTA`` the best alpha is fixed by the sign of the
    slope ``sum_l d loss / d alpha_l`` when the first-order term dominates the second
    (checked from the rows): ``1 - DELTA sign(slope)``."""
    _, _, res = golden_sweep
    slope = sum(r["derivative"] for r in res.rows if r["kind"] == "derivative")
    loss = {r["alpha"]: r["loss"] for r in res.rows
            if r["kind"] == "global" and r["scheme"] == "euler/split"}
    curvature = (loss[1 + DELTA] + loss[1 - DELTA] - 2 * loss[1.0]) / DELTA**2
    assert abs(slope) * DELTA > abs(curvature) * DELTA**2  # the first-order term decides
    assert res.figures["best_alpha"]["euler/split"] == 1 - DELTA * np.sign(slope)
