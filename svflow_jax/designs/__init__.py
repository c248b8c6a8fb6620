"""Solvers as trainable layer designs: a bridging package (it speaks both vocabularies).

* :mod:`.design`: a layer design is a method of the solver catalogue
  (:mod:`svflow_jax.solvers.catalogue`) read as a Transformer block; :func:`from_tableau` (any
  explicit Butcher tableau), the stack's integration loop :func:`integrate` and the measured
  cost :func:`evaluations`.
* :mod:`.model`: :class:`SolverLM`, a Flax NNX causal language model whose stack is the solver
  on ``[0, T]`` with per-layer or continuous-in-depth weights (:class:`DesignConfig`).
* :mod:`.adaptive`: adaptive depth at evaluation (embedded error estimate + PID controller).

The mathematics is in docs/theory.md, "Training layer designs".
"""

from .adaptive import AdaptiveResult, adaptive_evaluate, step_costs
from .design import CLASSICAL_RK4, evaluations, from_tableau, integrate
from .model import DesignConfig, SolverLM

__all__ = [
    "CLASSICAL_RK4",
    "from_tableau",
    "integrate",
    "evaluations",
    "DesignConfig",
    "SolverLM",
    "adaptive_evaluate",
    "AdaptiveResult",
    "step_costs",
]
