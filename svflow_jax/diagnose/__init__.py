"""SVFlow diagnostics under prefix shuffling on pretrained language models
(``svflow diagnose``).

* :mod:`.extract`  the bridge: per-layer SVFlow metrics read off a ``TransformerLM``
                   (hidden states, attention, the layers' parameters), via the pure functions
                   of :mod:`svflow_jax.flow.diagnostics`.
* :mod:`.stats`    ranks, Spearman's rho, equal-mass ECE, bootstrap over windows.
* :mod:`.study`    the prefix-shuffling study, its analysis, the attention-scaling experiment,
                   :func:`diagnose`.
* :mod:`.output`   ``summary.json``, CSV tables, figures and ``report.md`` from a summary.
* :mod:`.cli`      the ``svflow diagnose`` subcommand.

Definitions: ``docs/theory.md``, section 16.
"""

from .extract import LayerSummaries, scale_attention_logits, window_diagnostics
from .study import (
    METRICS,
    QUICK,
    Diagnosis,
    StudyConfig,
    across_models,
    analyse_shuffle,
    diagnose,
)

__all__ = ["LayerSummaries", "scale_attention_logits", "window_diagnostics", "METRICS", "QUICK",
           "Diagnosis", "StudyConfig", "across_models", "analyse_shuffle", "diagnose"]
