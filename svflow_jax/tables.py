"""Former home of :func:`write_csv`, now in :mod:`svflow_jax.reporting` (kept so that existing
imports work)."""

from .reporting import write_csv

__all__ = ["write_csv"]
