"""SVFlow vector fields, written in probability words.

* :mod:`.field`      the base class: ``v_t(x) = P_x E_q[grad log p(x | z)]``; sums of fields.
* :mod:`.attention`  attention as a vMF-kernel posterior over (head, context position).
* :mod:`.experts`    MoE and dense FFN as a router posterior over relaxed score networks.
* :mod:`.paths`      time-dependent parameters: constant, per-layer, linear, Chebyshev.
"""

from .attention import AttentionField, AttentionParams, attention_posterior, natural_parameters
from .experts import ExpertsField, ExpertsParams, RouterPosterior, ScoreNetworks, router_posterior
from .field import ScaledField, SumField, VectorField
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
    "ScaledField",
    "ParameterPath",
    "Constant",
    "PiecewiseConstant",
    "LinearInterpolation",
    "ChebyshevInterpolation",
    "chebyshev_points",
    "stack",
]
