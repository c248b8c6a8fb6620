"""The correspondence layer's own behaviour, beyond the claims (``tests/test_claims.py`` runs
every measured claim): the domain of the standard post-norm identity, the dictionary of
parameter names, and the order fit every claim uses, against SciPy.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from svflow_jax import fitting
from svflow_jax.bridge import correspondence
from svflow_jax.claims import Context, Options, problem
from svflow_jax.transformer import Transformer, layer_params

CTX = Context(Options(tokens=5, dim=8, layers=16))


def test_standard_postnorm_step_refuses_to_cross_the_origin():
    """Claim b holds while ``1 + h x.u > 0``. With a large step (``h = 2``) some sub-step has
    ``1 + h x.u <= 0``: ``x + h u`` crosses into the half-space ``y . x <= 0`` and the layer
    returns the antipode of any per-token step. The flow side must say so rather than return a
    wrong state."""
    config = problem.transformer_config(CTX, block="sequential", residual_scale=2.0,
                                        init_std=0.3)
    params = problem.random_params(config, 0)
    x = problem.inputs(CTX)
    substeps = Transformer.from_layer_params(config, params).hidden_states(x, substeps=True)
    factors = np.asarray(correspondence.radial_factors(config, params, substeps))
    assert np.any(factors <= 0), "this test needs a sub-step with 1 + h x.u <= 0"
    with pytest.raises(Exception, match="crossed the origin"):
        correspondence.layer_gaps(config, params, x)


def test_discrepancy_of_a_model_instance():
    """``discrepancy(model, x)`` (the user-facing entry point) agrees with ``layer_gaps``."""
    config = problem.transformer_config(CTX, project_branches=True, n_layers=3)
    params = problem.random_params(config, 1)
    model = Transformer.from_layer_params(config, params)
    out = correspondence.discrepancy(model, problem.inputs(CTX))
    assert len(out["per_layer"]) == 3 and out["max_abs_diff"] <= 1e-12
    assert layer_params(model).keys() == params.keys()


def test_gain_helpers_follow_the_sub_step_order():
    """``substep_gains`` lists, for each layer, the gain of each sub-step's Norm in hidden-state
    order (macaron: FFN, attention, FFN, sharing the FFN Norm)."""
    config = problem.transformer_config(CTX, block="macaron", norm_gain=True, n_layers=2)
    params = problem.random_params(config, 2)
    ffn, attn = jnp.full((2, 8), 2.0), jnp.full((2, 8), 3.0)
    params = correspondence.with_gains(config, params, [attn, ffn])  # sorted names: attn, ffn
    gains = np.asarray(correspondence.substep_gains(config, params))[:, 0]
    np.testing.assert_array_equal(gains, [2.0, 3.0, 2.0, 2.0, 3.0, 2.0])
    with pytest.raises(ValueError, match="no Norm gains"):
        correspondence.with_gains(dataclasses.replace(config, norm_gain=False), params, 1.0)


def test_ellipsoid_residual_closed_form():
    g = jnp.asarray([1.0, 2.0, 0.5, 1.5])
    x = g * jnp.asarray([1.0, -1.0, 1.0, 1.0]) * math.sqrt(4) / 2.0  # |x / g| = sqrt(d)
    assert float(correspondence.ellipsoid_residual(x, g)) == pytest.approx(0.0, abs=1e-15)
    assert float(correspondence.ellipsoid_residual(2 * x, g)) == pytest.approx(2.0)


def test_fit_order_agrees_with_scipy():
    """Slope and 95% interval against ``scipy.stats.linregress`` and ``scipy.stats.t``."""
    stats = pytest.importorskip("scipy.stats")
    h = np.geomspace(1e-3, 1e-1, 6)
    err = 3 * h**2 * (1 + 0.2 * np.sin(np.arange(6.0)))  # order 2 with a wobble
    fit = fitting.fit_order(h, err)
    ref = stats.linregress(np.log(h), np.log(err))
    half = stats.t.ppf(0.975, 4) * ref.stderr
    assert fit.slope == pytest.approx(ref.slope, abs=1e-12)
    assert fit.low == pytest.approx(ref.slope - half, abs=1e-3)
    assert fit.high == pytest.approx(ref.slope + half, abs=1e-3)
    assert fitting.fit_order(h, h**1.5).slope == pytest.approx(1.5, abs=1e-12)
