"""Multi-head attention as SVFlow: a vMF-kernel posterior times vMF scores.

Head ``h`` compares tokens in a ``k``-dimensional embedding with a von Mises-Fisher kernel of
concentration ``kappa_h``. For token ``i`` and head ``h`` the posterior over the context
positions ``j`` (``j <= i`` when causal) is

    q_h(j | x_i) = softmax_j( kappa_h <x_i A_h, x_j B_h> )              (posterior)

and position ``j`` explains ``x`` by a vMF likelihood whose natural parameter is a linear image
of ``x_j``,

    eta_{h j} = x_j N_h M_h,   grad_x log p(x | h, j) = eta_{h j}          (Euclidean score)

so the field is the posterior expectation of the Riemannian scores ``P_x eta``:

    v(x_i) = sum_h sum_j q_h(j | x_i) P_{x_i} eta_{h j}.

Why heads ADD. The latent of token ``i`` is one context position PER HEAD,
``z = (j_1, ..., j_H)``, with the factorised (product) posterior
``q(z | x_i) = prod_h q_h(j_h | x_i)`` and the likelihood
``p(x | z) proportional to exp(sum_h eta_{h j_h} . x)``, a vMF whose natural parameter is
``sum_h eta_{h j_h}``. Its score is ``sum_h eta_{h j_h}``, and the expectation under the
product posterior is ``sum_h sum_j q_h(j | x_i) eta_{h j}`` exactly: one weight distribution per
head, each summing to one over ``j``. A single joint latent ``z = (h, j)`` would instead have
ONE distribution summing to one over all pairs ``(h, j)`` (for instance ``q(h) q_h(j | x_i)``
with ``q(h) = 1/H``), and its expected score would AVERAGE the heads' scores, ``1/H`` times the
sum. A Transformer sums its heads (``sum_h o_h W_O^h``), so the product latent is the one it
implements.

When the softmax is a Bayes posterior. As a density in ``x_i``, the kernel of component
``(h, j)`` is ``exp(x_i . m_{hj})`` with ``m_{hj} = kappa_h x_j B_h A_h^T`` (for a Transformer,
``A_h = W_Q^h``, ``B_h = W_K^h``: ``m_{hj} = kappa_h x_j W_K^h W_Q^h^T``), a vMF kernel with
concentration ``kappa_{hj} = |m_{hj}|``, which differs between positions because ``x_j B_h`` is
not a unit vector. With a prior ``pi_j`` over positions, Bayes' rule gives

    p(j | x_i, h) = pi_j C_d(kappa_{hj}) exp(x_i . m_{hj}) / sum_j' pi_j' C_d(kappa_{hj'}) exp(...),

so the softmax above IS the exact Bayes posterior of these vMF components only under the prior
``pi_j`` proportional to ``1 / C_d(kappa_{hj})``, which cancels each component's normaliser.
Under a uniform prior it is that posterior only up to the factors ``C_d(kappa_{hj})``. The
posterior over the ``n`` tokens in context is a kernel-smoothed (Monte Carlo) estimate of the
posterior over the continuous latent.

Row-vector convention: a point is a row ``x`` of shape ``(d,)`` and maps act on the right.
See ``docs/theory.md``, "Attention".
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Real

from .field import VectorField, _check_tokens
from .paths import Constant, ParameterPath

__all__ = [
    "AttentionParams",
    "AttentionField",
    "attention_posterior",
    "kernel_embeddings",
    "natural_parameters",
    "rotate_pairs",
]


class AttentionParams(eqx.Module):
    """Parameters of the vMF-kernel posterior and of the scores, for ``H`` heads.

    Attributes:
        kernel_query: ``A`` of shape ``(d, H, k)``: embeds the token being explained.
        kernel_key: ``B`` of shape ``(d, H, k)``: embeds the context tokens.
        concentration: ``kappa`` of shape ``(H,)``: the kernel's concentration per head.
        natural_in: ``N`` of shape ``(d, H, r)``.
        natural_out: ``M`` of shape ``(H, r, d)``; ``eta_{hj} = x_j N_h M_h`` is the natural
            parameter (mean direction times concentration) of component ``(h, j)``.

    Optional parts, each ``None`` when absent (what real checkpoints add; docs/theory.md,
    "Real pre-norm models"):

        query_offset, key_offset: ``alpha_h``, ``beta_h`` of shape ``(H, k)``: the kernel's
            embeddings are affine, ``a_i = x_i A_h + alpha_h``, ``b_j = x_j B_h + beta_h``, which
            adds linear terms in ``x_i`` and ``x_j`` to the kernel's exponent (the posterior
            stays in the exponential family).
        natural_offset: ``c_h`` of shape ``(H, r)``: ``eta_{hj} = (x_j N_h + c_h) M_h``.
        score_offset: ``e`` of shape ``(d,)``: a score shared by every component, added to the
            expectation (``sum_h`` of posteriors that each sum to one would count it ``H`` times,
            so it is added once, outside).
        kernel_gain_query, kernel_gain_key: ``gamma_h`` of shape ``(H, k)``: the embeddings are
            put on a sphere before they are compared, ``a <- gamma * a / sqrt(mean(a^2) +
            kernel_eps)``; the kernel is then exactly vMF in the embedding's direction, with a
            concentration fixed by ``kappa_h`` and the gains.
        rotation_frequencies: ``omega`` of shape ``(k/2,)``: position-dependent rotations; the
            pair of coordinates ``(m, m + k/2)`` of ``a_i`` (``b_j``) is turned by the angle
            ``p_i omega_m`` (``p_j omega_m``), ``p`` the token's position, so the exponent
            reads ``a_i R(p_j - p_i) b_j^T``: the kernel depends on the positions only through
            their difference.
    """

    kernel_query: Float[Array, "d H k"]
    kernel_key: Float[Array, "d H k"]
    concentration: Float[Array, " H"]
    natural_in: Float[Array, "d H r"]
    natural_out: Float[Array, "H r d"]
    query_offset: Float[Array, "H k"] | None = None
    key_offset: Float[Array, "H k"] | None = None
    natural_offset: Float[Array, "H r"] | None = None
    score_offset: Float[Array, " d"] | None = None
    kernel_gain_query: Float[Array, "H k"] | None = None
    kernel_gain_key: Float[Array, "H k"] | None = None
    rotation_frequencies: Float[Array, " k2"] | None = None
    kernel_eps: float = eqx.field(static=True, default=0.0)

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
            "query_offset": (H, k),
            "key_offset": (H, k),
            "natural_offset": (H, self.natural_in.shape[-1]),
            "score_offset": (d,),
            "kernel_gain_query": (H, k),
            "kernel_gain_key": (H, k),
            "rotation_frequencies": (k // 2,),
        }
        if self.rotation_frequencies is not None and k % 2:
            raise ValueError(f"position rotations need an even embedding width k, got {k}")
        for name, shape in expected.items():
            if getattr(self, name) is not None and getattr(self, name).shape != shape:
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


def rotate_pairs(
    a: Float[Array, "... n k"], positions: Array, frequencies: Float[Array, " k2"]
) -> Float[Array, "... n k"]:
    """Turns the coordinate pair ``(m, m + k/2)`` of row ``i`` by the angle
    ``positions[i] * frequencies[m]`` (a rotation of R^k per position)."""
    half = a.shape[-1] // 2
    angles = jnp.asarray(positions, a.dtype)[:, None] * frequencies.astype(a.dtype)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    first, second = a[..., :half], a[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _embed(x, kernel, offset, gain, eps, frequencies):
    a = jnp.einsum("...nd,dhk->...hnk", x, kernel)
    if offset is not None:
        a = a + offset[:, None, :]
    if gain is not None:  # onto the sphere of radius sqrt(k) |gamma|_rms
        a = gain[:, None, :] * a / jnp.sqrt(jnp.mean(a * a, axis=-1, keepdims=True) + eps)
    if frequencies is not None:
        a = rotate_pairs(a, jnp.arange(x.shape[-2]), frequencies)
    return a


def kernel_embeddings(
    params: AttentionParams, x: Float[Array, "... n d"]
) -> tuple[Float[Array, "... H n k"], Float[Array, "... H n k"]]:
    """The two sides of the kernel's exponent, ``kappa_h a_i`` and ``b_j``, so that
    ``log_kernel[h, i, j] = kappa_h <a_i, b_j>``; token ``i`` sits at position ``i``.

    ``a_i = x_i A_h + alpha_h``, put on a sphere by the kernel gains if present, rotated by the
    position rotation if present (``b_j`` likewise, with ``B_h``, ``beta_h``).
    """
    eps = params.kernel_eps
    a = _embed(x, params.kernel_query, params.query_offset, params.kernel_gain_query, eps,
               params.rotation_frequencies)
    b = _embed(x, params.kernel_key, params.key_offset, params.kernel_gain_key, eps,
               params.rotation_frequencies)
    # kappa_h scales the query embedding (n H k products) rather than the kernel (H n^2).
    return params.concentration[:, None, None] * a, b


def attention_posterior(
    params: AttentionParams, x: Float[Array, "... n d"], causal: bool = False
) -> Float[Array, "... H n n"]:
    """``q[..., h, i, j] = q_h(j | x_i)``, the vMF-kernel posterior over context positions.

    ``softmax_j(kappa_h <x_i A_h, x_j B_h>)``: for each head, weights summing to one over ``j``.
    It is the exact Bayes posterior of the vMF components ``(h, j)`` (concentration
    ``kappa_{hj} = kappa_h |x_j B_h A_h^T|``) under the prior ``pi_j`` proportional to
    ``1 / C_d(kappa_{hj})``; under a uniform prior it is that posterior only up to the factors
    ``C_d(kappa_{hj})`` (module docstring).
    """
    log_kernel = jnp.einsum("...hik,...hjk->...hij", *kernel_embeddings(params, x))
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
    return jnp.einsum("...hnr,hrd->...hnd", _natural_hidden(params, x), params.natural_out)


def _natural_hidden(params: AttentionParams, x: Array) -> Array:
    """``x_j N_h + c_h``, shape ``(..., H, n, r)``."""
    hidden = jnp.einsum("...nd,dhr->...hnr", x, params.natural_in)
    if params.natural_offset is not None:
        hidden = hidden + params.natural_offset[:, None, :]
    return hidden


def expected_natural_parameter(
    params: AttentionParams, posterior: Float[Array, "... H n n"], x: Float[Array, "... n d"]
) -> Float[Array, "... n d"]:
    """``E_q[eta] = sum_h (sum_j q_h(j | x_i) x_j N_h) M_h``: the expected Euclidean score
    ``sum_h sum_j q_h(j | x_i) eta_{h j}`` of :func:`natural_parameters`, in a cheaper order.

    ``eta_{hj} = x_j N_h M_h`` is linear in ``x_j``, so the posterior average can be taken in the
    ``r``-dimensional space of ``x_j N_h`` before mapping to R^d with ``M_h``: ``O(H n^2 r)``
    work instead of ``O(H n^2 d)`` (the field is evaluated at every solver stage).
    """
    averaged = jnp.einsum("...hij,...hjr->...hir", posterior, _natural_hidden(params, x))
    expected = jnp.einsum("...hir,hrd->...id", averaged, params.natural_out)
    return expected if params.score_offset is None else expected + params.score_offset


class AttentionField(VectorField):
    """The attention field ``v_t(x_i) = P_{x_i} sum_h E_{q_h(j | x_i)}[eta_{h j}]``.

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
