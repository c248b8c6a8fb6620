"""The metrics of ``svflow diagnose``, one :class:`Metric` record each: extraction
(:mod:`.extract`), the study (:mod:`.study`) and the report (:mod:`.output`) read this list, so
adding a metric means adding one record (and, for an SVFlow metric, computing it in
:mod:`.extract`).

Three kinds:

* ``"svflow"``: an SVFlow quantity read off the model; tested ("does it track perplexity?"),
  and counted among the comparisons of the Bonferroni correction (:data:`TESTED`);
* ``"model_units"``: the same quantity in the model's units, reported beside, never tested;
* ``"control"``: a model-free property of the text (:class:`TextCounts`): the mean surprisal
  of the scored tokens under unigram or bigram counts of the Austen novels. It goes through
  the same rule as every SVFlow metric, and every SVFlow metric is also tested given it: a
  metric tracks perplexity only beyond the shuffle level and beyond the controls. The controls
  check the rule and carry no claim of the paper, so they are not among the comparisons.

Definitions: ``docs/theory.md``, section 19.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["Metric", "METRICS", "BY_NAME", "TESTED", "SVFLOW", "CONTROLS", "LOCAL",
           "comparisons", "TextCounts"]


@dataclasses.dataclass(frozen=True)
class Metric:
    """One metric of the study.

    Attributes:
        name: its key in the arrays, ``summary.json`` and the tables.
        description: one line, with its unit.
        sign: the sign its association with perplexity is expected to have, fixed before any
            run (``+1``: it rises with perplexity; reasons in ``docs/theory.md``, section 19).
        kind: ``"svflow"`` (tested), ``"model_units"`` (description) or ``"control"``.
        local: whether it is also read layer-locally (only that layer's context shuffled).
        read: how its values are obtained. SVFlow metrics: ``read(summaries)`` of a
            :class:`~svflow_jax.diagnose.extract.LayerSummaries`, ``(L, P, H)`` or ``(L, P)``;
            controls: ``read(counts, previous, tokens, exclude)`` (:meth:`TextCounts.surprisal`
            per sequence), ``(P,)``.
    """

    name: str
    description: str
    sign: int
    kind: str
    read: Callable[..., np.ndarray]
    local: bool = False

    def __post_init__(self):
        if self.sign not in (-1, 1):
            raise ValueError(f"{self.name}: sign must be +1 or -1, got {self.sign!r}")
        if self.kind not in ("svflow", "model_units", "control"):
            raise ValueError(f"{self.name}: unknown kind {self.kind!r}")

    @property
    def tested(self) -> bool:
        """Counted among the comparisons (Bonferroni's ``m``)."""
        return self.kind == "svflow"


def _svflow(name: str, description: str, sign: int, local: bool = False,
            kind: str = "svflow") -> Metric:
    return Metric(name, description, sign, kind, operator.attrgetter(name), local)


def _control(order: int) -> Callable[..., np.ndarray]:
    def read(counts: TextCounts, previous: np.ndarray, tokens: np.ndarray,
             exclude: int | None) -> np.ndarray:
        return counts.surprisal(previous, tokens, order, exclude).mean(-1)

    return read


METRICS: tuple[Metric, ...] = (
    _svflow("log_evidence", "log p_t(x_i): vMF-mixture evidence of the token direction "
            "(flow units)", -1),  # -log p_t is the surprise the paper reads as perplexity
    _svflow("kl_q_p", "KL(q_t || p_t): attention posterior vs the mixture's true posterior "
            "(flow units)", +1, local=True),  # further from the mixture: worse prediction
    _svflow("kl_excess", "KL(q_t || p_t) - (log n_i - H(q_t)): what the KL adds to the "
            "attention entropy (flow units)", +1),
    _svflow("kl_clean", "KL(q_clean || q_shuffled): attention posterior, clean vs perturbed",
            +1, local=True),  # attention moved further by the shuffle: worse prediction
    _svflow("entropy", "entropy of the attention posterior (nats)", +1,
            local=True),  # a more diffuse posterior: a less certain prediction
    # concentrations: confidence, so lower with worse prediction
    _svflow("kappa_eta", "mean component concentration |eta_hj| (flow units)", -1),
    _svflow("kappa_posterior", "posterior-weighted component concentration E_q |eta_hj| "
            "(flow units)", -1),
    _svflow("kappa_attn", "attention kernel concentration |q_hi| mean_j |k_hj| / sqrt(d_k)",
            -1),
    _svflow("kappa_resultant", "kappa of the hidden-state directions from their mean "
            "resultant length", -1),
    # the same quantities in the model's units (eta on the Norm's sphere of radius sqrt(d)),
    # where the unit changes their ranking; reported beside, not tested
    _svflow("log_evidence_model", "log p_t(x_i) in model units", -1, kind="model_units"),
    _svflow("kl_q_p_model", "KL(q_t || p_t) in model units", +1, kind="model_units"),
    _svflow("kl_excess_model", "KL(q_t || p_t) - (log n_i - H(q_t)) in model units", +1,
            kind="model_units"),
    Metric("unigram_surprisal", "model-free control: mean -log P(token) of the scored tokens "
           "under add-one unigram counts of the other Austen novels (nats)", +1, "control",
           _control(1)),
    Metric("bigram_surprisal", "model-free control: mean -log P(token | previous token) of the "
           "scored tokens, bigram counts of the other Austen novels with one pseudo-count "
           "spread as the unigram distribution (nats)", +1, "control", _control(2)),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}
#: the metrics read off the model (tested and model units), in order
SVFLOW: tuple[Metric, ...] = tuple(m for m in METRICS if m.kind != "control")
#: the model-free controls
CONTROLS: tuple[Metric, ...] = tuple(m for m in METRICS if m.kind == "control")
#: the names of the metrics tested (the comparisons of the Bonferroni correction)
TESTED: tuple[str, ...] = tuple(m.name for m in METRICS if m.tested)
#: the names of the metrics also read layer-locally
LOCAL: tuple[str, ...] = tuple(m.name for m in METRICS if m.local)


def comparisons() -> int:
    """Bonferroni's ``m``: the number of metrics tested."""
    return len(TESTED)


class TextCounts:
    """Unigram and bigram counts of documents (token ids), per document so that a window's
    own document can be left out of the counts its surprisal is read from.

    With ``N`` tokens and vocabulary ``V`` in the documents counted: ``P1(b) = (c(b) + 1) /
    (N + V)`` (add-one), ``P2(b | a) = (c(a, b) + P1(b)) / (c(a .) + 1)`` (one pseudo-count
    spread as the unigram distribution, so an unseen context falls back to ``P1``); ``c(a .)``
    counts ``a`` as the first token of a bigram. No other smoothing (no discounting, no
    Kneser-Ney): a plain text statistic that knows nothing of any model."""

    def __init__(self, documents: Mapping[str, np.ndarray], vocab: int):
        docs = [np.asarray(d, np.int64) for d in documents.values()]
        self.names = list(documents)
        self.vocab = V = max([vocab] + [int(d.max()) + 1 for d in docs if d.size])
        self.unigram = np.stack([np.bincount(d, minlength=V) for d in docs])  # (D, V)
        self.context = np.stack([np.bincount(d[:-1], minlength=V) for d in docs])
        self.pairs = [np.unique(d[:-1] * V + d[1:], return_counts=True) for d in docs]

    def _pairs(self, codes: np.ndarray, keep: list[int]) -> np.ndarray:
        total = np.zeros(codes.shape, np.int64)
        for d in keep:
            keys, counts = self.pairs[d]
            at = np.clip(np.searchsorted(keys, codes), 0, len(keys) - 1)
            total += np.where(keys[at] == codes, counts[at], 0)
        return total

    def surprisal(self, previous: np.ndarray, tokens: np.ndarray, order: int,
                  exclude: int | None = None) -> np.ndarray:
        """``-log P(tokens)`` (order 1) or ``-log P(tokens | previous)`` (order 2), in nats,
        elementwise, from the counts of every document but ``exclude`` (an index)."""
        keep = [d for d in range(len(self.names)) if d != exclude]
        tokens = np.asarray(tokens, np.int64)
        uni = self.unigram[keep].sum(0)
        p1 = (uni[tokens] + 1.0) / (uni.sum() + self.vocab)
        if order == 1:
            return -np.log(p1)
        if order != 2:
            raise ValueError(f"order must be 1 or 2, got {order!r}")
        previous = np.asarray(previous, np.int64)
        pair = self._pairs(previous * self.vocab + tokens, keep)
        ctx = self.context[keep].sum(0)[previous]
        return -np.log((pair + p1) / (ctx + 1.0))

    def describe(self) -> dict[str, Any]:
        return {"documents": self.names, "tokens": int(self.unigram.sum()),
                "vocabulary": self.vocab}
