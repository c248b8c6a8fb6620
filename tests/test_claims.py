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

from svflow_jax import claims, correspondence
from svflow_jax.claims import measure, problem
from svflow_jax.claims.exactness import VARIANTS
from svflow_jax.solvers import GeodesicEuler, Retracted, catalogue
from svflow_jax.solvers.registry import SOLVERS, SolverSpec

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
    spec = SolverSpec("heun-claimed-3", lambda: Retracted(diffrax.Heun()), expected_order=3,
                      evaluations_per_step=2, step_range=(4, 400))
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
    assert len(catalogue.methods()) == len(SOLVERS)


def test_options_are_validated():
    for bad in (dict(tokens=0), dict(layers=-1), dict(repeats=0), dict(seed=-1), dict(dim=1),
                dict(dim=7), dict(t1=float("nan")), dict(strength=0.0),
                dict(step_scale=float("inf")), dict(dtype="float16"), dict(depths=(8, 16)),
                dict(num_sizes=2)):
        with pytest.raises(ValueError):
            claims.Options(**bad)


def test_select_by_prefix_and_unknown_prefix():
    assert [c.name for c in claims.select(["exactness/moe"])] == ["exactness/moe"]
    with pytest.raises(ValueError, match="no claim matches"):
        claims.select(["no-such-claim"])


def test_step_counts_are_distinct_and_geometric():
    counts = measure.step_counts(4, 512, 8)
    assert len(set(counts)) == 8 and counts[0] == 4 and counts[-1] == 512
    assert measure.step_counts(4, 6, 3) == [4, 5, 6]
    with pytest.raises(ValueError):
        measure.step_counts(4, 6, 8)


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
