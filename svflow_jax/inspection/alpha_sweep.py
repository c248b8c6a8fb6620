"""The step-size sweep on a real pre-norm model: ``y_{l+1} = y_l + alpha_l h F_l(y_l)``.

A pre-norm stack is exactly forward Euler with step ``h`` per layer of its flow ``dy/dt = F_t(y)``
(:func:`svflow_jax.bridge.correspondence.to_flow`). Its branch outputs are linear in the output maps
(attention ``W_O, b_O``; FFN ``W_down, b_down`` or ``W_out, b_out``, every expert's in a MoE), so
multiplying layer ``l``'s output maps by ``alpha_l`` multiplies its field by ``alpha_l``: the step
of layer ``l`` becomes ``alpha_l h`` with every stage still reading layer ``l``'s weights. The sweep
builds the model's flow once and scales the same maps in the flow's own parameters
(:func:`scale_field`; ``to_flow`` passes them through unchanged, the output bias divided by
``rho``), so each measurement runs the model and not the weight conversion. The same
scaled flow is then integrated, one step per layer, by the block's own scheme (``euler``: Euler for
a parallel block, Lie-Trotter of Euler steps for a sequential one) and by any method of the solver
catalogue with a step in ``R^d``: a splitting (``strang``, ...) splits the attention and FFN fields
of a sequential block, a single-field method (``heun``, ``midpoint``, ``rk4``, ...) integrates the
sum field ``F_A + F_F``.

:func:`alpha_sweep` measures the next-token loss (and perplexity) for a global ``alpha`` per
scheme, for one layer's ``alpha`` at a time (Euler: which layers' step sizes matter), and for
smooth linear profiles ``alpha_l = 1 + a (2 l / (L - 1) - 1)``. ``alpha`` is a traced array: one
compiled program per scheme serves every value.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from ..bridge import correspondence
from ..claims.core import ClaimResult, Evidence
from ..next_token import next_token_nll
from ..solvers import catalogue
from ..transformer import TransformerConfig, TransformerLM, layer_params
from ..transformer.lens import final_logits

__all__ = ["OUTPUT_MAPS", "AlphaOptions", "QUICK_ALPHA", "sweep_scheme_names", "scale_updates",
           "scale_field", "scheme_states", "final_scores", "unknown_methods", "alpha_sweep"]

#: The parameters each branch's output is linear in (layer-stacked, leading axis L).
OUTPUT_MAPS = ("wo", "bo", "w_down", "b_down", "w_out", "b_out")

@dataclasses.dataclass(frozen=True)
class AlphaOptions:
    """The grid of the sweep.

    Attributes:
        alphas: global step multipliers, for every scheme (must include 1).
        schemes: ``euler`` (the model's own scheme) and methods with a step in ``R^d``: names
            of the solver catalogue (:func:`sweep_scheme_names`) or ``package.module:Attr``.
        layer_alphas: multipliers applied to one layer at a time (Euler; 0 removes the layer).
        profiles: slopes ``a`` of the linear profiles ``1 + a (2 l / (L - 1) - 1)`` (Euler).
        windows: how many of the given text windows the sweep reads (the first ones; it
            integrates the flow about 150 times, so it reads fewer than the other studies).
    """

    alphas: tuple[float, ...] = (0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.5)
    schemes: tuple[str, ...] = ("euler", "strang", "heun", "midpoint", "rk4")
    layer_alphas: tuple[float, ...] = (0.0, 0.5, 1.5)
    profiles: tuple[float, ...] = (-0.4, -0.2, 0.2, 0.4)
    windows: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.windows, bool) or not isinstance(self.windows, int) or (
                self.windows < 1):
            raise ValueError(f"windows must be a positive integer, got {self.windows!r}")
        if 1.0 not in self.alphas:
            raise ValueError(f"alphas must include 1 (the model itself), got {self.alphas}")
        bad = [a for a in (*self.alphas, *self.layer_alphas)
               if not (isinstance(a, int | float) and 0 <= a <= 10)]
        if bad:
            raise ValueError(f"alphas must be numbers in [0, 10], got {bad}")
        unknown = unknown_methods(self.schemes, sweep_scheme_names(), splittings=True)
        if unknown:
            raise ValueError(f"schemes: unknown methods {unknown}; known: "
                             f"{sweep_scheme_names()}, or package.module:Attr of a method with "
                             "a step in R^d")


def sweep_scheme_names() -> list[str]:
    """``euler`` and every method of the solver catalogue with a step in ``R^d``."""
    return ["euler", *[n for n in catalogue.names(ambient=True) if n != "euler"]]


def unknown_methods(names: Sequence[str], known: Sequence[str], *, splittings: bool
                    ) -> list[str]:
    """The names of ``names`` that are neither in ``known`` nor an import path
    ``package.module:Attr`` (:func:`svflow_jax.solvers.catalogue.get`, the current folder
    searched first) of a method with a step in ``R^d`` (a single-field one unless
    ``splittings``). An import path that cannot be resolved raises its ``ValueError``, after
    ``"schemes: "`` (the field of the options that hold such names)."""
    out = []
    for name in names:
        if name in known:
            continue
        if isinstance(name, str) and ":" in name:
            try:
                method = catalogue.get(name)
            except ValueError as err:
                raise ValueError(f"schemes: {err}") from None
            if method.ambient is not None and (splittings or not method.is_splitting):
                continue
        out.append(name)
    return out


QUICK_ALPHA = AlphaOptions(alphas=(0.5, 1.0, 1.5), schemes=("euler", "heun", "rk4"),
                           layer_alphas=(0.0,), profiles=(0.2,))


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


def _scheme_config(config: TransformerConfig, scheme: str
                   ) -> tuple[TransformerConfig, Any, float]:
    """``(config the flow is stepped as, solver or None for the block's own, evaluations of
    the whole field per layer)`` of ``scheme``."""
    if scheme == "euler":
        return config, None, 1.0
    method = catalogue.get(scheme)
    if method.is_splitting:
        if config.block != "sequential":
            raise ValueError(f"scheme {scheme!r} splits attention and FFN: it needs a "
                             f"sequential block, the model's is {config.block!r}")
        return config, method.ambient, method.evaluations_per_step
    return (dataclasses.replace(config, block="parallel"), method.ambient,
            method.evaluations_per_step)


_to_flow = eqx.filter_jit(correspondence.to_flow)


@eqx.filter_jit
def _final_states(flow, scheme_config, solver, alpha, x0):
    return correspondence.flow_states(scale_field(flow, alpha), scheme_config, x0, solver,
                                      throw=False)[-1]


def scheme_states(config: TransformerConfig, params: dict[str, Array], x0: Array,
                  scheme: str, alpha: Float[Array, " L"],
                  flow: correspondence.LayerFlow | None = None) -> Array:
    """The final hidden states (before the final Norm) of the flow with layer steps
    ``alpha_l h``, integrated by ``scheme`` (one step per layer). ``flow``: the model's flow
    ``to_flow(config, params)`` when the caller already built it (a sweep builds it once)."""
    cfg, solver, _ = _scheme_config(config, scheme)
    flow = _to_flow(config, params) if flow is None else flow
    return _final_states(flow, cfg, solver, jnp.asarray(alpha, x0.dtype), x0)


@nnx.jit(graph_updates=False)  # reads the model: no state to write back
def final_scores(lm: TransformerLM, states: Array, targets: Array) -> tuple[Array, Array]:
    """The final Norm, the logits and the next-token negative log-likelihood
    (:func:`svflow_jax.next_token.next_token_nll`, the project's one next-token loss) of the
    last hidden ``states`` against ``targets``, and the argmax of each position: the one
    scoring of the inspection study and the step-size sweep."""
    logits = final_logits(lm, states)
    return next_token_nll(logits, targets), jnp.argmax(logits, axis=-1)


def _loss(lm, states: Array, targets: Array) -> float:
    """Mean next-token loss (nats, computed in float32) of the final ``states``."""
    return float(np.asarray(final_scores(lm, states, targets)[0], np.float64).mean())


def alpha_sweep(loaded, windows: np.ndarray, options: AlphaOptions | None = None,
                progress: Callable[[str], None] | None = None) -> ClaimResult:
    """Next-token loss of the model's flow with scaled steps (rows: ``kind`` = ``global``,
    ``layer`` or ``profile``; ``scheme``, ``alpha`` or ``layer``/``slope``, ``loss``,
    ``perplexity``, ``loss_change`` from the model's own loss). Figures: the model's loss, the
    best global ``alpha`` per scheme, and the layers whose one-layer change moves the loss
    most (largest ``|loss_change|`` over ``layer_alphas``)."""
    start = time.perf_counter()
    options = options or AlphaOptions()
    lm, config = loaded.model, loaded.config
    if not (config.lm_head and config.causal):
        raise ValueError("the alpha sweep scores next-token predictions: it needs a causal "
                         "language model (this checkpoint is an encoder)")
    correspondence.check_supported(config)
    if config.norm_position != "pre":
        raise ValueError("the alpha sweep scales the residual updates of a pre-norm model")
    schemes = [s for s in options.schemes if s == "euler" or config.block == "sequential"
               or not catalogue.get(s).is_splitting]
    params = layer_params(lm.transformer)
    flow = _to_flow(config, params)  # once: each measurement scales its output maps
    windows = windows[: options.windows]
    tokens, targets = jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])
    x0 = lm.embeddings(tokens)
    L = config.n_layers
    base = _loss(lm, lm.hidden_states(tokens)[-1], targets)
    rows: list[dict[str, Any]] = []

    def measure(scheme: str, steps: np.ndarray, **row) -> None:
        loss = _loss(lm, scheme_states(config, params, x0, scheme, steps, flow), targets)
        rows.append({**row, "scheme": scheme, "loss": loss, "perplexity": float(np.exp(loss)),
                     "loss_change": loss - base})

    for scheme in schemes:
        cost = _scheme_config(config, scheme)[2]
        for a in options.alphas:
            measure(scheme, np.full(L, a), kind="global", alpha=float(a),
                    evaluations_per_layer=cost)
        if progress:
            progress(f"alpha {scheme}")
    for layer in range(L):
        for a in options.layer_alphas:
            alpha = np.ones(L)
            alpha[layer] = a
            measure("euler", alpha, kind="layer", layer=layer + 1, alpha=float(a))
    if progress:
        progress("alpha layers")
    ramp = 2 * np.arange(L) / max(L - 1, 1) - 1
    for slope in options.profiles:
        measure("euler", 1 + slope * ramp, kind="profile", slope=float(slope))
    figures: dict[str, Any] = {"loss_model": base, "perplexity_model": float(np.exp(base)),
                               "tokens": int(tokens.size)}
    for scheme in schemes:
        glob = [r for r in rows if r["kind"] == "global" and r["scheme"] == scheme]
        best = min(glob, key=lambda r: r["loss"])
        figures[f"best_alpha_{scheme}"] = best["alpha"]
        figures[f"best_perplexity_{scheme}"] = best["perplexity"]
    effect = {}
    for r in rows:
        if r["kind"] == "layer":
            effect[r["layer"]] = max(effect.get(r["layer"], 0.0), abs(r["loss_change"]))
    figures["layers_that_matter_most"] = sorted(effect, key=effect.get, reverse=True)[:3]
    improving = [r for r in rows if r["kind"] == "layer" and r["loss_change"] < 0]
    figures["one_layer_changes_that_lower_the_loss"] = len(improving)
    evidence = Evidence(None, figures, "descriptive", rows)
    return ClaimResult(name="alpha-sweep", section="inspect",
                       statement="Next-token loss of the model's own flow with every layer's step "
                                 "scaled by alpha (globally, one layer at a time, linear "
                                 "profiles), integrated by Euler (the model at alpha = 1), the "
                                 "splittings and higher-order solvers, one step per layer.",
                       passed=None, figures=figures, tolerance=evidence.tolerance, rows=rows,
                       seconds=time.perf_counter() - start)
