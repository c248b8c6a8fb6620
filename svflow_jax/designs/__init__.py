"""Solvers as trainable layer designs: a bridging package (it speaks both vocabularies).

* :mod:`.design`: a layer design is a method of the solver catalogue
  (:mod:`svflow_jax.solvers.catalogue`) read as a Transformer block; :func:`from_tableau` (any
  explicit Butcher tableau), the stack's integration loop :func:`integrate` and the measured
  cost :func:`evaluations`.
* :mod:`.model`: :class:`SolverLM`, a Flax NNX causal language model whose stack is the solver
  on ``[0, T]`` with per-layer or continuous-in-depth weights (:class:`DesignConfig`).
* :mod:`.adaptive`: adaptive depth at evaluation (embedded error estimate + PID controller).
* :mod:`.rules`: the configuration's cross-field rules, without JAX (``svflow train`` checks
  them before JAX is imported).

The mathematics is in docs/theory.md, "Training layer designs".
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for readers and the API docs
    from .adaptive import AdaptiveResult, adaptive_evaluate, step_costs
    from .design import CLASSICAL_RK4, evaluations, from_tableau, integrate
    from .model import DesignConfig, SolverLM

_MODULES = {
    ".design": ["CLASSICAL_RK4", "from_tableau", "integrate", "evaluations"],
    ".model": ["DesignConfig", "SolverLM"],
    ".adaptive": ["adaptive_evaluate", "AdaptiveResult", "step_costs"],
}
__all__ = ["CLASSICAL_RK4", "from_tableau", "integrate", "evaluations", "DesignConfig",
           "SolverLM", "adaptive_evaluate", "AdaptiveResult", "step_costs"]

# Loaded on first use (PEP 562), so that ``svflow train`` checks its configuration's rules
# (:mod:`.rules`) before JAX is imported.
_WHERE = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
