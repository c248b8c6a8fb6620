"""Exactness: a Transformer IS a solver of its flow, layer by layer, to round-off.

Each claim runs a random Transformer (:mod:`.problem`) and the flow solver it equals
(:func:`svflow_jax.bridge.correspondence.layer_gaps`) from the same input and reports the largest
difference over layers, tokens and coordinates, in the Transformer's units, against
:func:`.measure.exactness_tolerance`. The figure ``moved`` (how far the tokens' directions
travel) shows that the equality is not between two standing-still trajectories.
"""

from __future__ import annotations

import itertools
import math

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..bridge import correspondence
from ..solvers import RetractedEuler, SolveError, solve
from ..solvers.solve import time_value
from ..transformer import RoPE
from .core import Context, Evidence, claim
from .measure import C_FLOAT32, exactness_tolerance, precision_in_force
from .problem import checkpoint_like, hidden_states, inputs, random_params, transformer_config

__all__ = ["VARIANTS"]

_LLAMA = dict(norm_position="pre", block="sequential", ffn="swiglu", n_heads=4, n_kv_heads=2,
              rope=RoPE(100.0), norm_eps=1e-5, norm_gain=True, final_norm=False)

# variant -> (Transformer settings, the solver the stack equals)
VARIANTS: dict[str, tuple[dict, str]] = {
    "postnorm-projected": (dict(norm_position="post", block="parallel", project_branches=True),
                           "RetractedEuler on v_A + v_F"),
    "postnorm": (dict(norm_position="post", block="parallel", project_branches=False),
                 "VariableStepRetractedEuler, h' = h / (1 + h x.u)"),
    "prenorm": (dict(norm_position="pre", block="parallel", project_branches=False),
                "diffrax Euler of dy/dt = F(R(y)), R(y) = y / |y|"),
    "sequential": (dict(norm_position="post", block="sequential", project_branches=True),
                   "LieTrotter(RetractedEuler) of v_A, v_F"),
    "parallel-swiglu": (dict(norm_position="post", block="parallel", project_branches=True,
                             ffn="swiglu"),
                        "RetractedEuler on v_A + v_F (SwiGLU FFN)"),
    "macaron": (dict(norm_position="post", block="macaron", project_branches=True),
                "Strang(RetractedEuler): F/2, A, F/2"),
    "gqa": (dict(norm_position="post", block="sequential", project_branches=False,
                 ffn="swiglu", n_heads=4, n_kv_heads=2),
            "LieTrotter(VariableStepRetractedEuler), 4 query heads on 2 key/value heads"),
    "moe": (dict(norm_position="post", block="sequential", project_branches=False, ffn="moe",
                 n_experts=4, top_k=2),
            "LieTrotter(VariableStepRetractedEuler), top-2 of 4 experts"),
    # What trained checkpoints add (weights from problem.checkpoint_like): RoPE, Norm eps and
    # gains, biases, per-head query/key Norms.
    "llama": (dict(_LLAMA), "LieTrotter(Euler) of dy/dt = F(S(y)), S(y) = y / sqrt(|y|^2 + "
              "eps), with gains folded, RoPE as the kernel's position rotation (Llama)"),
    "qwen2": (dict(_LLAMA, qkv_bias=True),
              "the llama variant with Q/K/V biases as the kernel's and the scores' offsets"),
    "qwen3": (dict(_LLAMA, qk_norm=True),
              "the llama variant with per-head query/key RMSNorm: a kernel on the sphere"),
    # The families interpretability work uses: LayerNorm, partial rotary, GeGLU.
    "gpt2": (dict(norm_position="pre", block="sequential", ffn="gelu", activation="gelu_tanh",
                  norm="layer", norm_gain=True, norm_bias=True, use_bias=True, norm_eps=1e-5,
                  final_norm=False),
             "LieTrotter(Euler) of dy/dt = F(S(P y)), P y = y - mean(y) (pre-LayerNorm, gains "
             "and biases folded into the first maps), tanh-GELU FFN with biases (GPT-2)"),
    "gpt-neox": (dict(norm_position="pre", block="parallel", ffn="gelu", norm="layer",
                      norm_gain=True, norm_bias=True, use_bias=True, norm_eps=1e-5,
                      rope=RoPE(100.0, rotary_dim=2), final_norm=False),
                 "Euler of dy/dt = F_A(S(P y)) + F_F(S(P y)) with RoPE on 2 coordinates of each "
                 "head (partial rotary: the rotated pairs permuted onto the kernel's, the rest "
                 "at frequency 0), pre-LayerNorm (GPT-NeoX, Pythia)"),
    "phi3": (dict(_LLAMA, n_kv_heads=4, rope=RoPE(100.0, rotary_dim=2)),
             "the llama variant with multi-head attention and RoPE on part of each head "
             "(Phi-3; its fused QKV and gate/up matrices are split when loading)"),
    "gemma": (dict(_LLAMA, n_kv_heads=1, activation="gelu_tanh"),
              "the llama variant with a GeGLU FFN (tanh-GELU gate) and one key/value head "
              "(Gemma)"),
    "postnorm-rope-bias": (dict(norm_position="post", block="sequential", rope=RoPE(100.0),
                                project_branches=False, norm_gain=False, use_bias=True,
                                n_heads=4, n_kv_heads=2),
                           "LieTrotter(VariableStepRetractedEuler) with RoPE and Q/K/V/O/FFN "
                           "biases"),
}


def _variant_config(ctx: Context, settings: dict):
    settings = dict(settings)
    if "n_heads" in settings:  # same total width, narrower heads
        settings["d_head"] = ctx.options.dim // settings["n_heads"] or 1
    return transformer_config(ctx, **settings)


def _exactness(ctx: Context, index: int, variant: str) -> Evidence:
    settings, _ = VARIANTS[variant]
    config = _variant_config(ctx, settings)
    params = random_params(config, ctx.options.seed + index)
    if config.norm_gain or config.any_bias or config.qk_norm:
        params = checkpoint_like(config, params, ctx.options.seed + index)
    gaps = _gaps(config, params, inputs(ctx))
    per_layer = gaps["per_layer"]
    scale = float(gaps["scale"])
    tolerance = exactness_tolerance(config.param_dtype, config.n_layers, scale)
    figures = {"max_abs_diff": float(per_layer.max()), "depth": config.n_layers,
               "moved": float(gaps["moved"]), "scale": scale}
    passed = bool(per_layer.max() <= tolerance)
    if "radial_factors" in gaps:
        # The per-token step needs 1 + c x.u > 0 at every sub-step.
        factor = float(np.min(gaps["radial_factors"]))
        figures["min_radial_factor"] = factor
        passed = passed and factor > 0
    if "router_logits" in gaps:
        figures.update(_routing(config, gaps["router_logits"]))
    rows = [{"layer": l + 1, "max_abs_diff": float(v)} for l, v in enumerate(per_layer)]
    return Evidence(passed, figures, f"max abs diff <= {tolerance:.1e}", rows,
                    headline="max_abs_diff")


def _gaps(config, params, x) -> dict[str, np.ndarray]:
    """:func:`svflow_jax.bridge.correspondence.layer_gaps`'s figures (``per_layer``, ``moved``,
    ``scale``), with ``radial_factors`` for a standard post-norm stack and ``router_logits``
    (at each layer's FFN input) for a MoE one: one compiled program, NumPy arrays back."""
    return _all_gaps([(config, params, x)])[0]


def _all_gaps(cases) -> list[dict[str, np.ndarray]]:
    """:func:`_gaps` of each ``(config, params, x)``, all in one program."""
    out = jax.tree.map(np.asarray, _gaps_programs(tuple((c, dict(p), x) for c, p, x in cases)))
    for gaps in out:
        if not np.all(np.isfinite(gaps["per_layer"])):  # here: the program stays cacheable
            raise SolveError("the flow side returned NaN (a standard post-norm step with "
                             "1 + h x.u <= 0, or a field that produced NaN)")
    return out


@eqx.filter_jit
def _gaps_programs(cases):
    return [_gaps_program(*case) for case in cases]


@eqx.filter_jit
def _gaps_program(config, params, x):
    per_layer, _, moved, scale, substeps = correspondence._layer_gaps(config, params, {}, x,
                                                                      None)
    out = {"per_layer": per_layer, "moved": moved, "scale": scale}
    if config.norm_position == "post" and not config.project_branches:
        out["radial_factors"] = correspondence.radial_factors(config, params, substeps)
    if config.ffn == "moe":
        ffn_inputs = substeps[1::2][: config.n_layers]  # after each attention sub-step
        out["router_logits"] = correspondence.router_logits(config, params, ffn_inputs)
    return out


def _routing(config, logits: np.ndarray) -> dict:
    """How the top-k router routes along the trajectory: the number of distinct expert sets
    (routing that never changes would not test top-k) and the smallest gap between the k-th and
    (k+1)-th logits (far above round-off: both sides must select the same experts)."""
    k = config.top_k
    top = np.sort(np.argsort(-logits, axis=-1, kind="stable")[..., :k], axis=-1).reshape(-1, k)
    ordered = np.sort(logits, axis=-1)
    margin = float(np.min(ordered[..., -k] - ordered[..., -k - 1]))
    return {"expert_sets": len({tuple(r) for r in top.tolist()}), "router_margin": margin}


def _register_variant(index: int, variant: str) -> None:
    settings, solver = VARIANTS[variant]
    claim(f"exactness/{variant}", "exactness",
          f"A {variant} Transformer (random weights) is {solver} of its flow: every hidden "
          "state equals the solver's state to round-off.")(
        lambda ctx: _exactness(ctx, index, variant))


for _i, _variant in enumerate(VARIANTS):
    _register_variant(_i, _variant)


@claim("exactness/plain-solve", "exactness",
       "A parallel post-norm stack with projected branches is a plain diffrax solve "
       "solve(v_A + v_F, RetractedEuler(), num_steps=L); a parallel pre-norm stack is "
       "diffrax.Euler on dy/dt = F(y / |y|) (written independently of flow_states).")
def plain_solve(ctx: Context) -> Evidence:
    rows, cases = [], []
    positions = (("post", True), ("pre", False))
    for position, projected in positions:
        config = transformer_config(ctx, norm_position=position, block="parallel",
                                    project_branches=projected)
        cases.append((config, random_params(config, ctx.options.seed + 11), inputs(ctx)))
    gaps = _plain_solve_gaps(tuple(cases))  # both stacks in one program
    for (position, _), (config, _, _), (diff, scale) in zip(positions, cases, gaps,
                                                            strict=True):
        diff, scale = float(diff), float(scale)
        if not math.isfinite(diff):
            raise FloatingPointError(f"the {position}-norm plain solve produced NaN")
        tolerance = exactness_tolerance(config.param_dtype, config.n_layers, scale)
        rows.append({"stack": f"{position}-norm parallel", "max_abs_diff": diff,
                     "tolerance": tolerance, "passed": diff <= tolerance})
    return Evidence(all(r["passed"] for r in rows),
                    {"max_abs_diff": max(r["max_abs_diff"] for r in rows)},
                    "max abs diff <= the exactness tolerance of each row", rows,
                    headline="max_abs_diff")


@eqx.filter_jit
def _plain_solve_gaps(cases):
    return [_plain_solve_gap(*case) for case in cases]


@eqx.filter_jit
def _plain_solve_gap(config, params, x):
    """``(max |x_l - rho y_l|, max |x_l|)`` against a plain solve: ``solve(v_A + v_F,
    RetractedEuler())`` (post-norm) or ``diffrax.Euler`` on ``dy/dt = F(y / |y|)`` (pre-norm);
    checked by the caller (no runtime check inside, so the program can be cached). One
    program: the Transformer, its flow and the solve."""
    states = hidden_states(config, params, x)
    flow = correspondence.to_flow(config, params)
    y0 = states[0] / flow.radius
    if config.norm_position == "post":
        ys = solve(flow.field, y0, 0.0, flow.t1, solver=RetractedEuler(),
                   num_steps=flow.num_layers, saveat=diffrax.SaveAt(steps=True),
                   throw=False).ys
    else:
        t1 = time_value(flow.t1, y0.dtype)  # known: no runtime check in the program
        ys = diffrax.diffeqsolve(
            diffrax.ODETerm(flow.field.ambient), diffrax.Euler(), time_value(0.0, y0.dtype), t1,
            t1 / flow.num_layers, y0, saveat=diffrax.SaveAt(steps=True),
            max_steps=flow.num_layers, throw=False).ys
    return (jnp.max(jnp.abs(ys * flow.radius - states[1:])),
            jnp.max(jnp.linalg.norm(states, axis=-1)))


@claim("exactness/float32", "exactness",
       "In float32 the two sides differ by round-off that grows at most linearly in depth: "
       f"max_l d_l / (l eps s) <= {C_FLOAT32:g} (s: the largest token norm; eps = 2 u of the "
       "float32 matrix multiply in force: eps32 on a CPU, TF32's 2^-10 under a GPU's default "
       "precision).")
def float32_bound(ctx: Context) -> Evidence:
    precision = precision_in_force()
    eps = 2 * precision["float32_unit_roundoff"]
    rows, cases = [], []
    positions = (("post", True), ("pre", False))
    for position, projected in positions:
        config = transformer_config(ctx, norm_position=position, block="sequential",
                                    project_branches=projected, param_dtype=jnp.float32)
        cases.append((config, random_params(config, ctx.options.seed + 13),
                      np.asarray(inputs(ctx)).astype(np.float32)))
    for (position, _), (config, _, _), gaps in zip(positions, cases, _all_gaps(cases),
                                                   strict=True):
        per_layer = gaps["per_layer"].astype(float)
        layers = np.arange(1, config.n_layers + 1)
        ratio = float(np.max(per_layer / (layers * eps * float(gaps["scale"]))))
        rows.append({"stack": f"{position}-norm sequential", "max_abs_diff": float(
            per_layer.max()), "c_eff": ratio, "visible": bool(per_layer.max() > 1e-9)})
    passed = all(r["c_eff"] <= C_FLOAT32 and r["visible"] for r in rows)
    return Evidence(passed, {"c_eff": max(r["c_eff"] for r in rows), "eps": eps, **precision},
                    f"c_eff <= {C_FLOAT32:g} (eps = {eps:.3g}, {precision['float32_matmul']} "
                    "matrix multiplies), and the round-off visible (> 1e-9)", rows,
                    headline="c_eff")


# Arrays to_flow rescales (pre-norm gains folded in, biases divided by rho): they come back
# after two roundings, |w' - w| <= 2 u |w| = eps |w| (u = eps / 2 the unit round-off).
_RESCALED = {"wq", "wk", "wv", "w_in", "w_gate", "w_up", "router", "bq", "bk", "bv", "bo"}


@claim("round-trip", "exactness",
       "Transformer weights -> flow parameters -> Transformer weights is bit-identical, for "
       "every block x FFN kind x MHA/GQA x gains x post/pre-norm, two float32 variants and "
       "three checkpoint-like ones (RoPE, eps, biases, query/key Norms); the arrays to_flow "
       "rescales (pre-norm gains folded, biases over rho) come back within eps |w|.")
def round_trip(ctx: Context) -> Evidence:
    count, failures = 0, []
    ffns = {"gelu": dict(ffn="gelu"), "swiglu": dict(ffn="swiglu"),
            "moe-gelu": dict(ffn="moe", n_experts=4, top_k=2, expert_ffn="gelu"),
            "moe-swiglu": dict(ffn="moe", n_experts=4, top_k=2, expert_ffn="swiglu")}
    heads = {"mha": {}, "gqa": dict(n_heads=4, n_kv_heads=2)}
    variants = [(block, ffn, head, gain, position, ctx.options.dtype, {})
                for block, ffn, head, gain, position in itertools.product(
                    ("sequential", "parallel", "macaron"), ffns, heads, (False, True),
                    ("post", "pre"))]
    # float32 too, where d / sqrt(d_head) is not a float32 round number
    variants += [("sequential", "gelu", "gqa", False, "post", "float32", {}),
                 ("sequential", "moe-gelu", "mha", True, "post", "float32", {})]
    real = dict(rope=RoPE(100.0), norm_eps=1e-5)
    variants += [("sequential", "swiglu", "gqa", True, "pre", ctx.options.dtype, extra)
                 for extra in (real, dict(real, qkv_bias=True), dict(real, qk_norm=True,
                                                                     use_bias=True))]
    cases = []
    for seed, (block, ffn, head, gain, position, dtype, extra) in enumerate(variants):
        config = _variant_config(ctx, dict(block=block, norm_gain=gain, norm_position=position,
                                           n_layers=2, param_dtype=jnp.dtype(dtype),
                                           **ffns[ffn], **heads[head], **extra))
        params = random_params(config, ctx.options.seed + seed)
        if extra:  # checkpoint-like gains and biases (gains other than 1)
            params = checkpoint_like(config, params, ctx.options.seed + seed)
        cases.append((config, params, gain and not extra))
    # every variant's round trip in one program (one per variant and operation otherwise)
    trips = jax.tree.map(np.asarray, _round_trips(tuple(cases)))
    for (block, ffn, head, gain, position, dtype, extra), (params, back) in zip(
            variants, trips, strict=True):
        bad = sorted(set(params) ^ set(back))
        for name in sorted(set(params) & set(back)):
            a, b = params[name], back[name]
            if not (a.shape == b.shape and a.dtype == b.dtype):
                bad.append(name)
            elif name in _RESCALED and (position == "pre" and gain or name.startswith("b")):
                if np.any(np.abs(b - a) > np.finfo(a.dtype).eps * np.abs(a)):
                    bad.append(name)
            elif a.tobytes() != b.tobytes():
                bad.append(name)
        if bad:
            failures.append({"variant": f"{block}/{ffn}/{head}/gain={gain}/{position}/{dtype}"
                             f"/{sorted(extra)}", "arrays": ";".join(bad)})
        count += 1
    return Evidence(not failures, {"variants": count, "not_identical": len(failures)},
                    "0 variants differ (bit-identical; eps |w| for rescaled arrays)", failures,
                    headline="not_identical")


@eqx.filter_jit
def _round_trips(cases):
    """``(params, back)`` per ``(config, params, set_gains)``: ``back`` the weights that
    ``to_flow`` then ``to_transformer_params`` return; ``set_gains``: every Norm gain set to
    1.25 first (gains other than 1 must survive too)."""
    out = []
    for config, params, set_gains in cases:
        if set_gains:
            params = correspondence.with_gains(config, params, 1.25)
        out.append((params, correspondence.to_transformer_params(
            correspondence.to_flow(config, params), config)))
    return out


@claim("gains/ellipsoid", "exactness",
       "With RMSNorm gains g, every post-norm state lies on the ellipsoid |x / g| = sqrt(d) of "
       "the Norm that produced it (not on the sphere).")
def ellipsoid(ctx: Context) -> Evidence:
    rng = np.random.default_rng(ctx.options.seed + 17)
    cases = []
    for block in ("sequential", "parallel", "macaron"):
        config = transformer_config(ctx, norm_gain=True, block=block)
        params = random_params(config, ctx.options.seed + 19)
        shape = (config.n_layers, config.d_model)
        gains = [rng.uniform(0.5, 1.5, shape) for _ in range(2)]
        g_in = np.asarray(rng.uniform(0.5, 1.5, config.d_model), config.param_dtype)
        cases.append((config, params, gains, g_in))
    residuals = _ellipsoid_residuals(tuple(cases), inputs(ctx))  # one program for the three
    rows = []
    for (config, *_), (residual, off) in zip(cases, residuals, strict=True):
        residual, off = float(residual), float(off)
        tolerance = exactness_tolerance(config.param_dtype, config.n_layers, math.sqrt(
            config.d_model) * 1.5)
        rows.append({"block": config.block, "ellipsoid_residual": residual,
                     "sphere_residual": off, "passed": residual <= tolerance and off > 0.1})
    return Evidence(all(r["passed"] for r in rows),
                    {"ellipsoid_residual": max(r["ellipsoid_residual"] for r in rows),
                     "sphere_residual": min(r["sphere_residual"] for r in rows)},
                    "ellipsoid residual <= the exactness tolerance; sphere residual > 0.1", rows,
                    headline="ellipsoid_residual")


@eqx.filter_jit
def _ellipsoid_residuals(cases, x):
    """Per ``(config, params, gains, input gain)``: the largest residual of the post-norm states
    (after every sub-step) from their Norm's ellipsoid, and from the sphere of radius sqrt(d)."""
    out = []
    for config, params, gains, g_in in cases:
        params = correspondence.with_gains(config, params, [jnp.asarray(g) for g in gains])
        g_in = jnp.asarray(g_in)
        states = hidden_states(config, params, x, correspondence.input_norm(g_in),
                               substeps=True)
        all_gains = jnp.concatenate([g_in[None], correspondence.substep_gains(config, params)])
        out.append((jnp.max(correspondence.ellipsoid_residual(states, all_gains[:, None])),
                    jnp.max(jnp.abs(jnp.linalg.norm(states, axis=-1)
                                    - math.sqrt(config.d_model)))))
    return out
