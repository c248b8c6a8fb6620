"""Time-dependent parameters ``theta(t)``: how layers become time.

A Transformer layer ``l`` uses the weights ``theta_l`` at time ``t_l = t0 + l h``. Which function
of *continuous* time those weights come from decides what the ODE is:

* :class:`Constant`: one ``theta`` for all t (weight-tied layers, an autonomous flow);
* :class:`PiecewiseConstant`: ``theta(t) = theta_l`` on ``[t_l, t_{l+1})`` (separate weights per
  layer; exactly what a Transformer stack integrates);
* :class:`LinearInterpolation`: continuous, piecewise linear through the layer anchors;
* :class:`ChebyshevInterpolation`: the polynomial through anchors at Chebyshev points,
  C-infinity, so higher-order solvers reach their full order and depth can go to infinity.

A path maps a time to a parameter *pytree* (for example an
:class:`~svflow_jax.flow.attention.AttentionParams`), so any field can take any schedule.
Anchors are stored stacked: every array leaf has a leading axis of length ``L``.

Which weights a solver step reads is the path's decision too (:meth:`ParameterPath.within_step`,
called by the sphere solvers at the start of every step): a continuous path is read at each
stage time; a :class:`PiecewiseConstant` path gives every stage of a step inside layer ``l`` the
weights ``theta_l``, so a stage at the end of the step does not read the next layer and steps
aligned with the layers keep the solver's order.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PyTree, Real

__all__ = [
    "ParameterPath",
    "Constant",
    "PiecewiseConstant",
    "LinearInterpolation",
    "ChebyshevInterpolation",
    "stack",
    "num_anchors",
]


def stack(params: list[PyTree]) -> PyTree:
    """Stacks a list of parameter pytrees along a new leading (anchor) axis."""
    return jax.tree.map(lambda *a: jnp.stack(a), *params)


def num_anchors(stacked: PyTree) -> int:
    """Length of the leading (anchor) axis shared by every leaf of ``stacked``."""
    sizes = {leaf.shape[0] for leaf in jax.tree.leaves(stacked) if eqx.is_array(leaf)}
    if len(sizes) != 1:
        raise ValueError(f"stacked parameters must share one leading axis length, got {sizes}")
    return sizes.pop()


def _index(stacked: PyTree, i) -> PyTree:
    return jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, stacked)


class ParameterPath(eqx.Module):
    """``t -> theta(t)``.

    Besides ``__call__``, a path says which weights a solver step reads, through
    :meth:`within_step` (the sphere solvers call it on every node of their terms that has it).
    """

    @abc.abstractmethod
    def __call__(self, t: Real[Array, ""]) -> PyTree:
        """The parameters at time ``t``."""

    def within_step(self, t0: Real[Array, ""], t1: Real[Array, ""]) -> ParameterPath:
        """The path that the stages of a solver step over ``[t0, t1]`` read.

        By default the path itself (the identity, returned as ``self``): a continuous
        ``theta(t)`` is read at each stage time ``t0 + c_i h``. :class:`PiecewiseConstant`
        overrides it so that every stage of a step inside a layer reads *that* layer's
        weights, also a stage at ``c = 1``, i.e. at the next layer's start time. The solvers of
        :mod:`svflow_jax.solvers` call it at the start of every step (see
        :func:`svflow_jax.solvers.within_step`); ``t0``, ``t1`` may be traced.
        """
        del t0, t1
        return self


class Constant(ParameterPath):
    """``theta(t) = theta`` (weight tying: every layer shares the same weights)."""

    value: PyTree

    def __call__(self, t):
        del t
        return self.value


class _LayerGrid(ParameterPath):
    """Anchors ``theta_l`` at ``t_l = t0 + l h``, ``l = 0..L-1``."""

    anchors: PyTree
    t0: float = eqx.field(static=True)
    step: float = eqx.field(static=True)

    def __init__(self, anchors: PyTree, step: float, t0: float = 0.0):
        if not step > 0:
            raise ValueError(f"the layer step h must be positive, got {step}")
        num_anchors(anchors)  # validates the stacking
        self.anchors = anchors
        self.step = float(step)
        self.t0 = float(t0)

    @property
    def num_layers(self) -> int:
        return num_anchors(self.anchors)

    def _position(self, t):
        """``(t - t0) / h`` in units of layers, in the dtype of ``t``."""
        t = jnp.asarray(t)
        return (t - self.t0) / self.step


class PiecewiseConstant(_LayerGrid):
    """``theta(t) = theta_l`` for ``t`` in ``[t_l, t_{l+1})``; clamped outside ``[t0, t_L)``.

    A forward-Euler step from ``t_l`` evaluates at the left end of the interval, which is what a
    Transformer layer does. ``t_l`` computed by a solver as ``t0 + l * h`` can land a few ulps
    below the exact grid point, so the layer index is ``floor(position + slack)`` with a slack of
    a few hundred ulps of the position: the interval boundaries move by that much, which no
    step size resolves.
    """

    def __call__(self, t):
        position = self._position(t)
        index = jnp.clip(jnp.floor(position + _slack(position)).astype(jnp.int32), 0,
                         self.num_layers - 1)
        return _index(self.anchors, index)

    def within_step(self, t0, t1) -> ParameterPath:
        """``theta_l`` for every stage of a step over ``[t0, t1]`` inside layer ``l``.

        ``l`` is the layer that contains the step's midpoint ``(t0 + t1) / 2`` (clamped to
        ``0..L-1``). Right-continuity puts a Runge-Kutta stage at ``c = 1`` of the step
        ``[t_l, t_{l+1}]`` (Heun, RK4, Tsit5, Dopri, RKMK4) on layer ``l + 1``: one ``O(h)``
        local error per layer boundary, so every such method would be first order on per-layer
        weights. Reading ``theta_l`` at every stage instead integrates exactly the ODE of the
        stack, ``theta = theta_l`` on ``[t_l, t_{l+1}]``, and keeps the solver's order when the
        steps are aligned with the layer grid (any number of steps per layer).

        When the step lies inside layer ``l`` (its ends within the ulp slack of
        :meth:`__call__` of ``[t_l, t_{l+1}]``; the first and last layers extend to
        ``-inf`` / ``+inf`` like the clamping), the result equals ``Constant(theta_l)``. A
        step that straddles a layer boundary (unaligned fixed steps, or an adaptive
        controller's trial step) reads the path itself, as it would without this method: its
        stages then see the jump, so an adaptive controller's error estimate still notices it
        and shrinks the step (or use ``PIDController(jump_ts=layer times)``).
        """
        p0, p1 = self._position(t0), self._position(t1)
        mid = 0.5 * (p0 + p1)
        layers = self.num_layers
        index = jnp.clip(jnp.floor(mid).astype(jnp.int32), 0, layers - 1)
        lower = index.astype(mid.dtype)
        inside = ((index == 0) | (p0 >= lower - _slack(p0))) & (
            (index == layers - 1) | (p1 <= lower + 1 + _slack(p1))
        )
        return _LayerOfStep(self, index, inside)


def _slack(position):
    """A few hundred ulps of a layer position: ``t_l`` computed as ``t0 + l h`` by a solver can
    land that far from the exact grid point."""
    return 256 * jnp.finfo(position.dtype).eps * jnp.maximum(1.0, jnp.abs(position))


class _LayerOfStep(ParameterPath):
    """:meth:`PiecewiseConstant.within_step`: ``theta_index`` where ``inside``, else the path."""

    path: PiecewiseConstant
    index: Array
    inside: Array

    def __call__(self, t):
        own = _index(self.path.anchors, self.index)
        at_t = self.path(t)
        return jax.tree.map(
            lambda a, b: jnp.where(self.inside, a, b) if eqx.is_array(a) else a, own, at_t
        )


class LinearInterpolation(_LayerGrid):
    """Piecewise-linear ``theta(t)`` through ``theta_l`` at ``t_l``; constant beyond the ends."""

    def __call__(self, t):
        position = jnp.clip(self._position(t), 0, self.num_layers - 1)
        left = jnp.clip(jnp.floor(position).astype(jnp.int32), 0, max(self.num_layers - 2, 0))
        frac = position - left
        right = jnp.minimum(left + 1, self.num_layers - 1)
        return jax.tree.map(
            lambda a: (1 - frac) * a[left] + frac * a[right] if eqx.is_array(a) else a,
            self.anchors,
        )


def chebyshev_points(num: int, t0: float, t1: float) -> np.ndarray:
    """Chebyshev points of the second kind on ``[t0, t1]``, in increasing order."""
    if num == 1:
        return np.array([(t0 + t1) / 2])
    k = np.arange(num)
    return t0 + (t1 - t0) * (1 - np.cos(np.pi * k / (num - 1))) / 2


class ChebyshevInterpolation(ParameterPath):
    """The polynomial through anchors at the Chebyshev points of ``[t0, t1]``.

    ``theta(t) = sum_k c_k T_k(s)`` with ``s`` the time mapped to ``[-1, 1]`` and the Chebyshev
    coefficients ``c = V^{-1} theta_anchor`` fixed by interpolation (``V[i, k] = T_k(s_i)``,
    well conditioned at Chebyshev points). We evaluate it as ``theta(t) = sum_i w_i(t)
    theta_i`` with weights ``w(t) = V^{-T} T(s)``, so the anchors may be traced arrays. The path
    is C-infinity, values *and* derivatives: a solver of order p converges at order p on it (a
    piecewise path caps the order unless steps align with its pieces). Use
    :func:`chebyshev_points` for the anchor times. Outside ``[t0, t1]`` it extrapolates.
    """

    anchors: PyTree
    inverse_vandermonde: Float[Array, "K K"]
    t0: float = eqx.field(static=True)
    t1: float = eqx.field(static=True)

    def __init__(self, anchors: PyTree, t0: float, t1: float):
        if not t1 > t0:
            raise ValueError(f"need t1 > t0 for a Chebyshev path, got [{t0}, {t1}]")
        num = num_anchors(anchors)
        s = 2 * (chebyshev_points(num, t0, t1) - t0) / (t1 - t0) - 1
        vandermonde = np.cos(np.arange(num)[None, :] * np.arccos(np.clip(s, -1, 1))[:, None])
        self.anchors = anchors
        self.inverse_vandermonde = jnp.asarray(np.linalg.inv(vandermonde))
        self.t0, self.t1 = float(t0), float(t1)

    def weights(self, t: Real[Array, ""]) -> Float[Array, " K"]:
        """``w_i(t)`` with ``theta(t) = sum_i w_i(t) theta_i``."""
        t = jnp.asarray(t, jnp.result_type(t, float))
        s = 2 * (t - self.t0) / (self.t1 - self.t0) - 1
        num = self.inverse_vandermonde.shape[0]

        def recurrence(carry, _):  # T_{k+1} = 2 s T_k - T_{k-1}: smooth, no arccos
            previous, current = carry
            return (current, 2 * s * current - previous), previous

        _, basis = jax.lax.scan(recurrence, (jnp.ones_like(s), s), None, length=num)
        return basis @ self.inverse_vandermonde.astype(basis.dtype)

    def __call__(self, t):
        w = self.weights(t)
        return jax.tree.map(
            lambda a: jnp.tensordot(w.astype(a.dtype), a, axes=1) if eqx.is_array(a) else a,
            self.anchors,
        )
