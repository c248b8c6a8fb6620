"""Calibration of the level-controlled tests of ``svflow diagnose`` on simulated studies.

Studies of the study's shape (36 windows = 6 documents x 6 passages, 6 shuffle levels) in
which metric and target (log-perplexity) are independent given the level, with persistent
effects that the design carries: a per-window effect in each (independent of each other), or
a per-document effect in each plus smaller window effects. For each null
(:func:`svflow_jax.diagnose.stats.level_controlled_spearman`): the former one (each level's
windows permuted separately), one permutation of the windows at every level, and the documents
permuted whole (with the windows within each), the share of studies rejected at 0.05 by each
statistic and by the rule (both p below 0.05 / 9); and the share with a control that explains
both, for the partial correlation given the control. Then the coverage of Bonferroni-level
percentile intervals (level ``1 - 0.05 / 9``) with 1000 resamples and with
:func:`~svflow_jax.diagnose.stats.bonferroni_resamples`, over windows (60 units) and over six
documents.

    python experiments/diagnose_calibration.py [--studies 1000] [--draws 2000]

prints the table (about 3 minutes on a 2-core CPU with the defaults).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from svflow_jax.diagnose import stats  # noqa: E402

W, K, D = 36, 6, 6
BOUND = 0.05 / 9


def study(rng: np.random.Generator, effects: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(metric, target, control): the level moves both; persistent effects per window or per
    document (independent in metric and target); the control, when used, is a third
    per-window effect shared by both (``effects == "control"``)."""
    level = 0.3 * np.arange(K)[None]
    groups = np.repeat(np.arange(D), W // D)
    control = rng.normal(size=(W, 1))

    def persistent():
        if effects == "document":
            return rng.normal(size=D)[groups][:, None] + 0.5 * rng.normal(size=(W, 1))
        return rng.normal(size=(W, 1))

    shared = control if effects == "control" else 0.0
    target = level + shared + persistent() + 0.3 * rng.normal(size=(W, K))
    metric = 2.0 * level + shared + persistent() + 0.3 * rng.normal(size=(W, K))
    return metric, target, np.broadcast_to(control, (W, K))


def rates(effects: str, studies: int, draws: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(D), W // D)
    hits: dict[str, int] = {}

    def count(key: str, ok: bool) -> None:
        hits[key] = hits.get(key, 0) + bool(ok)

    for i in range(studies):
        metric, target, control = study(rng, effects)
        for null, g in (("windows", None), ("documents", groups)):
            r = stats.level_controlled_spearman(metric, target, +1, draws, seed=i, groups=g,
                                                control=control if effects == "control" else None)
            if null == "windows":
                count("former: stratified p < 0.05", r.former_stratified_p < 0.05)
                count("former: rule", r.former_stratified_p < BOUND and r.former_partial_p < BOUND)
            count(f"{null}: stratified p < 0.05", r.stratified_p < 0.05)
            count(f"{null}: partial p < 0.05", r.partial_p < 0.05)
            count(f"{null}: rule", r.stratified_p < BOUND and r.partial_p < BOUND)
            if effects == "control":
                count(f"{null}: given the control p < 0.05", r.controlled_p < 0.05)
    return {k: v / studies for k, v in hits.items()}


def coverage(units: int, resamples: int, reps: int, clusters: bool) -> float:
    """Share of Bonferroni-level percentile intervals of a mean that miss the true mean 0."""
    rng = np.random.default_rng(1)
    if clusters:  # six documents of six windows, document effects dominate
        groups = np.repeat(np.arange(units), 6)
        idx = stats.cluster_bootstrap_indices(groups, resamples, seed=2)
    else:
        idx = stats.bootstrap_indices(units, resamples, seed=2)
    misses = 0
    for _ in range(reps):
        if clusters:
            x = np.repeat(rng.normal(size=units), 6) + 0.3 * rng.normal(size=units * 6)
        else:
            x = rng.normal(size=units)
        lo, hi = stats.percentile_interval(x[idx].mean(-1), 1 - BOUND)
        misses += not lo <= 0.0 <= hi
    return misses / reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--studies", type=int, default=1000)
    p.add_argument("--draws", type=int, default=2000)
    args = p.parse_args(argv)
    mc = math.sqrt(0.05 * 0.95 / args.studies)
    print(f"{args.studies} simulated studies, {args.draws} draws each; nominal 0.05 (Monte "
          f"Carlo sd {mc:.3f}); the rule's nominal rate is at most {BOUND:.4f}")
    for effects in ("window", "document", "control"):
        print(f"\n{effects} effects")
        for k, v in rates(effects, args.studies, args.draws).items():
            print(f"  {k:<40} {v:.3f}")
    need = stats.bonferroni_resamples(0.05, 9)
    print(f"\nmiss rate of 1 - 0.05/9 percentile intervals of a mean (nominal {BOUND:.4f}), "
          "2000 samples:")
    for label, units, clusters in (("60 windows", 60, False), ("6 documents", 6, True)):
        for b in (1000, need):
            print(f"  {label}, {b} resamples: {coverage(units, b, 2000, clusters):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
