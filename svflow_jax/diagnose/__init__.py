"""SVFlow diagnostics under prefix shuffling on pretrained language models
(``svflow diagnose``).

* :mod:`.extract`  the bridge: per-layer SVFlow metrics read off a ``TransformerLM``
                   (hidden states, attention, the layers' parameters), via the pure functions
                   of :mod:`svflow_jax.flow.diagnostics`.
* :mod:`.stats`    ranks, Spearman's rho, equal-mass ECE, bootstrap over windows and
                   documents, permutation tests.
* :mod:`.config`   the options (:class:`StudyConfig`), without JAX: checked before it loads.
* :mod:`.study`    the prefix-shuffling study, its analysis, the attention-scaling experiment,
                   :func:`diagnose`.
* :mod:`.output`   ``summary.json``, CSV tables, figures and ``report.md`` from a summary.
* the ``svflow diagnose`` subcommand is :mod:`svflow_jax.cli.diagnose`.

Definitions: ``docs/theory.md``, section 19.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names are, for readers and the API docs
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

# Loaded on first use (PEP 562), so that ``svflow verify`` does not import the diagnostics
# stack just to list ``svflow diagnose``'s options.
_WHERE = {name: ".extract" if i < 3 else ".study" for i, name in enumerate(__all__)}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
