"""Former home of ``svflow train``'s command line, now :mod:`svflow_jax.cli.train` (kept so
that existing imports work)."""

from ..cli.train import add_train_parser, config_from_args, run_train

__all__ = ["add_train_parser", "run_train", "config_from_args"]
