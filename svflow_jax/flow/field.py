"""The SVFlow vector field: an expectation of Riemannian scores under a variational posterior.

    dx/dt = v_t(x) = E_{q_t(z | x)} [ grad_x log p_t(x | z) ]         on S^{d-1}

Every field in :mod:`svflow_jax.flow` is a :class:`VectorField`. It implements one method,
:meth:`VectorField.drift`, the expectation of the *Euclidean* scores

    u_t(x) = E_{q_t(z | x)} [ grad^E_x log p_t(x | z) ]    (an ambient vector in R^d),

and inherits the Riemannian field ``v_t(x) = P_x u_t(x)``. Because ``P_x`` is linear, the
expectation of the Riemannian scores equals the projection of the expected Euclidean score:
projecting once per token instead of once per latent saves a factor of the number of latents.

The Euclidean drift ``u`` is what an unprojected Transformer branch computes, which is why both
are exposed. In a post-norm layer its radial part ``x . u`` only rescales the step
(``h' = h / (1 + h x . u)``) and drops out of the continuous limit; in a pre-norm stack it drives
the token radii (``dr_i/dt = u_i . F_t(U)_i``), which feed back into the directions: see
``docs/theory.md``, "Post-norm, standard layer" and "Pre-norm".

A field is called like a diffrax vector field, ``field(t, x, args)``, with ``x`` of shape
``(..., n, d)`` (tokens on the last-but-one axis, any leading batch axes), so it can be wrapped
directly in ``diffrax.ODETerm``.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, PyTree, Real

from ..sphere import project_tangent, soft_retract

__all__ = ["VectorField", "SumField"]


class VectorField(eqx.Module):
    """A time-dependent tangent field on ``(S^{d-1})^n``: ``v_t(x) = P_x E_q[grad log p]``."""

    @abc.abstractmethod
    def drift(
        self, t: Real[Array, ""], x: Float[Array, "... n d"]
    ) -> Float[Array, "... n d"]:
        """Expected Euclidean score ``u_t(x) = E_q[grad^E log p(x | z)]`` (not projected)."""

    def __call__(
        self, t: Real[Array, ""], x: Float[Array, "... n d"], args: PyTree = None
    ) -> Float[Array, "... n d"]:
        """Riemannian field ``v_t(x) = P_x u_t(x)``, tangent to the sphere at every token."""
        del args
        return project_tangent(x, self.drift(t, x))

    def ambient(
        self, t: Real[Array, ""], y: Float[Array, "... n d"], args: PyTree = None,
        eps: float = 0.0, centred: bool = False,
    ) -> Float[Array, "... n d"]:
        """Ambient extension ``F(y) = u_t(y / |y|)`` used by pre-norm layers.

        Pre-norm residual streams live in R^d, not on the sphere: ``y <- y + h F(Norm(y))``
        is forward Euler of ``dy/dt = u_t(y/|y|)`` (``docs/theory.md``, "Pre-norm"). With
        ``eps > 0`` the field reads ``y / sqrt(|y|^2 + eps)`` (:func:`~svflow_jax.sphere.
        soft_retract`): a short token is read inside the sphere, at radius
        ``|y| / sqrt(|y|^2 + eps)``. ``centred`` (a LayerNorm in front of the branch) reads
        the centred point ``P y = y - mean(y) 1`` instead of ``y``: the field reads the unit
        sphere of the hyperplane orthogonal to ``1``, while the state moves in all of R^d.
        """
        del args
        if centred:
            y = y - jnp.mean(y, axis=-1, keepdims=True)
        if eps == 0:
            return self.drift(t, y / jnp.linalg.norm(y, axis=-1, keepdims=True))
        return self.drift(t, soft_retract(y, eps))


class SumField(VectorField):
    """``v = v_1 + ... + v_m``: independent latents whose log-likelihoods add, so scores add.

    A parallel Transformer block (attention and FFN on one residual) integrates this field.
    """

    fields: tuple[VectorField, ...]

    def __init__(self, *fields: VectorField):
        if not fields:
            raise ValueError("SumField needs at least one field")
        self.fields = tuple(fields)

    def drift(self, t, x):
        return sum(f.drift(t, x) for f in self.fields)


def _check_tokens(x: Array, d: int, what: str) -> None:
    """Static shape check shared by the fields: ``x`` is ``(..., n, d)``."""
    if x.ndim < 2:
        raise ValueError(
            f"{what}: the state must have shape (..., n, d) (tokens x dimension), got {x.shape}"
        )
    if x.shape[-1] != d:
        raise ValueError(
            f"{what}: the state has dimension d={x.shape[-1]} but the parameters expect d={d}"
        )
