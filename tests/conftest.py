"""Test configuration: verification runs in float64.

``jax_enable_x64`` must be set before any JAX array exists, so it is done here, at import time
of the conftest, before any test module is collected. Float32 paths are exercised by asking for
``jnp.float32`` explicitly, with the tolerances stated in each test.
"""

import jax

jax.config.update("jax_enable_x64", True)
