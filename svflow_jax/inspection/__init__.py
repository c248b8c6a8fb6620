"""``svflow inspect``: how close is a real pretrained Transformer to the solution of its ODE?

* :mod:`.study`: the measurements on real text (exactness of the model's own flow, the geometry
  of the layers' updates, the smoothness of the weights in depth, refinement of the flow, the
  logit lens) and :func:`~.study.inspect_model`, which runs them all;
* :mod:`.alpha_sweep`: the step-size sweep, every layer's step ``h`` scaled by ``alpha``, and
  :func:`~.alpha_sweep.final_scores`, the one "final Norm, logits, next-token loss" of both;
* :mod:`.report`: ``summary.json``, CSV tables, PNG figures and ``report.md`` of a run;
* :mod:`.config`: the options of both (:class:`InspectOptions`, :class:`AlphaOptions`), without
  JAX: the command checks them before JAX is imported.

The models are named as everywhere (:func:`svflow_jax.checkpoints.resolve`): a packaged
model's name, a Hugging Face folder or a GGUF file.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .config import QUICK, AlphaOptions, InspectOptions, scheme_names

if TYPE_CHECKING:  # what the names are, for readers and the API docs
    from .report import SCHEMA_VERSION, write_inspection
    from .study import (
        depth_smoothness,
        exactness,
        geometry,
        inspect_model,
        lens,
        refinement,
        resolve_model,
        token_windows,
    )

__all__ = [
    "AlphaOptions",
    "InspectOptions",
    "QUICK",
    "SCHEMA_VERSION",
    "depth_smoothness",
    "exactness",
    "geometry",
    "inspect_model",
    "lens",
    "refinement",
    "resolve_model",
    "scheme_names",
    "token_windows",
    "write_inspection",
]

# The studies are loaded on first use (PEP 562), so that ``svflow inspect`` checks its options
# (:mod:`.config`) before JAX is imported.
_WHERE = {"SCHEMA_VERSION": ".report", "write_inspection": ".report",
          **{name: ".study" for name in __all__ if name not in globals()
             and name not in ("SCHEMA_VERSION", "write_inspection")}}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
