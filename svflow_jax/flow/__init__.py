"""SVFlow vector fields, written in probability words.

* :mod:`.field`      the base class: ``v_t(x) = P_x E_q[grad log p(x | z)]``; sums of fields.
* :mod:`.attention`  attention as a vMF-kernel posterior over context positions, one per head
                     (heads add).
* :mod:`.experts`    MoE and dense FFN as a router posterior over relaxed score networks
                     (top-k: ties to the lower expert index, as ``jax.lax.top_k``).
* :mod:`.paths`      time-dependent parameters: constant, per-layer, linear, Chebyshev.

The mathematics and the definitions chosen are in ``docs/theory.md``.
"""

from .attention import AttentionField, AttentionParams, attention_posterior, natural_parameters
from .experts import ExpertsField, ExpertsParams, RouterPosterior, ScoreNetworks, router_posterior
from .field import SumField, VectorField
from .paths import (
    ChebyshevInterpolation,
    Constant,
    LinearInterpolation,
    ParameterPath,
    PiecewiseConstant,
    chebyshev_points,
    stack,
)

__all__ = [
    "AttentionField",
    "AttentionParams",
    "attention_posterior",
    "natural_parameters",
    "ExpertsField",
    "ExpertsParams",
    "RouterPosterior",
    "ScoreNetworks",
    "router_posterior",
    "VectorField",
    "SumField",
    "ParameterPath",
    "Constant",
    "PiecewiseConstant",
    "LinearInterpolation",
    "ChebyshevInterpolation",
    "chebyshev_points",
    "stack",
]
