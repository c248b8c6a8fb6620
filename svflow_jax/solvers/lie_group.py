"""Lie-group methods: SO(d) acts on each token's sphere by rotations.

Per token, a tangent vector ``k`` at a point ``x`` of the sphere defines the generator
``Omega = k x^T - x k^T`` of so(d), which moves ``x`` with velocity ``k`` (``Omega x = k``).
Its exponential rotates the plane ``span(x, k)`` by the angle ``|k|`` (``sphere.plane_rotation``),
so a step built from such exponentials stays on the sphere exactly (up to round-off).

* Crouch-Grossman methods (:class:`AbstractCrouchGrossman`): with ``k_j = h f(t0 + c_j h, Y_j)``
  and ``Omega_j`` frozen at stage ``j``,

      Y_i = exp(a_{i,i-1} Omega_{i-1}) ... exp(a_{i1} Omega_1) y0,
      y1  = exp(b_s Omega_s) ... exp(b_1 Omega_1) y0,

  the first factor acting first. A method is its tableau ``(a, b, c)``; the order conditions
  differ from the classical ones beyond order 2 (Owren & Marthinsen 1999).
  :class:`CrouchGrossman3` is the three-stage third-order one.
* Runge-Kutta-Munthe-Kaas (:class:`RKMK4`): a classical Runge-Kutta method on the Lie-algebra
  ODE ``u' = dexp_u^{-1}(xi(t, exp(u) y0))``, ``xi(t, y) = f(t, y) y^T - y f(t, y)^T``,
  truncated to the commutators that order 4 needs, then ``y1 = exp(u) y0``.
"""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import jax.scipy.linalg as jsl
from diffrax import RESULTS
from jaxtyping import Array

from svflow_jax import sphere

from .base import AbstractSphereSolver, within_step

__all__ = ["AbstractCrouchGrossman", "CrouchGrossman3", "RKMK4"]


class AbstractCrouchGrossman(AbstractSphereSolver):
    """Explicit Crouch-Grossman method for the action of SO(d) on each token's sphere.

    With ``k_j = h f(t0 + c_j h, Y_j)``, stage ``j`` freezes, per token, the generator
    ``Omega_j = (k_j Y_j^T - Y_j k_j^T) / h`` of so(d), which moves ``Y_j`` with velocity
    ``f(Y_j)``, and acts on points by ``exp(h a Omega_j) y = plane_rotation(Y_j, a k_j, y)``:

        Y_i = exp(h a_{i,i-1} Omega_{i-1}) ... exp(h a_{i1} Omega_1) y0
        y1  = exp(h b_s Omega_s) ... exp(h b_1 Omega_1) y0

    Every factor is a rotation, so the states stay on the sphere exactly (up to round-off).
    No error estimate; dense output is :class:`RetractedLinearInterpolation` (a chord: local
    error ``O(h^2)``). The state must be a single array. One field evaluation per stage.

    A new method is a subclass that sets the tableau as class attributes::

        class MyCG(AbstractCrouchGrossman):
            a_lower = ((a21,), (a31, a32))      # row i: a_{i+2, 1..i+1}
            b = (b1, b2, b3)
            c = (0.0, c2, c3)                   # c_1 = 0, c_i = sum_j a_ij
            method_order = 3

    The tableau is checked when the subclass is defined (shapes, ``sum b = 1``,
    ``c_1 = 0``, ``c_i = sum_j a_ij``); the order is the subclass's claim (measure it).
    """

    a_lower: ClassVar[tuple[tuple[float, ...], ...]]
    b: ClassVar[tuple[float, ...]]
    c: ClassVar[tuple[float, ...]]
    method_order: ClassVar[int]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        names = ("a_lower", "b", "c", "method_order")
        if all(hasattr(cls, name) for name in names):
            _check_tableau(cls.__name__, cls.a_lower, cls.b, cls.c, cls.method_order)

    def order(self, terms) -> int:
        return self.method_order

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        terms, _ = within_step(terms, t0, t1)
        control = terms.contr(t0, t1)
        h = t1 - t0
        stages: list[Array] = []
        incs: list[Array] = []
        for i, ci in enumerate(self.c):  # static, a handful of stages
            coeffs = self.a_lower[i - 1] if i > 0 else ()
            y = _compose_rotations(y0, stages, incs, coeffs)
            stages.append(y)
            incs.append(terms.vf_prod(t0 + ci * h, y, args, control))
        # Rotations keep |y| = 1 exactly; the retraction only stops round-off accumulating.
        y1 = sphere.retract(_compose_rotations(y0, stages, incs, self.b))
        return y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful


def _check_tableau(name, a_lower, b, c, method_order) -> None:
    def fail(why):
        raise TypeError(f"{name}: invalid Crouch-Grossman tableau: {why}")

    s = len(c)
    if s < 1 or len(b) != s or len(a_lower) != s - 1:
        fail(f"need len(c) == len(b) == len(a_lower) + 1, got {len(c)}, {len(b)}, "
             f"{len(a_lower)}")
    for i, row in enumerate(a_lower):
        if len(row) != i + 1:
            fail(f"row {i} of a_lower (stage {i + 2}) must have {i + 1} entries, got {len(row)}")
    if c[0] != 0:
        fail(f"the first stage is explicit: c[0] must be 0, got {c[0]}")
    if abs(sum(b) - 1.0) > 1e-12:
        fail(f"the weights b must sum to 1 (consistency), got {sum(b)}")
    for i, row in enumerate(a_lower):
        if abs(sum(row) - c[i + 1]) > 1e-12:
            fail(f"c[{i + 1}] = {c[i + 1]} must equal the row sum of a_lower[{i}] = {sum(row)}")
    if isinstance(method_order, bool) or not isinstance(method_order, int) or method_order < 1:
        fail(f"method_order must be a positive int, got {method_order!r}")


def _compose_rotations(y0, stages, incs, coeffs) -> Array:
    """``exp(a_m Omega_m) ... exp(a_1 Omega_1) y0``: the first factor acts first."""
    y = y0
    for a, x, k in zip(coeffs, stages, incs, strict=False):
        if a != 0.0:
            y = sphere.plane_rotation(x, a * k, y)
    return y


class CrouchGrossman3(AbstractCrouchGrossman):
    """Three-stage, third-order Crouch-Grossman method (Crouch & Grossman 1993, as given by
    Owren & Marthinsen 1999):

        c = (0, 3/4, 17/24),  a21 = 3/4,  a31 = 119/216,  a32 = 17/108,
        b = (13/51, -2/3, 24/17).

    Third order for general (non-commuting) frozen flows; verified numerically in
    ``tests/test_solvers.py``.
    """

    a_lower: ClassVar = ((3 / 4,), (119 / 216, 17 / 108))
    b: ClassVar = (13 / 51, -2 / 3, 24 / 17)
    c: ClassVar = (0.0, 3 / 4, 17 / 24)
    method_order: ClassVar[int] = 3


def _gram(basis: Array) -> Array:
    """``G = V V^T`` of the basis rows ``V`` (shape ``(..., m, m)``)."""
    return jnp.einsum("...id,...jd->...ij", basis, basis)


def _wedge(b: Array, a: Array) -> Array:
    """Coefficients ``K = b a^T - a b^T`` of the generator ``p y^T - y p^T``, for ``p = V^T b``
    and ``y = V^T a`` (then ``V^T K V`` is the generator)."""
    outer = b[..., :, None] * a[..., None, :]
    return outer - jnp.swapaxes(outer, -1, -2)


def _bracket(a: Array, gram: Array, b: Array) -> Array:
    """Coefficients of ``[V^T A V, V^T B V] = V^T (A G B - B G A) V``."""
    return a @ gram @ b - b @ gram @ a


def _act(s: Array, gram: Array, basis: Array) -> tuple[Array, Array]:
    """``y = exp(V^T S V) y0`` on the sphere, for ``y0 = V^T e_1`` (the first basis row), and
    its coefficients ``c`` (``y = V^T c``): ``(V^T S V) V^T = V^T (S G)``, hence
    ``exp(V^T S V) V^T e_1 = V^T expm(S G) e_1``."""
    c = jsl.expm(s @ gram)[..., :, 0]
    c = c / jnp.sqrt(jnp.einsum("...i,...ij,...j->...", c, gram, c))[..., None]
    return c, jnp.einsum("...i,...id->...d", c, basis)


class RKMK4(AbstractSphereSolver):
    """Runge-Kutta-Munthe-Kaas method with the classical RK4 tableau.

    Per token, ``xi(t, y) = f(t, y) y^T - y f(t, y)^T`` in so(d) (``xi(y) y = f(y)``, with
    ``f`` projected on the tangent space at ``y``). The Lie-algebra increments solve
    ``u' = dexp_u^{-1}(xi(exp(u) y0))``; with the RK4 tableau it is enough to keep the
    commutators below (Munthe-Kaas 1999; Hairer, Lubich & Wanner, *Geometric Numerical
    Integration*, IV.8):

        k1 = h xi(t0,       y0)
        k2 = h xi(t0 + h/2, exp(k1/2) y0)
        k3 = h xi(t0 + h/2, exp(k2/2 - [k1, k2]/8) y0)
        k4 = h xi(t0 + h,   exp(k3) y0)
        y1 = exp((k1 + 2 k2 + 2 k3 + k4)/6 - [k1, k4]/12) y0

    Order 4 (verified numerically in the tests). Uses dense ``d x d`` matrix exponentials per
    token: ``O(n d^3)`` per stage, a reference method for small ``d``. The re-normalisation
    after each action only removes round-off. The state must be a single array. Four field
    evaluations per step; on per-layer weights all four read the layer of the step (``k4`` at
    ``t0 + h`` too, see :func:`within_step`).
    """

    def order(self, terms) -> int:
        return 4

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        terms, _ = within_step(terms, t0, t1)
        control = terms.contr(t0, t1)
        h = t1 - t0
        m = 5  # basis rows: y0, then h f at each of the four stages (zero until evaluated)
        basis = jnp.zeros((*y0.shape[:-1], m, y0.shape[-1]), y0.dtype).at[..., 0, :].set(y0)
        eye = jnp.eye(m, dtype=y0.dtype)

        def stage(i, t, s, basis, gram):
            """Stage ``i``: the point ``exp(V^T s V) y0`` (``y0`` for ``s = None``; ``gram``:
            the basis's Gram matrix), ``h f`` there as basis row ``i``; the new basis, its Gram
            matrix and ``k_i``'s coefficients."""
            c, y = (eye[0], y0) if s is None else _act(s, gram, basis)
            v = terms.vf_prod(t, y, args, control)
            basis = basis.at[..., i, :].set(v)
            # k_i = p y^T - y p^T with p = v - (y . v) y, the tangent part of v at y
            b = eye[i] - sphere.dot(y, v) * c
            return basis, _gram(basis), _wedge(b, c)

        basis, gram, k1 = stage(1, t0, None, basis, None)
        basis, gram, k2 = stage(2, t0 + 0.5 * h, 0.5 * k1, basis, gram)
        basis, gram, k3 = stage(3, t0 + 0.5 * h, 0.5 * k2 - _bracket(k1, gram, k2) / 8, basis,
                                gram)
        basis, gram, k4 = stage(4, t1, k3, basis, gram)
        u = (k1 + 2 * k2 + 2 * k3 + k4) / 6 - _bracket(k1, gram, k4) / 12
        _, y1 = _act(u, gram, basis)
        return y1, None, dict(y0=y0, y1=y1), None, RESULTS.successful
