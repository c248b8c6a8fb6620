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

Definitions: ``docs/theory.md``, section 19.
"""

import importlib
from typing import Any

# Loaded on first use (PEP 562), so that ``svflow verify`` does not import the diagnostics
# stack just to list ``svflow diagnose``'s options.
_WHERE = {"LayerSummaries": ".extract", "scale_attention_logits": ".extract",
          "window_diagnostics": ".extract", "METRICS": ".study", "QUICK": ".study",
          "Diagnosis": ".study", "StudyConfig": ".study", "across_models": ".study",
          "analyse_shuffle": ".study", "diagnose": ".study"}

__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
