"""The bridge between the two vocabularies: a Transformer's internals read in flow words.

* :mod:`.readout`: the one reader of a :class:`~svflow_jax.transformer.TransformerLM`'s
  internals (the blocks' recorded sub-steps, natural parameters) and the one
  :func:`~.readout.check_supported`, used by the diagnostics and the objective.
* :mod:`.correspondence`: the exact map between a Transformer's parameters and a
  flow's (``to_flow`` / ``from_flow``).
"""

from .readout import (
    SubStep,
    attention_substep,
    check_supported,
    head_values,
    natural_parameters,
    read_layers,
)

__all__ = ["SubStep", "attention_substep", "check_supported", "head_values",
           "natural_parameters", "read_layers"]
