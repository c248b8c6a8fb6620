"""``python -m svflow_jax ...`` is the ``svflow`` command."""

from .cli import main

raise SystemExit(main())
