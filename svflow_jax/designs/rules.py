"""The cross-field rules of a training run's configuration, without JAX.

:class:`~svflow_jax.designs.DesignConfig` and :class:`~svflow_jax.training.TrainConfig` call
these when built; ``svflow train`` calls them on the planned run before JAX is imported, so a
combination of options that cannot run is refused in a fraction of a second. Whether a method
has a pre-norm form is read from the catalogue's static table (:mod:`svflow_jax.method_table`);
a design the table does not hold (``package.module:Attr``) is left to the catalogue.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import method_table

__all__ = ["check_norm_options", "check_depths"]


def check_norm_options(design: str, norm_position: str, update: str = "residual",
                       embed_norm: bool = False) -> None:
    """``ValueError`` for a design without a pre-norm form in a pre-norm stack, ``embed_norm``
    outside a pre-norm stack and nGPT's step (``update='ngpt'``) outside a post-norm one."""
    if norm_position == "pre" and method_table.has_prenorm_form(design) is False:
        raise ValueError(method_table.no_prenorm_form(design))
    if embed_norm and norm_position != "pre":
        raise ValueError("embed_norm is a pre-norm option: a post-norm state starts "
                         "normalised already")
    if update == "ngpt" and norm_position != "post":
        raise ValueError("update='ngpt' (nGPT's normalised step) lives on the sphere: it "
                         "needs norm_position='post'")


def check_depths(weights: str, extra_depths: Sequence[int], random_depths: Sequence[int]
                 ) -> None:
    """``ValueError`` for other block counts (``extra_depths``, ``random_depths``) with
    per-layer weights, and for both kinds at once."""
    for name, depths in (("extra_depths", extra_depths), ("random_depths", random_depths)):
        if depths and weights == "per_layer":
            raise ValueError(f"{name} needs weights continuous in depth ('linear' or "
                             "'chebyshev'): per-layer weights change with the block count")
    if extra_depths and random_depths:
        raise ValueError("TrainConfig: extra_depths (every depth each step) or "
                         "random_depths (one drawn per step), not both")
