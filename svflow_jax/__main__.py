"""``python -m svflow_jax ...`` is the ``svflow`` command."""

from .cli import entry

entry()
