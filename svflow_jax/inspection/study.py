"""``svflow inspect``: how close is a real pretrained Transformer to the solution of its ODE?

A pre-norm stack is *exactly* forward Euler, one step ``h`` per layer, of its ambient ODE
``dy/dt = F_t(y)`` (:func:`svflow_jax.bridge.correspondence.to_flow`, docs/theory.md, "Real pre-norm
models"). Whether its depth is *close to the solution* of that ODE is another question, which
this module answers with numbers on real text. Every measurement is a function returning a
:class:`~svflow_jax.claims.ClaimResult` (statement, figures, criterion, rows); the command, the
report and the tests consume those objects.

* :func:`exactness`: the flow reproduces every hidden state (float64 and float32).
* :func:`geometry`: per layer, the angle each token's direction turns, the growth of its norm
  (the growth of the radius that divides a pre-norm direction's speed; not a per-token
  clock, a reading docs/theory.md, "Pre-norm layers", shows wrong), the radial share of the
  update and its relative size.
* :func:`depth_smoothness`: ``|theta_{l+1} - theta_l| / |theta_l|`` per weight group (an ODE
  limit needs weights that vary smoothly with depth; unrelated weights of equal norm give
  ``sqrt(2)``).
* :func:`refinement`: the same flow (same weights, layer ``l`` on ``[l h, (l + 1) h]``)
  integrated with 2, 4, 8 Euler sub-steps per layer and with Heun and RK4 per layer: the change
  in next-token loss and in the final hidden states. A model whose depth solves its ODE changes
  little, and the changes shrink like ``h / m`` (Euler is first order); a model that uses its
  layers as large, discrete moves changes a lot.

Token position 0 is left out of the geometric statistics: it has no context, and in trained
language models it becomes an "attention sink" whose norm is tens of times the others'.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from ..bridge import correspondence
from ..checkpoints import LoadedModel, load, resolve
from ..claims.core import ClaimResult, Evidence
from ..claims.measure import precision_in_force
from ..solvers import catalogue
from ..transformer import TransformerConfig, TransformerLM, layer_params
from ..transformer.lens import decompose_logits, logit_lens
from .alpha_sweep import alpha_sweep, final_scores
from .config import QUICK, AlphaOptions, InspectOptions, scheme_names

__all__ = [
    "InspectOptions",
    "scheme_names",
    "QUICK",
    "resolve_model",
    "token_windows",
    "exactness",
    "geometry",
    "depth_smoothness",
    "refinement",
    "inspect_model",
    "progress_steps",
    "layer_groups",
]

def resolve_model(model: str | Path) -> LoadedModel:
    """A packaged model name (:data:`svflow_jax.checkpoints.packaged.MODELS`), a Hugging Face
    folder or a GGUF file (:func:`svflow_jax.checkpoints.resolve`), loaded in float32."""
    return load(resolve(model))


def token_windows(tokenizer: Any, text: str, windows: int, window: int) -> np.ndarray:
    """``windows`` consecutive, non-overlapping windows of ``window + 1`` token ids from the
    start of ``text`` (the last id of each is the last prediction's target): ``(W, n + 1)``."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer: cannot tokenise the text")
    ids = np.asarray(tokenizer.encode(text).ids, np.int32)
    need = windows * window + 1
    if ids.size < need:
        raise ValueError(f"the text has {ids.size} tokens; {windows} windows of {window} need "
                         f"{need}: give a longer text or fewer/shorter windows")
    return np.stack([ids[k * window : (k + 1) * window + 1] for k in range(windows)])


def _result(name: str, statement: str, evidence: Evidence, start: float) -> ClaimResult:
    return ClaimResult(name=name, section="inspect", statement=statement,
                       passed=evidence.passed, figures=evidence.figures,
                       tolerance=evidence.tolerance, rows=evidence.rows,
                       seconds=time.perf_counter() - start)


def _as_dtype(config: TransformerConfig, params: dict, dtype) -> tuple[TransformerConfig, dict]:
    config = dataclasses.replace(config, param_dtype=jnp.dtype(dtype), dtype=None)
    return config, {k: v.astype(dtype) for k, v in params.items()}


# ============================================================================================
# Exactness
# ============================================================================================

EXACT_RELATIVE_FLOAT64 = 1e-10


def exactness(loaded: LoadedModel, tokens: Int[Array, " n"]) -> ClaimResult:
    """``to_flow`` of the model reproduces every hidden state: the largest relative difference
    ``max_{l, i} |x_li - rho y_li| / |x_li|`` in float64 (weights cast up; criterion
    ``<= 1e-10``) and, reported, in float32. With per-head Q/K RMSNorm (Qwen3) also the
    kernel's vMF concentration per layer and head
    (:func:`~svflow_jax.bridge.correspondence.kernel_concentrations`).

    Models ``to_flow`` refuses (post-LayerNorm encoders such as BERT) are reported as such,
    with how far their states are from any sphere (:func:`_sphere_departure`).
    """
    start = time.perf_counter()
    lm, config = loaded.model, loaded.config
    statement = ("The model's own flow (to_flow) reproduces every hidden state: relative "
                 "difference <= 1e-10 in float64.")
    try:
        correspondence.check_supported(config)
    except ValueError as err:
        return _result("exactness", statement, _sphere_departure(loaded, tokens, str(err)),
                       start)
    figures, rows = {}, []
    x = lm.embeddings(jnp.asarray(tokens)[None])
    params = layer_params(lm.transformer)
    for dtype in ("float64", "float32"):
        cfg, p = _as_dtype(config, params, dtype)
        gaps = correspondence.layer_gaps(cfg, p, x.astype(dtype))
        relative = np.asarray(gaps["relative"], float)
        figures[f"relative_{dtype}"] = float(relative.max())
        figures[f"max_abs_diff_{dtype}"] = float(np.max(gaps["per_layer"]))
        figures["scale"] = float(gaps["scale"])
        rows += [{"dtype": dtype, "layer": l + 1, "relative": float(r)}
                 for l, r in enumerate(relative)]
    figures["tokens"] = int(np.size(tokens))
    if config.qk_norm:  # a kernel on the sphere: its concentration, per layer and head
        kappa = {k: np.asarray(v, float) for k, v in
                 correspondence.kernel_concentrations(config, params).items()}
        figures["kernel_concentration_median"] = float(np.median(kappa["typical"]))
        figures["kernel_concentration_max"] = float(np.max(kappa["bound"]))
        rows += [{"layer": l + 1, "head": h, "kernel_concentration": float(kappa["typical"][l, h]),
                  "kernel_concentration_bound": float(kappa["bound"][l, h])}
                 for l in range(config.n_layers) for h in range(config.n_heads)]
    passed = figures["relative_float64"] <= EXACT_RELATIVE_FLOAT64
    return _result("exactness", statement,
                   Evidence(passed, figures, f"relative_float64 <= {EXACT_RELATIVE_FLOAT64:g}",
                            rows), start)


def _sphere_departure(loaded: LoadedModel, tokens, reason: str) -> Evidence:
    """For a post-LayerNorm stack: the states lie on the affine ellipsoid ``{b + g z : mean(z)
    = 0, |z| = sqrt(d)}`` of the Norm that produced them (``ellipsoid_residual``, a check), and
    ``sphere_departure = max_i | |x_i| / r - 1 |``, ``r`` the RMS token norm of the layer, says
    how far that is from a sphere centred at 0. A pre-norm stack's states are no Norm's output:
    only ``sphere_departure`` is reported (``ellipsoid_residual`` is ``None``)."""
    lm, config = loaded.model, loaded.config
    states = np.asarray(_hidden_states(lm, jnp.asarray(tokens)[None]), float)[:, 0]
    params = {k: np.asarray(v, float) for k, v in layer_params(lm.transformer).items()}
    post_ln = config.norm_position == "post" and "norm_ffn_bias" in params
    rows = []
    for l in range(1, config.n_layers + 1):
        x = states[l]
        norms = np.linalg.norm(x, axis=-1)
        rms = float(np.sqrt(np.mean(norms**2)))
        row = {"layer": l, "sphere_departure": float(np.max(np.abs(norms / rms - 1)))}
        if post_ln:
            g, b = params["norm_ffn_gain"][l - 1], params["norm_ffn_bias"][l - 1]
            z = (x - b) / g
            row |= {"ellipsoid_residual": float(np.max(np.abs(
                        np.linalg.norm(z, axis=-1) - math.sqrt(config.d_model)))),
                    "centring_residual": float(np.max(np.abs(z.mean(axis=-1)))),
                    "bias_over_radius": float(np.linalg.norm(b) / rms)}
        rows.append(row)
    figures = {"sphere_departure": max(r["sphere_departure"] for r in rows),
               "ellipsoid_residual": max(r["ellipsoid_residual"] for r in rows)
               if post_ln else None,
               "not_a_flow": reason}
    return Evidence(None, figures, "not decidable: no exact flow (departure reported)", rows)


# ============================================================================================
# Geometry of the layers' updates
# ============================================================================================


@nnx.jit(graph_updates=False)  # reads the model: no state to write back
def _hidden_states(lm: TransformerLM, tokens: Array) -> Array:
    return lm.hidden_states(tokens)


@jax.jit
def _update_geometry(states: Float[Array, "m W n d"]) -> dict[str, Array]:
    """Per layer and token (position 0 dropped): turning angle, norm growth, radial share
    ``(Delta . u)^2 / |Delta|^2`` and relative size ``|Delta| / |x|`` of ``Delta = x_{l+1} -
    x_l``."""
    x = states[:, :, 1:].astype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    norms = jnp.linalg.norm(x, axis=-1)
    u = x / norms[..., None]
    cos = jnp.clip(jnp.sum(u[1:] * u[:-1], axis=-1), -1.0, 1.0)
    sin = jnp.linalg.norm(u[1:] - cos[..., None] * u[:-1], axis=-1)
    delta = x[1:] - x[:-1]
    size = jnp.linalg.norm(delta, axis=-1)
    radial = jnp.sum(delta * u[:-1], axis=-1)
    return {"angle_deg": jnp.degrees(jnp.arctan2(sin, cos)),
            "growth": norms[1:] / norms[:-1],
            "radial_share": (radial / size) ** 2,
            "relative_step": size / norms[:-1]}


def geometry(loaded: LoadedModel, windows: np.ndarray) -> ClaimResult:
    """Per layer ``l -> l + 1``, over every token (position 0 left out) of every window: the
    median and 90th percentile of the angle a token's direction turns (degrees), the median
    norm growth ``|x_{l+1}| / |x_l|``, the median radial share of the update and its median
    relative size ``|x_{l+1} - x_l| / |x_l|`` (the Euler step's size, relative to the state)."""
    start = time.perf_counter()
    states = _hidden_states(loaded.model, jnp.asarray(windows[:, :-1]))
    stats = {k: np.asarray(v, float).reshape(v.shape[0], -1)
             for k, v in _update_geometry(states).items()}
    rows = []
    for l in range(stats["angle_deg"].shape[0]):
        rows.append({"layer": l + 1,
                     "angle_deg_median": float(np.median(stats["angle_deg"][l])),
                     "angle_deg_p90": float(np.percentile(stats["angle_deg"][l], 90)),
                     "growth_median": float(np.median(stats["growth"][l])),
                     "radial_share_median": float(np.median(stats["radial_share"][l])),
                     "relative_step_median": float(np.median(stats["relative_step"][l]))})
    figures = {
        "total_angle_deg_median": float(np.median(_total_angle(states))),
        "relative_step_median": float(np.median(stats["relative_step"])),
        "radial_share_median": float(np.median(stats["radial_share"])),
        "growth_total_median": float(np.median(np.prod(stats["growth"], axis=0))),
        "tokens": int(stats["angle_deg"].shape[1]),
    }
    return _result("geometry", "How each layer moves the tokens: turning angle, norm growth, "
                   "radial share and relative size of the update (position 0 left out).",
                   Evidence(None, figures, "descriptive", rows), start)


def _total_angle(states: Array) -> np.ndarray:
    first, last = np.asarray(states[0, :, 1:], float), np.asarray(states[-1, :, 1:], float)
    cos = np.sum(first * last, -1) / np.linalg.norm(first, axis=-1) / np.linalg.norm(last, axis=-1)
    return np.degrees(np.arccos(np.clip(cos, -1, 1))).ravel()


# ============================================================================================
# Smoothness of the weights in depth
# ============================================================================================

_GROUPS = {
    "attention": ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm_gain", "k_norm_gain"),
    "ffn": ("w_gate", "w_up", "w_down", "w_in", "w_out", "b_gate", "b_up", "b_down", "b_in",
            "b_out", "router"),
    "norms": ("norm_attn_gain", "norm_ffn_gain", "norm_gain", "norm_attn_bias",
              "norm_ffn_bias", "norm_bias"),
}


def depth_smoothness(loaded: LoadedModel) -> ClaimResult:
    """For each weight group (attention, FFN, Norms) and each pair of consecutive layers:
    ``|theta_{l+1} - theta_l| / |theta_l|`` (Frobenius norms) and the cosine between them. Two
    unrelated weight sets of equal norm give ``sqrt(2) = 1.41`` and cosine 0; weights that
    sample a smooth ``theta(t)`` with step ``h`` give ``O(h)``."""
    start = time.perf_counter()
    params = layer_params(loaded.model.transformer)
    L = loaded.config.n_layers
    rows, figures = [], {}
    for group, names in _GROUPS.items():
        present = [n for n in names if n in params]
        if not present:
            continue
        # The group's weights of layer l as one vector theta_l: its squared norms, the squared
        # norms of consecutive differences and consecutive inner products, summed parameter by
        # parameter in float64 (no copy of the whole stack)
        norm2, step2, inner = np.zeros(L), np.zeros(L - 1), np.zeros(L - 1)
        for name in present:
            w = np.asarray(params[name], np.float64).reshape(L, -1)
            norm2 += np.einsum("li,li->l", w, w)
            inner += np.einsum("li,li->l", w[1:], w[:-1])
            step = w[1:] - w[:-1]
            step2 += np.einsum("li,li->l", step, step)
        diff = np.sqrt(step2 / norm2[:-1])
        cos = inner / np.sqrt(norm2[1:] * norm2[:-1])
        rows += [{"group": group, "layers": f"{l + 1}->{l + 2}", "layer": l + 1,
                  "relative_change": float(d), "cosine": float(c)}
                 for l, (d, c) in enumerate(zip(diff, cos, strict=True))]
        figures[f"{group}_relative_change_median"] = float(np.median(diff))
        figures[f"{group}_cosine_median"] = float(np.median(cos))
    return _result("depth-smoothness", "How smoothly the weights vary with depth: "
                   "|theta_{l+1} - theta_l| / |theta_l| (sqrt(2) for unrelated weights).",
                   Evidence(None, figures, "descriptive (unrelated weights: 1.41)", rows), start)


# ============================================================================================
# Refinement consistency
# ============================================================================================


@eqx.filter_jit
def _flow_final(flow, config, x0, solver, steps_per_layer):
    ys = correspondence.flow_states(flow, config, x0, solver, throw=False,
                                    steps_per_layer=steps_per_layer)
    return ys


def refinement(
    loaded: LoadedModel, windows: np.ndarray, substeps: Sequence[int] = (2, 4, 8),
    schemes: Sequence[str] = ("heun", "rk4"), progress: Callable[[str], None] | None = None,
) -> ClaimResult:
    """The model's own flow integrated more finely: ``m`` Euler sub-steps per layer (the
    block's splitting, each sub-step ``h / m``) and Heun / RK4 per layer on ``F_A + F_F``
    (every stage reads that layer's weights). For each scheme: the next-token loss and its
    change from the model's, the share of top-1 predictions that stay the same, and the
    median relative change ``|x_L' - x_L| / |x_L|`` of the final hidden states (position 0 left
    out), with the same change per layer in the rows. ``euler x1`` is the model itself solved
    as a flow (its change is round-off)."""
    start = time.perf_counter()
    lm, config = loaded.model, loaded.config
    if not config.lm_head:
        return _result("refinement", "Refinement needs a language-model head.",
                       Evidence(None, {"skipped": "no LM head (an encoder)"}, "skipped"), start)
    try:
        correspondence.check_supported(config)
    except ValueError as err:  # e.g. a pre-LayerNorm decoder (GPT-2): no flow to refine
        return _result("refinement", "Refinement needs a model to_flow can express.",
                       Evidence(None, {"skipped": str(err)}, "skipped"), start)
    flow = correspondence.to_flow(config, layer_params(lm.transformer))
    tokens, targets = jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])
    states = _hidden_states(lm, tokens)  # (L + 1, W, n, d)
    base_nll, base_top = (np.asarray(a) for a in final_scores(lm, states[-1], targets))
    base = np.asarray(states[1:, :, 1:], np.float64)
    runs = [("euler x1", None, 1, 1)] + [(f"euler x{m}", None, m, m) for m in substeps]
    if config.block == "parallel":
        parallel = None
    else:
        parallel = dataclasses.replace(config, block="parallel")
    for s in schemes:
        method = catalogue.get(s)
        runs.append((f"{s} x1", method.ambient, 1, method.evaluations_per_step))
    rows, per_layer, finals = [], [], {}
    for name, solver, m, evaluations in runs:
        # Heun / RK4 integrate the sum field F_A + F_F (the ODE every splitting converges to)
        cfg = config if solver is None or parallel is None else parallel
        ys = _flow_final(flow, cfg, states[0], solver, m)
        if not bool(jnp.all(jnp.isfinite(ys[-1]))):
            raise FloatingPointError(f"the {name} solve of the model's flow produced NaN")
        nll, top = (np.asarray(a) for a in final_scores(lm, ys[-1], targets))
        change = (np.linalg.norm(np.asarray(ys[:, :, 1:], np.float64) - base, axis=-1)
                  / np.linalg.norm(base, axis=-1))
        finals[name] = np.asarray(ys[-1, :, 1:], np.float64)
        rows.append({"scheme": name, "evaluations_per_layer": evaluations,
                     "loss": float(nll.mean()), "loss_change": float(nll.mean() - base_nll.mean()),
                     "top1_same": float(np.mean(top == base_top)),
                     "final_change_median": float(np.median(change[-1])),
                     "final_change_p90": float(np.percentile(change[-1], 90))})
        per_layer += [{"scheme": name, "layer": l + 1, "change_median": float(np.median(c))}
                      for l, c in enumerate(change)]
        if progress:
            progress(name)
    figures = {"loss_model": float(base_nll.mean()),
               "loss_perplexity_model": float(np.exp(base_nll.mean()))}
    for row in rows:
        key = row["scheme"].replace(" ", "_")
        figures[f"loss_change_{key}"] = row["loss_change"]
        figures[f"final_change_{key}"] = row["final_change_median"]
    # Richardson: in the asymptotic regime of a first-order method, |x_2m - x_m| halves as m
    # doubles (ratio 2). Far from it (steps too large for the ODE), the ratio is ~1 or erratic.
    ms = [1, *substeps]
    ratios = []
    for a, b, c in zip(ms, ms[1:], ms[2:], strict=False):
        if b == 2 * a and c == 2 * b:
            d1 = np.median(np.linalg.norm(finals[f"euler x{b}"] - finals[f"euler x{a}"], axis=-1))
            d2 = np.median(np.linalg.norm(finals[f"euler x{c}"] - finals[f"euler x{b}"], axis=-1))
            ratios.append(float(d1 / d2))
    figures["richardson_ratios"] = ratios
    exact = rows[0]["final_change_median"]
    return _result(
        "refinement", "Refining the model's own flow (Euler sub-steps, Heun, RK4 per layer) "
        "changes the next-token loss and the final states by (rows); a model whose depth "
        "solves its ODE would change little, by ratios near 2 per halving of the step.",
        Evidence(None, {**figures, "euler_x1_change": exact}, "descriptive", rows + per_layer),
        start)


# ============================================================================================
# The step-size sweep and the lens
# ============================================================================================


def _alpha_sweep(loaded: LoadedModel, windows: np.ndarray, options: AlphaOptions
                 ) -> ClaimResult:
    """:func:`.alpha_sweep.alpha_sweep`, or a skipped result for a model it cannot
    sweep (an encoder, a post-norm stack, a model ``to_flow`` refuses)."""
    start = time.perf_counter()
    try:
        return alpha_sweep(loaded, windows, options)
    except ValueError as err:
        return _result("alpha-sweep", "The step-size sweep needs a causal pre-norm language "
                       "model that is exactly its flow.",
                       Evidence(None, {"skipped": str(err)}, "skipped"), start)


def lens(loaded: LoadedModel, windows: np.ndarray, top_k: int = 5) -> ClaimResult:
    """The model read layer by layer (:mod:`svflow_jax.transformer.lens`) on the first window:
    the logit lens after every sub-step (rows ``kind="lens"``: state, next-token loss, the
    top-1 token of the last position) and the direct-logit decomposition of the target tokens'
    logits (rows ``kind="component"``: mean and mean absolute contribution over the positions).
    Figures: the loss of the embedding and of the model, the components with the largest
    mean absolute contribution, and ``remainder``, the largest ``|logits - sum of parts|``
    (contributions, the final Norm's bias, the head's bias) relative to the largest
    ``|logit|``, beside ``remainder_bound``, the round-off that sum may carry in the model's
    dtype (:func:`~svflow_jax.transformer.lens.decompose_logits`): ``remainder_is_roundoff``
    says which side it falls."""
    start = time.perf_counter()
    lm = loaded.model
    statement = ("Every sub-step's contribution to the prediction: the logit lens, and the "
                 "logits split exactly into the embedding's and each branch's parts.")
    try:
        tokens, targets = jnp.asarray(windows[0, :-1]), jnp.asarray(windows[0, 1:])
        readout = logit_lens(lm, tokens, targets, top_k=top_k)
        eps = None
        if jnp.dtype(lm.config.param_dtype) == jnp.float32:  # TF32 products on a GPU
            eps = 2 * precision_in_force()["float32_unit_roundoff"]
        dec = decompose_logits(lm, tokens, targets[:, None], eps=eps)
    except ValueError as err:  # post-norm, or no LM head
        return _result("lens", statement, Evidence(None, {"skipped": str(err)}, "skipped"),
                       start)
    loss = np.asarray(readout.loss, float)
    top1 = np.asarray(readout.top_ids[:, -1, 0])
    decode = getattr(loaded.tokenizer, "decode", None)
    rows: list[dict[str, Any]] = [
        {"kind": "lens", "state": i, "label": label, "loss": float(loss[i]),
         "top1_last_position": decode([int(top1[i])]) if decode else int(top1[i])}
        for i, label in enumerate(readout.labels)]
    contrib = np.asarray(dec.contributions[..., 0], float)  # (components, n)
    rows += [{"kind": "component", "component": name, "mean": float(contrib[k].mean()),
              "mean_abs": float(np.abs(contrib[k]).mean())}
             for k, name in enumerate(dec.names)]
    largest = np.argsort(-np.abs(contrib).mean(1))[:3]
    figures = {"loss_embedding": float(loss[0]), "loss_model": float(loss[-1]),
               "largest_components": [dec.names[k] for k in largest],
               "remainder": dec.remainder, "remainder_bound": dec.remainder_bound,
               "remainder_is_roundoff": dec.roundoff, "tokens": int(tokens.shape[0])}
    return _result("lens", statement, Evidence(None, figures, "exact to round-off", rows), start)


# ============================================================================================
# All together
# ============================================================================================


def progress_steps(loaded: LoadedModel, options: InspectOptions) -> int:
    """How many times :func:`inspect_model` calls ``progress``: once per measurement, and in
    the refinement study once per integration of the flow (the model itself, each Euler
    sub-step count, each scheme) when the model has a language-model head."""
    steps = 4 + (options.alpha is not None) + options.lens
    if not loaded.config.lm_head:
        return steps
    return steps + 1 + len(options.substeps) + len(options.schemes)


def inspect_model(
    loaded: LoadedModel, text: str, options: InspectOptions | None = None,
    progress: Callable[[str], None] | None = None, total: Callable[[int], None] | None = None,
) -> list[ClaimResult]:
    """Every measurement of this module on ``text``, in report order; ``progress(name)`` after
    each step, ``total(n)`` first with the number of steps (:func:`progress_steps`)."""
    options = options or InspectOptions()
    if total:
        total(progress_steps(loaded, options))
    windows = token_windows(loaded.tokenizer, text, options.windows, options.window)
    tokens = np.concatenate(windows[:, :-1])[: options.exactness_tokens]
    results = []
    for name, run in (("exactness", lambda: exactness(loaded, tokens)),
                      ("geometry", lambda: geometry(loaded, windows)),
                      ("depth-smoothness", lambda: depth_smoothness(loaded)),
                      ("refinement", lambda: refinement(loaded, windows, options.substeps,
                                                        options.schemes, progress)),
                      ("alpha-sweep", lambda: _alpha_sweep(loaded, windows, options.alpha)),
                      ("lens", lambda: lens(loaded, windows))):
        if (name == "alpha-sweep" and options.alpha is None) or (name == "lens"
                                                                 and not options.lens):
            continue
        results.append(run())
        if progress:
            progress(name)
    return results


def layer_groups(rows: list[dict[str, Any]], groups: int) -> list[dict[str, Any]]:
    """Per-layer rows averaged over ``groups`` contiguous groups of layers (numeric columns)."""
    layers = sorted({r["layer"] for r in rows})
    bounds = np.array_split(np.asarray(layers), min(groups, len(layers)))
    out = []
    for chunk in bounds:
        members = [r for r in rows if r["layer"] in set(chunk.tolist())]
        keys = [k for k, v in members[0].items() if isinstance(v, float)]
        out.append({"layers": f"{chunk[0]}-{chunk[-1]}",
                    **{k: float(np.mean([r[k] for r in members])) for k in keys}})
    return out
