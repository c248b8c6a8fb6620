"""Small smooth tangent fields on (S^{d-1})^n for testing the solvers.

* :func:`attention_field`: an attention-like field (docs/theory.md section 4, one head)
  ``v_i(t, X) = P_{x_i} sum_j softmax_j(beta <A(t) x_i, x_j>) W(t) x_j`` with
  ``A(t) = A0 + sin(t) A1`` and ``W(t) = W0 + cos(2t) W1``;
* :func:`linear_field`: ``v(t, x) = P_x M(t) x`` with ``M(t) = M0 + sin(3t) M1``;
* :func:`total_field`: their sum (the splitting tests split it back into the two);
* :func:`rotation_field`: ``v(t, x) = S x`` for a skew ``S``: already tangent, with the closed
  form ``x(t) = expm(t S) x(0)``.

Everything above is smooth (analytic) in ``t`` and ``X``, so no order is capped by the field.
:class:`PathField` reads its weights from a parameter path (e.g. per-layer weights,
``flow.paths.PiecewiseConstant``, which jump at every layer boundary), for the tests of
:func:`svflow_jax.solvers.within_step`.
Parameters travel in ``args`` (a dict of arrays) so gradients with respect to them can be taken.
"""

from __future__ import annotations

from typing import Any, ClassVar

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from svflow_jax import sphere
from svflow_jax.flow.paths import PiecewiseConstant
from svflow_jax.solvers import Method, Retracted, RetractedEuler, Strang

Params = dict[str, Array]


def make_params(key: Array, d: int, *, scale: float = 1.0, dtype=jnp.float64) -> Params:
    """Random matrices of moderate norm: Gaussian entries of variance ``scale^2 / d`` (operator
    norm about ``2 scale``), so the flow moves O(1) over ``t in [0, 1]``."""
    names = ("A0", "A1", "W0", "W1", "M0", "M1")
    keys = jax.random.split(key, len(names))
    params = {
        name: scale * jax.random.normal(k, (d, d), dtype=dtype) / jnp.sqrt(d)
        for name, k in zip(names, keys, strict=True)
    }
    params["beta"] = jnp.asarray(1.5, dtype=dtype)
    return params


def attention_field(t, x: Float[Array, "n d"], p: Params) -> Float[Array, "n d"]:
    a = p["A0"] + jnp.sin(t) * p["A1"]
    w = p["W0"] + jnp.cos(2.0 * t) * p["W1"]
    logits = p["beta"] * (x @ a.T) @ x.T  # [i, j] = beta <A x_i, x_j>
    attn = jax.nn.softmax(logits, axis=-1)
    return sphere.project_tangent(x, attn @ (x @ w.T))


def linear_field(t, x: Float[Array, "n d"], p: Params) -> Float[Array, "n d"]:
    m = p["M0"] + jnp.sin(3.0 * t) * p["M1"]
    return sphere.project_tangent(x, x @ m.T)


def total_field(t, x: Float[Array, "n d"], p: Params) -> Float[Array, "n d"]:
    return attention_field(t, x, p) + linear_field(t, x, p)


def rotation_field(t, x: Float[Array, "n d"], s: Float[Array, "d d"]) -> Float[Array, "n d"]:
    """``S x`` with ``S`` skew-symmetric (tangent without projection)."""
    del t
    return x @ s.T


def skew(key: Array, d: int, *, scale: float = 1.0, dtype=jnp.float64) -> Float[Array, "d d"]:
    g = scale * jax.random.normal(key, (d, d), dtype=dtype) / jnp.sqrt(d)
    return g - g.T


# ---------------------------------------------------------------------------------------------
# Per-layer weights: a field whose parameters are a path theta(t)
# ---------------------------------------------------------------------------------------------


def layer_anchors(key: Array, num_layers: int, d: int, *, scale: float = 1.0,
                  dtype=jnp.float64) -> Params:
    """Per-layer weights of :func:`layer_field`, stacked on a leading axis of ``num_layers``:
    Gaussian ``d x d`` matrices ``A``, ``W``, ``M`` of variance ``scale^2 / d``. Independent draws
    per layer, so the field jumps by O(1) at every layer boundary."""
    keys = jax.random.split(key, 3)
    return {
        name: scale * jax.random.normal(k, (num_layers, d, d), dtype=dtype) / jnp.sqrt(d)
        for name, k in zip(("A", "W", "M"), keys, strict=True)
    }


def layer_field(theta: Params, x: Float[Array, "n d"]) -> Float[Array, "n d"]:
    """An attention-like field at fixed weights: ``P_x (softmax(<A x_i, x_j>) W x_j + M x_i)``."""
    attn = jax.nn.softmax((x @ theta["A"].T) @ x.T, axis=-1)
    return sphere.project_tangent(x, attn @ (x @ theta["W"].T) + x @ theta["M"].T)


class PathField(eqx.Module):
    """``v(t, x) = layer_field(path(t), x)``: the path is a pytree node, so the solvers see it
    (and its ``within_step``)."""

    path: Any

    def __call__(self, t, x, args):
        del args
        return layer_field(self.path(t), x)


class WithoutStepRestriction(PiecewiseConstant):
    """Per-layer weights whose ``within_step`` is the identity: every stage reads the path at
    its own time, i.e. a stage at ``c = 1`` reads the next layer (the behaviour before the
    fix)."""

    def within_step(self, t0, t1):
        del t0, t1
        return self


# ---------------------------------------------------------------------------------------------
# Solvers for the registry tests (imported by path: "fields_for_tests:...")
# ---------------------------------------------------------------------------------------------


def retracted_ralston():
    """Ralston's second-order method, retracted."""
    return Retracted(diffrax.Ralston())


def retracted_bosh3():
    """Bogacki-Shampine 3(2), retracted: four stages, the last one FSAL."""
    return Retracted(diffrax.Bosh3())


def strang_euler():
    """A splitting: it needs two fields and has no order without them."""
    return Strang(RetractedEuler())


def not_a_solver():
    """A factory that returns something else."""
    return 42


class OrderlessRalston(diffrax.Ralston):
    """Ralston with an unknown order (``order`` returns None)."""

    stays_on_sphere: ClassVar[bool] = True

    def order(self, terms):
        return None


EULER_INSTANCE = RetractedEuler()
RALSTON_METHOD = Method("ralston", retracted_ralston(), diffrax.Ralston(), None,
                        "Ralston, retracted", order=2, cost=2, step_range=(4, 256), num_sizes=6)
