"""``ScanAdjoint``: the same gradient as diffrax's default adjoint, with fewer field
evaluations; storing every residual (``remat=False``) is refused.

Evaluations are counted at run time: the field is a ``jax.custom_vjp`` whose forward rule calls
a host callback (with the state as argument, so that no loop hoists it as loop-invariant); a
recomputation in the backward pass (``jax.checkpoint``) runs that forward rule again.
"""

from __future__ import annotations

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from svflow_jax import sphere
from svflow_jax.flow import AttentionField
from svflow_jax.flow.attention import AttentionParams
from svflow_jax.solvers import RK4, Retracted, RetractedEuler, ScanAdjoint, solve

N, D, H, STEPS = 6, 8, 2, 8
_count = {"f": 0}


def _bump(y):
    del y
    _count["f"] += 1


@jax.custom_vjp
def _field(params, t, y):
    jax.debug.callback(_bump, y)
    return AttentionField(params)(t, y)


def _field_fwd(params, t, y):
    jax.debug.callback(_bump, y)
    out, vjp = jax.vjp(lambda p, t, y: AttentionField(p)(t, y), params, t, y)
    return out, vjp


def _field_bwd(vjp, ct):
    return vjp(ct)


_field.defvjp(_field_fwd, _field_bwd)


def _problem():
    params = AttentionParams.random(jax.random.PRNGKey(0), D, H, D // H)
    y0 = sphere.retract(jax.random.normal(jax.random.PRNGKey(1), (N, D)))
    return params, y0


def _gradient(solver, adjoint, counted):
    params, y0 = _problem()
    weights = jnp.arange(D, dtype=y0.dtype)

    def loss(p):
        field = (lambda t, y, args: _field(p, t, y)) if counted else AttentionField(p)
        sol = solve(field, y0, 0.0, 1.0, solver=solver, num_steps=STEPS, adjoint=adjoint)
        return jnp.sum(sol.ys[-1] ** 2 * weights)

    grad = jax.jit(jax.grad(loss))
    jax.block_until_ready(grad(params))  # compile (and run once)
    jax.effects_barrier()
    _count["f"] = 0
    g = jax.block_until_ready(grad(params))
    jax.effects_barrier()
    return g, _count["f"]


def test_storing_every_residual_is_refused():
    """``ScanAdjoint(remat=False)`` (the former ``StoredAdjoint``) was slower than the default
    at every size of the peer benchmark, with 20-30 times its memory: it is refused."""
    with pytest.raises(ValueError, match="was removed"):
        ScanAdjoint(remat=False)


def test_scan_adjoint_needs_num_steps():
    params, y0 = _problem()
    with pytest.raises(ValueError, match="ScanAdjoint is for fixed-step solves"):
        solve(AttentionField(params), y0, 0.0, 1.0, solver=Retracted(RK4()), dt0=0.125,
              adjoint=ScanAdjoint())


def test_backsolve_still_refused():
    params, y0 = _problem()
    with pytest.raises(ValueError, match="BacksolveAdjoint"):
        solve(AttentionField(params), y0, 0.0, 1.0, solver=RetractedEuler(), num_steps=4,
              adjoint=diffrax.BacksolveAdjoint())


def test_scan_gradient_with_splitting_and_dense_saves():
    """A splitting of two fields (LieTrotter) and SaveAt(ts=...) (diffrax's inner loop)."""
    from svflow_jax.solvers import LieTrotter

    params, y0 = _problem()
    other = AttentionParams.random(jax.random.PRNGKey(2), D, H, D // H)
    weights = jnp.arange(D, dtype=y0.dtype)
    setups = [
        (LieTrotter(RetractedEuler()), lambda p: (AttentionField(p), AttentionField(other)), {}),
        (Retracted(RK4()), AttentionField,
         dict(saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 5)))),
    ]
    for solver, field, kw in setups:
        def loss(p, adjoint, solver=solver, field=field, kw=kw):
            sol = solve(field(p), y0, 0.0, 1.0, solver=solver, num_steps=STEPS,
                        adjoint=adjoint, **kw)
            return jnp.sum(sol.ys ** 2 * weights)

        a = jax.grad(loss)(params, diffrax.RecursiveCheckpointAdjoint())
        b = jax.grad(loss)(params, ScanAdjoint())
        for x, y in zip(jax.tree.leaves(b), jax.tree.leaves(a), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("remat, extra", [(True, 1), (jax.checkpoint_policies.dots_saveable, 1)],
                         ids=["step", "dots_saveable"])
def test_scan_adjoint_recomputes_each_step_once(remat, extra):
    """``ScanAdjoint(remat=True)``: the backward pass evaluates every stage exactly once more
    (the rematerialised step), fewer than diffrax's default; a checkpoint policy is accepted
    (the counting custom_vjp hides the field's matrix products from it, so here it recomputes
    the whole step too); the gradient is the default's."""
    solver = Retracted(RK4())
    g_default, n_default = _gradient(solver, diffrax.RecursiveCheckpointAdjoint(), True)
    g_scan, n_scan = _gradient(solver, ScanAdjoint(remat=remat), True)
    assert n_scan == (1 + extra) * 4 * STEPS < n_default
    for a, b in zip(jax.tree.leaves(g_scan), jax.tree.leaves(g_default), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


def test_scan_solve_saves_like_diffeqsolve():
    """``SaveAt`` of ``t0`` / ``steps`` / ``t1`` through the scan: the same times and states as
    diffrax's loop, float32 stays float32."""
    params, y0 = _problem()
    saves = [dict(t1=True), dict(t0=True, t1=True), dict(steps=True), dict(t0=True, steps=True),
             dict(steps=True, t1=True)]
    for dtype, tol in ((jnp.float64, 1e-14), (jnp.float32, 2e-6)):
        p = jax.tree.map(lambda x, dtype=dtype: x.astype(dtype), params)
        y = y0.astype(dtype)
        for save in saves:
            kw = dict(solver=Retracted(RK4()), num_steps=STEPS, saveat=diffrax.SaveAt(**save))
            a = solve(AttentionField(p), y, 0.0, 1.0, **kw)
            b = solve(AttentionField(p), y, 0.0, 1.0, adjoint=ScanAdjoint(), **kw)
            assert b.ys.dtype == dtype and b.ts.dtype == dtype, save
            np.testing.assert_allclose(b.ts, a.ts, rtol=0, atol=4 * float(jnp.finfo(dtype).eps))
            np.testing.assert_allclose(b.ys, a.ys, rtol=0, atol=tol)
