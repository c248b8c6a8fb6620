"""Speed benchmark: the Transformer, its diffrax flow and a plain ``lax.scan`` loop, side by side.

Run by hand (it is not a test; timings on a shared machine are too noisy to assert on)::

    python experiments/benchmark.py [--out results/benchmark] [--quick | --smoke] [--repeats R]

What is timed
-------------
The same function ``x -> output`` (``x`` a raw ``(n, d)`` hidden state, the output the state
after ``L`` layers) computed three ways, the contenders, all ``jit``-compiled and scanned over
depth:

(i)   ``transformer``: the Flax NNX :class:`~svflow_jax.transformer.Transformer` forward
      (``nnx.split`` / ``nnx.merge`` + ``jax.jit``). Post-norm, projected branches, sequential
      block (causal attention then exact-GELU FFN), RMSNorm with ``norm_eps = 0`` and no gain,
      ``H = 4`` heads of width ``d / 4``, ``d_ff = 4 d``, residual step ``h = 1 / L``: exactly
      ``L`` retracted forward-Euler steps of the SVFlow.
(ii)  ``diffrax``: ``diffrax.diffeqsolve`` of the same flow
      (:func:`svflow_jax.bridge.correspondence.to_flow`), ``LieTrotter(RetractedEuler())`` on
      ``MultiTerm(ODETerm(attention), ODETerm(experts))``, ``StepTo`` on the layer grid,
      ``SaveAt(t1=True)``; input normalised to the unit sphere, output scaled back by
      ``sqrt(d)``.
(iii) ``reference``: the same maths written straightforwardly in ``jnp`` in this file
      (:func:`make_reference`): ``lax.scan`` over the stacked layer weights.

Diagnostic (no target): ``flow_scan``, the flow's own fields (``flow.attention``,
``flow.experts``) stepped by a hand-written ``lax.scan`` with the same retraction.
``diffrax / flow_scan`` is the cost of diffrax's loop, ``flow_scan / reference`` that of the field
implementation (:mod:`svflow_jax.flow`); together they make up (ii)/(iii).

Sizes ``(n, d, L) = (32, 64, 16)`` and ``(256, 256, 64)``, in float32 and float64 (x64 is enabled
at start so both run in one process; weights, inputs and times are cast explicitly to the dtype
under test). Each contender is compiled first (``jax.jit(f).lower(...).compile()``, timed
separately) and checked against the others numerically. Then, in each of ``R`` repetitions the
contenders run one after the other (round robin, starting with a different one each time, so
machine noise hits all of them alike); one sample is ``number`` calls, each followed by
``block_until_ready``, with ``number`` chosen so a sample lasts at least ``--min-sample``
seconds. Reported: the median time per call of each, and the ratios (i)/(iii), (ii)/(iii) as
the median over repetitions of the per-repetition ratio (``ratios``, checked against the
targets): samples of one repetition run seconds apart under the same load, so their ratio
cancels the swings of a shared machine (other processes taking a core slow XLA's 2-thread
kernels by up to ~2x, for seconds at a time). For information, also the ratio of the medians
(``ratios_of_medians``) and of the minima (``ratios_of_min``).

Compile time versus depth: lowering + XLA compilation of (i), (ii) and (iii) at ``L = 4`` and
``L = 1024`` (small ``n = 8``, ``d = 32``, float32, abstract arguments so no 1024-layer weights
are allocated), median over a few fresh compilations. A scanned stack compiles in a time
independent of ``L``.

Machine reference: median time of a jitted ``(1024 x 1024) @ (1024 x 1024)`` matmul, ``2 N^3``
flops, in float32 and float64, measured on its own at start (``matmul``) and, for float32, also
inside every round robin above (``matmul_f32_side_by_side``), so that the fraction below is a
side-by-side ratio like the others (the machine's free capacity changes from minute to minute).

FLOP count of one forward pass (matmuls only; softmax, norms, GELU, projections and the
retraction are ``O(n d)`` or ``O(H n^2)`` elementwise work and are left out; the causal mask is
not exploited, every implementation computes the full ``n x n`` scores)::

    flops = L * ( 2 n d (3 H dk)      Q, K, V projections
                + 2 n (H dk) d        output projection W_O
                + 2 H n^2 dk          scores Q K^T
                + 2 H n^2 dk          P V
                + 2 * 2 n d d_ff )    FFN (W_in, W_out)

Achieved GFLOP/s of each contender = flops / median time. As a fraction of the float32 matmul
rate (``fraction_of_f32_matmul``): median over repetitions of the rate achieved over the matmul
rate of the same repetition; also over the same-dtype matmul rate measured at start
(``fraction_of_same_dtype_matmul``, less reliable).

Targets: (i)/(iii) <= 1.1, (ii)/(iii) <= 1.1, compile(L=1024)/compile(L=4) <= 1.5 (for each of
(i), (ii), (iii)).

Output: ``OUT/benchmark.json`` (default ``results/benchmark/benchmark.json``) with top-level
keys ``schema``, ``created``, ``mode``, ``settings``, ``machine``, ``targets``, ``matmul``,
``runs`` (one entry per size and dtype: ``median_s``, ``min_s``, ``samples_s``, ``compile_s``,
``ratios``, ``targets_met``, ``ratios_of_medians``, ``ratios_of_min``, ``diagnostic_ratios``,
``flops``, ``gflops``, ``matmul_f32_side_by_side``, ``fraction_of_f32_matmul``, ``agreement``),
``compile_vs_depth`` and ``summary``; a readable table is printed too.

``--quick``: fewer repeats and shorter samples. ``--smoke``: tiny sizes, one repeat, compile at
``L = 4`` and ``L = 8`` only (for the test that checks the script runs and writes its JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from svflow_jax.cli.types import nonnegative_int, positive_float, positive_int


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time the Transformer forward, its diffrax RetractedEuler solve and a plain "
        "lax.scan reference side by side (ratios, median of interleaved runs), compile time "
        "against depth, and the float32 matmul rate; write JSON.",
    )
    parser.add_argument("--out", type=Path, default=Path("results/benchmark"),
                        help="output folder (benchmark.json is written there)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer repeats, shorter samples")
    mode.add_argument("--smoke", action="store_true",
                      help="tiny sizes, 1 repeat, compile at L=4 and L=8 (for the test)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="interleaved timing repeats (default 11, quick 3, smoke 1)")
    parser.add_argument("--min-sample", type=positive_float, default=None,
                        help="seconds one timing sample lasts at least (calls are batched)")
    parser.add_argument("--compile-repeats", type=positive_int, default=None,
                        help="fresh compilations per depth (median)")
    parser.add_argument("--seed", type=nonnegative_int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args(None)  # a bad option exits here, before JAX is imported (0.2 s instead of 3.4 s)

import diffrax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from svflow_jax import sphere  # noqa: E402
from svflow_jax.bridge.correspondence import LayerFlow, to_flow  # noqa: E402
from svflow_jax.designs import DesignConfig, SolverLM  # noqa: E402
from svflow_jax.environment import environment  # noqa: E402
from svflow_jax.solvers import LieTrotter, RetractedEuler, solve  # noqa: E402
from svflow_jax.training.loop import placed, train_step  # noqa: E402
from svflow_jax.training.recipes import recipe  # noqa: E402
from svflow_jax.training.trainer import lm_loss, make_optimizer  # noqa: E402
from svflow_jax.transformer import Transformer, TransformerConfig, layer_params  # noqa: E402

CONTENDERS = ("transformer", "diffrax", "reference")  # the three with targets
DIAGNOSTIC = "flow_scan"  # timed alongside, no target
TARGETS = {"transformer/reference": 1.1, "diffrax/reference": 1.1, "compile_depth_ratio": 1.5}
MATMUL_N = 1024
N_HEADS = 4

# (n, d, L) per mode; compile-vs-depth settings (n, d, depths) per mode.
SIZES = {
    "full": [(32, 64, 16), (256, 256, 64)],
    "quick": [(32, 64, 16), (256, 256, 64)],
    "smoke": [(8, 32, 4)],
}
DEPTH_SIZE = {"full": (8, 32, (4, 1024)), "quick": (8, 32, (4, 1024)), "smoke": (8, 16, (4, 8))}
DEFAULTS = {  # repeats, seconds per sample at least, fresh compilations per depth
    "full": dict(repeats=11, min_sample=0.05, compile_repeats=3),
    "quick": dict(repeats=3, min_sample=0.02, compile_repeats=1),
    "smoke": dict(repeats=1, min_sample=0.0, compile_repeats=1),
}


# --------------------------------------------------------------------------------------------
# The model under test
# --------------------------------------------------------------------------------------------


def make_config(d: int, L: int, dtype: Any) -> TransformerConfig:
    """The post-norm, projected, sequential stack that is exactly retracted Euler of SVFlow."""
    return TransformerConfig(
        d_model=d, n_layers=L, n_heads=N_HEADS, d_head=d // N_HEADS, d_ff=4 * d,
        norm_position="post", block="sequential", residual_scale=1.0 / L,
        project_branches=True, norm="rms", norm_eps=0.0, norm_gain=False, causal=True,
        ffn="gelu", dtype=dtype, param_dtype=dtype,
    )


def param_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the stacked layer weights (``layer_params`` layout)."""
    L, d, H, k, f = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_ff
    return {
        "wq": (L, d, H, k), "wk": (L, d, H, k), "wv": (L, d, H, k), "wo": (L, H, k, d),
        "w_in": (L, d, f), "w_out": (L, f, d),
    }


def random_params(cfg: TransformerConfig, seed: int) -> dict[str, np.ndarray]:
    """Float64 weights with unit-variance outputs (std ``1 / sqrt(fan_in)``), so that layers act
    visibly (scores of order 1); cast to each dtype under test by the caller."""
    rng = np.random.default_rng(seed)
    d, hk, f = cfg.d_model, cfg.n_heads * cfg.d_head, cfg.d_ff
    fan_in = {"wq": d, "wk": d, "wv": d, "wo": hk, "w_in": d, "w_out": f}
    return {
        name: rng.standard_normal(shape) / math.sqrt(fan_in[name])
        for name, shape in param_shapes(cfg).items()
    }


def forward_flops(n: int, cfg: TransformerConfig) -> int:
    """Matmul flops of one forward pass (formula in the module docstring)."""
    d, H, k, f = cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_ff
    per_layer = (
        2 * n * d * 3 * H * k  # Q, K, V
        + 2 * n * H * k * d  # W_O
        + 2 * H * n * n * k  # Q K^T
        + 2 * H * n * n * k  # P V
        + 2 * 2 * n * d * f  # FFN
    )
    return cfg.n_layers * per_layer


# --------------------------------------------------------------------------------------------
# The three contenders: each is (function(weights, x), weights); x is a raw (n, d) state
# --------------------------------------------------------------------------------------------


def make_transformer(model: Transformer) -> tuple[Callable, Any]:
    """(i) The Flax forward; the graph definition is static, the state is the argument."""
    graphdef, state = nnx.split(model)

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    return forward, state


def make_diffrax(cfg: TransformerConfig, flow: LayerFlow) -> tuple[Callable, Any]:
    """(ii) ``diffeqsolve`` of the flow with the solver a sequential post-norm block *is*."""
    L, radius = cfg.n_layers, math.sqrt(cfg.d_model)

    def solve(flow: LayerFlow, x):
        y0 = x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # the input Norm, on S^{d-1}
        # Times in the state's dtype: a float32 solve must not be promoted by float64 times.
        ts = jnp.arange(L + 1, dtype=x.dtype) * jnp.asarray(flow.step, x.dtype)
        terms = diffrax.MultiTerm(diffrax.ODETerm(flow.attention), diffrax.ODETerm(flow.experts))
        sol = diffrax.diffeqsolve(
            terms, LieTrotter(RetractedEuler()), ts[0], ts[-1], None, y0,
            saveat=diffrax.SaveAt(t1=True), stepsize_controller=diffrax.StepTo(ts=ts),
            max_steps=L, throw=False,
        )
        return sol.ys[-1] * jnp.asarray(radius, x.dtype)

    return solve, flow


def make_flow_scan(cfg: TransformerConfig) -> Callable:
    """Diagnostic: the flow's fields stepped by hand, ``y <- R(y + h v_A(t, y))``, then
    ``y <- R(y + h v_F(t, y))``, in a ``lax.scan``: (ii) without diffrax's loop."""
    L, radius = cfg.n_layers, math.sqrt(cfg.d_model)

    def forward(flow: LayerFlow, x):
        h = jnp.asarray(flow.step, x.dtype)

        def layer(y, i):
            t = i.astype(x.dtype) * h  # left end of layer i: PiecewiseConstant picks theta_i
            y = sphere.retract(y + h * flow.attention(t, y))
            y = sphere.retract(y + h * flow.experts(t, y))
            return y, None

        y, _ = jax.lax.scan(layer, sphere.retract(x), jnp.arange(L))
        return y * jnp.asarray(radius, x.dtype)

    return forward


def make_reference(cfg: TransformerConfig) -> Callable:
    """(iii) The same stack in plain ``jnp``: ``lax.scan`` over the stacked layer weights.

    Per layer, with ``|x_i| = sqrt(d)`` (RMSNorm without eps or gain):
    ``x <- Norm(x + h P_x Attn(x))``, then ``x <- Norm(x + h P_x FFN(x))``,
    ``P_x u = u - (x.u / x.x) x``.
    """
    h, scale = cfg.residual_scale, 1.0 / math.sqrt(cfg.d_head)

    def norm(x):
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True))

    def tangent(x, u):
        return u - (jnp.sum(x * u, -1, keepdims=True) / jnp.sum(x * x, -1, keepdims=True)) * x

    def layer(x, w):
        n = x.shape[0]
        q = jnp.einsum("nd,dhk->hnk", x, w["wq"])
        k = jnp.einsum("nd,dhk->hnk", x, w["wk"])
        v = jnp.einsum("nd,dhk->hnk", x, w["wv"])
        scores = jnp.einsum("hqk,hsk->hqs", q, k) * scale
        causal = jnp.tril(jnp.ones((n, n), dtype=bool))
        p = jax.nn.softmax(jnp.where(causal, scores, jnp.finfo(x.dtype).min), axis=-1)
        attn = jnp.einsum("hqk,hkd->qd", jnp.einsum("hqs,hsk->hqk", p, v), w["wo"])
        x = norm(x + h * tangent(x, attn))
        ffn = jax.nn.gelu(x @ w["w_in"], approximate=False) @ w["w_out"]
        x = norm(x + h * tangent(x, ffn))
        return x, None

    def forward(weights, x):
        x, _ = jax.lax.scan(layer, norm(x), weights)
        return x

    return forward


def build(cfg: TransformerConfig, params: dict[str, Any]) -> dict[str, tuple[Callable, Any]]:
    """The three contenders and the diagnostic on the same weights (``params`` already in the
    dtype under test)."""
    model = Transformer.from_layer_params(cfg, params)
    flow = to_flow(cfg, layer_params(model))
    return {
        "transformer": make_transformer(model),
        "diffrax": make_diffrax(cfg, flow),
        "reference": (make_reference(cfg), dict(params)),
        DIAGNOSTIC: (make_flow_scan(cfg), flow),
    }


def build_abstract(cfg: TransformerConfig) -> dict[str, tuple[Callable, Any]]:
    """The three contenders with abstract (``ShapeDtypeStruct``) weights: enough to compile,
    with no memory for the weights (L = 1024)."""
    dtype = cfg.param_dtype
    shapes = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in param_shapes(cfg).items()}
    # nnx.eval_shape traces the constructor without drawing any random number.
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    flow = jax.eval_shape(lambda p: to_flow(cfg, p), shapes)
    return {
        "transformer": make_transformer(model),
        "diffrax": make_diffrax(cfg, flow),
        "reference": (make_reference(cfg), shapes),
    }  # the diagnostic is not compiled at depth: it is no target


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def time_compile(fn: Callable, *args) -> tuple[float, float, Any]:
    """(trace + lowering seconds, XLA compile seconds, compiled executable).

    A fresh ``jax.jit`` of a fresh wrapper each time, so nothing comes from JAX's caches.
    """
    fresh = jax.jit(lambda *a: fn(*a))
    t0 = time.perf_counter()
    lowered = fresh.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, compiled


def time_calls(fn: Callable, args: tuple, number: int) -> float:
    """Seconds per call over ``number`` calls, each waited for (latency, not pipelining)."""
    t0 = time.perf_counter()
    for _ in range(number):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) / number


def round_robin(
    fns: dict[str, tuple[Callable, tuple]], repeats: int, number: int
) -> dict[str, list[float]]:
    """``repeats`` samples per function, interleaved: repetition ``r`` starts with function
    ``r mod m`` so that neither noise drifts nor a fixed order favours any of them."""
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            fn, args = fns[name]
            samples[name].append(time_calls(fn, args, number))
    return samples


def _ratio(values: dict[str, float], key: str) -> float:
    a, b = key.split("/")
    return values[a] / values[b]


def paired_ratio(samples: dict[str, list[float]], key: str) -> float:
    """Median over repetitions of ``a_r / b_r`` for ``key = "a/b"``: the two samples of one
    repetition ran seconds apart under the same load, so their ratio cancels the slow swings of
    a shared machine that the ratio of two medians would keep."""
    a, b = key.split("/")
    return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))


def calls_per_sample(single_call_s: float, min_sample: float) -> int:
    return max(1, math.ceil(min_sample / max(single_call_s, 1e-9)))


MATMUL_FLOPS = 2 * MATMUL_N**3


def make_matmul(dtype: Any) -> tuple[Callable, tuple]:
    """A compiled ``(N x N) @ (N x N)`` matmul in ``dtype`` and its arguments."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((MATMUL_N, MATMUL_N)), dtype)
    b = jnp.asarray(rng.standard_normal((MATMUL_N, MATMUL_N)), dtype)
    return time_compile(jnp.matmul, a, b)[2], (a, b)


def matmul_rate(dtype: Any, repeats: int, min_sample: float) -> dict[str, float]:
    """Median seconds and GFLOP/s of the matmul in ``dtype``, timed on its own."""
    mm, args = make_matmul(dtype)
    number = calls_per_sample(time_calls(mm, args, 1), min_sample)
    median = statistics.median(round_robin({"mm": (mm, args)}, repeats, number)["mm"])
    return {"n": MATMUL_N, "median_s": median, "gflops": MATMUL_FLOPS / median / 1e9}


# --------------------------------------------------------------------------------------------
# Benchmarks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    mode: str
    repeats: int
    min_sample: float
    compile_repeats: int
    seed: int


def bench_size(n: int, d: int, L: int, dtype: Any, s: Settings,
               matmul_f32: tuple[Callable, tuple], same_dtype_gflops: float) -> dict[str, Any]:
    """Compile, check agreement, then time the contenders (and the diagnostic, and the float32
    matmul as the machine's yardstick) side by side at one size and dtype."""
    cfg = make_config(d, L, dtype)
    params = {k: jnp.asarray(v, dtype) for k, v in random_params(cfg, s.seed).items()}
    x = jnp.asarray(np.random.default_rng(s.seed + 1).standard_normal((n, d)), dtype)
    contenders = build(cfg, params)

    compiled, compile_s = {}, {}
    for name, (fn, weights) in contenders.items():
        lower_s, xla_s, compiled[name] = time_compile(fn, weights, x)
        compile_s[name] = {"lower_s": lower_s, "compile_s": xla_s, "total_s": lower_s + xla_s}

    outputs = {name: np.asarray(compiled[name](w, x)) for name, (_, w) in contenders.items()}
    assert all(o.dtype == np.dtype(dtype) for o in outputs.values()), "silent dtype promotion"
    radius = math.sqrt(d)
    diffs = {
        f"{a}-{b}": float(np.max(np.abs(outputs[a] - outputs[b])))
        for a, b in (("transformer", "reference"), ("diffrax", "reference"),
                     ("transformer", "diffrax"), (DIAGNOSTIC, "diffrax"))
    }
    # States have norm sqrt(d); scaled to the unit sphere the tolerance is dtype-relative.
    tol = 1e-12 if dtype == jnp.float64 else 1e-4
    agreement = {
        "max_abs_diff": diffs,
        "max_abs_diff_unit_sphere": {k: v / radius for k, v in diffs.items()},
        "tolerance_unit_sphere": tol,
        "ok": all(v / radius <= tol for v in diffs.values()),
    }

    # Time the jitted functions as a user calls them (jax.jit's C++ dispatch; calling the AOT
    # `Compiled` object goes through Python and flattens pytree arguments on every call, which
    # at ~1 ms per call charged ~0.1-0.2 ms of dispatch to whichever takes a deep pytree).
    jitted = {name: jax.jit(fn) for name, (fn, _) in contenders.items()}
    for name, (_, w) in contenders.items():
        jax.block_until_ready(jitted[name](w, x))  # compiles once more, untimed
    fns = {name: (jitted[name], (w, x)) for name, (_, w) in contenders.items()}
    single = max(time_calls(fn, args, 1) for fn, args in fns.values())
    number = calls_per_sample(single, s.min_sample)
    samples = round_robin(fns | {"matmul_f32": matmul_f32}, s.repeats, number)
    mm_samples = samples.pop("matmul_f32")
    mm_median = statistics.median(mm_samples)
    median = {name: statistics.median(v) for name, v in samples.items()}
    minimum = {name: min(v) for name, v in samples.items()}
    targeted = ("transformer/reference", "diffrax/reference")
    diagnostic = (f"diffrax/{DIAGNOSTIC}", f"{DIAGNOSTIC}/reference")
    ratios = {k: paired_ratio(samples, k) for k in targeted}
    flops = forward_flops(n, cfg)
    gflops = {name: flops / t / 1e9 for name, t in median.items()}
    # Paired as well: achieved rate over the matmul rate of the same repetition.
    fraction = {
        name: statistics.median(m / t for m, t in zip(mm_samples, v, strict=True))
        * flops / MATMUL_FLOPS
        for name, v in samples.items()
    }
    return {
        "n": n, "d": d, "L": L, "dtype": jnp.dtype(dtype).name,
        "n_heads": cfg.n_heads, "d_head": cfg.d_head, "d_ff": cfg.d_ff,
        "calls_per_sample": number, "repeats": s.repeats,
        "median_s": median, "min_s": minimum, "samples_s": samples, "compile_s": compile_s,
        "ratios": ratios,
        "targets_met": {k: v <= TARGETS[k] for k, v in ratios.items()},
        "ratios_of_medians": {k: _ratio(median, k) for k in targeted},
        "ratios_of_min": {k: _ratio(minimum, k) for k in targeted},
        "diagnostic_ratios": {k: paired_ratio(samples, k) for k in diagnostic},
        "flops": flops, "gflops": gflops,
        "matmul_f32_side_by_side": {
            "median_s": mm_median, "gflops": MATMUL_FLOPS / mm_median / 1e9,
        },
        "fraction_of_f32_matmul": fraction,
        "fraction_of_same_dtype_matmul": {k: v / same_dtype_gflops for k, v in gflops.items()},
        "agreement": agreement,
    }


def bench_compile_depth(n: int, d: int, depths: tuple[int, ...], s: Settings) -> dict[str, Any]:
    """Trace + lower + compile time of each contender at each depth (float32, abstract
    weights), median of ``compile_repeats`` fresh compilations, depths interleaved."""
    dtype = jnp.float32
    builds = {L: build_abstract(make_config(d, L, dtype)) for L in depths}
    x = jax.ShapeDtypeStruct((n, d), dtype)
    raw: dict[str, dict[int, list[tuple[float, float]]]] = {
        name: {L: [] for L in depths} for name in CONTENDERS
    }
    for _ in range(s.compile_repeats):
        for L in depths:
            for name in CONTENDERS:
                fn, weights = builds[L][name]
                lower_s, xla_s, _ = time_compile(fn, weights, x)
                raw[name][L].append((lower_s, xla_s))
    result: dict[str, Any] = {"n": n, "d": d, "dtype": "float32", "depths": list(depths),
                              "repeats": s.compile_repeats}
    ratios, met = {}, {}
    lo, hi = depths[0], depths[-1]
    for name in CONTENDERS:
        per_depth = {}
        for L in depths:
            lowers, xlas = zip(*raw[name][L], strict=True)
            totals = [a + b for a, b in raw[name][L]]
            per_depth[str(L)] = {
                "lower_s": statistics.median(lowers), "compile_s": statistics.median(xlas),
                "total_s": statistics.median(totals),
            }
        result[name] = per_depth
        ratios[name] = per_depth[str(hi)]["total_s"] / per_depth[str(lo)]["total_s"]
        met[name] = ratios[name] <= TARGETS["compile_depth_ratio"]
    result["ratios"] = ratios  # compile(L = max) / compile(L = min), total seconds
    result["targets_met"] = met
    return result


# --------------------------------------------------------------------------------------------
# The training step and the solve's gradient
# --------------------------------------------------------------------------------------------


def evaluation_flops(n: int, d: int, n_heads: int, d_head: int, d_ff: int) -> int:
    """Matmul flops of one field evaluation (one attention + one FFN sub-layer) on one sequence
    of ``n`` tokens: one layer of :func:`forward_flops`."""
    hk = n_heads * d_head
    return (2 * n * d * 3 * hk  # Q, K, V
            + 2 * n * hk * d  # W_O
            + 2 * 2 * n_heads * n * n * d_head  # Q K^T and P V
            + 2 * 2 * n * d * d_ff)  # FFN (W_in, W_out)


def lm_flops(model: DesignConfig, batch: int, n: int, evaluations_per_step: float) -> dict:
    """Matmul flops of ``svflow train``'s step on a :class:`SolverLM` of ``model``, ``batch``
    sequences of ``n`` tokens, ``evaluations_per_step`` field evaluations per block (the
    design's :attr:`~svflow_jax.solvers.catalogue.Method.evaluations_per_step`; a first step
    that costs more, e.g. FSAL, is not counted).

    ``forward``: the stack (``num_steps`` blocks) and the head ``2 n d V`` per sequence (the
    embedding is a gather). ``step``: ``3 x forward``, the model flops of a training step (the
    backward pass takes two matmuls per forward matmul: the gradient of the input and of the
    weight); the usual convention, so the fraction is comparable with other reports.
    ``step_with_remat``: what the CPU executes with ``remat=True`` (each block's forward once
    more in the backward pass). Softmax, norms, GELU, projections, the retraction, the loss and
    the optimiser are ``O(n d)`` or ``O(H n^2)`` elementwise work, left out as in
    :func:`forward_flops`."""
    blocks = batch * model.num_steps * evaluations_per_step * evaluation_flops(
        n, model.d_model, model.n_heads, model.d_head, model.d_ff)
    head = batch * 2 * n * model.d_model * model.vocab_size
    forward = blocks + head
    return {"forward": forward, "step": 3 * forward,
            "step_with_remat": 3 * forward + (blocks if model.remat else 0)}


# svflow train's default model and batch (full, quick), a tiny one for the smoke test
TRAIN_SMOKE = dict(model=dict(d_model=16, n_heads=2, d_head=8, d_ff=32, context=8,
                              num_steps=2, num_anchors=2), batch_size=2)


#: what the backward pass of a training step recomputes (``DesignConfig.remat``): every block,
#: only the elementwise work between the stored matrix products, nothing
REMAT_CHOICES = (True, "dots", False)


def bench_training(s: Settings, matmul_f32: tuple[Callable, tuple],
                   overrides: dict | None = None) -> dict[str, Any]:
    """``svflow train``'s step (the program :func:`svflow_jax.training.loop.fit` compiles:
    forward, backward, clipping and AdamW) on its default model and batch, and its parts (the
    loss alone, the loss and its gradient), and the step with each other choice of
    :data:`REMAT_CHOICES`, timed side by side with the float32 matmul;
    achieved GFLOP/s by :func:`lm_flops` and the fraction of the matmul rate."""
    overrides = overrides if overrides is not None else (TRAIN_SMOKE if s.mode == "smoke"
                                                         else {})
    base = recipe()  # what `svflow train` runs with no options
    config = dataclasses.replace(
        base, model=base.model.replace(**overrides.get("model", {})),
        batch_size=overrides.get("batch_size", base.batch_size))
    model_cfg = config.model
    model = SolverLM(model_cfg, rngs=nnx.Rngs(s.seed))
    _, graphdef, params, rest, tx, opt_state = placed(model, make_optimizer(config))
    n = model_cfg.context
    rng = np.random.default_rng(s.seed + 2)
    tokens = rng.integers(0, model_cfg.vocab_size, (config.batch_size, n + 1))
    batch = (jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32),
             jnp.ones((config.batch_size, n), jnp.float32))

    def loss(params, batch):
        return lm_loss(nnx.merge(graphdef, params, rest), *batch)[0]

    fns = {
        "forward": (jax.jit(loss), (params, batch)),
        "gradient": (jax.jit(jax.value_and_grad(loss)), (params, batch)),
        "step": (functools.partial(train_step, graphdef, lm_loss, tx),
                 (params, rest, opt_state, batch)),
    }
    for remat in REMAT_CHOICES:  # the same step with each choice of what the backward recomputes
        if remat != model_cfg.remat:
            other = SolverLM(model_cfg.replace(remat=remat), rngs=nnx.Rngs(s.seed))
            _, other_def, other_params, other_rest, _, _ = placed(other, make_optimizer(config))
            fns[f"step, remat={remat}"] = (functools.partial(train_step, other_def, lm_loss, tx),
                                           (other_params, other_rest, opt_state, batch))
    compile_s = {}
    for name, (fn, args) in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        compile_s[name] = time.perf_counter() - start
    design = model_cfg.layer_design
    flops = lm_flops(model_cfg, config.batch_size, n, design.evaluations_per_step)
    work = {name: flops["forward"] if name == "forward" else flops["step"] for name in fns}
    result = _timed_rates(fns, work, s, matmul_f32)
    return {"model": dataclasses.asdict(model_cfg) | {"design": design.name},
            "batch_size": config.batch_size, "tokens_per_step": config.batch_size * n,
            "flops": flops, "first_call_s": compile_s, **result,
            "tokens_per_s": config.batch_size * n / result["median_s"]["step"]}


def solve_gradient_flops(n: int, cfg: TransformerConfig) -> int:
    """Model flops of the gradient of a solve of ``cfg``'s flow: ``3 x``
    :func:`forward_flops` (as :func:`lm_flops`); the default adjoint recomputes each step
    once more in the backward pass (``4 x`` executed)."""
    return 3 * forward_flops(n, cfg)


def bench_solve_gradient(n: int, d: int, L: int, dtype: Any, s: Settings,
                         matmul_f32: tuple[Callable, tuple]) -> dict[str, Any]:
    """The gradient, with respect to every weight of the flow, of a scalar of ``solve``'s
    output (``LieTrotter(RetractedEuler())``, ``num_steps = L``: the stack of (ii), with
    :func:`svflow_jax.solvers.solve`'s default adjoint), timed with the float32 matmul."""
    cfg = make_config(d, L, dtype)
    params = {k: jnp.asarray(v, dtype) for k, v in random_params(cfg, s.seed).items()}
    flow = to_flow(cfg, params)
    x = jnp.asarray(np.random.default_rng(s.seed + 1).standard_normal((n, d)), dtype)
    y0 = x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    weight = jnp.asarray(np.random.default_rng(s.seed + 3).standard_normal((n, d)), dtype)

    def objective(flow, y0):
        y1 = solve((flow.attention, flow.experts), y0, 0.0, L * flow.step,
                   solver=LieTrotter(RetractedEuler()), num_steps=L,
                   saveat=diffrax.SaveAt(t1=True), throw=False).ys[-1]
        return jnp.sum(y1 * weight)

    fns = {"solve": (jax.jit(objective), (flow, y0)),
           "solve_gradient": (jax.jit(jax.grad(objective)), (flow, y0))}
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))
    forward = forward_flops(n, cfg)
    work = {"solve": forward, "solve_gradient": solve_gradient_flops(n, cfg)}
    return {"n": n, "d": d, "L": L, "dtype": jnp.dtype(dtype).name, "flops": work,
            **_timed_rates(fns, work, s, matmul_f32)}


def _timed_rates(fns: dict[str, tuple[Callable, tuple]], flops: dict[str, int], s: Settings,
                 matmul_f32: tuple[Callable, tuple]) -> dict[str, Any]:
    """``fns`` and the float32 matmul timed round robin; median seconds, GFLOP/s of each
    (``flops[name]`` per call) and its fraction of the matmul rate of the same repetition."""
    single = max(time_calls(fn, args, 1) for fn, args in fns.values())
    number = calls_per_sample(single, s.min_sample)
    samples = round_robin(fns | {"matmul_f32": matmul_f32}, s.repeats, number)
    mm = samples.pop("matmul_f32")
    median = {name: statistics.median(v) for name, v in samples.items()}
    return {
        "calls_per_sample": number, "median_s": median, "samples_s": samples,
        "gflops": {name: flops[name] / t / 1e9 for name, t in median.items()},
        "matmul_f32_side_by_side": {"median_s": statistics.median(mm),
                                    "gflops": MATMUL_FLOPS / statistics.median(mm) / 1e9},
        "fraction_of_f32_matmul": {
            name: statistics.median(m / t for m, t in zip(mm, v, strict=True))
            * flops[name] / MATMUL_FLOPS for name, v in samples.items()},
    }


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def print_report(res: dict[str, Any]) -> None:
    mm = res["matmul"]
    print(f"\nmachine: {res['machine']['devices'][0]} ({res['machine']['cpu_count']} CPUs), "
          f"jax {res['machine']['versions']['jax']}; mode {res['mode']}, "
          f"{res['settings']['repeats']} interleaved repeats")
    print(f"matmul {MATMUL_N}^3 (alone, at start): float32 {mm['float32']['gflops']:.1f} GFLOP/s, "
          f"float64 {mm['float64']['gflops']:.1f} GFLOP/s\n")
    head = (f"{'n':>4} {'d':>4} {'L':>4} {'dtype':>7} | {'(i) tf':>9} {'(ii) dfx':>9} "
            f"{'(iii) ref':>9} {'flow_scan':>9} | {'i/iii':>6} {'ii/iii':>6} | "
            f"{'dfx/fs':>6} {'fs/ref':>6} | {'GF/s (i)':>8} {'%f32mm':>6} | {'diff/rho':>8}")
    print("median ms per call; ratios: median of the per-repetition ratios, ! = target missed;\n"
          "dfx/fs = diffrax loop overhead, fs/ref = flow field cost (diagnostics); "
          "%f32mm: of the float32 matmul rate timed alongside")
    print(head)
    print("-" * len(head))
    for r in res["runs"]:
        m, q, g = r["median_s"], r["ratios"], r["diagnostic_ratios"]
        diff = max(r["agreement"]["max_abs_diff_unit_sphere"].values())
        ti, tii = (("" if r["targets_met"][k] else "!") for k in q)
        print(f"{r['n']:>4} {r['d']:>4} {r['L']:>4} {r['dtype']:>7} | "
              + " ".join(f"{1e3 * m[k]:>9.3f}" for k in (*CONTENDERS, DIAGNOSTIC))
              + f" | {q['transformer/reference']:>5.2f}{ti:1} {q['diffrax/reference']:>5.2f}{tii:1}"
              f" | {g[f'diffrax/{DIAGNOSTIC}']:>6.2f} {g[f'{DIAGNOSTIC}/reference']:>6.2f}"
              f" | {r['gflops']['transformer']:>8.1f} "
              f"{100 * r['fraction_of_f32_matmul']['transformer']:>5.1f}% | {diff:>8.1e}")
    t = res["training"]
    print(f"\nsvflow train's step ({t['model']['design']}, d={t['model']['d_model']}, "
          f"{t['model']['num_steps']} blocks, batch {t['batch_size']} x "
          f"{t['model']['context']}): {t['tokens_per_s']:.0f} tokens/s")
    for name in t["median_s"]:
        print(f"  {name:<20} {1e3 * t['median_s'][name]:9.2f} ms  {t['gflops'][name]:7.1f} GFLOP/s"
              f"  {100 * t['fraction_of_f32_matmul'][name]:5.1f}% of the f32 matmul")
    print("the solve's gradient (solve's default adjoint):")
    for g in res["solve_gradient"]:
        print(f"  n={g['n']:>4} d={g['d']:>4} L={g['L']:>3} {g['dtype']:>7}: "
              + "  ".join(f"{name} {g['gflops'][name]:7.1f} GFLOP/s "
                          f"{100 * g['fraction_of_f32_matmul'][name]:5.1f}%"
                          for name in ("solve", "solve_gradient")))
    c = res["compile_vs_depth"]
    lo, hi = c["depths"][0], c["depths"][-1]
    print(f"\ncompile (trace + lower + XLA), n={c['n']} d={c['d']} float32, seconds:")
    for name in CONTENDERS:
        a, b = c[name][str(lo)]["total_s"], c[name][str(hi)]["total_s"]
        ok = "ok" if c["targets_met"][name] else "MISSED"
        print(f"  {name:<12} L={lo}: {a:6.3f}   L={hi}: {b:6.3f}   ratio {c['ratios'][name]:.2f}"
              f"  ({ok}, target <= {TARGETS['compile_depth_ratio']})")
    missed = res["summary"]["missed"]
    print("\nall targets met" if not missed else "\ntargets missed: " + ", ".join(missed))
    if not res["summary"]["agreement_ok"]:
        print("WARNING: the three implementations disagree beyond tolerance")


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    # Before any array exists: float64 must be available to time both dtypes in one process.
    jax.config.update("jax_enable_x64", True)
    args = parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    d = DEFAULTS[mode]
    s = Settings(
        mode=mode,
        repeats=args.repeats if args.repeats is not None else d["repeats"],
        min_sample=args.min_sample if args.min_sample is not None else d["min_sample"],
        compile_repeats=(args.compile_repeats if args.compile_repeats is not None
                         else d["compile_repeats"]),
        seed=args.seed,
    )
    dtypes = (jnp.float32, jnp.float64)
    depth_n, depth_d, depths = DEPTH_SIZE[mode]
    start = time.perf_counter()

    matmul = {jnp.dtype(t).name: matmul_rate(t, s.repeats, s.min_sample) for t in dtypes}
    matmul_f32 = make_matmul(jnp.float32)
    runs = []
    for n, dm, L in SIZES[mode]:
        for dtype in dtypes:
            print(f"timing n={n} d={dm} L={L} {jnp.dtype(dtype).name} ...", flush=True)
            runs.append(bench_size(n, dm, L, dtype, s, matmul_f32,
                                   matmul[jnp.dtype(dtype).name]["gflops"]))
    print("timing svflow train's step ...", flush=True)
    training = bench_training(s, matmul_f32)
    gradients = []
    for n, dm, L in SIZES[mode]:
        for dtype in dtypes:
            print(f"timing the solve's gradient n={n} d={dm} L={L} {jnp.dtype(dtype).name} ...",
                  flush=True)
            gradients.append(bench_solve_gradient(n, dm, L, dtype, s, matmul_f32))
    print(f"compile time at L={depths} ...", flush=True)
    compile_depth = bench_compile_depth(depth_n, depth_d, depths, s)

    missed = [
        f"{k} at n={r['n']} d={r['d']} L={r['L']} {r['dtype']} ({r['ratios'][k]:.2f})"
        for r in runs for k, ok in r["targets_met"].items() if not ok
    ] + [
        f"compile ratio {name} ({compile_depth['ratios'][name]:.2f})"
        for name, ok in compile_depth["targets_met"].items() if not ok
    ]
    result = {
        "schema": 1,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": mode,
        "settings": {
            "repeats": s.repeats, "min_sample_s": s.min_sample,
            "compile_repeats": s.compile_repeats, "seed": s.seed,
            "sizes": [list(t) for t in SIZES[mode]],
            "dtypes": [jnp.dtype(t).name for t in dtypes],
            "n_heads": N_HEADS, "d_head": "d / n_heads", "d_ff": "4 d", "residual_scale": "1 / L",
        },
        "machine": environment(),  # versions, machine, backend, XLA flags
        "targets": TARGETS,
        "matmul": matmul,
        "runs": runs,
        "training": training,
        "solve_gradient": gradients,
        "compile_vs_depth": compile_depth,
        "summary": {
            "all_targets_met": not missed,
            "missed": missed,
            "agreement_ok": all(r["agreement"]["ok"] for r in runs),
            "wall_s": time.perf_counter() - start,
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "benchmark.json"
    from svflow_jax.atomic import write_json

    write_json(path, result)
    print_report(result)
    print(f"\nwrote {path} ({result['summary']['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
