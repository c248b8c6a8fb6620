"""Deprecated alias of :mod:`svflow_jax.checkpoints.packaged` (the same module object)."""

import sys

from svflow_jax.checkpoints import packaged as _packaged

sys.modules[__name__] = _packaged
