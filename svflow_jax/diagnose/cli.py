"""Former home of ``svflow diagnose``'s command line, now :mod:`svflow_jax.cli.diagnose`
(kept so that existing imports work)."""

from ..cli.diagnose import OPTIONS, add_diagnose_parser, run_diagnose

__all__ = ["add_diagnose_parser", "run_diagnose", "OPTIONS"]
