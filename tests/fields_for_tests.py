"""Small smooth tangent fields on (S^{d-1})^n for testing the solvers.

* :func:`attention_field`: an attention-like field (SVFLOW.md section 3, one head)
  ``v_i(t, X) = P_{x_i} sum_j softmax_j(beta <A(t) x_i, x_j>) W(t) x_j`` with
  ``A(t) = A0 + sin(t) A1`` and ``W(t) = W0 + cos(2t) W1``;
* :func:`linear_field`: ``v(t, x) = P_x M(t) x`` with ``M(t) = M0 + sin(3t) M1``;
* :func:`total_field`: their sum (the splitting tests split it back into the two);
* :func:`rotation_field`: ``v(t, x) = S x`` for a skew ``S``: already tangent, with the closed
  form ``x(t) = expm(t S) x(0)``.

Everything is smooth (analytic) in ``t`` and ``X``, so no order is capped by the field.
Parameters travel in ``args`` (a dict of arrays) so gradients with respect to them can be taken.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from svflow_jax import sphere

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
