"""One way to measure: the error metric, the reference solves, the tolerances, the order fit.

Error metric (everywhere): the largest geodesic distance over tokens between two directions,

    err = max_i 2 atan2(|a_i - b_i|, |a_i + b_i|),     a_i, b_i on S^{d-1} (retracted first),

accurate near 0, where ``arccos`` of a dot product loses half of the digits.

References: ``u(T)`` of the spherical flow by ``Retracted(Dopri8())`` with a PID controller at
``rtol = atol = 1e-13`` (:func:`sphere_reference`); the limit of a pre-norm stack, a coupled
system of directions and radii, by plain ``Dopri8`` at the same tolerance
(:func:`coupled_reference`). Both always run in float64, so float32 runs are measured against an
accurate answer.

Tolerances: two sides that are equal in exact arithmetic agree to :data:`EXACT_FLOAT64` in
float64; in float32 to ``C_FLOAT32 L eps s`` (``L`` layers, ``s`` the largest token norm,
``eps = 2 u`` with ``u`` the unit round-off of a float32 matrix multiply in force;
:func:`exactness_tolerance`, :func:`matmul_unit_roundoff`). ``u`` is float32's ``2^-24`` on the
CPU, and TF32's ``2^-11`` under a GPU's default precision, where XLA rounds a float32 matrix
multiply's inputs to TF32: the tolerances follow what the hardware was asked to do, and
``summary.json`` records it (:func:`precision_in_force`). Orders pass within
:data:`ORDER_TOLERANCE` of theory (order >= 5: from ``order - HIGH_ORDER_SHORTFALL`` to ``order +``
``HIGH_ORDER_EXCESS``; :func:`order_passes`), fitted over the asymptotic window
(:func:`fit_window`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .. import fitting, sphere
from ..solvers import Retracted, SolveError
from ..solvers.adjoint import fixed_step_loop

__all__ = [
    "EXACT_FLOAT64",
    "C_FLOAT32",
    "ORDER_TOLERANCE",
    "HIGH_ORDER_SHORTFALL",
    "REFERENCE_TOLERANCE",
    "FIT_FLOOR",
    "FIT_FLOOR_FLOAT32",
    "FIT_CEILING",
    "MIN_STEPS_IN_FIT",
    "UNIT_ROUNDOFF",
    "matmul_unit_roundoff",
    "precision_in_force",
    "exactness_tolerance",
    "fit_floor",
    "geodesic_error",
    "sphere_reference",
    "coupled_reference",
    "fit_window",
    "order_passes",
    "step_counts",
    "fixed_step_solve",
    "median_seconds",
]

EXACT_FLOAT64 = 1e-12
# float32: each side rounds a layer's new state with a relative error of one or two eps32 (the
# Norm, dot products of at most d_ff terms, the residual sum), so two independently ordered
# evaluations differ by at most ~4 eps32 s per layer; the differences add up linearly over
# layers on these problems (float64 per-layer differences grow linearly). Measured C: 0.4-0.9.
C_FLOAT32 = 4.0
ORDER_TOLERANCE = 0.15
# Order-5+ methods may converge faster than their worst case on a given problem (their leading
# error coefficient is small: Tsit5 fits 5.59-5.70, Dopri8 7.88-7.98 on the claims' problems),
# but not by more than one order: a method registered one order too low fails.
HIGH_ORDER_EXCESS = 1.0
HIGH_ORDER_SHORTFALL = 0.2  # ... and not by more than this below it
REFERENCE_TOLERANCE = 1e-13
MAX_REFERENCE_STEPS = 100_000
FIT_FLOOR = 1e-12  # ten times the reference's own error (~1e-13)
FIT_FLOOR_FLOAT32 = 1e-4  # float32 states carry ~1e-7 of round-off per step
FIT_CEILING = 1e-1
MIN_STEPS_IN_FIT = 8  # coarser steps over [0, T] are pre-asymptotic


# Unit round-off u (half the machine epsilon) of the formats a float32 matrix multiply may use.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "tensorfloat32": 2.0**-11, "bfloat16": 2.0**-8}


def matmul_unit_roundoff(platform: str, precision: str | None = None) -> tuple[str, float]:
    """``(format, u)``: the format a float32 matrix multiply rounds its inputs to on
    ``platform`` under ``jax_default_matmul_precision`` ``precision``, and its unit round-off.

    The rule (JAX's ``lax.Precision``):

    * ``highest`` / ``float32``: float32 everywhere (``u = 2^-24``);
    * ``cpu``: float32 whatever the setting: XLA's CPU backend ignores it (measured with
      ``jax 0.10.2``: a 64 x 256 x 64 product has the same error, 1.9e-7 relative, under every
      setting; ``tests/test_claims.py`` measures it again);
    * ``gpu`` (``cuda``, ``rocm``), any lower setting (``None``, ``default``, ``high``,
      ``bfloat16``, ``tensorfloat32``): TF32 (``u = 2^-11``), what XLA uses on GPUs with tensor
      cores (an older GPU computes in float32, so the tolerance is then only looser);
    * ``tpu``, any lower setting: bfloat16 passes (``u = 2^-8``; ``high``, three passes, is
      more accurate than that: the tolerance is looser than needed).
    """
    precision = (precision or "default").lower()
    platform = platform.lower()
    if precision in ("highest", "float32") or platform == "cpu":
        name = "float32"
    elif platform in ("gpu", "cuda", "rocm"):
        name = "tensorfloat32"
    else:
        name = "bfloat16"
    return name, UNIT_ROUNDOFF[name]


def precision_in_force() -> dict[str, Any]:
    """The backend, ``jax_default_matmul_precision`` and the float32 matrix multiply's format and
    unit round-off that follow (:func:`matmul_unit_roundoff`): the facts behind every float32
    tolerance of a run (``summary.json`` records them). Starts the backend."""
    platform = _platform()
    precision = jax.config.jax_default_matmul_precision
    name, unit = matmul_unit_roundoff(platform, precision)
    return {"backend": platform, "matmul_precision": precision or "default",
            "float32_matmul": name, "float32_unit_roundoff": unit}


def _platform() -> str:
    return jax.default_backend()


def _float32_epsilon() -> float:
    """``2 u`` of a float32 matrix multiply in force (``eps32`` on the CPU)."""
    return 2 * precision_in_force()["float32_unit_roundoff"]


def exactness_tolerance(dtype, layers: int, scale: float) -> float:
    """``1e-12`` in float64; ``C_FLOAT32 * layers * eps * scale`` in float32, ``eps = 2 u`` of
    the float32 matrix multiply in force (:func:`precision_in_force`; ``eps32`` on the CPU)."""
    if jnp.dtype(dtype) == jnp.float64:
        return EXACT_FLOAT64
    return C_FLOAT32 * layers * _float32_epsilon() * scale


def fit_floor(dtype) -> float:
    """Smallest error that enters an order fit, for states of ``dtype`` (in float32 scaled by
    the matrix multiply's round-off in force relative to float32's)."""
    if jnp.dtype(dtype) == jnp.float64:
        return FIT_FLOOR
    return FIT_FLOOR_FLOAT32 * _float32_epsilon() / float(jnp.finfo(jnp.float32).eps)


def geodesic_error(a: Float[Array, "... n d"], b: Float[Array, "... n d"]) -> float:
    """``max_i dist(R(a_i), R(b_i))``: the largest geodesic distance between directions."""
    return float(_geodesic_error(a, b))  # no jnp.asarray: it compiles a program per shape


@jax.jit
def _geodesic_error(a, b):  # one program per shape instead of one per operation
    dtype = jnp.result_type(a, b)
    a, b = a.astype(dtype), b.astype(dtype)
    return jnp.max(sphere.geodesic_distance(sphere.retract(a), sphere.retract(b)))


def _float64(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, tree)


def sphere_reference(field: Callable, u0: Float[Array, "n d"], t1: float) -> Array:
    """``u(t1)`` of ``du/dt = v_t(u)`` on the sphere, in float64: ``Retracted(Dopri8())``, PID at
    ``rtol = atol = 1e-13``."""
    if not jax.config.jax_enable_x64:
        raise RuntimeError("reference solves run in float64: enable jax_enable_x64 first")
    return _succeeded(*_adaptive_reference(field, u0, float(t1)))


def _succeeded(y, result, succeeded, nan):
    """The state of a reference solve, checked on the host from flags the program computed (a
    check inside the program would be a host callback, which keeps the program out of the
    compilation cache; a check by JAX operations here would compile one program each)."""
    if not bool(succeeded):
        raise SolveError(f"a reference solve failed: {diffrax.RESULTS[result]}")
    if bool(nan):
        raise SolveError("a reference solve produced NaN")
    return y


def _outcome(y, result):
    """``(y, result, succeeded, nan)``: what :func:`_succeeded` checks, computed in the program."""
    return (y, result, result == diffrax.RESULTS.successful,
            jnp.any(jnp.isnan(jax.tree.leaves(y)[0])))


@eqx.filter_jit
def _adaptive_reference(field, u0, t1):
    u0 = sphere.retract(jnp.asarray(u0, jnp.float64))
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(_float64(field)), Retracted(diffrax.Dopri8(scan_kind="lax")), 0.0, t1,
        None, u0,
        stepsize_controller=diffrax.PIDController(rtol=REFERENCE_TOLERANCE,
                                                  atol=REFERENCE_TOLERANCE),
        max_steps=MAX_REFERENCE_STEPS, throw=False)
    return _outcome(sol.ys[-1], sol.result)


def coupled_reference(field, y0: Float[Array, "n d"], t1: float) -> tuple[Array, Array]:
    """The continuous limit of an unprojected pre-norm stack, in directions and radii.

    With ``y_i = r_i u_i`` and ``dy/dt = F_t(U)`` (``F = field.drift`` read at the directions
    ``U``), the directions and radii solve the coupled system

        du_i/dt = P_{u_i} F_t(U)_i / r_i = v_t(U)_i / r_i,      dr_i/dt = u_i . F_t(U)_i.

    It is not the spherical flow re-timed per token: every token's field reads all directions
    at the same time ``t``. Solved in float64 by ``Dopri8``, PID at ``rtol = atol = 1e-13``.
    Returns ``(U(t1), r(t1))``.
    """
    return _succeeded(*_coupled(field, y0, float(t1)))


@eqx.filter_jit
def _coupled(field, y0, t1):
    field, y0 = _float64(field), y0.astype(jnp.float64)
    def vector_field(t, state, args):
        u, r = state
        drift = field.drift(t, u)
        radial = jnp.sum(u * drift, axis=-1)
        return (drift - radial[..., None] * u) / r[..., None], radial

    r0 = jnp.linalg.norm(y0, axis=-1)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field), diffrax.Dopri8(scan_kind="lax"), 0.0, t1, None,
        (y0 / r0[..., None], r0),
        stepsize_controller=diffrax.PIDController(rtol=REFERENCE_TOLERANCE,
                                                  atol=REFERENCE_TOLERANCE),
        max_steps=MAX_REFERENCE_STEPS, throw=False,
    )
    u, r = sol.ys  # pyright: ignore[reportGeneralTypeIssues]  (saved: SaveAt(t1=True))
    return _outcome((sphere.retract(u[-1]), r[-1]), sol.result)


def fit_window(
    steps: Iterable[float], errors: Iterable[float], floor: float = FIT_FLOOR,
    ceiling: float = FIT_CEILING, max_step: float = math.inf,
) -> dict[str, Any]:
    """The order over the asymptotic window: points with ``floor <= err <= ceiling`` and
    ``h <= max_step``, fitted by :func:`svflow_jax.fitting.fit_order`.

    Returns ``fitted_order``, ``order_ci`` (``[lo, hi]``; NaN with fewer than 3 points),
    ``fit_points`` and ``in_fit`` (one bool per point).
    """
    h, e = np.asarray(list(steps), float), np.asarray(list(errors), float)
    mask = np.isfinite(e) & (e >= floor) & (e <= ceiling) & (h <= max_step * (1 + 1e-12))
    k = int(mask.sum())
    if k < 3:
        return {"fitted_order": math.nan, "order_ci": [math.nan, math.nan], "fit_points": k,
                "in_fit": mask.tolist()}
    fit = fitting.fit_order(h[mask], e[mask])
    return {"fitted_order": fit.slope, "order_ci": [fit.low, fit.high], "fit_points": k,
            "in_fit": mask.tolist()}


def order_passes(fitted: float, expected: float, low: float | None = None) -> bool:
    """Within :data:`ORDER_TOLERANCE` of theory. Order-5+ methods may exceed their order on a
    given problem (their last points approach round-off): at least ``expected -
    HIGH_ORDER_SHORTFALL``, and not
    more than ``HIGH_ORDER_EXCESS`` above it, which fails only when the fit's whole 95% interval
    lies above (``low``, its lower end; without it the fitted value itself). The default run's
    Dopri8 fits 9.06 [7.89, 10.2]: faster than 8 + 1, but not by more than its interval."""
    if not math.isfinite(fitted):
        return False
    if expected >= 5:
        lowest = fitted if low is None or not math.isfinite(low) else min(low, fitted)
        return expected - HIGH_ORDER_SHORTFALL <= fitted and lowest <= expected + HIGH_ORDER_EXCESS
    return abs(fitted - expected) <= ORDER_TOLERANCE


def step_counts(first: int, last: int, num: int = 8) -> list[int]:
    """``num`` distinct step counts, geometrically spaced from ``first`` to ``last``."""
    if not 1 <= first < last:
        raise ValueError(f"need 1 <= first < last, got {first}, {last}")
    if num > last - first + 1:
        raise ValueError(f"{num} distinct step counts do not fit in [{first}, {last}]")
    counts = sorted({int(round(v)) for v in np.geomspace(first, last, num)})
    candidate = first
    while len(counts) < num:  # rounding merged some: fill the gaps from the bottom
        if candidate not in counts:
            counts = sorted({*counts, candidate})
        candidate += 1
    return counts


def fixed_step_solve(terms, solver, y0, t1, num_steps) -> Array:
    """``y(t1)`` after ``num_steps`` equal steps of ``solver`` from ``y0`` at time 0: the solver's
    own ``init`` and ``step``, applied ``num_steps`` times in a loop, as a Transformer applies its
    layers. ``t1`` and ``num_steps`` are traced, so one compilation serves every step size (and
    every claim asking for the same solver on the same shapes); the program is about half the
    size of a full ``diffeqsolve``. A NaN in the result is an error, never a silent value."""
    dtype = jnp.asarray(y0).dtype  # NumPy scalars: jnp.asarray of a Python number compiles
    y = _fixed_steps(terms, solver, y0, np.asarray(t1, dtype), np.asarray(num_steps))
    # checked here, not in the program (no host callback in it, so it is cacheable), and in
    # NumPy (a JAX operation here would compile programs of its own)
    if np.isnan(np.asarray(y)).any():
        raise FloatingPointError("a fixed-step solve produced NaN")
    return y


_fixed_steps = fixed_step_loop  # the claims' name for it


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` (each blocked until ready)."""
    import time

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))
