"""Deprecated alias of :mod:`svflow_jax.checkpoints.packaged`: importing it gives that very
module (so that setting its attributes, as tests do, reaches the code that reads them)."""

import sys

from svflow_jax.checkpoints import packaged as _packaged
from svflow_jax.checkpoints.packaged import MODELS, PackagedModel, fetch, location, models_dir

__all__ = ["PackagedModel", "MODELS", "models_dir", "location", "fetch"]

sys.modules[__name__] = _packaged
