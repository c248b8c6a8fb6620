"""A trainable causal language model whose stack is a solver: :class:`SolverLM` (Flax NNX).

The stack integrates ``dy/dt = v_t(y)`` on ``[0, T]`` with ``N`` equal steps of a design's solver
(:mod:`.design`); ``v_t = v_A + v_F`` is the attention field plus the FFN field of
:mod:`svflow_jax.flow`, whose weights are a path ``theta(t)`` through ``K`` anchors:

* ``weights="per_layer"``: ``theta(t) = theta_l`` on ``[l T/K, (l+1) T/K)``
  (:class:`~svflow_jax.flow.PiecewiseConstant`); every stage of a step inside layer ``l`` reads
  ``theta_l`` (:func:`~svflow_jax.solvers.within_step`). With ``N = K`` steps this is a
  Transformer with ``K`` layers of separate weights;
* ``weights="linear"``: the piecewise-linear path through ``theta_k`` at ``t_k = k T/(K-1)``;
* ``weights="chebyshev"``: the polynomial through ``theta_k`` at the Chebyshev points of
  ``[0, T]`` (C-infinity).

For the two continuous paths a stage at time ``t + c_i h`` reads ``theta(t + c_i h)``, so the
same weights run at any number of steps ``N`` (depth transfer, adaptive depth).

Dictionary with a Transformer of width ``d`` (``rho = sqrt(d)``), as in
:mod:`svflow_jax.bridge.correspondence`: the hidden state is ``x = rho y``; ``wq, wk`` of anchor
``k`` are the kernel embeddings of ``theta_k`` with concentration ``d / sqrt(d_head)``; ``wv,
wo`` the natural-parameter maps; the FFN ``w_in, w_out`` the relaxed score network
``s(y) = F(rho y) / rho``.

* post-norm (default): ``y0 = R(e)``, ``R(y) = y / |y|``, with ``e`` the token plus position
  embedding; the field is projected (``P_y u``) and the solver stays on the sphere (its
  retraction is the Norm); logits ``= rho y_T W_U [+ b]``.
* pre-norm: ``y0 = e / rho`` in ``R^d``; ``dy/dt = u_t(y / |y|)`` solved by the design's ambient
  method; logits ``= rho R(y_T) W_U [+ b]`` (the final Norm). With ``embed_norm``
  ``y0 = R(e)`` (a Norm on the embeddings, ``x0 = rho R(e)``): every token's state starts at
  unit length, so a first step ``h |u|`` is measured against 1, not against ``|e| / rho``
  (which weight decay keeps small). The field reads ``y / |y|`` either way, so the first
  block's branches are the same; what changes is the weight of the embedding in the sum.

* ``update="ngpt"`` (on the sphere): the normalised step of nGPT (Loshchilov et al., 2024,
  "nGPT: Normalized Transformer with Representation Learning on the Hypersphere"). Each branch
  ``u_X`` (attention, FFN) is normalised and the state moves towards it by learned
  per-dimension rates ``a_X(t)`` (``step_rates``, on the weight path like every weight): the
  field is ``f_X(y) = a_X(t) * (R(u_X(y)) - y)``, unprojected, so that one retracted Euler
  sub-step ``R(y + h f_X(y))`` is nGPT's update ``h <- Norm(h + alpha (Norm(h_X) - h))`` with
  ``alpha = h a_X`` (the Lie-Trotter design is nGPT's block). Its radial part only rescales
  the step, as in :class:`~svflow_jax.solvers.VariableStepRetractedEuler`: the flow is
  ``dy/dt = P_y f(y)``. The rates are stored as ``a / (a_0 sqrt(d))`` (nGPT's
  ``alpha_scale = 1/sqrt(d)``), ``a_0 = 1 / T`` at initialisation, i.e. ``alpha = 1/N``. Not
  included: nGPT's normalisation of the weight matrices and its ``s_qk, s_u, s_v, s_z`` scales.

With ``head_bias`` the head has a bias ``b`` (``unembed_bias``), which the trainer starts at the
log frequencies of the training tokens (:func:`svflow_jax.training.train`). Without it a
post-norm stack fits the unigram distribution, the first thing a language model learns, by
moving every token's state on the unit sphere to one point, and at learning rates of 1e-3 and
above it stays there (collapse: ``docs/results/layer-designs.md``).

The Euler post-norm design with per-layer weights and ``N = K`` IS the post-norm, parallel-block
:class:`~svflow_jax.transformer.TransformerLM` with projected branches, RMSNorm without gain or
epsilon and residual step ``T / K``: :meth:`SolverLM.transformer_config` and
:meth:`SolverLM.to_transformer` give that model with the same weights (tested).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from diffrax import MultiTerm, ODETerm
from flax import nnx
from jaxtyping import Array, Float, Int

from svflow_jax import sphere
from svflow_jax.flow import (
    AttentionField,
    AttentionParams,
    ChebyshevInterpolation,
    ExpertsField,
    ExpertsParams,
    LinearInterpolation,
    PiecewiseConstant,
    ScoreNetworks,
)
from svflow_jax.transformer import TransformerConfig, TransformerLM

from ..solvers import catalogue
from ..solvers.catalogue import Method
from .design import integrate
from .rules import check_norm_options

__all__ = ["DesignConfig", "SolverLM", "Update", "Weights"]

Weights = Literal["per_layer", "linear", "chebyshev"]
Update = Literal["residual", "ngpt"]


@dataclasses.dataclass(frozen=True)
class DesignConfig:
    """Everything that fixes a :class:`SolverLM` (weights aside).

    Attributes:
        design: a registered design name (see :data:`~svflow_jax.solvers.catalogue.CATALOGUE`),
            ``package.module:Attr``, or a :class:`~svflow_jax.solvers.catalogue.Method`.
        vocab_size: tokens (256 for bytes).
        context: the longest sequence (learned absolute positions).
        d_model, n_heads, d_head, d_ff: widths, as in a Transformer.
        num_steps: blocks ``N`` of the stack during training.
        num_anchors: weight anchors ``K`` (layers of weights).
        weights: ``"per_layer"``, ``"linear"`` or ``"chebyshev"`` (module docstring).
        duration: the depth-time ``T``; the step is ``h = T / N``.
        norm_position: ``"post"`` (on the sphere) or ``"pre"``.
        update: ``"residual"`` (the block adds ``h`` times its branches) or ``"ngpt"``
            (nGPT's normalised step with learned rates; post-norm only; module docstring).
        init_std: std of the normal initialiser of every weight matrix.
        head_bias: the head adds a bias ``unembed_bias (V,)`` to the logits (module docstring).
        embed_norm: the initial state is the normalised embedding ``R(e)`` instead of
            ``e / rho`` (module docstring; pre-norm only: post-norm starts there anyway).
        remat: rematerialise every block in the backward pass (``True``), only its
            elementwise work (``"dots"``: the matrix products are stored), or nothing
            (``False``); see :func:`~svflow_jax.designs.integrate`. The numbers are the same.
    """

    design: str | Method = "euler"
    vocab_size: int = 256
    context: int = 64
    d_model: int = 64
    n_heads: int = 4
    d_head: int = 16
    d_ff: int = 128
    num_steps: int = 8
    num_anchors: int = 8
    weights: Weights = "per_layer"
    duration: float = 8.0
    norm_position: Literal["post", "pre"] = "post"
    update: Update = "residual"
    init_std: float = 0.02
    head_bias: bool = False
    embed_norm: bool = False
    remat: bool | Literal["dots"] = True

    def __post_init__(self):
        for name in ("vocab_size", "context", "d_model", "n_heads", "d_head", "d_ff",
                     "num_steps", "num_anchors"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DesignConfig.{name} must be a positive int, got {value!r}")
        if self.weights not in ("per_layer", "linear", "chebyshev"):
            raise ValueError(f"weights must be 'per_layer', 'linear' or 'chebyshev', got "
                             f"{self.weights!r}")
        if self.weights != "per_layer" and self.num_anchors < 2:
            raise ValueError("continuous-in-depth weights need num_anchors >= 2")
        if not (isinstance(self.duration, int | float) and math.isfinite(self.duration)
                and self.duration > 0):
            raise ValueError(f"duration must be a finite positive number, got {self.duration!r}")
        if self.norm_position not in ("post", "pre"):
            raise ValueError(f"norm_position must be 'post' or 'pre', got {self.norm_position!r}")
        # an unknown design, or one without a pre-norm form
        catalogue.get(self.design, what="design").solver_for(self.norm_position)
        if self.remat not in (True, False, "dots"):
            raise ValueError(f"remat must be True, False or 'dots', got {self.remat!r}")
        if self.update not in ("residual", "ngpt"):
            raise ValueError(f"update must be 'residual' or 'ngpt', got {self.update!r}")
        check_norm_options(self.design, self.norm_position, self.update, self.embed_norm)

    @property
    def layer_design(self) -> Method:
        return catalogue.get(self.design, what="design")

    @property
    def radius(self) -> float:
        return math.sqrt(self.d_model)

    def replace(self, **changes) -> DesignConfig:
        return dataclasses.replace(self, **changes)


class _Field(eqx.Module):
    """A sum of flow fields as a diffrax vector field: ``P_y sum u`` on the sphere (post),
    ``sum u(y / |y|)`` in ``R^d`` (pre), or nGPT's ``sum a_X(t) * (R(u_X) - y)`` (ngpt, with
    ``rates`` the paths of ``a_X``). A module, so solvers can restrict its paths to a step."""

    parts: tuple
    kind: str = eqx.field(static=True)
    rates: tuple = ()

    def __call__(self, t, y, args):
        if self.kind == "post":
            return sphere.project_tangent(y, sum(f.drift(t, y) for f in self.parts))
        if self.kind == "ngpt":
            return sum(a(t) * (sphere.retract(f.drift(t, y)) - y)
                       for f, a in zip(self.parts, self.rates, strict=True))
        z = sphere.retract(y)
        return sum(f.drift(t, z) for f in self.parts)


def _normal(rngs: nnx.Rngs, std: float, shape) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32))


class SolverLM(nnx.Module):
    """Embeddings -> the design's solver on ``[0, T]`` -> LM head (module docstring).

    Parameters (``K`` anchors): ``embed (V, d)``, ``pos_embed (P, d)``, ``unembed (d, V)``,
    ``wq (K, d, H, k)``, ``wk``, ``wv (K, d, H, k)``, ``wo (K, H, k, d)``, ``w_in (K, d, f)``,
    ``w_out (K, f, d)``: the names and layouts of
    :func:`svflow_jax.transformer.layer_params`; with ``head_bias`` also ``unembed_bias (V,)``;
    with ``update="ngpt"`` also ``step_rates (K, 2, d)`` (attention, FFN; module docstring).
    """

    def __init__(self, config: DesignConfig, *, rngs: nnx.Rngs):
        self.config = config
        c, K, s = config, config.num_anchors, config.init_std
        self.embed = _normal(rngs, s, (c.vocab_size, c.d_model))
        self.pos_embed = _normal(rngs, s, (c.context, c.d_model))
        self.unembed = _normal(rngs, s, (c.d_model, c.vocab_size))
        self.wq = _normal(rngs, s, (K, c.d_model, c.n_heads, c.d_head))
        self.wk = _normal(rngs, s, (K, c.d_model, c.n_heads, c.d_head))
        self.wv = _normal(rngs, s, (K, c.d_model, c.n_heads, c.d_head))
        self.wo = _normal(rngs, s, (K, c.n_heads, c.d_head, c.d_model))
        self.w_in = _normal(rngs, s, (K, c.d_model, c.d_ff))
        self.w_out = _normal(rngs, s, (K, c.d_ff, c.d_model))
        self.unembed_bias = (nnx.Param(jnp.zeros((c.vocab_size,), jnp.float32))
                             if c.head_bias else None)
        self.step_rates = (nnx.Param(jnp.full((K, 2, c.d_model), c.d_model ** -0.5,
                                              jnp.float32))
                           if c.update == "ngpt" else None)

    # ---------------------------------------------------------------------------- the flow

    def _path(self, anchors):
        c = self.config
        if c.weights == "per_layer":
            return PiecewiseConstant(anchors, c.duration / c.num_anchors)
        if c.weights == "linear":
            return LinearInterpolation(anchors, c.duration / (c.num_anchors - 1))
        return ChebyshevInterpolation(anchors, 0.0, float(c.duration))

    def fields(self) -> tuple[AttentionField, ExpertsField]:
        """The attention and FFN fields ``v_A``, ``v_F`` on the unit sphere."""
        c = self.config
        K = c.num_anchors
        kappa = jnp.full((K, c.n_heads), c.d_model / math.sqrt(c.d_head), jnp.float32)
        attention = AttentionParams(
            kernel_query=self.wq[...], kernel_key=self.wk[...], concentration=kappa,
            natural_in=self.wv[...], natural_out=self.wo[...])
        nets = ScoreNetworks(w1=self.w_in[...][:, None], w2=self.w_out[...][:, None],
                             activation="gelu")
        return (AttentionField(self._path(attention), causal=True),
                ExpertsField(self._path(ExpertsParams(experts=nets)), radius=c.radius))

    def rates(self) -> tuple | None:
        """nGPT's rates ``a_A(t), a_F(t)`` (per unit of depth-time) as paths, or ``None``."""
        if self.step_rates is None:
            return None
        c = self.config
        a = self.step_rates[...] * (math.sqrt(c.d_model) / c.duration)
        return self._path(a[:, 0]), self._path(a[:, 1])

    def terms(self):
        """The diffrax term(s) the solver integrates: one field, or ``MultiTerm(A, F)`` for a
        splitting."""
        attention, experts = self.fields()
        rates = self.rates()
        kind = ("ngpt" if rates is not None else
                "post" if self.config.norm_position == "post" else "pre")
        rate_a, rate_f = ((), ()) if rates is None else ((rates[0],), (rates[1],))
        if self.config.layer_design.is_splitting:
            return MultiTerm(ODETerm(_Field((attention,), kind, rate_a)),
                             ODETerm(_Field((experts,), kind, rate_f)))
        return ODETerm(_Field((attention, experts), kind, rate_a + rate_f))

    # ---------------------------------------------------------------------------- forward

    def embeddings(self, tokens: Int[Array, "... n"]) -> Float[Array, "... n d"]:
        n = tokens.shape[-1]
        if n > self.config.context:
            raise ValueError(f"sequence of {n} tokens exceeds the context {self.config.context}")
        return jnp.take(self.embed[...], tokens, axis=0) + self.pos_embed[...][:n]

    def initial_state(self, tokens: Int[Array, "... n"]) -> Float[Array, "... n d"]:
        e = self.embeddings(tokens)
        c = self.config
        return sphere.retract(e) if c.norm_position == "post" or c.embed_norm else e / c.radius

    def head(self, y: Float[Array, "... n d"]) -> Float[Array, "... n V"]:
        """Logits from the final state (pre-norm: after the final Norm)."""
        if self.config.norm_position == "pre":
            y = sphere.retract(y)
        logits = jnp.einsum("...nd,dv->...nv", self.config.radius * y, self.unembed[...])
        return logits if self.unembed_bias is None else logits + self.unembed_bias[...]

    def final_state(
        self, tokens: Int[Array, "... n"], *, num_steps: int | None = None
    ) -> Float[Array, "... n d"]:
        """The state ``y_T`` the head reads (pre-norm: before the final Norm), after
        ``num_steps`` blocks (default: the trained depth)."""
        c = self.config
        steps = c.num_steps if num_steps is None else num_steps
        solver = c.layer_design.solver_for(c.norm_position)
        return integrate(solver, self.terms(), self.initial_state(tokens), 0.0, c.duration,
                         steps, remat=c.remat)

    def __call__(
        self, tokens: Int[Array, "... n"], *, num_steps: int | None = None
    ) -> Float[Array, "... n V"]:
        """Next-token logits ``(..., n, V)``; ``num_steps`` overrides the trained depth."""
        return self.head(self.final_state(tokens, num_steps=num_steps))

    # ---------------------------------------------------------------------------- bridge

    def transformer_config(self) -> TransformerConfig:
        """The :class:`TransformerConfig` this model equals when the design is Euler with
        per-layer weights and ``num_steps == num_anchors`` (``"lie-trotter"``: the sequential
        block; ``"strang"``: the macaron block). Post-norm: projected branches; pre-norm:
        standard branches and a final Norm."""
        c = self.config
        if c.update != "residual":
            raise ValueError("a SolverLM with nGPT's normalised step (update='ngpt') has no "
                             "TransformerLM equivalent")
        if c.embed_norm:
            raise ValueError("a pre-norm SolverLM with embed_norm (a Norm on the embeddings) "
                             "has no TransformerLM equivalent")
        post = c.norm_position == "post"
        block = c.layer_design.block
        return TransformerConfig(
            d_model=c.d_model, n_layers=c.num_anchors, n_heads=c.n_heads, d_head=c.d_head,
            d_ff=c.d_ff, norm_position=c.norm_position, block=block,
            residual_scale=c.duration / c.num_anchors, project_branches=post, norm="rms",
            norm_eps=0.0, norm_gain=False, causal=True, ffn="gelu", vocab_size=c.vocab_size,
            n_positions=c.context, lm_head=True, tie_embeddings=False, head_bias=c.head_bias)

    def to_transformer(self) -> TransformerLM:
        """A :class:`TransformerLM` holding this model's weights (see
        :meth:`transformer_config`). The flow's weights are mapped by the correspondence
        layer (:func:`svflow_jax.bridge.correspondence.to_transformer_params`), the one place that
        speaks both vocabularies; only the embeddings and the head are this model's own."""
        from svflow_jax.bridge.correspondence import LayerFlow, to_transformer_params
        from svflow_jax.transformer import set_embedding_params, set_layer_params

        c = self.config
        config = self.transformer_config()
        attention, experts = self.fields()
        flow = LayerFlow(attention=attention, experts=experts, passthrough={},
                         step=c.duration / c.num_anchors, num_layers=c.num_anchors,
                         radius=c.radius)
        lm = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
        set_layer_params(lm.transformer, to_transformer_params(flow, config))
        head = {"unembed": self.unembed[...]}
        if self.unembed_bias is not None:
            head["unembed_bias"] = self.unembed_bias[...]
        set_embedding_params(lm, {"embed": self.embed[...], "pos_embed": self.pos_embed[...],
                                  **head})
        return lm
