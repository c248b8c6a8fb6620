"""Geometry of the unit sphere S^{d-1} in R^d.

Every function acts on the last axis and broadcasts over all leading axes, so a state of
n tokens is simply an array of shape ``(..., n, d)``. Nothing here knows about flows or
Transformers: this is the manifold both of them live on.

Conventions
-----------
* ``x`` is a point: ``|x| = 1``.
* ``v``/``w`` are tangent vectors at ``x``: ``x . v = 0``.
* The tangent projection is ``P_x = I - x x^T``.
* The retraction ``R(y) = y / |y|`` is the metric projection back onto the sphere. It is
  what a normalisation layer does (up to the radius ``sqrt(d)`` of RMSNorm).
* ``exp_map`` follows great circles: ``exp_x(w) = cos|w| x + sin|w| w/|w|``.

The small-angle branches use ``sinc``-type expressions so that values *and* gradients are
finite at ``|w| = 0`` (no ``0/0`` under ``jnp.where``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

__all__ = [
    "dot",
    "norm",
    "project_tangent",
    "retract",
    "soft_retract",
    "exp_map",
    "log_map",
    "geodesic_distance",
    "uniform",
    "plane_rotation",
    "norm_drift",
    "unit_tolerance",
    "off_sphere",
]


def dot(a: Float[Array, "... d"], b: Float[Array, "... d"]) -> Float[Array, "... 1"]:
    """Inner product over the last axis, keeping it (shape ``(..., 1)``) for broadcasting."""
    return jnp.sum(a * b, axis=-1, keepdims=True)


def norm(a: Float[Array, "... d"]) -> Float[Array, "... 1"]:
    """Euclidean norm over the last axis, keeping it."""
    return jnp.linalg.norm(a, axis=-1, keepdims=True)


def _safe_norm(a: Float[Array, "... d"]) -> Float[Array, "... 1"]:
    """Norm whose gradient is finite (zero) at ``a = 0`` ("double where")."""
    sq = jnp.sum(a * a, axis=-1, keepdims=True)
    positive = sq > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def project_tangent(x: Float[Array, "... d"], v: Float[Array, "... d"]) -> Float[Array, "... d"]:
    """``P_x v = v - (x . v) x``: the component of ``v`` tangent to the sphere at ``x``."""
    return v - dot(x, v) * x


def retract(y: Float[Array, "... d"]) -> Float[Array, "... d"]:
    """``R(y) = y / |y|``, the metric projection of ``y != 0`` onto the sphere."""
    return y / norm(y)


def soft_retract(y: Float[Array, "... d"], eps: float) -> Float[Array, "... d"]:
    """``y / sqrt(|y|^2 + eps) = s(y) R(y)`` with ``s(y) = |y| / sqrt(|y|^2 + eps) < 1``: the
    retraction shrunk radially, most for short ``y`` (``eps = 0``: :func:`retract`)."""
    if eps == 0:
        return retract(y)
    return y / jnp.sqrt(jnp.sum(y * y, axis=-1, keepdims=True) + eps)


def exp_map(x: Float[Array, "... d"], w: Float[Array, "... d"]) -> Float[Array, "... d"]:
    """Riemannian exponential ``exp_x(w) = cos|w| x + sin|w| w / |w|``.

    ``w`` is projected onto the tangent space at ``x`` first, so round-off in ``w`` never moves
    the result off the great circle. The result is re-normalised, which only removes round-off.
    """
    w = project_tangent(x, w)
    theta = _safe_norm(w)
    y = jnp.cos(theta) * x + jnp.sinc(theta / jnp.pi) * w
    return retract(y)


def log_map(x: Float[Array, "... d"], y: Float[Array, "... d"]) -> Float[Array, "... d"]:
    """Riemannian logarithm: the tangent vector ``w`` at ``x`` with ``exp_x(w) = y``.

    ``|w|`` is the geodesic distance. Undefined for antipodal points (any direction works);
    there the returned vector has length pi in the direction of ``P_x y`` (which is ~0).
    """
    u = project_tangent(x, y)
    theta = geodesic_distance(x, y)[..., None]
    # w = theta * u / |u|, and |u| = sin(theta): write it as u / sinc(theta) to stay smooth at 0.
    return u / jnp.sinc(theta / jnp.pi)


def geodesic_distance(x: Float[Array, "... d"], y: Float[Array, "... d"]) -> Float[Array, "..."]:
    """Great-circle distance, accurate for all separations.

    ``arccos(x . y)`` loses half the significant digits near 0 (``1 - cos`` cancels). We use
    ``2 atan2(|x - y|, |x + y|)``, which has full relative accuracy near 0 *and* near pi.
    """
    return 2.0 * jnp.arctan2(
        jnp.linalg.norm(x - y, axis=-1), jnp.linalg.norm(x + y, axis=-1)
    )


def uniform(
    key: PRNGKeyArray, shape: tuple[int, ...], d: int, dtype=None
) -> Float[Array, "*shape d"]:
    """Samples from the uniform distribution on ``S^{d-1}``: normalised standard Gaussians."""
    if int(d) < 2:
        raise ValueError(f"the sphere S^(d-1) needs d >= 2, got d={d}")
    dtype = dtype if dtype is not None else jnp.result_type(float)
    g = jax.random.normal(key, (*shape, int(d)), dtype=dtype)
    return retract(g)


def plane_rotation(
    x: Float[Array, "... d"], w: Float[Array, "... d"], y: Float[Array, "... d"]
) -> Float[Array, "... d"]:
    """Action of ``exp(w x^T - x w^T)`` in SO(d) on ``y``.

    ``x`` is a unit vector and ``w`` a tangent vector at ``x`` (its normal part is removed).
    The generator ``w x^T - x w^T`` is the element of so(d) that moves ``x`` with velocity
    ``w``: it rotates the plane span(x, w) by the angle ``|w|`` and fixes its orthogonal
    complement. Lie-group integrators (Crouch-Grossman, Munthe-Kaas) freeze such a generator
    at one point and apply it to another; applied to ``y = x`` it equals ``exp_map(x, w)``.

    In the orthonormal basis ``e1 = x``, ``e2 = w / |w|`` and with ``a = e1 . y``,
    ``b = e2 . y``, the rotation is
    ``y + (cos|w| - 1)(a e1 + b e2) + sin|w| (a e2 - b e1)``. We write the ``e2`` terms with
    ``w`` itself and sinc-type factors so the map is smooth at ``w = 0``.
    """
    w = project_tangent(x, w)
    theta = _safe_norm(w)
    a = dot(x, y)
    wy = dot(w, y)
    sinc = jnp.sinc(theta / jnp.pi)  # sin(theta) / theta
    half_sinc = jnp.sinc(theta / (2.0 * jnp.pi))  # sin(theta/2) / (theta/2)
    cos_m1 = -2.0 * jnp.sin(theta / 2.0) ** 2  # cos(theta) - 1 without cancellation
    # (cos - 1) b e2 = -(1/2) half_sinc^2 (w . y) w ;  sin * b * e1 = sinc (w . y) x
    return (
        y
        + cos_m1 * a * x
        - 0.5 * half_sinc**2 * wy * w
        + sinc * (a * w - wy * x)
    )


def norm_drift(y: Float[Array, "... d"]) -> Float[Array, ""]:
    """``max | |y| - 1 |`` over all leading axes: how far a state has left the sphere."""
    return jnp.max(jnp.abs(jnp.linalg.norm(y, axis=-1) - 1.0))


def unit_tolerance(dtype, d: int) -> float:
    """Largest ``| |x| - 1 |`` of a point of ``S^{d-1}`` stored in ``dtype``: ``32 sqrt(d) eps``.

    This is the one definition of "a unit vector" in the package (the solvers' input check and
    the vMF functions both use it). ``retract(y) = y / |y|`` rounded to ``dtype`` leaves
    ``| |x| - 1 |`` typically of order ``sqrt(d) eps`` (the rounding errors of the ``d``
    components and of the norm add up like a random walk). 32 times that accepts every
    normalised vector, also one computed in float64 and cast to float32 or moved by a few
    rotations, and still rejects any unnormalised input by orders of magnitude, e.g. the
    radius-``sqrt(d)`` sphere of RMSNorm.
    Values: float64, ``d = 3``: 1.2e-14; ``d = 64``: 5.7e-14; float32, ``d = 768``: 1.1e-4.
    """
    if int(d) < 1:
        raise ValueError(f"the dimension d must be positive, got d={d}")
    return 32.0 * math.sqrt(int(d)) * float(jnp.finfo(dtype).eps)


def off_sphere(x: Float[Array, "... d"], tol: float | None = None) -> Bool[Array, "..."]:
    """Per row, whether ``x`` is NOT a unit vector: ``| |x| - 1 | > tol`` or not finite.

    ``tol`` defaults to :func:`unit_tolerance` of ``x``'s dtype and last axis. A row containing
    NaN or inf counts as off the sphere. The result has ``x``'s shape without the last axis.
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("x must have a last axis of length d, got a scalar")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
    if tol is None:
        tol = unit_tolerance(x.dtype, x.shape[-1])
    deviation = jnp.abs(jnp.linalg.norm(x, axis=-1) - 1.0)
    return ~(deviation <= tol)  # NaN compares False: off the sphere
