"""The options of ``svflow inspect`` and of its step-size sweep, without JAX.

:class:`InspectOptions` (the study, :mod:`.study`) and :class:`AlphaOptions` (the step-size
sweep, :mod:`.alpha_sweep`) check their values when built; the command builds them before JAX
is imported, so a bad option is refused in a fraction of a second. Method names are checked
against the solver catalogue's static table (:mod:`svflow_jax.method_table`); only a user's
method, ``package.module:Attr``, imports the catalogue (and JAX) to be resolved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .. import method_table

__all__ = ["AlphaOptions", "QUICK_ALPHA", "sweep_scheme_names", "unknown_methods",
           "InspectOptions", "scheme_names", "QUICK"]


@dataclasses.dataclass(frozen=True)
class AlphaOptions:
    """The grid of the sweep.

    Attributes:
        alphas: global step multipliers, for every scheme (must include 1).
        schemes: methods with a step in ``R^d``, each measured in its variants
            (:func:`~.alpha_sweep.sweep_schemes`): names of the solver catalogue
            (:func:`sweep_scheme_names`) or ``package.module:Attr``.
        layer_alphas: multipliers applied to one layer at a time (the model's scheme; 0 removes
            the layer).
        profiles: slopes ``a`` of the linear profiles ``1 + a (2 l / (L - 1) - 1)`` (the
            model's scheme).
        windows: how many of the given text windows the sweep reads (the first ones); the
            intervals are over these windows.
        fit_steps: Adam steps of the fitted per-layer profile
            (:func:`~.alpha_sweep.fit_profile`; 0: no fit). Each step is one forward and one
            backward pass over the sweep's windows.
        fit_rate: Adam's learning rate of the fit.
    """

    alphas: tuple[float, ...] = (0.5, 0.8, 0.9, 1.0, 1.1, 1.2, 1.5)
    schemes: tuple[str, ...] = ("euler", "heun", "rk4", "strang")
    layer_alphas: tuple[float, ...] = (0.0, 0.5, 1.5)
    profiles: tuple[float, ...] = (-0.2, 0.2)
    windows: int = 8
    fit_steps: int = 0
    fit_rate: float = 0.01

    def __post_init__(self) -> None:
        for name in ("windows", "fit_steps"):
            value = getattr(self, name)
            least = 1 if name == "windows" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if not (isinstance(self.fit_rate, int | float) and self.fit_rate > 0):
            raise ValueError(f"fit_rate must be a positive number, got {self.fit_rate!r}")
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
    return ["euler", *[n for n in method_table.names(prenorm=True) if n != "euler"]]


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
            from ..solvers import catalogue  # a user's method: imports JAX

            try:
                method = catalogue.get(name)
            except ValueError as err:
                raise ValueError(f"schemes: {err}") from None
            if method.ambient is not None and (splittings or not method.is_splitting):
                continue
        out.append(name)
    return out


#: the step-size sweep of ``svflow inspect --quick``
QUICK_ALPHA = AlphaOptions(alphas=(0.5, 1.0, 1.5), schemes=("euler", "heun", "rk4", "strang"),
                           layer_alphas=(0.0,), profiles=(-0.2, 0.2), windows=2)


def scheme_names() -> list[str]:
    """The methods the refinement study can use per layer: the single-field methods of the
    solver catalogue with a step in ``R^d`` (read from :mod:`svflow_jax.method_table`), less
    ``euler`` (the model itself, always measured)."""
    return [n for n in method_table.names(splitting=False, prenorm=True) if n != "euler"]


@dataclasses.dataclass(frozen=True)
class InspectOptions:
    """The knobs of ``svflow inspect``.

    Attributes:
        windows: number of consecutive text windows.
        window: tokens per window (the next-token loss scores ``window`` predictions).
        substeps: Euler sub-steps per layer of the refinement study (each > 1).
        schemes: higher-order methods of the refinement study: names of :func:`scheme_names`
            or ``package.module:Attr`` of a single-field method with a step in ``R^d``.
        exactness_tokens: tokens of the exactness check (float64 and float32).
        alpha: the grid of the step-size sweep (:mod:`.alpha_sweep`); ``None`` skips
            it.
        lens: also read the model layer by layer (:func:`~.study.lens`: the logit lens after every
            sub-step and the exact decomposition of the logits).
    """

    windows: int = 8
    window: int = 128
    substeps: tuple[int, ...] = (2, 4, 8)
    schemes: tuple[str, ...] = ("heun", "rk4")
    exactness_tokens: int = 64
    alpha: AlphaOptions | None = AlphaOptions()
    lens: bool = False

    def __post_init__(self) -> None:
        for name in ("windows", "window", "exactness_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2 tokens, got {self.window}")
        if any(isinstance(m, bool) or not isinstance(m, int) or m < 2 for m in self.substeps):
            raise ValueError(f"substeps must be integers >= 2, got {self.substeps}")
        unknown = unknown_methods(self.schemes, scheme_names(), splittings=False)
        if unknown:
            raise ValueError(f"schemes: unknown methods {unknown}; known: {scheme_names()}, or "
                             "package.module:Attr of a single-field method with a step in R^d")


#: the options of ``svflow inspect --quick``
QUICK = dict(windows=2, window=24, substeps=(2, 4), exactness_tokens=16, alpha=QUICK_ALPHA,
             lens=True)
