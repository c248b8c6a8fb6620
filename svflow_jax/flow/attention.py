"""Multi-head attention as SVFlow: a vMF-kernel posterior times vMF scores.

For token ``i`` the latent is ``z = (h, j)``: a head ``h`` and a context position ``j``
(``j <= i`` when causal). Head ``h`` compares tokens in a ``k``-dimensional embedding with a
von Mises-Fisher kernel of concentration ``kappa_h``; the posterior over context positions is

    q(j | x_i, h) = softmax_j( kappa_h <x_i A_h, x_j B_h> )              (posterior)

and position ``j`` explains ``x`` by a vMF likelihood whose natural parameter is a linear image
of ``x_j``,

    eta_{h j} = x_j N_h M_h,   grad_x log p(x | h, j) = eta_{h j}          (Euclidean score)

so the field is the posterior expectation of the Riemannian scores ``P_x eta``:

    v(x_i) = sum_h sum_j q(j | x_i, h) P_{x_i} eta_{h j}.

Heads are a factorised latent whose log-likelihoods add, so their scores add (a sum over h,
not an average). The posterior over the n tokens in context is a kernel-smoothed Monte Carlo
estimate of the posterior over the continuous latent.

Row-vector convention: a point is a row ``x`` of shape ``(d,)`` and maps act on the right.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Real

from .field import VectorField, _check_tokens
from .paths import Constant, ParameterPath

__all__ = ["AttentionParams", "AttentionField", "attention_posterior", "natural_parameters"]


class AttentionParams(eqx.Module):
    """Parameters of the vMF-kernel posterior and of the scores, for ``H`` heads.

    Attributes:
        kernel_query: ``A`` of shape ``(d, H, k)``: embeds the token being explained.
        kernel_key: ``B`` of shape ``(d, H, k)``: embeds the context tokens.
        concentration: ``kappa`` of shape ``(H,)``: the kernel's concentration per head.
        natural_in: ``N`` of shape ``(d, H, r)``.
        natural_out: ``M`` of shape ``(H, r, d)``; ``eta_{hj} = x_j N_h M_h`` is the natural
            parameter (mean direction times concentration) of component ``(h, j)``.
    """

    kernel_query: Float[Array, "d H k"]
    kernel_key: Float[Array, "d H k"]
    concentration: Float[Array, " H"]
    natural_in: Float[Array, "d H r"]
    natural_out: Float[Array, "H r d"]

    @property
    def dim(self) -> int:
        return self.kernel_query.shape[-3]

    @property
    def num_heads(self) -> int:
        return self.concentration.shape[-1]

    def check(self) -> AttentionParams:
        """Raises a ValueError if the shapes are inconsistent; returns ``self``."""
        d, H, k = self.kernel_query.shape
        expected = {
            "kernel_key": (d, H, k),
            "concentration": (H,),
            "natural_in": (d, H, self.natural_in.shape[-1]),
            "natural_out": (H, self.natural_in.shape[-1], d),
        }
        for name, shape in expected.items():
            if getattr(self, name).shape != shape:
                raise ValueError(
                    f"AttentionParams.{name} has shape {getattr(self, name).shape}, expected "
                    f"{shape} (d={d}, H={H}, k={k})"
                )
        return self

    @classmethod
    def random(
        cls, key, d: int, num_heads: int, head_dim: int, concentration: float = 1.0,
        scale: float = 1.0, dtype=None,
    ) -> AttentionParams:
        """Gaussian parameters with unit-variance projections (times ``scale``)."""
        dtype = dtype if dtype is not None else jnp.result_type(float)
        k1, k2, k3, k4 = jax.random.split(key, 4)
        std_in = scale / jnp.sqrt(d)
        std_out = scale / jnp.sqrt(num_heads * head_dim)
        shape = (d, num_heads, head_dim)
        return cls(
            kernel_query=std_in * jax.random.normal(k1, shape, dtype),
            kernel_key=std_in * jax.random.normal(k2, shape, dtype),
            concentration=jnp.full((num_heads,), concentration, dtype),
            natural_in=std_in * jax.random.normal(k3, shape, dtype),
            natural_out=std_out * jax.random.normal(k4, (num_heads, head_dim, d), dtype),
        )


def causal_context(n: int) -> Bool[Array, "n n"]:
    """``mask[i, j] = j <= i``: token i may be explained by tokens up to itself."""
    return jnp.tril(jnp.ones((n, n), dtype=bool))


def attention_posterior(
    params: AttentionParams, x: Float[Array, "... n d"], causal: bool = False
) -> Float[Array, "... H n n"]:
    """``q[..., h, i, j] = q(j | x_i, h)``, the vMF-kernel posterior over context positions."""
    # kappa_h scales the query embedding (n H k products) rather than the kernel (H n^2).
    kappa = params.concentration[:, None, None]
    a = kappa * jnp.einsum("...nd,dhk->...hnk", x, params.kernel_query)
    b = jnp.einsum("...nd,dhk->...hnk", x, params.kernel_key)
    log_kernel = jnp.einsum("...hik,...hjk->...hij", a, b)
    if causal:
        n = x.shape[-2]
        # Mask by a large negative finite number, not -inf: the diagonal is always in context,
        # so every row keeps a finite maximum and no 0 * inf appears in gradients.
        log_kernel = jnp.where(causal_context(n), log_kernel, jnp.finfo(log_kernel.dtype).min)
    return jax.nn.softmax(log_kernel, axis=-1)


def natural_parameters(
    params: AttentionParams, x: Float[Array, "... n d"]
) -> Float[Array, "... H n d"]:
    """``eta[..., h, j] = x_j N_h M_h``: the Euclidean score of component ``(h, j)``."""
    hidden = jnp.einsum("...nd,dhr->...hnr", x, params.natural_in)
    return jnp.einsum("...hnr,hrd->...hnd", hidden, params.natural_out)


def expected_score(
    posterior: Float[Array, "... H n n"], eta: Float[Array, "... H n d"]
) -> Float[Array, "... n d"]:
    """``sum_h sum_j q(j | x_i, h) eta_{h j}``: expectation over the latent ``(h, j)``."""
    return jnp.einsum("...hij,...hjd->...id", posterior, eta)


def expected_natural_parameter(
    params: AttentionParams, posterior: Float[Array, "... H n n"], x: Float[Array, "... n d"]
) -> Float[Array, "... n d"]:
    """``E_q[eta] = sum_h (sum_j q(j | x_i, h) x_j N_h) M_h``, the same expectation as
    :func:`expected_score` of :func:`natural_parameters`, in a cheaper order.

    ``eta_{hj} = x_j N_h M_h`` is linear in ``x_j``, so the posterior average can be taken in the
    ``r``-dimensional space of ``x_j N_h`` before mapping to R^d with ``M_h``: ``O(H n^2 r)``
    work instead of ``O(H n^2 d)`` (the field is evaluated at every solver stage).
    """
    hidden = jnp.einsum("...nd,dhr->...hnr", x, params.natural_in)
    averaged = jnp.einsum("...hij,...hjr->...hir", posterior, hidden)
    return jnp.einsum("...hir,hrd->...id", averaged, params.natural_out)


class AttentionField(VectorField):
    """The attention field ``v_t(x_i) = P_{x_i} E_{q_t((h, j) | x_i)}[eta_{h j}]``.

    Args:
        params: a :class:`~svflow_jax.flow.paths.ParameterPath` returning
            :class:`AttentionParams` (or an ``AttentionParams``, taken as constant in time).
        causal: restrict the context of token i to positions ``j <= i``.
    """

    params: ParameterPath
    causal: bool = eqx.field(static=True, default=False)

    def __init__(self, params: ParameterPath | AttentionParams, causal: bool = False):
        if isinstance(params, AttentionParams):
            params = Constant(params.check())
        self.params = params
        self.causal = bool(causal)

    def drift(self, t: Real[Array, ""], x: Float[Array, "... n d"]) -> Float[Array, "... n d"]:
        theta = self.params(t)
        _check_tokens(x, theta.dim, "AttentionField")
        # The einsums promote to the wider of state and parameter dtypes; cast the parameters
        # so that a float32 state stays float32 (and float64 stays float64).
        theta = jax.tree.map(lambda a: a.astype(x.dtype), theta)
        return expected_natural_parameter(theta, attention_posterior(theta, x, self.causal), x)
