"""Mixture of experts and dense FFN as SVFlow: a router posterior times relaxed scores.

The latent is an expert ``e``. The router is a categorical posterior

    q(e | x) = softmax_e( x W_r )          (top-k: renormalised over k selected experts)

and expert ``e`` supplies a *relaxed* score ``s_e(x)``: a network that plays the role of
``grad log p(x | e)`` without being constrained to be the gradient of a log-density. The field is

    v(x) = P_x sum_e q(e | x) s_e(x).

A dense FFN is one expert with ``q = 1``.

Networks trained on the sphere of radius ``rho`` (RMSNorm without gain puts tokens on the sphere
of radius ``sqrt(d)``) are pulled back to the unit sphere: ``s(u) = net(rho u) / rho`` and the
router sees ``rho u``. ``rho`` is a fixed property of the score network, not a learned weight.

Top-k routing keeps exactly ``k`` experts: the ``k`` largest router logits, ties broken towards
the LOWER expert index, and renormalises the softmax over them:

    S_k(x) = the first k indices of the experts sorted by (logit descending, index ascending),
    q(e | x) = exp(l_e) / sum_{e' in S_k} exp(l_e')  for e in S_k,  0 otherwise.

This is the rule of ``jax.lax.top_k`` and of the Transformer's MoE block, so both sides route a
token with tied logits to the same experts. (Ties have probability zero for continuous inputs,
but they do occur: duplicated router columns, zero router weights, low-precision logits.)

Top-k routing makes the field only piecewise smooth: it jumps where the k-th and (k+1)-th router
scores cross. Order tests of higher-order solvers belong on dense routing (``top_k=None``).
See ``docs/theory.md``, "Mixture of experts and FFN".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Real

from .field import VectorField, _check_tokens
from .paths import Constant, ParameterPath

__all__ = ["ScoreNetworks", "RouterPosterior", "ExpertsParams", "ExpertsField", "router_posterior"]

Activation = Literal["gelu", "swiglu"]
Nonlinearity = Literal["gelu", "gelu_tanh", "silu"]
_PHI: dict[str, Callable[[Array], Array]] = {
    "gelu": lambda a: jax.nn.gelu(a, approximate=False),
    "gelu_tanh": lambda a: jax.nn.gelu(a, approximate=True),
    "silu": jax.nn.silu,
}


class ScoreNetworks(eqx.Module):
    """``E`` relaxed score networks ``s_e: R^d -> R^d``, stacked on a leading expert axis.

    ``gelu``: ``s_e(x) = phi(x W1_e + b1_e) W2_e + b2_e``, ``phi`` the exact (erf) GELU.
    ``swiglu``: ``s_e(x) = (phi(x W1_e + b1_e) * (x W3_e + b3_e)) W2_e + b2_e``, ``phi`` SiLU.

    ``phi`` overrides the nonlinearity: ``"gelu"`` (erf), ``"gelu_tanh"`` (the tanh
    approximation, GPT-2's and Gemma's) or ``"silu"``; a gated network with a GELU is GeGLU.
    The offsets ``b1, b3 (E, f)``, ``b2 (E, d)`` are optional (``None``: zero).
    """

    w1: Float[Array, "E d f"]
    w2: Float[Array, "E f d"]
    w3: Float[Array, "E d f"] | None = None
    activation: Activation = eqx.field(static=True, default="gelu")
    phi: Nonlinearity | None = eqx.field(static=True, default=None)
    b1: Float[Array, "E f"] | None = None
    b2: Float[Array, "E d"] | None = None
    b3: Float[Array, "E f"] | None = None

    def __check_init__(self):
        if self.activation not in ("gelu", "swiglu"):
            raise ValueError(f"unknown activation {self.activation!r}; use 'gelu' or 'swiglu'")
        if (self.activation == "swiglu") != (self.w3 is not None):
            raise ValueError("the 'swiglu' score networks need w3 (and 'gelu' must not have it)")
        if self.phi is not None and self.phi not in _PHI:
            raise ValueError(f"unknown phi {self.phi!r}; use one of {sorted(_PHI)}")

    @property
    def nonlinearity(self) -> Nonlinearity:
        """``phi``, else the network's own: erf-GELU (``gelu``) or SiLU (``swiglu``)."""
        if self.phi is not None:
            return self.phi
        return "gelu" if self.activation == "gelu" else "silu"

    @property
    def num_experts(self) -> int:
        return self.w1.shape[-3]

    @property
    def dim(self) -> int:
        return self.w1.shape[-2]

    def _hidden(self, x: Array, project: Callable[[Array, Array, Array | None], Array]) -> Array:
        """``phi(x W1 + b1)`` or ``phi(x W1 + b1) * (x W3 + b3)``, with ``project(x, W, b)``
        the affine map."""
        hidden = _PHI[self.nonlinearity](project(x, self.w1, self.b1))
        if self.activation == "gelu":
            return hidden
        return hidden * project(x, self.w3, self.b3)

    def single(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        """The score of the only expert (``E = 1``), without an expert axis (plain matmuls)."""
        def affine(a, w, b):
            return a @ w[0] if b is None else a @ w[0] + b[0]
        return affine(self._hidden(x, affine), self.w2, self.b2)

    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... E d"]:
        """Every expert's score at ``x``."""
        def affine(a, w, b):
            out = jnp.einsum("...d,edf->...ef", a, w)
            return out if b is None else out + b
        hidden = self._hidden(x, affine)
        out = jnp.einsum("...ef,efd->...ed", hidden, self.w2)
        return out if self.b2 is None else out + self.b2


def router_posterior(
    logits: Float[Array, "... E"], top_k: int | None
) -> Float[Array, "... E"]:
    """``q(e | x) = softmax(logits)``, renormalised over ``top_k`` selected experts (others 0).

    Renormalising the softmax over a subset equals the softmax of the subset's logits.
    Selection (the rule of the Transformer's MoE block): the ``top_k`` largest logits, ties
    broken towards the LOWER expert index (``jax.lax.top_k``), so exactly ``top_k`` experts get
    a non-zero weight, whatever the ties.
    """
    num_experts = logits.shape[-1]
    if top_k is None or top_k >= num_experts:
        return jax.nn.softmax(logits, axis=-1)
    _, top = jax.lax.top_k(logits, top_k)  # indices; equal values: the lower index first
    selected = jnp.any(top[..., :, None] == jnp.arange(num_experts), axis=-2)
    # finfo.min (not -inf) keeps every row's maximum finite; exp then underflows to 0.
    masked = jnp.where(selected, logits, jnp.finfo(logits.dtype).min)
    return jnp.where(selected, jax.nn.softmax(masked, axis=-1), 0.0)


class RouterPosterior(eqx.Module):
    """Router weights ``W_r`` of shape ``(d, E)``: ``q(e | x) = softmax(x W_r)``."""

    weight: Float[Array, "d E"]


class ExpertsParams(eqx.Module):
    """Score networks plus an optional router (``None``: one expert with ``q = 1``)."""

    experts: ScoreNetworks
    router: RouterPosterior | None = None

    def __check_init__(self):
        if self.router is None and self.experts.num_experts != 1:
            raise ValueError(
                f"{self.experts.num_experts} experts need a router; only a single expert "
                "(a dense FFN) may go without one"
            )
        # Trailing axes only: stacked (per-layer) parameters carry a leading anchor axis.
        if self.router is not None and self.router.weight.shape[-2:] != (
            self.experts.dim, self.experts.num_experts
        ):
            raise ValueError(
                f"router weight has shape {self.router.weight.shape}, expected "
                f"{(self.experts.dim, self.experts.num_experts)}"
            )

    @classmethod
    def random(
        cls, key, d: int, hidden: int, num_experts: int = 1, activation: Activation = "gelu",
        scale: float = 1.0, dtype=None,
    ) -> ExpertsParams:
        """Gaussian parameters; a router only when ``num_experts > 1``."""
        dtype = dtype if dtype is not None else jnp.result_type(float)
        k1, k2, k3, k4 = jax.random.split(key, 4)
        std1, std2 = scale / jnp.sqrt(d), scale / jnp.sqrt(hidden)
        e = num_experts
        experts = ScoreNetworks(
            w1=std1 * jax.random.normal(k1, (e, d, hidden), dtype),
            w2=std2 * jax.random.normal(k2, (e, hidden, d), dtype),
            w3=std1 * jax.random.normal(k3, (e, d, hidden), dtype)
            if activation == "swiglu" else None,
            activation=activation,
        )
        router = (
            RouterPosterior(jax.random.normal(k4, (d, e), dtype)) if num_experts > 1 else None
        )
        return cls(experts=experts, router=router)


class ExpertsField(VectorField):
    """``v_t(x) = P_x E_{q_t(e | x)}[s_e(x)]``: a mixture of experts, or a dense FFN.

    Args:
        params: a path returning :class:`ExpertsParams` (or one ``ExpertsParams``, constant).
        top_k: keep the ``top_k`` most probable experts (``None``: dense softmax routing).
        radius: the sphere radius ``rho`` the networks and router were trained on (1 for a
            native flow, ``sqrt(d)`` for a Transformer with RMSNorm).
    """

    params: ParameterPath
    top_k: int | None = eqx.field(static=True, default=None)
    radius: float = eqx.field(static=True, default=1.0)

    def __init__(
        self, params: ParameterPath | ExpertsParams, top_k: int | None = None,
        radius: float = 1.0,
    ):
        if isinstance(params, ExpertsParams):
            params = Constant(params)
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
        if not radius > 0:
            raise ValueError(f"the sphere radius must be positive, got {radius}")
        self.params = params
        self.top_k = top_k
        self.radius = float(radius)

    def drift(self, t: Real[Array, ""], x: Float[Array, "... n d"]) -> Float[Array, "... n d"]:
        theta = jax.tree.map(lambda a: a.astype(x.dtype), self.params(t))
        _check_tokens(x, theta.experts.dim, "ExpertsField")
        y = self.radius * x
        if theta.router is None:  # a dense FFN: one expert, q = 1 (no expert axis to carry)
            return theta.experts.single(y) / self.radius
        scores = theta.experts(y) / self.radius  # (..., n, E, d)
        posterior = router_posterior(y @ theta.router.weight, self.top_k)
        return jnp.einsum("...e,...ed->...d", posterior, scores)
