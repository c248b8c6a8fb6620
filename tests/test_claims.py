"""Every registered claim passes, measured by the same functions ``svflow verify`` runs.

The claims compare two independent computations (a Transformer's own forward pass against a
diffrax solve of its flow; a solver against a tight float64 reference solve; a pre-norm stack
against the coupled system solved separately), so a passing claim is evidence, not a tautology.
The tests below also show that the claims CAN fail: a solver registered with the wrong order, a
flow built from slightly wrong weights.

Sizes: n = 5 tokens, d = 8, 16 layers (float64), the claims' own tolerances. Each result's
figures are printed as ``FIGURE | claim | figures`` (``pytest -s`` shows them).
"""

from __future__ import annotations

import diffrax
import jax.numpy as jnp
import pytest

from svflow_jax import claims
from svflow_jax.bridge import correspondence
from svflow_jax.claims import measure, problem
from svflow_jax.claims.exactness import VARIANTS
from svflow_jax.solvers import GeodesicEuler, Method, Retracted, catalogue

OPTIONS = claims.Options(tokens=5, dim=8, layers=16, repeats=1, depths=(8, 16, 32, 64, 128))
NAMES = list(claims.all_claims())


@pytest.fixture(scope="module")
def ctx() -> claims.Context:
    return claims.Context(OPTIONS)


def report(result: claims.ClaimResult) -> None:
    shown = {k: v for k, v in result.figures.items() if not isinstance(v, list)}
    print(f"FIGURE | {result.name} | {shown}")


@pytest.mark.parametrize("name", NAMES)
def test_claim_passes(ctx, name):
    result = claims.get(name).run(ctx)
    report(result)
    assert result.passed is True, (result.figures, result.rows)
    assert result.statement and result.tolerance
    if name == "round-trip":  # 3 blocks x 4 FFN kinds x MHA/GQA x gains x post/pre-norm,
        # two float32 variants and three checkpoint-like ones
        assert result.figures["variants"] == 3 * 4 * 2 * 2 * 2 + 2 + 3 == 101


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("exactness/")
                                  and n not in ("exactness/plain-solve", "exactness/float32")])
def test_exactness_is_not_between_standing_trajectories(ctx, name):
    """The tokens' directions travel far enough (> 0.2 rad) that an equality means something."""
    result = claims.get(name).run(ctx)
    assert result.figures["moved"] > 0.2, result.figures  # T = 1: 0.25 to 1 rad here


def test_moe_routing_changes_along_the_trajectory(ctx):
    """Top-k routing that never changes would not test top-k; margins far above round-off."""
    figures = claims.get("exactness/moe").run(ctx).figures
    assert figures["expert_sets"] >= 3
    assert figures["router_margin"] > 1e-6


def test_piecewise_claim_shows_the_bug_it_fixes(ctx):
    """Without the stage rule (a stage at c = 1 reads the next layer) RK4 drops to order 1."""
    figures = claims.get("piecewise/aligned-rk4").run(ctx).figures
    assert abs(figures["order_without_stage_rule"] - 1) < 0.3, figures


def test_a_solver_with_the_wrong_order_fails(ctx):
    """The order claim can fail: retracted Heun registered as third order."""
    spec = Method("heun-claimed-3", Retracted(diffrax.Heun()), order=3, cost=2,
                  step_range=(4, 400))
    evidence = claims.solver_sweep(ctx, spec)
    assert abs(evidence.figures["fitted_order"] - 2) < 0.15
    assert evidence.passed is False


def test_exactness_measurement_tells_a_close_solver_apart(ctx):
    """The exactness measurement can fail: the same flow integrated by geodesic Euler (which
    agrees with retracted Euler to O(h^2) per step) is far outside the tolerance."""
    settings, _ = VARIANTS["postnorm-projected"]
    config = problem.transformer_config(ctx, **settings)
    params = problem.random_params(config, 0)
    x = problem.inputs(ctx)
    right = correspondence.layer_gaps(config, params, x)
    wrong = correspondence.layer_gaps(config, params, x, solver=GeodesicEuler())
    tolerance = measure.exactness_tolerance(config.param_dtype, config.n_layers, 3.0)
    assert float(right["per_layer"].max()) <= tolerance
    assert float(wrong["per_layer"].max()) > 1e3 * tolerance


def test_every_registered_solver_has_an_order_claim():
    assert {f"order/{m.name}" for m in catalogue.methods(splitting=False)} <= set(NAMES)
    assert {f"splitting/{m.name}" for m in catalogue.methods(splitting=True)} <= set(NAMES)
    assert len(catalogue.methods()) == len(catalogue.CATALOGUE)


@pytest.mark.parametrize(("bad", "message"), [
    (dict(tokens=0), r"tokens must be a positive integer, got 0"),
    (dict(layers=-1), r"layers must be a positive integer, got -1"),
    (dict(repeats=0), r"repeats must be a positive integer, got 0"),
    (dict(seed=-1), r"seed must be a non-negative integer, got -1"),
    (dict(dim=1), r"dim must be even and >= 2 \(two heads of width dim/2\), got 1"),
    (dict(dim=7), r"dim must be even and >= 2 \(two heads of width dim/2\), got 7"),
    (dict(t1=float("nan")), r"t1 must be a finite positive number, got nan"),
    (dict(strength=0.0), r"strength must be a finite positive number, got 0\.0"),
    (dict(step_scale=float("inf")), r"step_scale must be a finite positive number, got inf"),
    (dict(dtype="float16"), r"dtype must be 'float64' or 'float32', got 'float16'"),
    (dict(depths=(8, 16)), r"depths must be >= 3 increasing positive integers, got \(8, 16\)"),
    (dict(num_sizes=2), r"num_sizes must be >= 3 to fit an order, got 2"),
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "")
def test_options_are_validated(bad, message):
    with pytest.raises(ValueError, match=message):
        claims.Options(**bad)


def test_select_by_prefix_and_unknown_prefix():
    assert [c.name for c in claims.select(["exactness/moe"])] == ["exactness/moe"]
    with pytest.raises(ValueError, match="no claim matches"):
        claims.select(["no-such-claim"])


def test_step_counts_are_distinct_and_geometric():
    counts = measure.step_counts(4, 512, 8)
    assert len(set(counts)) == 8 and counts[0] == 4 and counts[-1] == 512
    assert measure.step_counts(4, 6, 3) == [4, 5, 6]
    with pytest.raises(ValueError, match=r"8 distinct step counts do not fit in \[4, 6\]"):
        measure.step_counts(4, 6, 8)


def test_high_orders_pass_in_a_band_not_at_any_higher_order():
    """Order 5+: from order - 0.2 to order + 1 (Tsit5 fits 5.6-5.7 here); below 5, +- 0.15."""
    assert measure.order_passes(5.7, 5) and measure.order_passes(4.8, 5)
    assert not measure.order_passes(4.79, 5) and not measure.order_passes(6.01, 5)
    assert measure.order_passes(8.9, 8) and not measure.order_passes(9.1, 8)
    assert measure.order_passes(4.14, 4) and not measure.order_passes(4.2, 4)
    # with the fit's interval: above 8 + 1 fails only when the whole interval is (the default
    # run's Dopri8 fits 9.06 [7.89, 10.2]); the lower limit order - 0.2 is unchanged
    assert measure.order_passes(9.06, 8, 7.89) and not measure.order_passes(9.5, 8, 9.02)
    assert not measure.order_passes(7.7, 8, 7.0) and not measure.order_passes(6.5, 5, 6.1)


def test_fit_window_keeps_only_the_asymptotic_points():
    import numpy as np

    h = np.geomspace(1e-3, 1e-1, 8)
    assert measure.fit_window(h, 3.0 * h**2, max_step=1e-2)["fit_points"] == 4
    plateau = measure.fit_window(h, np.maximum(1e1 * h**4, 1e-14))
    assert abs(plateau["fitted_order"] - 4.0) < 1e-9
    few = measure.fit_window([0.1, 0.05], [1e-3, 2.5e-4])
    assert few["fit_points"] == 2 and not measure.order_passes(few["fitted_order"], 2)


def test_random_params_are_the_stated_distribution():
    config = problem.transformer_config(claims.Context(OPTIONS), d_model=64, d_head=32,
                                        d_ff=128, n_layers=4)
    flat = jnp.concatenate([jnp.ravel(v) for v in problem.random_params(config, 0).values()])
    assert abs(float(flat.std()) / config.init_std - 1) < 0.02
    assert abs(float(flat.mean())) < 0.02 * config.init_std


def test_claims_in_threads_give_the_same_results():
    """``run_claims(workers=2)`` (``svflow verify --quick``): the same figures as one at a time,
    in the claims' order, each shared object built once."""
    chosen = claims.select(["exactness/postnorm-projected", "order/heun", "splitting/strang",
                            "exactness/gqa"])
    small = claims.Options(tokens=4, dim=8, layers=4, repeats=1, depths=(16, 32, 64))
    one = claims.run_claims(claims.Context(small), chosen)
    ctx = claims.Context(small)
    built = []
    ctx.shared("probe", lambda: built.append(1) or "x")
    done = []
    two = claims.run_claims(ctx, chosen, progress=done.append, workers=2)
    assert [r.name for r in two] == [c.name for c in chosen] and sorted(done) == sorted(
        c.name for c in chosen)
    for a, b in zip(one, two, strict=True):
        assert a.figures == b.figures and a.passed == b.passed, a.name
    assert ctx.shared("probe", lambda: built.append(1) or "y") == "x" and built == [1]
    with pytest.raises(ValueError, match="workers"):
        claims.run_claims(ctx, chosen, workers=0)


@pytest.mark.parametrize(("platform", "precision", "expected"), [
    ("cpu", None, "float32"), ("cpu", "bfloat16", "float32"),  # XLA:CPU ignores the setting
    ("gpu", None, "tensorfloat32"), ("cuda", "default", "tensorfloat32"),
    ("gpu", "high", "tensorfloat32"), ("gpu", "tensorfloat32", "tensorfloat32"),
    ("gpu", "bfloat16", "tensorfloat32"), ("gpu", "highest", "float32"),
    ("rocm", "float32", "float32"), ("tpu", None, "bfloat16"), ("tpu", "highest", "float32"),
])
def test_matmul_unit_roundoff_rule(platform, precision, expected):
    name, unit = measure.matmul_unit_roundoff(platform, precision)
    assert name == expected
    # u = 2^-(p) for a p-bit significand (with its hidden bit): float32 24, TF32 11, bf16 8
    bits = {"float32": jnp.finfo(jnp.float32).nmant + 1, "tensorfloat32": 11,
            "bfloat16": jnp.finfo(jnp.bfloat16).nmant + 1}[expected]
    assert unit == 2.0 ** -bits


@pytest.mark.parametrize("precision", ["bfloat16", "tensorfloat32", "highest"])
def test_cpu_ignores_the_matmul_precision_setting(precision):
    """The rule's CPU row, measured: a float32 product has float32's error (against float64)
    under every setting; were XLA:CPU to honour bfloat16, its error would be ~1e-3."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 256)), rng.standard_normal((256, 64))
    exact, size = a @ b, np.abs(a) @ np.abs(b)
    with jax.default_matmul_precision(precision):
        product = jax.jit(jnp.matmul)(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
        assert measure.precision_in_force()["matmul_precision"] == precision
    error = np.max(np.abs(np.asarray(product, float) - exact) / size)
    # float32 inputs (2 u) and a float32 sum of 256 products: |error| <= (256 + 2) u |a||b|
    # (the worst case of any summation order); bfloat16 or TF32 inputs alone give ~2^-8, 2^-11
    assert error < (256 + 2) * 2.0**-24


def test_float32_tolerances_follow_the_precision_in_force(ctx, monkeypatch):
    """Under a GPU's default precision (simulated: the backend read as ``gpu``) the float32
    claim measures its round-off in TF32 units and records them; the float32 tolerances grow
    by 2^13; float64 ones do not move."""
    cpu = claims.get("exactness/float32").run(ctx)
    assert cpu.figures["float32_matmul"] == "float32" and cpu.figures["backend"] == "cpu"
    tolerance = measure.exactness_tolerance(jnp.float32, 8, 2.0)
    floor = measure.fit_floor(jnp.float32)
    monkeypatch.setattr(measure, "_platform", lambda: "gpu")
    gpu = claims.get("exactness/float32").run(ctx)
    assert gpu.passed is True
    assert gpu.figures["float32_matmul"] == "tensorfloat32" and gpu.figures["backend"] == "gpu"
    assert gpu.figures["eps"] == 2.0**-10 and "tensorfloat32" in gpu.tolerance
    assert gpu.figures["c_eff"] == pytest.approx(cpu.figures["c_eff"] * 2.0**-13, rel=1e-12)
    assert measure.exactness_tolerance(jnp.float32, 8, 2.0) == tolerance * 2.0**13
    assert measure.fit_floor(jnp.float32) == floor * 2.0**13
    assert measure.exactness_tolerance(jnp.float64, 8, 2.0) == measure.EXACT_FLOAT64


def test_report_has_a_legend_under_each_table(tmp_path, monkeypatch):
    """report.md: directly under each section's table, a legend of its columns and of the rule
    that decides, quoting the tolerances the rule uses; change one, the legend follows."""
    from svflow_jax.claims import report as claims_report

    def one(name, section):
        return {"name": name, "section": section, "statement": "s", "figures": {},
                "tolerance": "t", "passed": True, "seconds": 0.0}

    summary = {"passed": True, "claims": [one("exactness/a", "exactness"),
                                          one("order/b", "orders")],
               "config": {"seed": 0, "dtype": "float64", "tokens": 4, "dim": 8, "layers": 4,
                          "t1": 1.0, "reference_tolerance": 1e-13, "fit_floor": 1e-12,
                          "fit_ceiling": 0.1, "min_steps_in_fit": 8},
               "compile": {"total_s": 1.0, "xla_compilations": 1, "cache_hits": 0,
                           "compile_total_s": 0.5, "busy_s": 1.0}}
    claims_report.write_markdown(tmp_path, summary, [])
    text = (tmp_path / "report.md").read_text()
    for row in ("| `exactness/a` |", "| `order/b` |"):
        assert text.split(row, 1)[1].split("\n", 2)[2].startswith("*Legend.* Columns:")
    assert f"at most {measure.EXACT_FLOAT64:g} in float64" in text
    assert f"within {measure.ORDER_TOLERANCE:g} of the solver's order" in text
    monkeypatch.setattr(measure, "ORDER_TOLERANCE", 0.25)
    assert "within 0.25 of the solver's order" in claims_report.legend("orders")
