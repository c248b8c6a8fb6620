"""Solvers as trainable layer designs: a bridging package (it speaks both vocabularies).

* :mod:`.design`: :class:`LayerDesign` (a solver read as a Transformer block), the registered
  designs :data:`DESIGNS`, :func:`from_tableau` (any explicit Butcher tableau), the stack's
  integration loop :func:`integrate` and the measured cost :func:`evaluations`.
* :mod:`.model`: :class:`SolverLM`, a Flax NNX causal language model whose stack is the solver
  on ``[0, T]`` with per-layer or continuous-in-depth weights (:class:`DesignConfig`).
* :mod:`.adaptive`: adaptive depth at evaluation (embedded error estimate + PID controller).

The mathematics is in docs/theory.md, "Training layer designs".
"""

from .design import (
    CLASSICAL_RK4,
    DESIGNS,
    LayerDesign,
    evaluations,
    from_tableau,
    get_design,
    integrate,
    register_design,
)
from .model import DesignConfig, SolverLM

__all__ = [
    "LayerDesign",
    "DESIGNS",
    "CLASSICAL_RK4",
    "from_tableau",
    "get_design",
    "register_design",
    "integrate",
    "evaluations",
    "DesignConfig",
    "SolverLM",
]
