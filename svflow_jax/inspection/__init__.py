"""``svflow inspect``: how close is a real pretrained Transformer to the solution of its ODE?

* :mod:`.study`: the measurements on real text (exactness of the model's own flow, the geometry
  of the layers' updates, the smoothness of the weights in depth, refinement of the flow, the
  logit lens) and :func:`~.study.inspect_model`, which runs them all;
* :mod:`.alpha_sweep`: the step-size sweep, every layer's step ``h`` scaled by ``alpha``, and
  :func:`~.alpha_sweep.final_scores`, the one "final Norm, logits, next-token loss" of both;
* :mod:`.report`: ``summary.json``, CSV tables, PNG figures and ``report.md`` of a run.

The models are named as everywhere (:func:`svflow_jax.checkpoints.resolve`): a packaged
model's name, a Hugging Face folder or a GGUF file.
"""

from .alpha_sweep import AlphaOptions
from .report import SCHEMA_VERSION, write_inspection
from .study import (
    QUICK,
    InspectOptions,
    depth_smoothness,
    exactness,
    geometry,
    inspect_model,
    lens,
    refinement,
    resolve_model,
    scheme_names,
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
