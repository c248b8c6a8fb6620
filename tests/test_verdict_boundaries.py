"""Every verdict rule on both sides of its boundary, on synthetic numbers (no solve, no
compilation): the claims' pass rules and tolerances, ``summary.json``'s overall verdict, the
report's verdict words, the intervals over seeds.

The claim functions run with their measurements replaced by figures made up here (a
Transformer's per-layer differences, a sweep's errors ``C h^p``, a stack's Norm residuals), so
a test places a figure exactly at the boundary the claim states and one step beyond it. Every
boundary comes from the code: its constants (``ORDER_TOLERANCE``, ``EXACT_FLOAT64``,
``C_FLOAT32``, ...), or, where the rule holds a literal, the number the claim states in its
tolerance text. ``.ci/mutants.py`` checks that these tests fail when a rule changes.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from svflow_jax import claims, reporting, sphere
from svflow_jax.claims import core, exactness, measure, orders, stacks
from svflow_jax.claims import run as claims_run
from svflow_jax.objective import mechanism, terms
from svflow_jax.training import compare

F64 = claims.Options(tokens=4, dim=8, layers=4, repeats=1, depths=(16, 32, 64))
F32 = dataclasses.replace(F64, dtype="float32")
# how far below its order a method of order >= 5 may fit, as the documentation states it
# (docs/howto/verify.md), not read from the code's constant
DEFICIT = float(re.search(r"at least order - ([0-9.]+)", " ".join(
    (Path(__file__).resolve().parent.parent / "docs" / "howto" / "verify.md").read_text()
    .split()))[1])


def _after(x: float) -> float:
    return math.nextafter(x, math.inf)


def _before(x: float) -> float:
    return math.nextafter(x, -math.inf)


def _number(pattern: str, text: str) -> float:
    """The number a claim states in its tolerance text."""
    found = re.search(pattern, text)
    assert found, (pattern, text)
    return float(found[1])


# ------------------------------------------------------------------------------ order_passes

@pytest.mark.parametrize("expected", [1, 2, 3, 4])
def test_orders_below_5_pass_within_the_tolerance_on_both_sides(expected):
    inside = measure.ORDER_TOLERANCE * (1 - 1e-9)
    outside = measure.ORDER_TOLERANCE * (1 + 1e-9)
    assert measure.order_passes(expected + inside, expected)
    assert measure.order_passes(expected - inside, expected)
    assert not measure.order_passes(expected + outside, expected)
    assert not measure.order_passes(expected - outside, expected)
    # a method registered one order too high or too low fails
    assert not measure.order_passes(expected + 1, expected)
    assert not measure.order_passes(expected - 1, expected)
    # the interval's lower end plays no part below order 5
    assert measure.order_passes(expected, expected, expected - 10)
    assert not measure.order_passes(expected + 1, expected, expected)


def test_the_order_band_is_closed():
    """A fit at exactly the tolerance passes (``0 +- ORDER_TOLERANCE`` is exact in binary)."""
    assert measure.order_passes(measure.ORDER_TOLERANCE, 0)
    assert measure.order_passes(-measure.ORDER_TOLERANCE, 0)
    assert not measure.order_passes(_after(measure.ORDER_TOLERANCE), 0)


@pytest.mark.parametrize("expected", [5, 8])
def test_high_orders_pass_from_order_minus_deficit_to_order_plus_excess(expected):
    low, high = expected - DEFICIT, expected + measure.HIGH_ORDER_EXCESS
    assert measure.order_passes(low, expected) and not measure.order_passes(_before(low),
                                                                            expected)
    assert measure.order_passes(high, expected) and not measure.order_passes(_after(high),
                                                                             expected)
    # above the band: fails only when the interval's lower end is above it too
    assert measure.order_passes(high + 0.5, expected, high)
    assert not measure.order_passes(high + 0.5, expected, _after(high))
    # a NaN lower end: the fitted value decides
    assert not measure.order_passes(_after(high), expected, math.nan)
    # a lower end above the fitted value (never from a fit): the fitted value decides
    assert measure.order_passes(high, expected, high + 1)
    # one order too low fails whatever the interval
    assert not measure.order_passes(expected - 1, expected, expected - 2)
    assert not measure.order_passes(math.nan, expected)
    assert not measure.order_passes(math.inf, expected)


# ------------------------------------------------------------------------------ fit_window

def test_fit_window_bounds_are_inclusive_and_each_excludes():
    h = np.geomspace(1e-3, 1e-1, 9)
    e = np.geomspace(measure.FIT_FLOOR, measure.FIT_CEILING, 9)
    everything = measure.fit_window(h, e, max_step=h[-1])
    assert everything["fit_points"] == 9 and all(everything["in_fit"])
    below = measure.fit_window(h, [_before(measure.FIT_FLOOR), *e[1:]])
    above = measure.fit_window(h, [*e[:-1], _after(measure.FIT_CEILING)])
    coarse = measure.fit_window(h, e, max_step=h[-2])
    assert below["in_fit"][0] is False and below["fit_points"] == 8
    assert above["in_fit"][-1] is False and above["fit_points"] == 8
    assert coarse["in_fit"] == [True] * 8 + [False]
    assert measure.fit_window(h, [math.nan, *e[1:]])["fit_points"] == 8


def test_fit_window_step_limit_allows_a_relative_round_off_of_1e_12_and_no_more():
    """``h <= max_step`` up to ``1e-12`` relative (``T / N`` and ``T / MIN_STEPS_IN_FIT``
    rounded differently): a step that much above the limit is in, ``1e-11`` above is out."""
    limit = 1 / 8
    h = np.array([1 / 64, 1 / 32, 1 / 16, limit * (1 + 1e-12)])
    assert measure.fit_window(h, 1e-3 * h, max_step=limit)["in_fit"] == [True] * 4
    h[-1] = limit * (1 + 1e-11)
    assert measure.fit_window(h, 1e-3 * h, max_step=limit)["in_fit"] == [True] * 3 + [False]


def test_fit_window_fits_from_three_points_and_not_two():
    h = np.array([0.04, 0.02, 0.01])
    three = measure.fit_window(h, 1e-3 * h**2)
    assert three["fit_points"] == 3 and three["fitted_order"] == pytest.approx(2)
    assert three["order_ci"][0] <= 2 <= three["order_ci"][1]
    two = measure.fit_window(h[:2], 1e-3 * h[:2] ** 2)
    assert two["fit_points"] == 2 and math.isnan(two["fitted_order"])


# ------------------------------------------------------------------------------ tolerances

def test_exactness_tolerances_are_the_stated_formulas():
    eps = 2 * measure.UNIT_ROUNDOFF["float32"]
    assert measure.UNIT_ROUNDOFF["float32"] == float(jnp.finfo(jnp.float32).eps) / 2
    assert measure.exactness_tolerance(jnp.float64, 12, 3.0) == measure.EXACT_FLOAT64
    assert measure.exactness_tolerance(jnp.float32, 12, 3.0) == pytest.approx(
        measure.C_FLOAT32 * 12 * eps * 3.0, rel=1e-15)
    assert measure.fit_floor(jnp.float64) == measure.FIT_FLOOR
    assert measure.fit_floor(jnp.float32) == measure.FIT_FLOOR_FLOAT32


def test_tolerances_tell_round_off_from_a_wrong_layer():
    """The float64 tolerance sits between round-off (a few hundred ulps of O(1) states) and the
    smallest error of a wrong computation the claims must catch: one step of retracted Euler
    against geodesic Euler at the claims' smallest step, O(h^3) = 1e-6 at h = 1 / 128; the
    float32 one above float32 round-off of a few layers and below a float64 error of 1e-3."""
    ulp = float(jnp.finfo(jnp.float64).eps)
    assert 100 * ulp < measure.EXACT_FLOAT64 < 1e-3 * (1 / 128) ** 3
    assert measure.REFERENCE_TOLERANCE < measure.FIT_FLOOR < 1e-3 * measure.FIT_CEILING
    f32 = measure.exactness_tolerance(jnp.float32, 1, 1.0)
    assert 4 * float(jnp.finfo(jnp.float32).eps) <= f32 < 1e-5
    # the float32 fits stop far above float32 round-off, the float64 fits far above float64's
    assert 100 * float(jnp.finfo(jnp.float32).eps) < measure.FIT_FLOOR_FLOAT32 < 1e-2
    assert measure.MIN_STEPS_IN_FIT >= 4 and measure.ORDER_TOLERANCE < 0.5
    assert 0 < measure.HIGH_ORDER_EXCESS <= 1


def test_a_failed_or_nan_reference_solve_is_an_error():
    import diffrax

    ok = diffrax.RESULTS.successful
    assert measure._succeeded("y", ok, True, False) == "y"
    with pytest.raises(measure.SolveError, match="failed"):
        measure._succeeded("y", ok, False, False)
    with pytest.raises(measure.SolveError, match="NaN"):
        measure._succeeded("y", ok, True, True)


# ------------------------------------------------------------------------------ options

@pytest.mark.parametrize("good", [
    dict(seed=0), dict(tokens=1), dict(dim=2), dict(num_sizes=3), dict(depths=(1, 2, 3)),
    dict(t1=1e-300), dict(strength=5), dict(step_scale=0.5)])
def test_options_at_their_smallest_allowed_values(good):
    claims.Options(**good)


@pytest.mark.parametrize("bad", [
    dict(tokens=True), dict(layers=1.0), dict(t1=True), dict(t1=-1.0), dict(t1=math.inf),
    dict(depths=(1, 2, 2)), dict(depths=(3, 2, 1)), dict(depths=(0, 1, 2)),
    dict(depths=(1, True, 3)), dict(num_sizes=0), dict(seed=True), dict(dim=4.0)])
def test_options_beyond_them_are_refused(bad):
    with pytest.raises(ValueError):
        claims.Options(**bad)


def test_the_positive_number_checks():
    core._positive_int("x", 1)
    core._positive_float("x", 1)
    core._positive_float("x", 0.5)
    for bad in (0, -1, True, 1.0, "1"):
        with pytest.raises(ValueError):
            core._positive_int("x", bad)
    for bad in (0, 0.0, -0.5, True, math.nan, math.inf, "1"):
        with pytest.raises(ValueError):
            core._positive_float("x", bad)


# ------------------------------------------------------------------------------ exactness

@pytest.fixture
def fake_transformer(monkeypatch):
    """``_exactness`` on made-up per-layer differences: ``set(per_layer, radial_factors=None,
    scale=2.0)``."""
    state = {}
    monkeypatch.setattr(exactness, "random_params", lambda config, seed: {})
    monkeypatch.setattr(exactness, "checkpoint_like", lambda config, params, seed: params)
    monkeypatch.setattr(exactness, "inputs", lambda ctx: np.zeros((4, 8)))

    def gaps(config, params, x):
        out = {"per_layer": np.asarray(state["per_layer"], float), "moved": 0.5,
               "scale": state["scale"]}
        if state.get("radial_factors") is not None:
            out["radial_factors"] = np.asarray(state["radial_factors"], float)
        return out

    monkeypatch.setattr(exactness, "_gaps", gaps)

    def set_(per_layer, radial_factors=None, scale=2.0):
        state.update(per_layer=per_layer, radial_factors=radial_factors, scale=scale)

    return set_


def _tolerance(options, layers, scale):
    dtype = jnp.float64 if options.float64 else jnp.float32
    return measure.exactness_tolerance(dtype, layers, scale)


@pytest.mark.parametrize("options", [F64, F32], ids=["float64", "float32"])
def test_exactness_passes_at_its_tolerance_and_fails_beyond(fake_transformer, options):
    ctx = claims.Context(options)
    layers, scale = options.layers, 2.0
    tol = _tolerance(options, layers, scale)
    fake_transformer([tol] * layers, scale=scale)
    at = exactness._exactness(ctx, 0, "postnorm-projected")
    assert at.passed is True and at.figures["max_abs_diff"] == tol
    fake_transformer([tol] * (layers - 1) + [_after(tol)], scale=scale)
    assert exactness._exactness(ctx, 0, "postnorm-projected").passed is False


def test_a_conversion_wrong_in_one_layer_fails_exactness(fake_transformer):
    """All but one layer agree to the ulp; one layer is off by 1e3 tolerances (a wrong
    conversion there): the claim fails, and reports that layer's difference."""
    ctx = claims.Context(F64)
    tol = _tolerance(F64, F64.layers, 2.0)
    for layer in range(F64.layers):
        per_layer = [0.0] * F64.layers
        per_layer[layer] = 1e3 * tol
        fake_transformer(per_layer)
        result = exactness._exactness(ctx, 0, "postnorm-projected")
        assert result.passed is False and result.figures["max_abs_diff"] == 1e3 * tol
        assert result.rows[layer]["max_abs_diff"] == 1e3 * tol


def test_a_standard_post_norm_step_needs_every_radial_factor_positive(fake_transformer):
    ctx = claims.Context(F64)
    tiny = np.finfo(float).tiny
    fake_transformer([0.0] * F64.layers, radial_factors=[tiny, 0.5, 2.0])
    result = exactness._exactness(ctx, 1, "postnorm")
    assert result.passed is True and result.figures["min_radial_factor"] == tiny
    fake_transformer([0.0] * F64.layers, radial_factors=[0.0, 0.5, 2.0])
    assert exactness._exactness(ctx, 1, "postnorm").passed is False
    fake_transformer([0.0] * F64.layers, radial_factors=[-0.1, 0.5, 2.0])
    assert exactness._exactness(ctx, 1, "postnorm").passed is False
    # a positive factor does not save a difference above the tolerance
    fake_transformer([1.0] * F64.layers, radial_factors=[1.0])
    assert exactness._exactness(ctx, 1, "postnorm").passed is False




def test_a_nan_difference_is_an_error(monkeypatch):
    """A NaN or infinite per-layer difference from the one program of every case is an error
    (of :func:`exactness._all_gaps`, so of ``_gaps`` and of the float32 claim alike), never a
    difference that compares false with the tolerance and so "passes" nothing silently."""
    def program(value):
        return lambda cases: [{"per_layer": np.array([0.0, value]), "moved": 0.5,
                               "scale": 1.0} for _ in cases]

    for value in (math.nan, math.inf, -math.inf):
        monkeypatch.setattr(exactness, "_gaps_programs", program(value))
        with pytest.raises(exactness.SolveError):
            exactness._gaps(None, {}, None)
        with pytest.raises(exactness.SolveError):
            exactness._all_gaps([(None, {}, None), (None, {}, None)])
    monkeypatch.setattr(exactness, "_gaps_programs", program(1.0))
    assert exactness._gaps(None, {}, None)["per_layer"].tolist() == [0.0, 1.0]


def _stated_tolerance(options, layers, scale):
    """The exactness tolerance as ``docs/theory.md`` (section 13) states it: ``1e-12`` in
    float64, ``C l eps s`` with ``C = 4`` in float32 (``eps = 2 u`` of the float32 matrix
    multiply in force: ``2^-23`` on the CPU)."""
    return 1e-12 if options.float64 else 4 * layers * _EPS32 * scale


_EPS32 = 2 * measure.matmul_unit_roundoff(jax.default_backend(),
                                          jax.config.jax_default_matmul_precision)[1]


def _plain_solve(monkeypatch, ctx, diffs: dict):
    """``plain_solve`` whose post-norm and pre-norm stacks differ from their solves by
    ``diffs["post"]`` and ``diffs["pre"]``, with largest token norm 2."""
    monkeypatch.setattr(exactness, "random_params", lambda config, seed: {})
    monkeypatch.setattr(exactness, "inputs", lambda ctx: None)
    monkeypatch.setattr(exactness, "_plain_solve_gaps", lambda cases: [
        (diffs[config.norm_position], 2.0) for config, _, _ in cases])
    return exactness.plain_solve(ctx)


@pytest.mark.parametrize("options", [F64, F32], ids=["float64", "float32"])
def test_plain_solve_passes_when_both_stacks_are_within_tolerance(monkeypatch, options):
    ctx = claims.Context(options)
    tol = _stated_tolerance(options, options.layers, 2.0)
    assert tol == pytest.approx(_tolerance(options, options.layers, 2.0), rel=1e-15)
    result = _plain_solve(monkeypatch, ctx, {"post": tol, "pre": tol / 2})
    assert result.passed is True and result.figures["max_abs_diff"] == tol
    assert [r["passed"] for r in result.rows] == [True, True]
    for wrong in ("post", "pre"):  # one stack beyond its tolerance, the other exact
        diffs = {"post": 0.0, "pre": 0.0, wrong: _after(tol)}
        result = _plain_solve(monkeypatch, ctx, diffs)
        assert result.passed is False and result.figures["max_abs_diff"] == _after(tol)
        assert [r["passed"] for r in result.rows] == [wrong != "post", wrong != "pre"]
    # a conversion wrong by 1000 tolerances fails; a tolerance 1000x looser would pass it
    assert _plain_solve(monkeypatch, ctx, {"post": 1e3 * tol, "pre": 0.0}).passed is False
    for bad in (math.nan, math.inf):
        with pytest.raises(FloatingPointError):
            _plain_solve(monkeypatch, ctx, {"post": bad, "pre": 0.0})
        with pytest.raises(FloatingPointError):
            _plain_solve(monkeypatch, ctx, {"post": 0.0, "pre": bad})


def _float32_claim(monkeypatch, per_layer):
    """``float32_bound`` on made-up per-layer differences ``per_layer(position)`` (one per
    layer, the largest token norm 2)."""
    monkeypatch.setattr(exactness, "random_params", lambda config, seed: {})
    monkeypatch.setattr(exactness, "inputs", lambda ctx: np.zeros((4, 8)))
    monkeypatch.setattr(exactness, "_all_gaps", lambda cases: [
        {"per_layer": np.asarray(per_layer(config.norm_position), float), "scale": 2.0}
        for config, _, _ in cases])
    return exactness.float32_bound(claims.Context(F64))


def test_float32_round_off_may_grow_linearly_in_depth_and_no_faster(monkeypatch):
    """``d_l <= C l eps s`` with ``C = 4`` (theory, section 13) at every layer ``l``: exactly
    at the bound passes (``c_eff = 4``), one layer beyond it fails, the first or the deepest,
    in either stack; a difference that does not grow with depth, at the deepest layer's bound
    everywhere, fails at the first layer (the bound is per layer, not the stack's total)."""
    layers = np.arange(1, F64.layers + 1)
    bound = 4 * layers * _EPS32 * 2.0
    at = _float32_claim(monkeypatch, lambda position: bound)
    assert at.passed is True and at.figures["c_eff"] == pytest.approx(4.0, rel=1e-15)
    assert at.figures["eps"] == _EPS32
    assert [r["c_eff"] for r in at.rows] == pytest.approx([4.0, 4.0], rel=1e-15)
    for stack in ("post", "pre"):
        for layer in range(F64.layers):
            over = bound.copy()
            over[layer] *= 1 + 1e-9
            result = _float32_claim(monkeypatch, lambda position, o=over, s=stack: o if
                                    position == s else bound)
            assert result.passed is False and result.figures["c_eff"] > 4.0, (stack, layer)
    flat = np.full(F64.layers, bound[-1])
    result = _float32_claim(monkeypatch, lambda position: flat)
    assert result.passed is False and result.figures["c_eff"] == pytest.approx(
        4.0 * F64.layers, rel=1e-12)
    # 1000 bounds in one layer (a conversion wrong there) fails
    wrong = bound.copy()
    wrong[1] *= 1e3
    assert _float32_claim(monkeypatch, lambda position: wrong).passed is False


def test_float32_round_off_must_be_visible(monkeypatch):
    """Round-off that shows (largest difference above the stated threshold, far below the
    bound and far above float64's round-off) in both stacks; zero differences (a float32 run
    that silently computed in float64) fail."""
    result = _float32_claim(monkeypatch, lambda position: np.zeros(F64.layers))
    visible = _number(r"visible \(> ([0-9.e+-]+)\)", result.tolerance)
    assert result.passed is False
    assert 1e3 * float(np.finfo(np.float64).eps) < visible < 4 * _EPS32 * 2.0 / 10
    flat = np.full(F64.layers, visible)  # at the threshold: not visible, far below the bound
    assert _float32_claim(monkeypatch, lambda position: flat).passed is False
    assert _float32_claim(monkeypatch, lambda position: np.full(F64.layers, _after(
        visible))).passed is True
    for stack in ("post", "pre"):  # one stack visible is not enough
        one = _float32_claim(monkeypatch, lambda position, s=stack: flat if position == s else
                             np.full(F64.layers, _after(visible)))
        assert one.passed is False and [r["visible"] for r in one.rows] == [
            stack != "post", stack != "pre"]
    deepest = np.zeros(F64.layers)  # visible in one layer is visible
    deepest[-1] = _after(visible)
    assert _float32_claim(monkeypatch, lambda position: deepest).passed is True


def _round_trip(monkeypatch, change):
    """``round_trip`` on made-up weights: ``change(config, set_gains, params) -> back``."""
    monkeypatch.setattr(exactness, "checkpoint_like", lambda config, params, seed: params)
    monkeypatch.setattr(exactness, "random_params", lambda config, seed: {
        "wq": np.full(3, 0.7, config.param_dtype), "wo": np.full(3, 0.3, config.param_dtype),
        "bq": np.full(3, 0.5, config.param_dtype)})
    monkeypatch.setattr(exactness, "_round_trips", lambda cases: [
        (params, change(config, params)) for config, params, _ in cases])
    return exactness.round_trip(claims.Context(F64))


def test_round_trip_is_bit_identical_except_the_rescaled_arrays(monkeypatch):
    same = _round_trip(monkeypatch, lambda config, params: dict(params))
    assert same.passed is True and same.figures["not_identical"] == 0
    variants = same.figures["variants"]

    def nudged(name, factor, when=lambda config: True):
        def change(config, params):
            back = dict(params)
            if when(config):
                a = params[name]
                back[name] = a + factor * np.finfo(a.dtype).eps * np.abs(a)
            return back
        return change

    rescaled = lambda c: c.norm_position == "pre" and c.norm_gain  # noqa: E731
    # a rescaled array within eps |w|: passes; beyond: fails
    assert _round_trip(monkeypatch, nudged("wq", 1.0, rescaled)).passed is True
    assert _round_trip(monkeypatch, nudged("bq", 1.0)).passed is True  # biases: always
    beyond = _round_trip(monkeypatch, nudged("wq", 2.0, rescaled))
    assert beyond.passed is False and 0 < beyond.figures["not_identical"] < variants
    assert _round_trip(monkeypatch, nudged("bq", 2.0)).figures["not_identical"] == variants

    def one_element(config, params):  # one element of a bias beyond eps |w|, the rest exact
        back = dict(params)
        a = params["bq"].copy()
        a[1] += 2.0 * np.finfo(a.dtype).eps * abs(a[1])
        back["bq"] = a
        return back

    assert _round_trip(monkeypatch, one_element).figures["not_identical"] == variants
    # an array to_flow does not rescale, or a rescaled one where nothing is folded: bit-exact
    post = lambda c: c.norm_position == "post"  # noqa: E731
    assert _round_trip(monkeypatch, nudged("wo", 1.0, rescaled)).passed is False
    assert _round_trip(monkeypatch, nudged("wq", 1.0, post)).passed is False
    # a changed shape, dtype or set of arrays
    for change in (lambda c, p: {**p, "wo": p["wo"][:2]},
                   lambda c, p: {**p, "wo": p["wo"].astype(np.float16)},
                   lambda c, p: {**p, "wo": p["wo"].reshape(3, 1)},  # the same bytes
                   lambda c, p: {**p, "wo": p["wo"].view(f"i{p['wo'].itemsize}")},
                   lambda c, p: {k: v for k, v in p.items() if k != "wo"},
                   lambda c, p: {**p, "extra": p["wo"]}):
        result = _round_trip(monkeypatch, change)
        assert result.passed is False and result.figures["not_identical"] == variants


def _ellipsoid(monkeypatch, options, residuals):
    monkeypatch.setattr(exactness, "random_params", lambda config, seed: {})
    monkeypatch.setattr(exactness, "inputs", lambda ctx: None)
    monkeypatch.setattr(exactness, "_ellipsoid_residuals", lambda cases, x: residuals)
    return exactness.ellipsoid(claims.Context(options))


@pytest.mark.parametrize("options", [F64, F32], ids=["float64", "float32"])
def test_ellipsoid_residual_at_tolerance_and_sphere_residual_above_the_floor(monkeypatch,
                                                                             options):
    config = exactness.transformer_config(claims.Context(options), norm_gain=True)
    # gains drawn in [0.5, 1.5]: states up to 1.5 sqrt(d) long
    tol = _tolerance(options, config.n_layers, math.sqrt(config.d_model) * 1.5)
    first = _ellipsoid(monkeypatch, options, [(0.0, 1.0)] * 3)
    floor = _number(r"sphere residual > ([0-9.]+)", first.tolerance)
    good = _ellipsoid(monkeypatch, options, [(tol, _after(floor))] * 3)
    assert good.passed is True
    assert good.figures == {"ellipsoid_residual": tol, "sphere_residual": _after(floor)}
    for i in range(3):
        rows = [(tol, _after(floor))] * 3
        rows[i] = (_after(tol), _after(floor))
        beyond = _ellipsoid(monkeypatch, options, rows)
        assert beyond.passed is False and beyond.figures["ellipsoid_residual"] == _after(tol)
        rows[i] = (tol, floor)
        result = _ellipsoid(monkeypatch, options, rows)
        assert result.passed is False and result.figures["sphere_residual"] == floor


# ------------------------------------------------------------------------------ orders

def _fit(points: int, order: float):
    h = np.geomspace(0.05, 0.1, points)
    return measure.fit_window(h, 0.5 * h**order)


@pytest.mark.parametrize("expected", [1, 4, 5])
def test_three_points_decide_an_order_and_two_do_not(expected):
    for options in (F64, F32):
        ctx = claims.Context(options)
        assert orders._order_verdict(ctx, _fit(3, expected), expected) == (True, True)
        wrong = expected + 1 if expected < 5 else expected - 1  # one order off
        assert orders._order_verdict(ctx, _fit(3, wrong), expected) == (True, False)
    assert orders._order_verdict(claims.Context(F64), _fit(2, expected), expected) == (
        False, False)
    assert orders._order_verdict(claims.Context(F32), _fit(2, expected), expected) == (
        False, None)


def test_the_order_verdict_reads_the_lower_end_of_the_interval():
    high = 5 + measure.HIGH_ORDER_EXCESS + 0.5
    fit = {"fit_points": 5, "fitted_order": high, "order_ci": [5.5, high + 1]}
    assert orders._order_verdict(claims.Context(F64), fit, 5) == (True, True)
    fit["order_ci"] = [_after(5 + measure.HIGH_ORDER_EXCESS), high + 1]
    assert orders._order_verdict(claims.Context(F64), fit, 5) == (True, False)


def test_sweep_counts_scale_the_registered_range():
    spec = types.SimpleNamespace(step_range=(4, 64), num_sizes=5)
    ctx = claims.Context(F64)
    assert orders.sweep_counts(ctx, spec) == measure.step_counts(4, 64, 5)
    assert orders.sweep_counts(ctx, spec, (2, 9), 3) == measure.step_counts(2, 9, 3)
    assert orders.sweep_counts(ctx, spec, num_sizes=3) == measure.step_counts(4, 64, 3)
    assert orders.sweep_counts(claims.Context(dataclasses.replace(F64, num_sizes=4)),
                               spec) == measure.step_counts(4, 64, 4)
    half = claims.Context(dataclasses.replace(F64, step_scale=0.5))
    assert orders.sweep_counts(half, spec) == measure.step_counts(2, 32, 5)
    tiny = claims.Context(dataclasses.replace(F64, step_scale=0.01))
    assert orders.sweep_counts(tiny, spec) == measure.step_counts(1, 5, 5)  # first >= 1


@pytest.fixture
def fake_sweep(monkeypatch):
    """The orders module on made-up errors: a solve returns its step count ``N``, its error is
    ``1e-3 (T / N)^state["order"]``, its norm drift ``N * 1e-16``."""
    state = {"order": 2.0}
    problem = types.SimpleNamespace(
        t1=1.0, u0=None, field=None,
        smooth=types.SimpleNamespace(attention=None, experts=None, field=None))
    monkeypatch.setattr(orders, "test_problem", lambda ctx: problem)
    monkeypatch.setattr(orders, "reference", lambda ctx: None)
    monkeypatch.setattr(orders, "_in_run_dtype", lambda ctx: (None, None))
    monkeypatch.setattr(orders, "fixed_step_solve", lambda terms, solver, y0, t1, n: n)
    monkeypatch.setattr(orders, "geodesic_error", lambda y, ref: 1e-3 * (1.0 / y)
                        ** state["order"])
    monkeypatch.setattr(orders, "median_seconds", lambda fn, repeats: 0.0)
    monkeypatch.setattr(orders, "_norm_drift", lambda y: y * 1e-16)
    return state


def _spec(order, **changes):
    return types.SimpleNamespace(**{
        "name": "fake", "description": "", "order": order, "solver": None,
        "evaluations_per_step": 1, "step_range": (8, 64), "num_sizes": 5,
        "is_splitting": False, **changes})


@pytest.mark.parametrize("order", [1, 2, 4])
def test_solver_sweep_passes_at_its_order_and_fails_one_tolerance_off(fake_sweep, order):
    ctx = claims.Context(F64)
    fake_sweep["order"] = order
    result = orders.solver_sweep(ctx, _spec(order))
    assert result.passed is True and result.figures["fitted_order"] == pytest.approx(order)
    assert result.figures["max_norm_drift"] == 64 * 1e-16  # the largest: the finest sweep
    assert f"|fitted order - {order}| <= {measure.ORDER_TOLERANCE:g}" == result.tolerance
    fake_sweep["order"] = order + measure.ORDER_TOLERANCE * 1.01
    assert orders.solver_sweep(ctx, _spec(order)).passed is False


def test_solver_sweep_of_a_high_order_method_states_its_band(fake_sweep):
    fake_sweep["order"] = 5 + measure.HIGH_ORDER_EXCESS * 0.9
    result = orders.solver_sweep(claims.Context(F64), _spec(5))
    assert result.passed is True
    assert f"<= {5 + measure.HIGH_ORDER_EXCESS:g}" in result.tolerance
    assert f"{5 - DEFICIT:g} <= fitted order" in result.tolerance


def test_solver_sweep_leaves_the_coarse_steps_out(fake_sweep):
    """Steps coarser than ``T / MIN_STEPS_IN_FIT`` do not enter the fit."""
    spec = _spec(2, step_range=(measure.MIN_STEPS_IN_FIT - 2, 64))
    result = orders.solver_sweep(claims.Context(F64), spec)
    used = {r["num_steps"]: r["in_fit"] for r in result.rows}
    assert all(used[n] is (n >= measure.MIN_STEPS_IN_FIT) for n in used)


@pytest.mark.parametrize("splitting", [False, True])
def test_a_splitting_claim_passes_at_its_order_only(fake_sweep, splitting):
    ctx = claims.Context(dataclasses.replace(F64, depths=(8, 16, 32, 64)))
    fake_sweep["order"] = 2
    result = orders._splitting(ctx, _spec(2, is_splitting=splitting))
    assert result.passed is True and "in_fit" not in result.figures
    assert result.figures["expected_order"] == 2
    assert orders._splitting(ctx, _spec(1, is_splitting=splitting)).passed is False




def _aligned_rk4(monkeypatch, order: float, naive_order: float = 1.0):
    """``aligned_rk4`` whose staged solve's errors are ``1e-2 (h / h_0)^order`` (``h_0`` the
    coarsest step: every error inside the fit window) and whose solve without the stage rule
    has errors ``1e-20 (h / h_0)^naive_order``, far below the float64 fit floor."""
    smooth = types.SimpleNamespace(attention=types.SimpleNamespace(causal=True),
                                   experts=types.SimpleNamespace(top_k=1), radius=1.0)
    monkeypatch.setattr(orders, "test_problem", lambda ctx: types.SimpleNamespace(
        smooth=smooth, t1=1.0, u0=np.zeros((2, 3))))
    monkeypatch.setattr(orders, "_layer_weights", lambda smooth, h: [None, None])
    monkeypatch.setattr(orders, "PiecewiseConstant", lambda theta, h: "staged")
    monkeypatch.setattr(orders, "_RightContinuousLayers", lambda theta, h: "naive")
    monkeypatch.setattr(orders, "AttentionField", lambda path, causal: path)
    monkeypatch.setattr(orders, "ExpertsField", lambda path, top_k, radius: path)
    monkeypatch.setattr(orders, "SumField", lambda a, b: a)

    def errors(terms, solver, y0, t1, counts, ref):
        h = float(t1) / np.asarray(counts, float)
        return np.stack([1e-2 * (h / h[0]) ** order, 1e-20 * (h / h[0]) ** naive_order])

    monkeypatch.setattr(orders, "_aligned_errors", errors)
    ctx = claims.Context(F64)
    ctx.shared("piecewise-reference", lambda: None)
    return orders.aligned_rk4(ctx)


def test_aligned_rk4_claims_order_4(monkeypatch):
    """The staged solve passes at order 4 (RK4's) and within 0.15 of it on each side; a
    method one order off, or just beyond the band, fails. The solve without the stage rule is
    fitted with no floor (its errors here lie below the float64 fit floor) and plays no part
    in the verdict."""
    result = _aligned_rk4(monkeypatch, 4.0)
    assert result.passed is True and result.figures["expected_order"] == 4
    assert result.figures["fitted_order"] == pytest.approx(4.0, abs=1e-9)
    assert result.figures["fit_points"] == 5
    assert result.figures["order_without_stage_rule"] == pytest.approx(1.0, abs=1e-9)
    assert _aligned_rk4(monkeypatch, 4.0, naive_order=4.0).passed is True
    for order in (4 - 0.15 * (1 - 1e-6), 4 + 0.15 * (1 - 1e-6)):
        assert _aligned_rk4(monkeypatch, order).passed is True, order
    for order in (3.0, 5.0, 4 - 0.15 * (1 + 1e-6), 4 + 0.15 * (1 + 1e-6)):
        assert _aligned_rk4(monkeypatch, order).passed is False, order


def _drift(monkeypatch, on_sphere: list[float], off_sphere: list[list[float]]):
    """``drift`` with sphere solvers whose sweeps drift by ``on_sphere`` and plain methods whose
    drifts, coarsest step first, are ``off_sphere``."""
    specs = [types.SimpleNamespace(name=f"s{i}") for i in range(len(on_sphere))]
    specs += [types.SimpleNamespace(name=f"p{i}") for i in range(len(off_sphere))]
    monkeypatch.setattr(orders._catalogue, "methods", lambda splitting=None: specs)
    drifts = dict(zip([s.name for s in specs], on_sphere + off_sphere, strict=True))
    # every method's sweep is retracted: the plain methods' sweeps stay on the sphere too
    monkeypatch.setattr(orders, "_shared_sweep", lambda ctx, spec: types.SimpleNamespace(
        figures={"max_norm_drift": drifts[spec.name] if spec.name[0] == "s" else 0.0}))

    def tables(ctx, chosen, num_sizes=6):
        return [{"solver": spec.name, "retracted": spec.name[0] == "s",
                 "points": [{"num_steps": 4, "norm_drift": drifts[spec.name]}]
                 if spec.name[0] == "s" else
                 [{"num_steps": 4 * 2**k, "norm_drift": d}
                  for k, d in enumerate(drifts[spec.name])]} for spec in chosen]

    monkeypatch.setattr(orders, "_drift_tables", tables)
    return orders.drift(claims.Context(F64))


def test_drift_splits_sphere_solvers_from_plain_methods_at_the_unit_tolerance(monkeypatch):
    """The unit tolerance ``32 sqrt(d) eps`` (float64, d = 8): every sphere solver's drift at
    most that, every plain method's drift at its coarsest step strictly above it."""
    tol = 32 * math.sqrt(F64.dim) * float(np.finfo(np.float64).eps)
    assert tol == sphere.unit_tolerance(jnp.float64, F64.dim)
    good = _drift(monkeypatch, [tol, 0.0], [[_after(tol), 0.0], [1.0, 0.5]])
    assert good.passed is True
    assert good.figures == {"max_drift_on_sphere": tol,
                            "min_coarsest_drift_off_sphere": _after(tol)}
    assert _drift(monkeypatch, [0.0, _after(tol)], [[1.0]]).passed is False
    assert _drift(monkeypatch, [_after(tol), 0.0], [[1.0]]).passed is False  # any solver
    assert _drift(monkeypatch, [0.0], [[1.0], [tol, 1.0]]).passed is False  # at: not above
    assert _drift(monkeypatch, [0.0], [[tol, 1.0], [1.0]]).passed is False  # any method
    assert _drift(monkeypatch, [0.0], [[1.0], [0.0, 1.0]]).passed is False  # coarsest decides
    # a tolerance 1000x looser would take a drift of 100 tolerances for round-off
    assert _drift(monkeypatch, [100 * tol], [[1.0]]).passed is False




# ------------------------------------------------------------------------------ stacks

@dataclasses.dataclass
class _Config:
    n_layers: int = 4
    norm_position: str = "post"
    block: str = "parallel"
    project_branches: bool = True
    final_norm: bool = False
    residual_scale: float = 0.25


def _errors(steps, order, c=1e-2):
    return [c * h**order for h in steps]


@pytest.mark.parametrize("expected", [1, 2, 5])
def test_a_stacks_order_is_decided_by_order_passes(expected):
    h = list(np.geomspace(1e-3, 1e-1, 5))
    fit, passed = stacks._order(h, _errors(h, expected), expected)
    assert passed is True and fit["fitted_order"] == pytest.approx(expected)
    assert stacks._order(h, _errors(h, expected - 1), expected)[1] is False
    if expected < 5:
        assert stacks._order(h, _errors(h, expected + 1), expected)[1] is False
    # no floor: errors far below the float64 fit floor still count
    tiny = [1e-20 * x for x in _errors(h, expected)]
    assert stacks._order(h, tiny, expected)[1] is True


def test_a_stacks_high_order_reads_the_lower_end_of_the_interval(monkeypatch):
    """A fit above 5 + 1 whose interval reaches below it passes; ``_order`` hands the interval's
    lower end, not its upper one."""
    top = 5 + measure.HIGH_ORDER_EXCESS
    fit = {"fitted_order": top + 0.5, "order_ci": [top, top + 1], "fit_points": 5}
    monkeypatch.setattr(stacks, "fit_window", lambda *a, **k: fit)
    assert stacks._order([], [], 5)[1] is True
    fit["order_ci"] = [_after(top), top + 1]
    assert stacks._order([], [], 5)[1] is False


@pytest.fixture
def fake_stacks(monkeypatch):
    problem = types.SimpleNamespace(config=_Config(), anchor_params=None, x=np.ones((2, 3)),
                                    u0=np.ones((2, 3)), t1=1.0,
                                    smooth=types.SimpleNamespace(radius=2.0), field=None)
    monkeypatch.setattr(stacks, "test_problem", lambda ctx: problem)
    monkeypatch.setattr(stacks, "reference", lambda ctx: None)
    return problem


def test_one_step_gap_is_second_order_and_visible(monkeypatch, fake_stacks):
    """Gaps ``g_min (h / h_min)^order``: the smallest at the visibility threshold fails, just
    above it passes; a gap of the wrong order fails."""
    state = {"order": 2.0, "smallest": None}
    monkeypatch.setattr(stacks, "_one_step_gaps", lambda config, params, x, steps: np.array(
        [state["smallest"] * (h / steps[0]) ** state["order"] for h in steps]))
    ctx = claims.Context(F64)
    visible = 1e3 * measure.EXACT_FLOAT64
    state["smallest"] = _after(visible)
    result = stacks.one_step_gap(ctx)
    assert result.passed is True and result.figures["expected_order"] == 2
    assert _number(r"every gap > ([0-9.e+-]+)", result.tolerance) == pytest.approx(visible)
    state["smallest"] = visible
    assert stacks.one_step_gap(ctx).passed is False
    state["smallest"], state["order"] = 1e-6, 2 + 2 * measure.ORDER_TOLERANCE
    assert stacks.one_step_gap(ctx).passed is False
    state["order"] = 1.0
    assert stacks.one_step_gap(ctx).passed is False
    monkeypatch.setattr(stacks, "_one_step_gaps", lambda *a: np.array([math.nan] * 5))
    with pytest.raises(FloatingPointError):
        stacks.one_step_gap(ctx)


@pytest.mark.parametrize("claim", ["postnorm_stack", "prenorm_projected", "prenorm_coupled"])
def test_the_stacks_converge_at_order_1(monkeypatch, fake_stacks, claim):
    state = {"order": 1.0}

    def rows(*args, **kwargs):
        return [{"depth": L, "step_size": 1.0 / L,
                 "error_sphere_flow": 1e-2 * (1.0 / L) ** state["order"],
                 "error_coupled": 1e-2 * (1.0 / L) ** state["order"]} for L in (8, 16, 32, 64)]

    monkeypatch.setattr(stacks, "_stack_errors", rows)
    monkeypatch.setattr(stacks, "_prenorm_rows", lambda ctx: {"rows": rows(), "radii": [1.0]})
    ctx = claims.Context(F64)
    result = getattr(stacks, claim)(ctx)
    assert result.passed is True and result.figures["expected_order"] == 1
    for wrong in (1 + 1.01 * measure.ORDER_TOLERANCE, 1 - 1.01 * measure.ORDER_TOLERANCE, 2):
        state["order"] = wrong
        assert getattr(stacks, claim)(ctx).passed is False


def _not_sphere(monkeypatch, coupled, sphere_errors, gap, radii):
    rows = [{"depth": L, "error_coupled": c, "error_sphere_flow": s}
            for L, c, s in zip((8, 16, 32), coupled, sphere_errors, strict=True)]
    monkeypatch.setattr(stacks, "_prenorm_rows", lambda ctx: {
        "rows": rows, "limit_gap": gap, "radii": radii})
    return stacks.prenorm_not_sphere(claims.Context(F64))


def test_prenorm_is_not_the_sphere_flow_on_each_side_of_its_thresholds(monkeypatch):
    text = _not_sphere(monkeypatch, [1, 1, 1], [1, 1, 1], 1.0, [1.0, 1.0]).tolerance
    times = _number(r"gap > ([0-9.]+)x", text)
    spread = _number(r"radii spread > ([0-9.]+)", text)
    half = 0.5  # "> half the limit gap"
    assert "half the limit gap" in text
    gap, radii = 1.0, [1.0, 1.0 + _after(spread)]
    coupled = [0.3, 0.1, gap / times / 2]  # the finest depth is the last
    good = _not_sphere(monkeypatch, coupled, [0.9, 0.8, 0.7], gap, radii)
    assert good.passed is True
    assert good.figures["error_coupled_finest"] == coupled[-1]
    assert good.figures["radius_spread"] == radii[1] - radii[0]
    assert _not_sphere(monkeypatch, coupled, [0.9, 0.8, 0.7], gap, [1.0, 1.0 + spread * (
        1 - 1e-9)]).passed is False
    assert _not_sphere(monkeypatch, [0.3, 0.1, gap / times], [0.9, 0.8, 0.7], gap,
                       radii).passed is False
    assert _not_sphere(monkeypatch, coupled, [0.9, half * gap, 0.7], gap, radii).passed is False
    assert _not_sphere(monkeypatch, coupled, [0.9, 0.8, _after(half * gap)], gap,
                       radii).passed is True


def test_gain_departure_is_first_order_on_the_linear_regime(monkeypatch, fake_stacks):
    state = {"bend": 1.0, "coarsest": 1.0}
    monkeypatch.setattr(stacks, "random_params", lambda config, seed: {})
    monkeypatch.setattr(stacks, "_to_device", lambda value, dtype: value)

    def departures(config, params, x, r, epsilons):
        out = [e * 1e-2 for e in epsilons]
        out[-2] *= state["bend"]
        out[-1] *= state["coarsest"]
        return np.array(out)

    monkeypatch.setattr(stacks, "_departures", departures)
    ctx = claims.Context(F64)
    result = stacks.gain_departure(ctx)
    linear = _number(r"on eps <= ([0-9.e+-]+)", result.tolerance)
    assert result.passed is True and result.figures["expected_slope"] == 1
    assert [r["eps"] <= linear for r in result.rows] == [True] * 4 + [False]
    state["coarsest"] = 1e3  # outside the linear regime: not fitted
    assert stacks.gain_departure(ctx).passed is True
    state["bend"] = 1e2  # the last point of the regime bent: fitted, fails
    assert stacks.gain_departure(ctx).passed is False


# ------------------------------------------------------------------------------ verdicts

def test_the_run_passes_unless_a_claim_failed(monkeypatch):
    monkeypatch.setattr(claims_run, "environment", lambda: {})

    def summary(*passed):
        results = [claims.ClaimResult(f"c{i}", "s", "", p, {}, "", [], 0.0)
                   for i, p in enumerate(passed)]
        return claims_run.summary(results, F64, {"total_s": 0.0})["passed"]

    assert summary(True, True) is True
    assert summary(True, None) is True  # unresolved in float32: not a failure
    assert summary(None) is True
    assert summary(True, False) is False and summary(False, None) is False
    assert summary() is True


def test_verdict_words():
    assert reporting.verdict(True) == "PASS"
    assert reporting.verdict(False) == "FAIL"
    assert reporting.verdict(None).startswith("UNRESOLVED")


def test_the_interval_over_seeds_is_two_sided_at_its_level():
    import scipy.stats

    v = [1.0, 2.0, 4.0, 7.0]
    for level in (0.95, 0.9, 1 - 0.05 / 6):
        mean, half = compare.interval(v, level)
        lo, hi = scipy.stats.t.interval(level, len(v) - 1, loc=np.mean(v),
                                        scale=scipy.stats.sem(v))
        assert mean == pytest.approx(np.mean(v)) and half == pytest.approx((hi - lo) / 2)
    assert compare.interval(v) == compare.interval(v, 0.95)
    assert compare.interval(v, 0.9)[1] < compare.interval(v)[1]
    assert compare.interval([3.0, math.nan]) == (3.0, pytest.approx(math.nan, nan_ok=True))
    two = compare.interval([1.0, 3.0])
    assert two[0] == 2.0 and two[1] == pytest.approx(
        scipy.stats.t.ppf(0.975, 1) * math.sqrt(2) / math.sqrt(2))
    empty = compare.interval([math.nan])
    assert math.isnan(empty[0]) and math.isnan(empty[1])


def test_equal_compute_steps_needs_a_whole_number_of_blocks(monkeypatch):
    costs = {"one": (1.0, 0.0), "two": (2.0, 1.0)}  # per step, first-step extra
    monkeypatch.setattr(compare.catalogue, "get", lambda name: types.SimpleNamespace(
        evaluations_per_step=costs[name][0], name=name))
    monkeypatch.setattr(compare, "evaluations", lambda spec, n: costs[spec.name][1]
                        + spec.evaluations_per_step * n)
    assert compare.equal_compute_steps(["one", "two"], 9) == {"one": 9, "two": 4}
    assert compare.equal_compute_steps(["one"], 1) == {"one": 1}  # one block: allowed
    for budget in (0.5, 8, 9 + 1e-6, 1):  # under one block, half a block, a sliver over, 0
        with pytest.raises(ValueError):
            compare.equal_compute_steps(["two"] if budget == 1 else ["one", "two"], budget)
    for budget in (0.5, 8, 9 + 1e-6):
        with pytest.raises(ValueError):
            compare.equal_compute_steps(["one", "two"], budget)
    assert compare.equal_compute_steps(["two"], 9 + 1e-12) == {"two": 4}  # round-off
    # a whole number of blocks up to 1e-9 (round-off of the budget), and no further
    assert compare.equal_compute_steps(["one"], 9 + 5e-10) == {"one": 9}
    with pytest.raises(ValueError):
        compare.equal_compute_steps(["one"], 9 + 2e-9)


def test_a_paired_difference_is_better_worse_or_unresolved_at_the_bonferroni_level():
    """``versus_baseline``'s level is ``1 - alpha / m`` and its interval two-sided."""
    import scipy.stats

    v = [-1.0, -1.2, -0.8]
    mean, half = compare.interval(v, 1 - 0.05 / 2)
    t = scipy.stats.t.ppf(1 - 0.05 / 4, 2)
    assert half == pytest.approx(t * np.std(v, ddof=1) / math.sqrt(3))
    assert mean + half < 0


# ------------------------------------------------------------------------------ objective

def test_usage_stats_count_an_expert_dead_strictly_below_its_share():
    E = 4
    balanced = terms.usage_stats(jnp.full((E,), 1 / E))
    assert float(balanced["usage_entropy"]) == pytest.approx(math.log(E))
    assert float(balanced["max_load"]) == pytest.approx(1.0)
    assert int(balanced["dead"]) == 0
    collapsed = terms.usage_stats(jnp.array([1.0, 0.0, 0.0, 0.0]))
    assert float(collapsed["usage_entropy"]) == pytest.approx(0.0, abs=1e-6)
    assert float(collapsed["max_load"]) == pytest.approx(E)
    assert int(collapsed["dead"]) == E - 1
    share = 0.2
    edge = np.float32(share / E)
    at = jnp.array([edge, 0.5, 0.25, 0.25 - edge], jnp.float32)
    assert int(terms.usage_stats(at, share)["dead"]) == 0  # at the share: alive
    below = jnp.array([np.nextafter(edge, np.float32(0)), 0.5, 0.25, 0.25], jnp.float32)
    assert int(terms.usage_stats(below, share)["dead"]) == 1
    per_layer = terms.usage_stats(jnp.stack([at, below]), share)  # (layers, E)
    assert per_layer["dead"].tolist() == [0, 1]
    assert per_layer["max_load"].tolist() == pytest.approx([2.0, 2.0])


def test_cosine_of_small_vectors_and_of_a_zero_vector():
    a = jnp.array([0.01, 0.0])
    assert float(mechanism.cosine(a, 2 * a)) == pytest.approx(1.0)
    assert float(mechanism.cosine(a, -a)) == pytest.approx(-1.0)
    assert float(mechanism.cosine(a, jnp.array([0.0, 0.03]))) == pytest.approx(0.0)
    assert math.isnan(float(mechanism.cosine(a, jnp.zeros(2))))
    rows = mechanism.cosine(jnp.array([[1.0, 0.0], [0.0, 0.0]]), jnp.array([[3.0, 0.0],
                                                                              [1.0, 1.0]]),
                            axis=-1)
    assert float(rows[0]) == pytest.approx(1.0) and math.isnan(float(rows[1]))




def _stated(pattern: str, text: str) -> float:
    """The number ``pattern`` captures in ``text``: a decimal, or TeX's ``10^{k}`` (group 1
    the decimal or the exponent ``k``, as the pattern writes it)."""
    found = re.search(pattern, text)
    assert found, (pattern, text[:200])
    return float(found[1])


def _power(exponent: str) -> float:
    return float(f"1e{int(exponent)}")


def test_the_theory_page_states_the_tolerances_the_code_applies():
    """``docs/theory.md`` (sections 13 and 14) states every tolerance and pass rule in numbers
    (TeX, ``$10^{-12}$``, or plain decimals): they are the constants the claims run with."""
    from pathlib import Path

    text = " ".join((Path(__file__).resolve().parent.parent / "docs" / "theory.md")
                    .read_text().split())
    start = text.index("## 13. Floating point")
    text = text[start:text.index("## 15.", start)]
    ten = r"\$?10\^\{(-?[0-9]+)\}\$?"

    assert _power(_stated(r"agree to \$10\^\{(-?[0-9]+)\}\$", text)) == measure.EXACT_FLOAT64
    assert _stated(r"with \$C = ([0-9.]+)\$", text) == measure.C_FLOAT32
    assert _power(_stated(r"start at an error of \$10\^\{(-?[0-9]+)\}\$", text)) == \
        measure.FIT_FLOOR_FLOAT32
    assert _stated(r"fewer than ([0-9]+) points above that floor", text) == 3
    assert _stated(r"at least ([0-9]+) steps over", text) == measure.MIN_STEPS_IN_FIT
    window = re.search(rf"an error in \$\[{ten}, {ten}\]\$", text)
    assert window, "the float64 fit window"
    assert (_power(window[1]), _power(window[2])) == (measure.FIT_FLOOR, measure.FIT_CEILING)
    window32 = re.search(rf"\$\[{ten}, {ten}\]\$ in float32", text)
    assert window32, "the float32 fit window"
    assert (_power(window32[1]), _power(window32[2])) == (measure.FIT_FLOOR_FLOAT32,
                                                          measure.FIT_CEILING)
    assert _stated(r"rtol = atol = ([0-9.e+-]+)`", text) == measure.REFERENCE_TOLERANCE
    assert _stated(r"Within ([0-9.]+) of the expected order", text) == measure.ORDER_TOLERANCE
    assert _stated(r"expected order minus ([0-9.]+)", text) == DEFICIT == \
        measure.HIGH_ORDER_SHORTFALL
    assert _stated(r"expected order plus ([0-9.]+)", text) == measure.HIGH_ORDER_EXCESS
    assert _stated(r"orders of ([0-9]+) or more", text) == 5
    # and the rule applies them: the band's ends as the page states them
    assert measure.order_passes(4 + measure.ORDER_TOLERANCE * (1 - 1e-9), 4)
    assert not measure.order_passes(_after(5 + measure.HIGH_ORDER_EXCESS), 5)
    assert measure.order_passes(5 - DEFICIT, 5) and not measure.order_passes(
        _before(5 - DEFICIT), 5)
