"""The step-size sweep on a real pre-norm model: ``y_{l+1} = y_l + alpha_l h F_l(y_l)``.

A pre-norm stack is exactly forward Euler with step ``h`` per layer of its flow ``dy/dt = F_t(y)``
(:func:`svflow_jax.bridge.correspondence.to_flow`). Its branch outputs are linear in the output maps
(attention ``W_O, b_O``; FFN ``W_down, b_down`` or ``W_out, b_out``, every expert's in a MoE), so
multiplying layer ``l``'s output maps by ``alpha_l`` multiplies its field by ``alpha_l``: the step
of layer ``l`` becomes ``alpha_l h`` with every stage still reading layer ``l``'s weights. The sweep
builds the model's flow once and scales the same maps in the flow's own parameters
(:func:`scale_field`; ``to_flow`` passes them through unchanged, the output bias divided by
``rho``), so each measurement runs the model and not the weight conversion.

A sequential block is a Lie-Trotter splitting of Euler sub-steps (attention, then FFN), so a
"method" changes two things that must be told apart: the *structure* (how the two fields are
combined: sequential, parallel ``F_A + F_F``, macaron) and the *method* (the sub-step). Every
method of the sweep (:func:`sweep_schemes`) is therefore measured in two variants:

* ``split``: the method's steps inside the model's own structure (for a sequential block:
  Lie-Trotter of the method's sub-steps, attention then FFN); only the method changes;
* ``sum``: the method on the sum field ``F_A + F_F`` (a parallel block); for ``euler`` this is
  the control that changes the structure alone.

A splitting of the catalogue (``strang``: half FFN, attention, half FFN) is measured as
published (``split``) and with its two fields exchanged (``swapped``: half attention, FFN, half
attention; :class:`svflow_jax.solvers.Swapped`). Every row says what it changes relative to the
model (``changes``: ``none``, ``method``, ``structure`` or ``structure and method``).

What "order" means here: a method of order ``p`` has a global error ``O(h^p)`` as ``h -> 0`` on a
smooth field. The sweep takes *one* step of size ``alpha h`` (``h = 1``) per layer of a field
whose coefficients jump at every layer boundary: no limit ``h -> 0`` is taken, so the order says
nothing about which method lands closer to the model, or to any solution. Each variant is
simply another map ``y_l -> y_{l+1}``; the model's weights were trained for exactly one of
them.

:func:`alpha_sweep` measures the next-token loss (and perplexity, with a Student-t interval over
the text windows) for a global ``alpha`` per scheme, for one layer's ``alpha`` at a time (the
model's scheme: which layers' step sizes matter), and for linear profiles ``alpha_l = 1 + a (2 l
/ (L - 1) - 1)``; the derivative ``d loss / d alpha_l`` at ``alpha = 1`` for every layer in one
backward pass (:func:`layer_derivative`); and, with ``fit_steps``, a per-layer profile fitted by
gradient descent on the sweep's windows and scored on held-out text (:func:`fit_profile`).
``alpha`` is a traced array: one compiled program per scheme serves every value.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Float

from ..bridge import correspondence
from ..claims.core import ClaimResult, Evidence
from ..diagnose.stats import spearman
from ..fitting import t_quantile
from ..next_token import next_token_nll
from ..solvers import LieTrotter, Strang, Swapped, WithinStep, catalogue
from ..transformer import TransformerConfig, TransformerLM, layer_params
from ..transformer.lens import final_logits
from .config import QUICK_ALPHA, AlphaOptions, sweep_scheme_names, unknown_methods

__all__ = ["OUTPUT_MAPS", "LEVEL", "STRUCTURES", "SWAPPED_STRUCTURES", "HELDOUT_NOVELS",
           "HELDOUT_FROM", "AlphaOptions", "QUICK_ALPHA", "Scheme", "sweep_scheme_names",
           "sweep_schemes", "scale_updates", "scale_field", "scheme_states", "final_scores",
           "window_losses", "window_interval", "unknown_methods", "layer_derivative",
           "inverse_sqrt_profile", "linear_profile", "heldout_windows", "fit_profile",
           "sweep_figures", "alpha_sweep"]

#: The parameters each branch's output is linear in (layer-stacked, leading axis L).
OUTPUT_MAPS = ("wo", "bo", "w_down", "b_down", "w_out", "b_out")

#: Confidence level of the intervals over windows.
LEVEL = 0.95


# ============================================================================================
# The schemes: (method, variant), and what each changes relative to the model
# ============================================================================================

#: How each block combines the attention field A and the FFN field F in one layer.
STRUCTURES = {"sequential": "sequential: A then F", "parallel": "parallel: A + F",
              "macaron": "macaron: F/2, A, F/2"}
#: The same with the two fields exchanged (:class:`svflow_jax.solvers.Swapped`).
SWAPPED_STRUCTURES = {"sequential": "sequential: F then A", "macaron": "macaron: A/2, F, A/2"}


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One integration of the scaled flow, one step per layer.

    Attributes:
        name: ``method/variant`` (``euler/split`` is the model).
        method: the catalogue method (or import path).
        variant: ``split`` (inside the model's structure), ``sum`` (on ``F_A + F_F``) or
            ``swapped`` (a splitting with its two fields exchanged).
        structure: how the layer combines A and F (:data:`STRUCTURES`).
        changes: relative to the model: ``none``, ``method``, ``structure`` or ``structure and
            method``.
        config: the configuration the flow is stepped as (its block).
        solver: the solver given to :func:`~svflow_jax.bridge.correspondence.flow_states`
            (``None``: the block's own, Euler sub-steps).
        evaluations: field evaluations per layer (one attention plus one FFN sub-layer = 1).
    """

    name: str
    method: str
    variant: str
    structure: str
    changes: str
    config: TransformerConfig
    solver: Any
    evaluations: float


def _changes(structure: bool, method: bool) -> str:
    return {(False, False): "none", (False, True): "method", (True, False): "structure",
            (True, True): "structure and method"}[(structure, method)]


def _is_euler_step(solver: Any) -> bool:
    inner = solver.solver if isinstance(solver, WithinStep) else solver
    return type(inner) is diffrax.Euler


def _splitting(block: str, substep: Any) -> Any:
    return {"sequential": LieTrotter(substep), "macaron": Strang(substep)}[block]


def sweep_schemes(config: TransformerConfig, names: Sequence[str]) -> list[Scheme]:
    """The schemes of the sweep for a model of ``config``, in order: for a single-field method
    its ``split`` variant (the method's steps inside the model's block: Lie-Trotter of its
    sub-steps for a sequential block, Strang for a macaron one, the method itself for a
    parallel one) and, unless the block is parallel (where the two coincide), its ``sum``
    variant (the method on ``F_A + F_F``; ``euler/sum`` is the parallel-Euler control); for a
    splitting (two fields; not for a parallel model) its catalogue ordering (``split``) and
    the two fields exchanged (``swapped``)."""
    model = STRUCTURES[config.block]
    out = []
    for name in names:
        method = catalogue.get(name)
        cost = float(method.evaluations_per_step)
        if method.is_splitting:
            if config.block == "parallel":
                continue
            splitting = method.ambient
            same_method = _is_euler_step(splitting.substep)
            for variant, solver, structure in (
                    ("split", splitting, STRUCTURES[method.block]),
                    ("swapped", Swapped(splitting), SWAPPED_STRUCTURES[method.block])):
                out.append(Scheme(f"{name}/{variant}", name, variant, structure,
                                  _changes(structure != model, not same_method), config,
                                  solver, cost))
            continue
        euler = _is_euler_step(method.ambient)
        split = None if euler else (method.ambient if config.block == "parallel"
                                    else _splitting(config.block, method.ambient))
        out.append(Scheme(f"{name}/split", name, "split", model, _changes(False, not euler),
                          config, split, cost))
        if config.block != "parallel":
            out.append(Scheme(f"{name}/sum", name, "sum", STRUCTURES["parallel"],
                              _changes(True, not euler),
                              dataclasses.replace(config, block="parallel"), method.ambient,
                              cost))
    return out


# ============================================================================================
# Scaling the field, integrating it, scoring it
# ============================================================================================


def scale_updates(params: dict[str, Array], alpha: Float[Array, " L"]) -> dict[str, Array]:
    """Layer ``l``'s output maps multiplied by ``alpha[l]`` (its field by ``alpha[l]``)."""
    out = dict(params)
    for name in OUTPUT_MAPS:
        if name in params:
            out[name] = _per_layer(params[name], alpha)
    return out


def _per_layer(w: Array, alpha: Float[Array, " L"]) -> Array:
    """``w`` (leading axis: the layers) with layer ``l``'s slice multiplied by ``alpha[l]``."""
    return w * jnp.reshape(alpha, (-1,) + (1,) * (w.ndim - 1)).astype(w.dtype)


def scale_field(flow: correspondence.LayerFlow, alpha: Float[Array, " L"]
                ) -> correspondence.LayerFlow:
    """:func:`scale_updates` on the flow's side: layer ``l``'s attention output map
    (``natural_out``, ``score_offset``) and its experts' output map (``w2``, ``b2``) multiplied
    by ``alpha[l]``, so ``scale_field(to_flow(c, p), a)`` is ``to_flow(c, scale_updates(p, a))``
    (the field of layer ``l`` times ``alpha[l]``) without converting the weights again."""
    def scaled(w: Array | None) -> Array | None:
        return None if w is None else _per_layer(w, alpha)

    attention = flow.attention.params.anchors
    experts = flow.experts.params.anchors.experts
    return eqx.tree_at(
        lambda f: (f.attention.params.anchors.natural_out, f.attention.params.anchors.score_offset,
                   f.experts.params.anchors.experts.w2, f.experts.params.anchors.experts.b2),
        flow, (scaled(attention.natural_out), scaled(attention.score_offset),
               scaled(experts.w2), scaled(experts.b2)), is_leaf=lambda x: x is None)


_to_flow = eqx.filter_jit(correspondence.to_flow)


@eqx.filter_jit
def _final_states(flow, scheme_config, solver, alpha, x0):
    return correspondence.flow_states(scale_field(flow, alpha), scheme_config, x0, solver,
                                      throw=False)[-1]


def _model_scheme(config: TransformerConfig) -> Scheme:
    return Scheme("euler/split", "euler", "split", STRUCTURES[config.block], "none", config,
                  None, 1.0)


def scheme_states(config: TransformerConfig, params: dict[str, Array], x0: Array,
                  scheme: str | Scheme, alpha: Float[Array, " L"],
                  flow: correspondence.LayerFlow | None = None) -> Array:
    """The final hidden states (before the final Norm) of the flow with layer steps
    ``alpha_l h``, integrated by ``scheme`` (one step per layer): a :class:`Scheme` of
    :func:`sweep_schemes`, or its name (``"euler"`` or ``"euler/split"``: the model;
    ``"heun/sum"``, ``"strang/swapped"``, ...; a bare method name is its ``sum`` variant for a
    single-field method, as before the variants, and its ``split`` one for a splitting).
    ``flow``: the model's flow ``to_flow(config, params)`` when the caller already built it (a
    sweep builds it once)."""
    if isinstance(scheme, str):
        scheme = _named_scheme(config, scheme)
    flow = _to_flow(config, params) if flow is None else flow
    return _final_states(flow, scheme.config, scheme.solver, jnp.asarray(alpha, x0.dtype), x0)


def _named_scheme(config: TransformerConfig, name: str) -> Scheme:
    if name in ("euler", "euler/split"):
        return _model_scheme(config)
    method, _, variant = name.rpartition("/") if "/" in name else (name, "", "")
    if not variant:
        variant = "split" if catalogue.get(method).is_splitting else "sum"
    for scheme in sweep_schemes(config, [method]):
        if scheme.variant == variant:
            return scheme
    if variant == "sum" and config.block == "parallel":  # the split variant is the sum
        return sweep_schemes(config, [method])[0]
    raise ValueError(f"scheme {name!r}: {method!r} has no variant {variant!r} for a "
                     f"{config.block} block")


def _loss_dtype(dtype) -> Any:
    """The dtype the loss is computed in: float32, or float64 for a float64 model."""
    return jnp.promote_types(dtype, jnp.float32)


@nnx.jit(graph_updates=False)  # reads the model: no state to write back
def final_scores(lm: TransformerLM, states: Array, targets: Array) -> tuple[Array, Array]:
    """The final Norm, the logits and the next-token negative log-likelihood
    (:func:`svflow_jax.next_token.next_token_nll`, the project's one next-token loss; in float32,
    or float64 for a float64 model) of the last hidden ``states`` against ``targets``, and the
    argmax of each position: the one scoring of the inspection study and the step-size
    sweep."""
    logits = final_logits(lm, states)
    return (next_token_nll(logits, targets, _loss_dtype(states.dtype)),
            jnp.argmax(logits, axis=-1))


def window_losses(lm: TransformerLM, states: Array, targets: Array) -> np.ndarray:
    """Mean next-token loss (nats) of each window (leading axis) of the final ``states``."""
    nll = np.asarray(final_scores(lm, states, targets)[0], np.float64)
    return nll.reshape(nll.shape[0], -1).mean(axis=1)


def window_interval(values: Sequence[float] | np.ndarray, level: float = LEVEL
                    ) -> tuple[float, float, float]:
    """``(mean, low, high)``: the two-sided ``level`` Student-t interval of the mean of
    ``values`` (one per window), ``mean +- t_{(1 + level) / 2, W - 1} s / sqrt(W)``; NaN bounds
    for a single window. The windows are consecutive stretches of one text, so they are
    treated as independent draws of a window's mean loss: an approximation (neighbouring
    windows share a topic), stated as such."""
    v = np.asarray(values, np.float64)
    mean = float(v.mean())
    if v.size < 2:
        return mean, math.nan, math.nan
    half = t_quantile((1 + level) / 2, v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return mean, mean - half, mean + half


def _loss_row(per_window: np.ndarray, base: np.ndarray) -> dict[str, float]:
    """Loss, perplexity and its interval over windows, and the change from the model's loss
    with its paired interval (the same windows)."""
    loss, low, high = window_interval(per_window)
    change, change_low, change_high = window_interval(per_window - base)
    return {"loss": loss, "perplexity": math.exp(loss), "perplexity_low": math.exp(low),
            "perplexity_high": math.exp(high), "loss_change": change,
            "loss_change_low": change_low, "loss_change_high": change_high}


# ============================================================================================
# The derivative d loss / d alpha_l, the profiles, the fit
# ============================================================================================


@eqx.filter_jit
def _loss_and_grad(graphdef, state, flow, config, alpha, x0, targets):
    """The mean next-token loss of the model's flow with layer steps ``alpha_l h`` and its
    gradient with respect to ``alpha`` (one forward and one backward pass)."""
    lm = nnx.merge(graphdef, state)

    def loss(a):
        ys = correspondence.flow_states(scale_field(flow, a), config, x0, None,
                                        throw=False)[-1]
        return next_token_nll(final_logits(lm, ys), targets, _loss_dtype(ys.dtype)).mean()

    return jax.value_and_grad(loss)(alpha)


class _Objective:
    """The model's loss as a function of the per-layer ``alpha`` on fixed windows."""

    def __init__(self, lm: TransformerLM, config: TransformerConfig,
                 flow: correspondence.LayerFlow, x0: Array, targets: Array):
        self.graphdef, self.state = nnx.split(lm)
        self.flow, self.config, self.x0, self.targets = flow, config, x0, targets

    def __call__(self, alpha) -> tuple[Array, Array]:
        return _loss_and_grad(self.graphdef, self.state, self.flow, self.config,
                              jnp.asarray(alpha, self.x0.dtype), self.x0, self.targets)


def layer_derivative(lm: TransformerLM, config: TransformerConfig, x0: Array, targets: Array,
                     flow: correspondence.LayerFlow | None = None,
                     alpha: Float[Array, " L"] | None = None) -> np.ndarray:
    """``d loss / d alpha_l`` at ``alpha`` (default: 1, the model) for every layer ``l``, by one
    backward pass through the model's flow (``jax.grad`` over the per-layer ``alpha``
    vector); ``loss`` is the mean next-token loss over the windows ``x0 -> targets``, as the
    sweep measures it. At ``alpha = 1``, ``-d loss / d alpha_l`` is the first-order
    prediction of the change that removing layer ``l`` (``alpha_l = 0``) makes."""
    flow = _to_flow(config, layer_params(lm.transformer)) if flow is None else flow
    at = np.ones(config.n_layers) if alpha is None else alpha
    return np.asarray(_Objective(lm, config, flow, x0, targets)(at)[1], np.float64)


def linear_profile(slope: float, layers: int) -> np.ndarray:
    """``alpha_l = 1 + slope (2 (l - 1) / (L - 1) - 1)`` for layers ``l = 1..L``: from
    ``1 - slope`` at the first layer to ``1 + slope`` at the last, mean 1."""
    return 1 + slope * (2 * np.arange(layers) / max(layers - 1, 1) - 1)


def inverse_sqrt_profile(layers: int) -> np.ndarray:
    """``alpha_l`` proportional to ``1 / sqrt(l)``, ``l = 1..L``, normalised to mean 1 (a
    schedule that shrinks the later layers' steps, as ``1 / sqrt(depth)`` initialisations do)."""
    a = 1 / np.sqrt(np.arange(1, layers + 1))
    return a / a.mean()


#: Where the held-out windows come from: the novels of ``svflow_jax.data.austen_novels`` other
#: than *Emma* (the default inspection text), from this character on (past the title pages).
HELDOUT_NOVELS = ("pride_and_prejudice", "sense_and_sensibility", "mansfield_park",
                  "northanger_abbey", "persuasion")
HELDOUT_FROM = 5000


def heldout_windows(tokenizer: Any, windows: int, window: int) -> tuple[np.ndarray, list[str]]:
    """``windows`` windows of ``window + 1`` token ids of held-out text: taken in turn from the
    five Austen novels other than *Emma* (:data:`HELDOUT_NOVELS`; the ``k``-th window of a
    novel is its ``k``-th consecutive window from character :data:`HELDOUT_FROM` on), with the
    novel each came from."""
    from ..data import austen_novels

    novels = austen_novels()
    per_novel = -(-windows // len(HELDOUT_NOVELS))
    chunks = {}
    for name in HELDOUT_NOVELS:
        text = novels[name][HELDOUT_FROM: HELDOUT_FROM + 8 * per_novel * (window + 1)]
        ids = np.asarray(tokenizer.encode(text).ids, np.int32)
        if ids.size < per_novel * window + 1:
            raise ValueError(f"held-out text of {name}: {ids.size} tokens, need "
                             f"{per_novel * window + 1}")
        chunks[name] = ids
    out, names = [], []
    for k in range(windows):
        name = HELDOUT_NOVELS[k % len(HELDOUT_NOVELS)]
        j = k // len(HELDOUT_NOVELS)
        out.append(chunks[name][j * window: (j + 1) * window + 1])
        names.append(name)
    return np.stack(out), names


def fit_profile(objective: Callable[[np.ndarray], tuple[Array, Array]], layers: int,
                steps: int, rate: float) -> tuple[np.ndarray, list[float]]:
    """One ``alpha`` per layer fitted by Adam (optax, learning rate ``rate``, ``steps`` steps,
    from ``alpha = 1``) to minimise ``objective`` (``alpha -> (loss, gradient)``); returns the
    fitted ``alpha`` and the loss before each step and after the last."""
    optimiser = optax.adam(rate)
    alpha = jnp.ones(layers)
    state = optimiser.init(alpha)
    history = []
    for _ in range(steps):
        loss, grad = objective(np.asarray(alpha))
        history.append(float(loss))
        updates, state = optimiser.update(jnp.asarray(grad, alpha.dtype), state, alpha)
        alpha = optax.apply_updates(alpha, updates)
    history.append(float(objective(np.asarray(alpha))[0]))
    return np.asarray(alpha, np.float64), history


# ============================================================================================
# The sweep
# ============================================================================================


def _top(values: dict[int, float], k: int = 3) -> list[int]:
    """The ``k`` keys of the largest values (ties: the lower key first)."""
    return sorted(values, key=lambda layer: (-values[layer], layer))[:k]


def sweep_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures read off the sweep's rows: per scheme the best global ``alpha`` (the argmin
    of the loss over the grid) and its perplexity; the layers whose one-layer changes move the
    loss most (largest ``|loss_change|`` over the one-layer alphas) and the number of one-layer
    changes that lower it; with removal rows (``alpha_l = 0``) and derivative rows, the three
    layers that matter most by each (largest ``|change|``, largest ``|d loss / d alpha_l|``) and
    the Spearman rank correlations of the derivative with the removal effect (signed: ``-d loss
    / d alpha_l``, the first-order prediction of the removal, against the removal's change;
    magnitudes: the two importance rankings); the slope of the best linear profile."""
    figures: dict[str, Any] = {"best_alpha": {}, "best_perplexity": {}}
    glob = [r for r in rows if r["kind"] == "global"]
    for scheme in dict.fromkeys(r["scheme"] for r in glob):
        best = min((r for r in glob if r["scheme"] == scheme), key=lambda r: r["loss"])
        figures["best_alpha"][scheme] = best["alpha"]
        figures["best_perplexity"][scheme] = best["perplexity"]
    effect: dict[int, float] = {}
    layer_rows = [r for r in rows if r["kind"] == "layer"]
    for r in layer_rows:
        effect[r["layer"]] = max(effect.get(r["layer"], 0.0), abs(r["loss_change"]))
    figures["layers_that_matter_most"] = _top(effect)
    figures["one_layer_changes_that_lower_the_loss"] = sum(r["loss_change"] < 0
                                                           for r in layer_rows)
    removal = {r["layer"]: r["loss_change"] for r in layer_rows if r["alpha"] == 0.0}
    derivative = {r["layer"]: r["derivative"] for r in rows if r["kind"] == "derivative"}
    if removal:
        figures["layers_by_removal"] = _top({k: abs(v) for k, v in removal.items()})
    if derivative:
        figures["layers_by_derivative"] = _top({k: abs(v) for k, v in derivative.items()})
    if removal and derivative and len(removal) >= 2:
        layers = sorted(removal)
        g = np.array([derivative[k] for k in layers])
        d = np.array([removal[k] for k in layers])
        figures["spearman_derivative_removal"] = float(spearman(-g, d))
        figures["spearman_importance"] = float(spearman(np.abs(g), np.abs(d)))
    profiles = [r for r in rows if r["kind"] == "profile"]
    if profiles:
        figures["best_profile_slope"] = min(profiles, key=lambda r: r["loss"])["slope"]
    return figures


def alpha_sweep(loaded, windows: np.ndarray, options: AlphaOptions | None = None,
                progress: Callable[[str], None] | None = None) -> ClaimResult:
    """Next-token loss of the model's flow with scaled steps. Rows (``kind``):

    * ``global``: ``scheme`` (``method/variant``), ``method``, ``variant``, ``structure``,
      ``changes`` (relative to the model), ``evaluations_per_layer``, ``alpha``;
    * ``layer``: ``layer``, ``alpha`` (that layer's alone; the model's scheme);
    * ``profile``: ``slope``, ``alpha_first``, ``alpha_last`` (the ramp's ends);
    * ``derivative``: ``layer``, ``derivative`` (``d loss / d alpha_l`` at 1) and, when the
      one-layer alphas include 0, ``removal_change``;
    * with ``fit_steps``: ``fit`` (``profile``: model, global 0.9, 1/sqrt(l), fitted;
      ``text``: training or held-out) and ``fitted_alpha`` (``layer``, ``alpha``).

    The first four carry ``loss``, ``perplexity`` with ``perplexity_low`` and
    ``perplexity_high`` (the Student-t interval of the mean loss over the windows,
    :func:`window_interval`, as perplexities), and ``loss_change`` from the model's loss with
    its paired interval over the same windows. Figures: :func:`sweep_figures`, the model's
    loss (also per window) and perplexity with its interval, the derivative's seconds, the
    fit's figures."""
    start = time.perf_counter()
    options = options or AlphaOptions()
    lm, config = loaded.model, loaded.config
    if not (config.lm_head and config.causal):
        raise ValueError("the alpha sweep scores next-token predictions: it needs a causal "
                         "language model (this checkpoint is an encoder)")
    correspondence.check_supported(config)
    if config.norm_position != "pre":
        raise ValueError("the alpha sweep scales the residual updates of a pre-norm model")
    schemes = sweep_schemes(config, options.schemes)
    params = layer_params(lm.transformer)
    flow = _to_flow(config, params)  # once: each measurement scales its output maps
    windows = windows[: options.windows]
    tokens, targets = jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])
    x0 = lm.embeddings(tokens)
    L = config.n_layers
    base = window_losses(lm, lm.hidden_states(tokens)[-1], targets)
    rows: list[dict[str, Any]] = []
    model = _model_scheme(config)

    def measure(scheme: Scheme, steps: np.ndarray, **row) -> dict[str, Any]:
        states = _final_states(flow, scheme.config, scheme.solver,
                               jnp.asarray(steps, x0.dtype), x0)
        rows.append({**row, "scheme": scheme.name, **_loss_row(
            window_losses(lm, states, targets), base)})
        return rows[-1]

    for scheme in schemes:
        for a in options.alphas:
            measure(scheme, np.full(L, a), kind="global", method=scheme.method,
                    variant=scheme.variant, structure=scheme.structure, changes=scheme.changes,
                    evaluations_per_layer=scheme.evaluations, alpha=float(a))
        if progress:
            progress(f"alpha {scheme.name}")
    for layer in range(L):
        for a in options.layer_alphas:
            alpha = np.ones(L)
            alpha[layer] = a
            measure(model, alpha, kind="layer", layer=layer + 1, alpha=float(a))
    if progress:
        progress("alpha layers")
    for slope in options.profiles:
        alpha = linear_profile(slope, L)
        measure(model, alpha, kind="profile", slope=float(slope),
                alpha_first=float(alpha[0]), alpha_last=float(alpha[-1]))
    objective = _Objective(lm, config, flow, x0, targets)
    tick = time.perf_counter()
    derivative = np.asarray(objective(np.ones(L))[1], np.float64)
    derivative_seconds = time.perf_counter() - tick
    removal = {r["layer"]: r["loss_change"] for r in rows
               if r["kind"] == "layer" and r["alpha"] == 0.0}
    rows += [{"kind": "derivative", "layer": l + 1, "derivative": float(g),
              **({"removal_change": removal[l + 1]} if removal else {})}
             for l, g in enumerate(derivative)]
    figures: dict[str, Any] = {"loss_model": float(base.mean()),
                               "loss_model_windows": [float(b) for b in base],
                               "perplexity_model": math.exp(float(base.mean())),
                               "tokens": int(tokens.size), "windows": int(windows.shape[0])}
    _, low, high = window_interval(base)
    figures["perplexity_model_interval"] = [math.exp(low), math.exp(high)]
    figures["derivative_seconds"] = derivative_seconds
    if options.fit_steps:
        fit_rows, fit_figures = _fit(loaded, objective, flow, windows.shape, options, progress)
        rows += fit_rows
        figures.update(fit_figures)
    figures.update(sweep_figures(rows))
    evidence = Evidence(None, figures, "descriptive", rows)
    return ClaimResult(name="alpha-sweep", section="inspect",
                       statement="Next-token loss of the model's own flow with every layer's step "
                                 "scaled by alpha (globally, one layer at a time, linear "
                                 "profiles; its derivative per layer), integrated one step per "
                                 "layer by each method inside the model's own block structure "
                                 "(split) and on the sum field (sum), with the parallel-Euler "
                                 "control and both Strang orderings.",
                       passed=None, figures=figures, tolerance=evidence.tolerance, rows=rows,
                       seconds=time.perf_counter() - start)


def _fit(loaded, objective: _Objective, flow, shape: tuple[int, ...], options: AlphaOptions,
         progress: Callable[[str], None] | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The fitted profile (:func:`fit_profile` on the sweep's windows) and, on as many
    held-out windows of the same length (:func:`heldout_windows`), the model, the global
    ``alpha = 0.9``, the ``1 / sqrt(l)`` profile and the fitted one."""
    lm, config = loaded.model, loaded.config
    L = config.n_layers
    tick = time.perf_counter()
    fitted, history = fit_profile(objective, L, options.fit_steps, options.fit_rate)
    fit_seconds = time.perf_counter() - tick
    held, novels = heldout_windows(loaded.tokenizer, shape[0], shape[1] - 1)
    h_tokens, h_targets = jnp.asarray(held[:, :-1]), jnp.asarray(held[:, 1:])
    h_x0 = lm.embeddings(h_tokens)
    profiles = {"model": np.ones(L), "global 0.9": np.full(L, 0.9),
                "1/sqrt(l)": inverse_sqrt_profile(L), "fitted": fitted}
    rows: list[dict[str, Any]] = []
    for text, x0, targets in (("training", objective.x0, objective.targets),
                              ("held-out", h_x0, h_targets)):
        per = {name: window_losses(lm, _final_states(flow, config, None,
                                                     jnp.asarray(a, x0.dtype), x0), targets)
               for name, a in profiles.items()}
        for name in profiles:
            rows.append({"kind": "fit", "profile": name, "text": text,
                         **_loss_row(per[name], per["model"])})
    rows += [{"kind": "fitted_alpha", "layer": l + 1, "alpha": float(a)}
             for l, a in enumerate(fitted)]
    held_fit = next(r for r in rows if r["text"] == "held-out" and r["profile"] == "fitted")
    if progress:
        progress("alpha fit")
    figures = {"fit_steps": options.fit_steps, "fit_rate": options.fit_rate,
               "fit_seconds": fit_seconds, "fit_training_loss": history,
               "fit_heldout_novels": sorted(set(novels)),
               "fit_heldout_loss_change": held_fit["loss_change"],
               "fit_heldout_loss_change_interval": [held_fit["loss_change_low"],
                                                    held_fit["loss_change_high"]],
               "fit_heldout_perplexity_ratio": math.exp(held_fit["loss_change"]),
               "fit_heldout_perplexity_ratio_interval": [
                   math.exp(held_fit["loss_change_low"]),
                   math.exp(held_fit["loss_change_high"])]}
    return rows, figures
