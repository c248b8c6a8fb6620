"""Test configuration: verification runs in float64.

``jax_enable_x64`` must be set before any JAX array exists, so it is done here, at import time
of the conftest, before any test module is collected. Float32 paths are exercised by asking for
``jnp.float32`` explicitly, with the tolerances stated in each test.

The tests' problems are small, so their time is mostly XLA compilation: they run under the
project's quick-run XLA flags (``svflow_jax.xla_settings.QUICK_FLAGS``: LLVM optimisations
off, the older fusion emitters), set here before JAX starts its CPU client, and only when the
backend is the CPU (``svflow_jax.xla_settings.project_flags``). A ``XLA_FLAGS`` in the
environment wins (run ``XLA_FLAGS= python -m pytest`` for XLA's defaults).
"""


from svflow_jax.xla_settings import use_project_flags

use_project_flags(quick=True)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
