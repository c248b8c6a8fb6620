"""The flow side of real (pre-norm) checkpoints, and the measurements of ``svflow inspect``.

* ``to_flow`` of the tiny random Llama, Llama-3-RoPE, Qwen2, Qwen3, GPT-2, GPT-NeoX and Gemma
  models of ``tests/golden`` (weights from Hugging Face transformers; RoPE, GQA, RMSNorm eps and
  gains, Q/K/V biases, per-head query/key RMSNorm; LayerNorm with bias, partial rotary, GeGLU)
  reproduces every hidden state to round-off: within ``C_FLOAT32 L eps s`` (``L`` layers, ``s``
  the largest token norm, ``eps`` of float64 or of the float32 matrix multiply in force), the
  rule of every exactness claim. Dropping any one ingredient from the flow (eps, the rotation, the
  offsets, the kernel gains, the centring, the GeGLU's GELU) moves the states by >= 1e-6: the
  check can fail. The partial rotation is checked against RoPE written the model's way, and
  the families' weights come back from their flows.
* BERT (post-LayerNorm) is refused by ``to_flow`` and reported with its departure from a sphere.
* :class:`WithinStep` against Heun written out by hand on a two-layer ambient ODE.
* The inspection measurements against closed forms (a known rotation and growth of the
  tokens, identical layers) and, on a tiny Llama, the refinement study recovers first order
  (Richardson ratios approaching 2), where the steps are small for the flow.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import diffrax
import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from models_for_tests import GOLDEN_DECODERS as DECODERS

from svflow_jax.bridge import correspondence
from svflow_jax.checkpoints import load_hf
from svflow_jax.claims.measure import C_FLOAT32, exactness_tolerance
from svflow_jax.flow import AttentionField, ExpertsField, PiecewiseConstant
from svflow_jax.inspection import study as inspection
from svflow_jax.solvers import WithinStep
from svflow_jax.transformer import layer_params

GOLDEN = Path(__file__).parent / "golden"
_LOADED: dict[str, object] = {}


def loaded(name: str):
    if name not in _LOADED:
        _LOADED[name] = load_hf(GOLDEN / name)
    return _LOADED[name]


def first_sequence(name: str) -> np.ndarray:
    """The unpadded first sequence of the golden inputs (22 or 13 tokens)."""
    with np.load(GOLDEN / name / "golden.npz") as g:
        valid = g["attention_mask"][0].astype(bool)
        return g["input_ids"][0][valid]


@pytest.mark.parametrize("name", DECODERS)
def test_tiny_decoders_are_exactly_their_flow(name):
    result = inspection.exactness(loaded(name), first_sequence(name))
    f = result.figures
    assert result.passed is True
    # Two orderings of the same float operations: the rule of every exactness claim
    # (svflow_jax.claims.measure, C_FLOAT32 L eps s: each side rounds a layer's new state to a
    # few eps of the largest token norm s, and the differences add over the L layers), with
    # float64's eps or the float32 matrix multiply's in force. Measured: C = 0.4-1.3 in both.
    layers = loaded(name).config.n_layers
    eps64 = float(np.finfo(np.float64).eps)
    assert f["max_abs_diff_float64"] <= C_FLOAT32 * layers * eps64 * f["scale"], f
    assert f["max_abs_diff_float32"] <= exactness_tolerance("float32", layers, f["scale"]), f
    assert f["scale"] > 1.0  # states of size O(1-10): 1e-12 is round-off, not a small state


def _gap(config, params, x, flow):
    """Largest difference between the model's states and ``flow``'s, float64."""
    from svflow_jax.transformer import Transformer

    states = Transformer.from_layer_params(config, params).hidden_states(x)
    ys = correspondence.flow_states(flow, config, states[0])
    return float(jnp.max(jnp.abs(ys - states[1:])))


@pytest.mark.parametrize("name, remove", [
    ("llama_gqa_tied", "eps"), ("llama_gqa_tied", "rotation_frequencies"),
    ("qwen2", "query_offset"), ("qwen2", "natural_offset"), ("qwen3", "kernel_gain_query"),
    ("gpt2", "centred"), ("gpt2", "query_offset"), ("gpt_neox", "rotation_frequencies"),
    ("gemma", "phi"),
])
def test_each_ingredient_matters(name, remove):
    """The exactness above is not vacuous: the flow without one ingredient is off by far more
    than round-off."""
    lm, config, _ = loaded(name)
    config = dataclasses.replace(config, param_dtype=jnp.float64)
    params = {k: v.astype(jnp.float64) for k, v in layer_params(lm.transformer).items()}
    x = lm.embeddings(jnp.asarray(first_sequence(name))[None]).astype(jnp.float64)
    flow = correspondence.to_flow(config, params)
    assert _gap(config, params, x, flow) <= 1e-12
    if remove in ("eps", "centred"):  # read y / sqrt(|y|^2) or the uncentred y
        broken = dataclasses.replace(flow, **{remove: {"eps": 0.0, "centred": False}[remove]})
    elif remove == "phi":  # SiLU in place of GeGLU's tanh-GELU
        theta = flow.experts.params.anchors
        theta = dataclasses.replace(theta, experts=dataclasses.replace(theta.experts, phi=None))
        broken = dataclasses.replace(flow, experts=ExpertsField(
            PiecewiseConstant(theta, flow.step), top_k=config.top_k, radius=flow.radius))
    else:
        theta = flow.attention.params.anchors
        theta = dataclasses.replace(theta, **{remove: None})
        if remove == "kernel_gain_query":  # both gains go together (qk-norm)
            theta = dataclasses.replace(theta, kernel_gain_key=None)
        broken = dataclasses.replace(flow, attention=AttentionField(
            PiecewiseConstant(theta, flow.step), causal=True))
    assert _gap(config, params, x, broken) >= 1e-6


@pytest.mark.parametrize("rotary", [2, 4, 6])
def test_partial_rotary_is_the_kernels_rotation_of_permuted_coordinates(rotary):
    """RoPE on the first ``r`` of ``k = 8`` coordinates (rotate-half within them, the model's
    ``apply_rope``) gives the scores of the kernel's whole-head rotation (``rotate_pairs``) of
    the coordinates permuted by ``to_flow`` with the frequencies padded by zeros: every
    ``<R_i q_i, R_j k_j>`` agrees to round-off; without the permutation they do not."""
    from svflow_jax.flow.attention import rotate_pairs
    from svflow_jax.transformer import RoPE, TransformerConfig
    from svflow_jax.transformer.model import apply_rope

    k, n = 8, 5
    config = TransformerConfig(d_model=16, n_layers=1, n_heads=2, d_head=k, d_ff=8,
                               rope=RoPE(10.0, rotary_dim=rotary))
    rng = np.random.default_rng(rotary)
    q, key = (jnp.asarray(rng.standard_normal((n, 1, k))) for _ in range(2))
    positions = jnp.arange(n)
    inv = config.rope.inv_freq(k)
    model = jnp.einsum("ik,jk->ij", apply_rope(q, positions, inv)[:, 0],
                       apply_rope(key, positions, inv)[:, 0])
    order = correspondence._rotary_order(config)
    assert sorted(np.asarray(order).tolist()) == list(range(k))  # a permutation
    omega = jnp.zeros(k // 2).at[: rotary // 2].set(inv)
    def kernel(perm):
        a, b = (rotate_pairs(v[:, 0][:, perm], positions, omega) for v in (q, key))
        return a @ b.T
    np.testing.assert_allclose(kernel(order), model, rtol=1e-13, atol=1e-13)
    assert np.max(np.abs(kernel(jnp.arange(k)) - model)) > 1e-2


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox", "gemma"])
def test_families_come_back_from_their_flows(name):
    """``to_transformer_params(to_flow(p)) = p`` in float64 for the LayerNorm, partial-rotary
    and GeGLU families: the LayerNorm biases' images ``b W`` are taken off the offsets again
    and the rotated coordinates put back in order (measured at most 6.8e-17 times the
    largest entry of an array, plus one)."""
    lm, config, _ = loaded(name)
    config = dataclasses.replace(config, param_dtype=jnp.float64)
    params = {k: v.astype(jnp.float64) for k, v in layer_params(lm.transformer).items()}
    back = correspondence.to_transformer_params(correspondence.to_flow(config, params), config)
    assert set(back) == set(params)
    for key, value in params.items():
        scale = float(jnp.max(jnp.abs(value))) + 1.0
        np.testing.assert_allclose(back[key], value, rtol=0, atol=5e-16 * scale, err_msg=key)


def test_encoder_is_refused_and_its_departure_reported():
    result = inspection.exactness(loaded("bert"), first_sequence("bert"))
    f = result.figures
    assert result.passed is None and "norm='layer'" in f["not_a_flow"]
    # Each state lies on its LayerNorm's ellipsoid (float32 round-off), not on a sphere.
    assert f["ellipsoid_residual"] <= 1e-4
    assert f["sphere_departure"] > 1e-2
    with pytest.raises(ValueError, match="LayerNorm"):
        bert = loaded("bert")
        correspondence.to_flow(bert.config, layer_params(bert.model.transformer))


class _Tanh(eqx.Module):
    """``F_t(y) = tanh(y W(t))`` with per-layer ``W``, a pytree (so solvers can restrict it)."""

    path: PiecewiseConstant

    def __call__(self, t, y, args):
        return jnp.tanh(y @ self.path(t))


def test_within_step_heun_by_hand():
    """Two layers, one Heun step each: ``y1 = y0 + h/2 (F_l(y0) + F_l(y0 + h F_l(y0)))`` with
    the layer's own weights at both stages (plain diffrax.Heun reads layer 2 at the end of
    layer 1)."""
    rng = np.random.default_rng(0)
    d, h = 3, 0.4
    mats = jnp.asarray(rng.standard_normal((2, d, d)))
    term = diffrax.ODETerm(_Tanh(PiecewiseConstant(mats, h)))
    y = jnp.asarray(rng.standard_normal(d))
    solve = lambda solver: diffrax.diffeqsolve(  # noqa: E731
        term, solver, 0.0, 2 * h, h, y, saveat=diffrax.SaveAt(t1=True)).ys[0]
    expected = y
    for W in mats:
        F = lambda z, W=W: jnp.tanh(z @ W)  # noqa: E731
        expected = expected + h / 2 * (F(expected) + F(expected + h * F(expected)))
    np.testing.assert_allclose(solve(WithinStep(diffrax.Heun())), expected, rtol=0, atol=1e-14)
    assert float(jnp.max(jnp.abs(solve(diffrax.Heun()) - expected))) > 1e-3


def test_update_geometry_closed_form():
    """A token turned by 30 degrees and stretched by 2 in one layer, by 0 and 1 in the next."""
    angle = math.radians(30)
    x0 = np.array([1.0, 0.0, 0.0])
    x1 = 2 * np.array([math.cos(angle), math.sin(angle), 0.0])
    first = np.array([5.0, 5.0, 5.0])  # position 0: left out
    states = jnp.asarray(np.stack([[first, x0], [first, x1], [first, x1]])[:, None])
    g = {k: np.asarray(v)[:, 0, 0] for k, v in inspection._update_geometry(states).items()}
    np.testing.assert_allclose(g["angle_deg"], [30.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(g["growth"], [2.0, 1.0], rtol=1e-12)
    delta = x1 - x0
    np.testing.assert_allclose(g["radial_share"][0], (delta @ x0) ** 2 / (delta @ delta),
                               rtol=1e-12)
    np.testing.assert_allclose(g["relative_step"][0], np.linalg.norm(delta), rtol=1e-12)


def test_depth_smoothness_closed_form():
    """Identical layers: relative change 0, cosine 1; then layer 2 = -layer 1 (change 2)."""
    lm, config, tok = loaded("llama_gqa_tied")
    params = layer_params(lm.transformer)
    same = {k: jnp.broadcast_to(v[:1], v.shape) for k, v in params.items()}
    from svflow_jax.transformer import set_layer_params

    set_layer_params(lm.transformer, same)
    try:
        r = inspection.depth_smoothness(inspection.LoadedModel(lm, config, tok))
        assert r.figures["attention_relative_change_median"] == 0.0
        assert r.figures["ffn_cosine_median"] == pytest.approx(1.0, abs=1e-12)
        flipped = {k: (v.at[1].set(-v[0]) if not k.endswith("gain") else v)
                   for k, v in same.items()}
        set_layer_params(lm.transformer, flipped)
        r = inspection.depth_smoothness(inspection.LoadedModel(lm, config, tok))
        assert r.figures["attention_relative_change_median"] == pytest.approx(2.0, rel=1e-6)
    finally:
        set_layer_params(lm.transformer, params)


def test_refinement_recovers_first_order_on_a_small_random_model():
    """The tiny Llama (random weights of std 0.02: a slow, smooth flow) is in the ODE regime:
    the model solved as its flow changes nothing (round-off), Euler sub-steps change the
    states by amounts that halve as the step halves (Richardson ratios approaching 2 for
    order 1: 1.42 at m = 1, 2, 4 and 1.83 at m = 2, 4, 8 when written), and
    Heun / RK4 agree with the finest Euler better than the model does."""
    name = "llama_gqa_tied"
    windows = np.stack([first_sequence(name)[:12], first_sequence(name)[10:22]])
    r = inspection.refinement(loaded(name), windows, substeps=(2, 4, 8))
    f = r.figures
    assert f["euler_x1_change"] <= 1e-5
    # The ratios approach 2 as the step shrinks (the asymptotic regime of order 1).
    ratios = f["richardson_ratios"]
    assert ratios == sorted(ratios) and 1.7 <= ratios[-1] <= 2.3, ratios
    changes = [f[f"final_change_euler_x{m}"] for m in (2, 4, 8)]
    assert changes[0] < changes[1] < changes[2]  # converging to a limit 2 x the x2 change
    assert f["final_change_rk4_x1"] == pytest.approx(2 * changes[0], rel=0.2)


def test_qwen3_kernel_concentration_is_the_largest_exponent():
    """With constant Q/K gains ``c_q``, ``c_k`` the exponent of the flow's kernel between a
    query and an equal key at position 0 (no rotation) is ``sqrt(dk) c_q c_k``, whatever the
    token: the reported concentration, computed independently through the flow's
    ``kernel_embeddings``."""
    lm, config, _ = loaded("qwen3")
    params = dict(layer_params(lm.transformer))
    params["q_norm_gain"] = jnp.full_like(params["q_norm_gain"], 1.7)
    params["k_norm_gain"] = jnp.full_like(params["k_norm_gain"], 0.6)
    group = config.n_heads // config.kv_heads  # query head h reads key head h // group:
    params["wq"] = jnp.repeat(params["wk"], group, axis=2)  # queries = their keys
    kappa = correspondence.kernel_concentrations(config, params)
    expected = math.sqrt(config.d_head) * 1.7 * 0.6
    np.testing.assert_allclose(kappa["typical"], expected, rtol=1e-6)
    np.testing.assert_allclose(kappa["bound"], expected, rtol=1e-6)
    from svflow_jax.flow.attention import kernel_embeddings

    flow = correspondence.to_flow(dataclasses.replace(config, norm_eps=0.0), params)
    theta = flow.attention.params(0.0)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, config.d_model)), jnp.float32)
    a, b = kernel_embeddings(theta, x / jnp.linalg.norm(x))
    exponent = jnp.einsum("hik,hik->h", a, b)  # token 0 with itself, no rotation at p = 0
    np.testing.assert_allclose(exponent, expected, rtol=1e-5)
