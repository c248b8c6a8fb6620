"""Peer benchmark: the project (JAX, diffrax, Flax NNX) against PyTorch and torchdiffeq.

Run by hand on a quiet machine (it is not a test: timings on a shared machine are noise)::

    pip install -e '.[peer]'                  # torch and torchdiffeq
    python experiments/peer_benchmark.py [--quick] [--rounds 14] [--out results/peer]
    python experiments/peer_benchmark.py --device cuda [--tf32] [--large]   # on a GPU

Protocol
--------
* One long-lived worker process per framework (this script with ``--worker jax`` or
  ``--worker torch``), driven by the main process over stdin/stdout, one JSON line each way.
  The workers never run at the same time.
* The same weights in both (drawn once in float64 by the main process, written to an ``.npz``
  file, cast by each worker to the dtype under test).
* Agreement before timing: each worker computes every case once and writes its outputs (final
  states, gradients, updated weights); the main process compares them (relative max error,
  ``max |a - b| / max |b|``) against the tolerances in :data:`TOLERANCES` and refuses to time a
  case that disagrees.
* Then ``--rounds`` rounds (default 14). In each round every case is timed in both workers, the
  worker that goes first alternating from round to round; one sample is the mean of ``number``
  calls (each waited for), ``number`` chosen at warm-up so that a sample lasts at least
  ``--min-sample`` seconds. Reported: the median sample per framework and the ratio
  ``torch / project`` of the medians (above 1: the project is faster).
* Peak memory of the gradient cases: in a fresh worker per case, the growth of the process's
  peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) over one call, after
  everything was built and (for JAX) compiled; it counts what the call allocates on top of the
  process's previous peak, so it is a lower bound of the call's working memory. For JAX the
  compiled program's temporary buffer size (``compiled.memory_analysis()``) is reported too.
  On a GPU (``--device cuda``) the device's peak instead: ``torch.cuda.max_memory_allocated()``
  after ``torch.cuda.reset_peak_memory_stats()``, and JAX's
  ``jax.devices()[0].memory_stats()["peak_bytes_in_use"]`` (the fresh process's peak: inputs,
  compilation and the call). A case that fails in one framework (a GPU out of memory, say) is
  reported as failed, and the others still run.

GPU (``--device cuda``): both frameworks on the first GPU (torch tensors on ``cuda``, each call
waited for with ``torch.cuda.synchronize()``; the JAX worker with ``JAX_PLATFORMS=cuda``).
Float32 matrix multiplies in full float32 on both sides (torch's ``allow_tf32`` off, JAX's
``jax_default_matmul_precision="highest"``) unless ``--tf32`` (TF32 on both: torch's
``allow_tf32`` on, JAX's ``"tensorfloat32"``). The GPU's default sizes add the large size
:data:`LARGE` (batch 8, ``n = d = 1024``, 16 heads; ``--large`` adds it on the CPU too, slowly)
and the case ``fwd_rk4_compiled``: the same RK4 loop in torch with the field compiled by
``torch.compile`` (the project's side is ``fwd_rk4``'s).

Cases (the field: :class:`svflow_jax.flow.AttentionField` with
:meth:`AttentionParams.random`, ``H = 4`` heads of width ``d / 4``, non-causal; the torch side
implements the identical field, softmax posterior, expected natural parameter, tangent
projection; loss of the gradient cases: ``sum(y(1) * w)`` for a fixed random ``w``, gradient
with respect to all field parameters):

================  ==============================================  =============================
case              project                                          torch
================  ==============================================  =============================
fwd_euler         ``solve``, ``RetractedEuler()``, 64 steps         the same loop, eager
fwd_rk4           ``solve``, ``Retracted(RK4())``, 64 steps         the same retracted RK4, eager
fwd_dopri5        ``Retracted(Dopri5())``, PID rtol = atol = 1e-6   ``torchdiffeq.odeint`` dopri5
grad_rk4          default: ``ScanAdjoint()`` (steps recomputed)    backprop through the loop
grad_rk4_dots     ``ScanAdjoint(dots_saveable)`` (stores products) backprop through the loop
grad_rk4_recur    diffrax's ``RecursiveCheckpointAdjoint()``       backprop through the loop
grad_dopri5       default ``RecursiveCheckpointAdjoint``            backprop through odeint
grad_dopri5_adj   default ``RecursiveCheckpointAdjoint``            ``odeint_adjoint``
transformer_fwd   Flax NNX ``Transformer`` forward                  the same model, eager
train_step        one SGD step of that model (jitted)               one SGD step, eager
================  ==============================================  =============================

The Transformer is ``experiments/benchmark.py``'s (post-norm, projected branches, sequential
block, causal, exact GELU, ``d_ff = 4 d``), ``L`` layers, loss ``mean(out * target)``.
torchdiffeq integrates the ambient ODE ``y' = f(R(y))`` and the output is retracted at the end;
the project retracts after every step: the two agree to the solve's tolerance, not to
round-off (stated tolerance). Sizes ``(n, d) = (32, 64), (256, 256)``, float32 and float64;
``--sizes`` takes ``NxD``, ``BxNxD`` (a batch of ``B`` independent sets of tokens, the field
cases only) and an optional ``:H`` field heads (default 4), e.g. ``8x1024x1024:16``.

Output: ``OUT/peer_benchmark.json`` (settings, machine, per size/dtype/case: agreement, medians,
samples, ratio, memory) and ``OUT/peer_benchmark.md`` (the table of ratios, then memory).
``--quick``: tiny sizes, 8 steps, 2 rounds (what the test runs). ``--jax-only``: no torch
worker; agreement and timing of the project's side alone (runs without torch installed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
N_HEADS = 4
CASES = (
    "fwd_euler", "fwd_rk4", "fwd_dopri5", "grad_rk4", "grad_rk4_dots",
    "grad_rk4_recur", "grad_dopri5", "grad_dopri5_adj", "transformer_fwd", "train_step",
)
GRADIENT_CASES = ("grad_rk4", "grad_rk4_dots", "grad_rk4_recur", "grad_dopri5",
                  "grad_dopri5_adj", "train_step")
# On a GPU (and on request): the RK4 loop with the field compiled by torch.compile.
COMPILED_CASES = ("fwd_rk4_compiled",)
ALL_CASES = CASES + COMPILED_CASES
DTYPES = ("float32", "float64")
DEVICES = ("cpu", "cuda")
LARGE = (8, 1024, 1024, 16)  # batch, n, d, field heads: the GPU's large size
MODES = {
    #        sizes (batch, n, d, heads)  steps  layers  rounds  min_sample  dopri5 tol
    "full": dict(sizes=[(1, 32, 64, N_HEADS), (1, 256, 256, N_HEADS)], steps=64, layers=16,
                 rounds=14, min_sample=0.05, tol=1e-6),
    "quick": dict(sizes=[(1, 8, 16, N_HEADS)], steps=8, layers=2, rounds=2, min_sample=0.0,
                  tol=1e-6),
}
# Relative max error allowed between the two frameworks, per (kind of case, dtype).
TOLERANCES = {
    ("fixed", "float64"): 1e-10, ("fixed", "float32"): 1e-4,
    ("adaptive", "float64"): 1e-4, ("adaptive", "float32"): 1e-3,
    ("adjoint", "float64"): 1e-3, ("adjoint", "float32"): 1e-2,
}
# The same program with other XLA flags: what the tests would accept as the same number.
FLAG_TOLERANCES = {
    ("fixed", "float64"): 1e-12, ("fixed", "float32"): 1e-5,
    ("adaptive", "float64"): 1e-6, ("adaptive", "float32"): 1e-4,
    ("adjoint", "float64"): 1e-6, ("adjoint", "float32"): 1e-4,
}
LR = 0.1


def case_kind(case: str) -> str:
    if case in COMPILED_CASES:
        return "fixed"
    if case == "grad_dopri5_adj":
        return "adjoint"
    return "adaptive" if "dopri5" in case else "fixed"


# --------------------------------------------------------------------------------------------
# Shared inputs (main process)
# --------------------------------------------------------------------------------------------


def make_inputs(n: int, d: int, layers: int, seed: int = 0, batch: int = 1,
                heads: int = N_HEADS) -> dict[str, np.ndarray]:
    """Float64 weights and data of one size, as flat ``name -> array`` (``field/...``,
    ``tf/...``); ``batch > 1``: the field cases' tokens are ``(batch, n, d)``."""
    rng = np.random.default_rng(seed)
    k = d // heads
    std_in, std_out = 1 / math.sqrt(d), 1 / math.sqrt(heads * k)
    out = {
        "field/kernel_query": std_in * rng.standard_normal((d, heads, k)),
        "field/kernel_key": std_in * rng.standard_normal((d, heads, k)),
        "field/concentration": np.ones(heads),
        "field/natural_in": std_in * rng.standard_normal((d, heads, k)),
        "field/natural_out": std_out * rng.standard_normal((heads, k, d)),
    }
    shape = (n, d) if batch == 1 else (batch, n, d)
    y0 = rng.standard_normal(shape)
    out["y0"] = y0 / np.linalg.norm(y0, axis=-1, keepdims=True)
    out["w"] = rng.standard_normal(shape)
    sys.path.insert(0, str(HERE))
    import benchmark  # noqa: E402  (experiments/benchmark.py: the Transformer's config)

    cfg = benchmark.make_config(d, layers, "float64")
    for name, a in benchmark.random_params(cfg, seed + 1).items():
        out[f"tf/{name}"] = a
    out["x"] = rng.standard_normal((n, d))
    out["target"] = rng.standard_normal((n, d))
    return out


# --------------------------------------------------------------------------------------------
# The project's side
# --------------------------------------------------------------------------------------------


def jax_cases(inputs: dict[str, np.ndarray], dtype: str, steps: int, layers: int, tol: float):
    """``case -> (function, args)``: jitted functions of the project, in ``dtype``."""
    import diffrax
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from svflow_jax.flow import AttentionField
    from svflow_jax.flow.attention import AttentionParams
    from svflow_jax.solvers import (
        RK4,
        Retracted,
        RetractedEuler,
        ScanAdjoint,
        solve,
    )
    from svflow_jax.transformer import Transformer, layer_params

    sys.path.insert(0, str(HERE))
    import benchmark  # noqa: E402

    dt = jnp.dtype(dtype)
    params = AttentionParams(**{
        k.split("/", 1)[1]: jnp.asarray(v, dt) for k, v in inputs.items()
        if k.startswith("field/")
    })
    y0, w = jnp.asarray(inputs["y0"], dt), jnp.asarray(inputs["w"], dt)
    pid = diffrax.PIDController(rtol=tol, atol=tol)

    def final(p, solver, **kw):
        sol = solve(AttentionField(p), y0, 0.0, 1.0, solver=solver, throw=False, **kw)
        return sol.ys[-1]

    def loss(p, solver, **kw):
        return jnp.sum(final(p, solver, **kw) * w)

    rk4 = Retracted(RK4())
    dopri = Retracted(diffrax.Dopri5())
    fns = {
        "fwd_euler": lambda p: final(p, RetractedEuler(), num_steps=steps),
        "fwd_rk4": lambda p: final(p, rk4, num_steps=steps),
        "fwd_dopri5": lambda p: final(p, dopri, stepsize_controller=pid),
        "grad_rk4": jax.grad(lambda p: loss(p, rk4, num_steps=steps)),
        "grad_rk4_recur": jax.grad(lambda p: loss(
            p, rk4, num_steps=steps, adjoint=diffrax.RecursiveCheckpointAdjoint())),
        "grad_rk4_dots": jax.grad(lambda p: loss(
            p, rk4, num_steps=steps,
            adjoint=ScanAdjoint(remat=jax.checkpoint_policies.dots_saveable))),
        "grad_dopri5": jax.grad(lambda p: loss(p, dopri, stepsize_controller=pid)),
    }
    fns["grad_dopri5_adj"] = fns["grad_dopri5"]
    fns["fwd_rk4_compiled"] = fns["fwd_rk4"]  # the peer compiles; the project always does
    cases = {name: (jax.jit(f), (params,)) for name, f in fns.items()}

    cfg = benchmark.make_config(inputs["x"].shape[-1], layers, dt)
    tf = {k.split("/", 1)[1]: jnp.asarray(v, dt) for k, v in inputs.items()
          if k.startswith("tf/")}
    model = Transformer.from_layer_params(cfg, tf)
    graphdef, state = nnx.split(model)
    x, target = jnp.asarray(inputs["x"], dt), jnp.asarray(inputs["target"], dt)

    def forward(state, x):
        return nnx.merge(graphdef, state)(x)

    def train_step(state, x, target):
        def tf_loss(state):
            return jnp.mean(forward(state, x) * target)

        value, grads = jax.value_and_grad(tf_loss)(state)
        return value, jax.tree.map(lambda p, g: p - LR * g, state, grads)

    cases["transformer_fwd"] = (jax.jit(forward), (state, x))
    cases["train_step"] = (jax.jit(train_step), (state, x, target))

    def outputs(case, out):
        """Comparable outputs as ``name -> float64 array``."""
        if case.startswith("grad"):
            return {f"d_{k}": np.asarray(getattr(out, k), np.float64)
                    for k in ("kernel_query", "kernel_key", "concentration", "natural_in",
                              "natural_out")}
        if case == "train_step":
            value, new_state = out
            new = layer_params(nnx.merge(graphdef, new_state))
            return {"loss": np.asarray(value, np.float64),
                    **{f"new_{k}": np.asarray(v, np.float64) for k, v in new.items()}}
        return {"y": np.asarray(out, np.float64)}

    return cases, outputs


# --------------------------------------------------------------------------------------------
# The torch side
# --------------------------------------------------------------------------------------------


def torch_cases(inputs: dict[str, np.ndarray], dtype: str, steps: int, layers: int, tol: float,
                device: str = "cpu"):
    """``case -> (function, args)``: the same computations in PyTorch eager + torchdiffeq (and
    ``torch.compile`` of the field for ``fwd_rk4_compiled``), on ``device``."""
    import torch
    import torchdiffeq

    dt = getattr(torch, dtype)

    def tensor(a, grad=False):
        return torch.tensor(np.asarray(a), dtype=dt, requires_grad=grad, device=device)

    names = ("kernel_query", "kernel_key", "concentration", "natural_in", "natural_out")
    y0, w = tensor(inputs["y0"]), tensor(inputs["w"])

    def retract(y):
        return y / torch.linalg.norm(y, dim=-1, keepdim=True)

    def field(p, y):
        """The project's AttentionField: softmax posterior, expected natural parameter,
        tangent projection (svflow_jax/flow/attention.py)."""
        A, B, kappa, N, M = (p[k] for k in names)
        a = torch.einsum("...nd,dhk->...hnk", y, A) * kappa[:, None, None]
        b = torch.einsum("...nd,dhk->...hnk", y, B)
        q = torch.softmax(torch.einsum("...hik,...hjk->...hij", a, b), dim=-1)
        hidden = torch.einsum("...nd,dhr->...hnr", y, N)
        u = torch.einsum("...hir,hrd->...id", torch.einsum("...hij,...hjr->...hir", q, hidden),
                         M)
        return u - torch.sum(y * u, -1, keepdim=True) * y

    def euler(p):
        y, h = y0, 1.0 / steps
        for _ in range(steps):
            y = retract(y + h * field(p, y))
        return y

    def rk4(p, field=field):
        """``Retracted(RK4())``: stages read at ``R(stage state)``, output retracted."""
        y, h = y0, 1.0 / steps
        for _ in range(steps):
            k1 = field(p, y)
            k2 = field(p, retract(y + 0.5 * h * k1))
            k3 = field(p, retract(y + 0.5 * h * k2))
            k4 = field(p, retract(y + h * k3))
            y = retract(y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4))
        return y

    class Func(torch.nn.Module):
        def __init__(self, p):
            super().__init__()
            self.p = torch.nn.ParameterDict({k: torch.nn.Parameter(v) for k, v in p.items()})

        def forward(self, t, y):
            return field(self.p, retract(y))

    ts = torch.tensor([0.0, 1.0], dtype=dt, device=device)

    def dopri(p):
        y1 = torchdiffeq.odeint(lambda t, y: field(p, retract(y)), y0, ts, method="dopri5",
                                rtol=tol, atol=tol)[-1]
        return retract(y1)

    def params(grad):
        return {k: tensor(inputs[f"field/{k}"], grad) for k in names}

    def gradient(run):
        def fn():
            p = params(True)
            return torch.autograd.grad(torch.sum(run(p) * w), [p[k] for k in names])
        return fn

    def grad_adjoint():
        f = Func(params(False))
        y1 = retract(torchdiffeq.odeint_adjoint(f, y0, ts, method="dopri5", rtol=tol,
                                                atol=tol)[-1])
        return torch.autograd.grad(torch.sum(y1 * w), [f.p[k] for k in names])

    fixed = params(False)
    cases = {
        "fwd_euler": (lambda: euler(fixed), ()),
        "fwd_rk4": (lambda: rk4(fixed), ()),
        "fwd_dopri5": (lambda: dopri(fixed), ()),
        "grad_rk4": (gradient(rk4), ()),
        "grad_rk4_recur": (gradient(rk4), ()),
        "grad_rk4_dots": (gradient(rk4), ()),
        "grad_dopri5": (gradient(dopri), ()),
        "grad_dopri5_adj": (grad_adjoint, ()),
    }
    compiled_field = torch.compile(field)  # compiled at the first call ("outputs")
    cases["fwd_rk4_compiled"] = (lambda: rk4(fixed, compiled_field), ())

    # The Transformer: experiments/benchmark.py's make_reference, in torch.
    d = inputs["x"].shape[-1]
    k_head, h = d // N_HEADS, 1.0 / layers
    tf_names = ("wq", "wk", "wv", "wo", "w_in", "w_out")

    def norm(x):
        return x / torch.sqrt(torch.mean(x * x, -1, keepdim=True))

    def tangent(x, u):
        return u - (torch.sum(x * u, -1, keepdim=True) / torch.sum(x * x, -1, keepdim=True)) * x

    def transformer(weights, x):
        n = x.shape[0]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))
        x = norm(x)
        for layer in range(layers):
            wq, wk, wv, wo, w_in, w_out = (weights[k][layer] for k in tf_names)
            q = torch.einsum("nd,dhk->hnk", x, wq)
            kk = torch.einsum("nd,dhk->hnk", x, wk)
            v = torch.einsum("nd,dhk->hnk", x, wv)
            s = torch.einsum("hqk,hsk->hqs", q, kk) / math.sqrt(k_head)
            s = torch.where(causal, s, torch.finfo(x.dtype).min)
            o = torch.einsum("hqs,hsk->hqk", torch.softmax(s, -1), v)
            x = norm(x + h * tangent(x, torch.einsum("hqk,hkd->qd", o, wo)))
            ffn = torch.nn.functional.gelu(x @ w_in) @ w_out
            x = norm(x + h * tangent(x, ffn))
        return x

    tf = {k: tensor(inputs[f"tf/{k}"], True) for k in tf_names}
    x, target = tensor(inputs["x"]), tensor(inputs["target"])

    def tf_forward():
        with torch.no_grad():
            return transformer(tf, x)

    def train_step():
        loss = torch.mean(transformer(tf, x) * target)
        grads = torch.autograd.grad(loss, [tf[k] for k in tf_names])
        with torch.no_grad():
            new = {k: tf[k] - LR * g for k, g in zip(tf_names, grads, strict=True)}
        return loss.detach(), new

    cases["transformer_fwd"] = (tf_forward, ())
    cases["train_step"] = (train_step, ())

    def host(t):
        return t.detach().double().cpu().numpy()

    def outputs(case, out):
        if case.startswith("grad"):
            return {f"d_{k}": host(g) for k, g in zip(names, out, strict=True)}
        if case == "train_step":
            value, new = out
            return {"loss": host(value), **{f"new_{k}": host(v) for k, v in new.items()}}
        return {"y": host(out)}

    return cases, outputs


# --------------------------------------------------------------------------------------------
# Worker: build the cases of one (size, dtype), answer commands on stdin
# --------------------------------------------------------------------------------------------


def _maxrss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _block(framework, out):
    """``out``, its computation finished (JAX: ``block_until_ready``; torch on a GPU:
    ``torch.cuda.synchronize``)."""
    if framework == "jax":
        import jax

        return jax.block_until_ready(out)
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return out


def matmul_settings(framework: str, device: str, tf32: bool) -> dict:
    """Sets the float32 matrix multiply precision (full float32 unless ``tf32``) and returns
    what is in force, with the device the worker computes on."""
    if framework == "jax":
        import jax

        jax.config.update("jax_default_matmul_precision",
                          "tensorfloat32" if tf32 else "highest")
        return {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
                "matmul_precision": jax.config.jax_default_matmul_precision}
    import torch

    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return {"device": name, "allow_tf32": torch.backends.cuda.matmul.allow_tf32}


def _memory_figures(framework: str, device: str, fn, args) -> dict:
    """Peak memory of one call of ``fn(*args)`` (the module's docstring)."""
    reply = {}
    if framework == "jax":
        import jax

        compiled = fn.lower(*args).compile()
        reply["xla_temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
        fn = compiled
    elif device == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = _maxrss_bytes()
    _block(framework, fn(*args))
    reply["peak_rss_delta_bytes"] = _maxrss_bytes() - before
    if device == "cuda" and framework == "jax":
        stats = jax.devices()[0].memory_stats() or {}
        reply["gpu_peak_bytes"] = stats.get("peak_bytes_in_use")
    elif device == "cuda":
        reply["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
    return reply


def worker(framework: str, device: str = "cpu", tf32: bool = False) -> None:
    """Answer JSON commands, one per line on stdin: ``setup``, ``outputs``, ``calibrate``,
    ``time``, ``memory``."""
    if framework == "jax":
        import jax

        jax.config.update("jax_enable_x64", True)
        make = jax_cases
    else:
        import torch

        torch.set_num_threads(int(os.environ.get("PEER_TORCH_THREADS", os.cpu_count() or 1)))

        def make(*common):
            return torch_cases(*common, device=device)
    settings = matmul_settings(framework, device, tf32)
    built: dict[str, tuple] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op, key = cmd["op"], cmd.get("key")
        reply: dict = {"ok": True}
        try:
            if op == "setup":
                inputs = dict(np.load(cmd["inputs"]))
                built[key] = make(inputs, cmd["dtype"], cmd["steps"], cmd["layers"], cmd["tol"])
                reply["settings"] = settings
            elif op == "outputs":  # run every case once (compiles), write the outputs
                cases, outputs = built[key]
                arrays, compile_s, failed = {}, {}, {}
                for case in cmd["cases"]:
                    fn, args = cases[case]
                    t0 = time.perf_counter()
                    try:  # a case that fails (out of memory, say) does not stop the others
                        out = _block(framework, fn(*args))
                    except Exception as exc:  # noqa: BLE001
                        failed[case] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        _release(framework)
                        continue
                    compile_s[case] = time.perf_counter() - t0
                    for name, a in outputs(case, out).items():
                        arrays[f"{case}/{name}"] = a
                np.savez(cmd["path"], **arrays)
                reply["first_call_s"] = compile_s
                reply["failed"] = failed
            elif op == "calibrate":  # calls per sample for min_sample seconds
                fn, args = built[key][0][cmd["case"]]
                t0 = time.perf_counter()
                _block(framework, fn(*args))
                once = time.perf_counter() - t0
                reply["number"] = max(1, math.ceil(cmd["min_sample"] / max(once, 1e-9)))
            elif op == "time":
                fn, args = built[key][0][cmd["case"]]
                t0 = time.perf_counter()
                for _ in range(cmd["number"]):
                    _block(framework, fn(*args))
                reply["seconds"] = (time.perf_counter() - t0) / cmd["number"]
            elif op == "memory":  # fresh worker: build, compile, then one call
                inputs = dict(np.load(cmd["inputs"]))
                cases, _ = make(inputs, cmd["dtype"], cmd["steps"], cmd["layers"], cmd["tol"])
                reply.update(_memory_figures(framework, device, *cases[cmd["case"]]))
            elif op == "quit":
                break
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # reported to the main process, which raises
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


def _release(framework: str) -> None:
    """After a failed case: give cached GPU memory back (torch keeps it otherwise)."""
    if framework == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def worker_env(framework: str, device: str, xla_flags: str | None = None) -> dict[str, str]:
    """The worker's environment: the project on ``PYTHONPATH``; for JAX, ``JAX_PLATFORMS`` of
    ``device`` (both frameworks on the same device) and ``xla_flags`` added to the caller's."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent), *filter(None, [env.get("PYTHONPATH")])])
    if framework == "jax":
        env["JAX_PLATFORMS"] = device
    if xla_flags:  # added to the caller's own XLA_FLAGS
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), xla_flags]))
    return env


class Worker:
    """A worker subprocess and its JSON line protocol."""

    def __init__(self, framework: str, xla_flags: str | None = None, device: str = "cpu",
                 tf32: bool = False, python: str | None = None):
        """``python``: the interpreter of the worker (default this one's)."""
        self.framework = framework
        self.proc = subprocess.Popen(
            [python or sys.executable, str(Path(__file__).resolve()), "--worker", framework,
             "--device", device, *(["--tf32"] if tf32 else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=worker_env(framework, device, xla_flags),
        )

    def __call__(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.framework} worker died (command {cmd['op']})")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise RuntimeError(f"{self.framework} worker, {cmd['op']}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


# --------------------------------------------------------------------------------------------
# Main: agreement, alternating rounds, memory, JSON and markdown
# --------------------------------------------------------------------------------------------


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    scale = float(np.max(np.abs(b))) or 1.0
    return float(np.max(np.abs(a - b))) / scale


def agreement(jax_out: dict, torch_out: dict, dtype: str, cases=CASES,
              tolerances=None, failed: dict | None = None) -> dict[str, dict]:
    """Per case: the largest relative error over its outputs, the tolerance, ok; a case that
    failed in a framework (``failed``: case -> {framework: error}) is not ok, with its errors."""
    tolerances = TOLERANCES if tolerances is None else tolerances
    result = {}
    for case in cases:
        if failed and case in failed:
            result[case] = {"relative_error": None, "ok": False, "failed": failed[case]}
            continue
        keys = [k for k in jax_out if k.startswith(case + "/")]
        err = max(relative_error(jax_out[k], torch_out[k]) for k in keys)
        tol = tolerances[(case_kind(case), dtype)]
        result[case] = {"relative_error": err, "tolerance": tol, "ok": bool(err <= tol)}
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few rounds")
    parser.add_argument("--rounds", type=int, default=None, help="default 14 (quick: 2)")
    parser.add_argument("--min-sample", type=float, default=None)
    parser.add_argument("--sizes", default=None,
                        help="NxD, BxNxD (a batch), each with an optional :H (field heads), "
                        "e.g. 32x64,8x1024x1024:16 (default: the mode's)")
    parser.add_argument("--large", action="store_true",
                        help="add the large size 8x1024x1024:16 (default on a GPU)")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where both frameworks compute (cuda: the first GPU)")
    parser.add_argument("--tf32", action="store_true",
                        help="float32 matrix multiplies in TF32 on both sides (default: off)")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--cases", default=None,
                        help=f"default: {','.join(CASES)} (cuda: and {','.join(COMPILED_CASES)})")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory workers")
    parser.add_argument("--jax-only", action="store_true",
                        help="the project's side alone (no torch needed)")
    parser.add_argument("--xla-flags", default=None, metavar="FLAGS",
                        help="no torch: time the project with these XLA_FLAGS against the "
                        "project without them (two JAX workers, the same protocol; ratio = "
                        "time without / time with, above 1: the flags help)")
    parser.add_argument("--out", default="results/peer")
    parser.add_argument("--worker", choices=("jax", "torch"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.min_sample is not None and args.min_sample < 0:
        parser.error(f"--min-sample must be >= 0, got {args.min_sample}")
    if args.sizes is not None:
        try:
            args.sizes = [parse_size(s) for s in args.sizes.split(",")]
        except ValueError as err:
            parser.error(f"--sizes: {err}")
    if args.tf32 and args.device != "cuda":
        parser.error("--tf32 needs --device cuda (a CPU has no TF32)")
    args.dtypes = [s for s in args.dtypes.split(",") if s]
    if args.cases is None:
        args.cases = ",".join(ALL_CASES if args.device == "cuda" else CASES)
    args.cases = [s for s in args.cases.split(",") if s]
    if not args.dtypes or set(args.dtypes) - set(DTYPES):
        parser.error(f"--dtypes must be among {DTYPES}, got {args.dtypes}")
    if not args.cases or set(args.cases) - set(ALL_CASES):
        parser.error(f"--cases must be among {ALL_CASES}, got {args.cases}")
    return args


def parse_size(text: str) -> tuple[int, int, int, int]:
    """``"NxD"``, ``"BxNxD"``, each with an optional ``":H"`` -> ``(B, N, D, H)`` (``B = 1``,
    ``H = 4`` by default); ``D`` a multiple of ``H``."""
    dims, _, heads = text.partition(":")
    try:
        values = [int(v) for v in dims.split("x")]
        h = int(heads) if heads else N_HEADS
    except ValueError:
        raise ValueError(f"{text!r} is not NxD, BxNxD or either with :H") from None
    if len(values) not in (2, 3):
        raise ValueError(f"{text!r} is not NxD, BxNxD or either with :H")
    b, n, d = ([1] + values)[-3:]
    if min(b, n, h) < 1 or d < N_HEADS or d % N_HEADS or d % h:
        raise ValueError(f"{text!r}: need B, N, H >= 1 and D a multiple of {N_HEADS} and of H")
    return b, n, d, h


def machine() -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "python": platform.python_version()}
    try:
        info["load_average_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.device, args.tf32)
        return {}
    mode = "quick" if args.quick else "full"
    cfg = dict(MODES[mode])
    if args.sizes:
        cfg["sizes"] = args.sizes
    if (args.large or (args.device == "cuda" and mode == "full" and not args.sizes)) and (
            LARGE not in cfg["sizes"]):
        cfg["sizes"] = [*cfg["sizes"], LARGE]
    rounds = args.rounds or cfg["rounds"]
    min_sample = cfg["min_sample"] if args.min_sample is None else args.min_sample
    if args.xla_flags is not None:  # two JAX workers: without and with the flags
        frameworks, spawn = ("jax", "flags"), {"jax": ("jax", None),
                                               "flags": ("jax", args.xla_flags)}
        args.no_memory = True
    else:
        frameworks = ("jax",) if args.jax_only else ("jax", "torch")
        spawn = {fw: (fw, None) for fw in frameworks}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    device = dict(device=args.device, tf32=args.tf32)
    workers = {fw: Worker(*spawn[fw], **device) for fw in frameworks}
    versions, settings = {}, {}
    runs = []
    try:
        for batch, n, d, heads in cfg["sizes"]:
            tag = f"b{batch}_n{n}_d{d}_h{heads}"
            inputs_path = out_dir / f"inputs_{tag}.npz"
            np.savez(inputs_path, **make_inputs(n, d, cfg["layers"], batch=batch, heads=heads))
            for dtype in args.dtypes:
                key = f"{tag}/{dtype}"
                common = dict(inputs=str(inputs_path), dtype=dtype, steps=cfg["steps"],
                              layers=cfg["layers"], tol=cfg["tol"])
                outs, first, failed = {}, {}, {}
                for fw, wk in workers.items():
                    settings[fw] = wk(op="setup", key=key, **common)["settings"]
                    path = out_dir / f"outputs_{fw}_{tag}_{dtype}.npz"
                    reply = wk(op="outputs", key=key, path=str(path), cases=args.cases)
                    first[fw] = reply["first_call_s"]
                    for c, error in reply["failed"].items():
                        failed.setdefault(c, {})[fw] = error
                    outs[fw] = dict(np.load(path))
                if "torch" in outs:
                    agree = agreement(outs["jax"], outs["torch"], dtype, args.cases,
                                      failed=failed)
                elif "flags" in outs:
                    agree = agreement(outs["flags"], outs["jax"], dtype, args.cases,
                                      FLAG_TOLERANCES, failed=failed)
                else:
                    agree = {c: {"ok": c not in failed, "relative_error": None,
                                 **({"failed": failed[c]} if c in failed else {})}
                             for c in args.cases}
                timed = [c for c in args.cases if agree[c]["ok"]]
                number = {(fw, c): wk(op="calibrate", key=key, case=c,
                                      min_sample=min_sample)["number"]
                          for fw, wk in workers.items() for c in timed}
                samples = {(fw, c): [] for fw in frameworks for c in timed}
                for r in range(rounds):
                    order = frameworks if r % 2 == 0 else frameworks[::-1]
                    for c in timed:
                        for fw in order:
                            samples[fw, c].append(workers[fw](
                                op="time", key=key, case=c, number=number[fw, c])["seconds"])
                cases = {}
                for c in args.cases:
                    entry = {"agreement": agree[c]}
                    if c in timed:
                        med = {fw: statistics.median(samples[fw, c]) for fw in frameworks}
                        entry.update(
                            median_s=med, number=number_of(number, c, frameworks),
                            samples_s={fw: samples[fw, c] for fw in frameworks},
                            first_call_s={fw: first[fw][c] for fw in frameworks},
                        )
                        if "torch" in med:
                            entry["ratio_torch_over_project"] = med["torch"] / med["jax"]
                        if "flags" in med:
                            entry["ratio_without_over_with_flags"] = med["jax"] / med["flags"]
                    cases[c] = entry
                if not args.no_memory:
                    for c in (c for c in args.cases if c in GRADIENT_CASES):
                        cases[c]["memory"] = {}
                        for fw in frameworks:
                            wk = Worker(fw, **device)
                            try:
                                cases[c]["memory"][fw] = wk(op="memory", case=c, **common)
                            except RuntimeError as err:  # out of memory, say: reported
                                cases[c]["memory"][fw] = {"error": str(err)[:300]}
                            finally:
                                wk.close()
                runs.append({"batch": batch, "n": n, "d": d, "heads": heads, "dtype": dtype,
                             "cases": cases})
    finally:
        for wk in workers.values():
            wk.close()

    for fw in frameworks:
        versions.update(_versions(spawn[fw][0]))
    result = {
        "schema": 1,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": mode, "jax_only": args.jax_only, "compared_xla_flags": args.xla_flags,
        "device": args.device, "tf32": args.tf32, "workers": settings,
        "settings": {**cfg, "rounds": rounds, "min_sample_s": min_sample,
                     "tolerances": {f"{k}/{t}": v for (k, t), v in TOLERANCES.items()},
                     "torch_threads": os.environ.get("PEER_TORCH_THREADS", os.cpu_count()),
                     "xla_flags": os.environ.get("XLA_FLAGS", "")},
        "machine": machine(), "versions": versions, "runs": runs,
        "summary": {"agreement_ok": all(e["agreement"]["ok"] for r in runs
                                        for e in r["cases"].values())},
    }
    from svflow_jax.atomic import write_json, write_text

    write_json(out_dir / "peer_benchmark.json", result, indent=1)
    table = markdown(result)
    write_text(out_dir / "peer_benchmark.md", table)
    print(table)
    return result


def number_of(number: dict, case: str, frameworks) -> dict:
    return {fw: number[fw, case] for fw in frameworks}


def _versions(framework: str) -> dict:
    code = ("import json, jax, diffrax, flax; print(json.dumps({'jax': jax.__version__, "
            "'diffrax': diffrax.__version__, 'flax': flax.__version__}))"
            if framework == "jax" else
            "import json, torch, importlib.metadata as m; print(json.dumps({'torch': "
            "torch.__version__, 'torchdiffeq': m.version('torchdiffeq')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def markdown(result: dict) -> str:
    """Ratios torch / project per case (columns: size, dtype), then the memory figures."""
    runs = result["runs"]
    cols = [(f"batch {r['batch']}, " if r.get("batch", 1) > 1 else "")
            + f"n={r['n']}, d={r['d']}"
            + (f", {r['heads']} heads" if r.get("heads", N_HEADS) != N_HEADS else "")
            + f", {r['dtype']}" for r in runs]
    flags = result.get("compared_xla_flags")
    what = (f"ratio = time without / time with XLA_FLAGS={flags!r} (above 1: the flags help)"
            if flags is not None else
            "ratio = torch time / project time (above 1: the project is faster)")
    device = result.get("device", "cpu")
    where = (f"{result.get('workers', {}).get('jax', {}).get('device_kind', 'GPU')}, TF32 "
             + ("on" if result.get("tf32") else "off") if device == "cuda" else
             f"{result['machine']['cpu_count']} CPUs")
    lines = [f"Peer benchmark ({result['mode']}, {result['created']}, {where}, "
             f"{result['settings']['rounds']} rounds); " + what, "",
             "| case | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for case in ALL_CASES:
        if not any(case in r["cases"] for r in runs):
            continue
        cells = []
        for r in runs:
            e = r["cases"].get(case)
            if e is None:
                cells.append("")
            elif "failed" in e["agreement"]:
                cells.append("failed (" + "; ".join(
                    f"{fw}: {err.split(':')[0]}" for fw, err in e["agreement"]["failed"].items())
                    + ")")
            elif not e["agreement"]["ok"]:
                cells.append(f"disagree ({e['agreement']['relative_error']:.1e})")
            elif "ratio_torch_over_project" in e:
                cells.append(f"{e['ratio_torch_over_project']:.2f}")
            elif "ratio_without_over_with_flags" in e:
                cells.append(f"{e['ratio_without_over_with_flags']:.2f}")
            elif "median_s" in e:
                cells.append(f"{e['median_s']['jax'] * 1e3:.3g} ms")
            else:
                cells.append("")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    if not any(e.get("memory") for r in runs for e in r["cases"].values()):
        return "\n".join(lines) + "\n"
    lines += ["", ("Peak GPU memory of one gradient call (torch: max_memory_allocated; JAX: "
                   "peak_bytes_in_use of a fresh process), MiB:" if device == "cuda" else
                   "Peak memory of one gradient call (growth of peak RSS in a fresh worker; "
                   "XLA temp buffers in brackets), MiB:"), "",
              "| case | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for case in GRADIENT_CASES:
        cells = []
        for r in runs:
            mem = r["cases"].get(case, {}).get("memory")
            if not mem:
                cells.append("")
                continue
            parts = []
            for fw, m in mem.items():
                if "error" in m:
                    parts.append(f"{fw} failed")
                    continue
                peak = m.get("gpu_peak_bytes") if device == "cuda" else None
                s = f"{fw} {(peak or m['peak_rss_delta_bytes']) / 2**20:.1f}"
                if "xla_temp_bytes" in m:
                    s += f" [{m['xla_temp_bytes'] / 2**20:.1f}]"
                parts.append(s)
            cells.append(", ".join(parts))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
