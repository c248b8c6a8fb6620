"""The MoE study's verdicts (``experiments/objective_moe.py``) are decided by intervals.

Synthetic runs with known per-seed numbers: every decision's bound is the one-sided Student-t
bound at the Bonferroni-adjusted level, recomputed here with SciPy; the same means give
"reproduced" when the seeds agree and not when they scatter (the old rule compared means with
thresholds and could not tell the two apart); one seed leaves a verdict undecided.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

ROOT = Path(__file__).resolve().parents[1]


def _script():
    name = "objective_moe_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" /
                                                      "objective_moe.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _row(moe: bool, usage: float, dead: float, attn: float, cos_attn: float, cos_moe: float):
    row = {"val_loss": 2.0, "val_bpc": 2.9, "ece": 0.05, "attn_entropy_uniform": 2.0,
           "attn_entropy": [2.0 * attn] * 2, "attn_j_var": [0.1] * 2,
           "coupling_attn_cos": [cos_attn] * 2}
    if moe:
        row |= {"usage_entropy": [usage * math.log(8)] * 2, "max_load": [1.5] * 2,
                "dead": [dead] * 2, "router_entropy": [1.0] * 2, "moe_j_var": [0.1] * 2,
                "coupling_ffn_cos": [cos_moe] * 2, "coupling_ffn_norm_ratio": [1.0] * 2}
    return row


def _runs(seeds: int, noise: float, seed: int = 0) -> list[dict]:
    """top-2 none collapses (usage 0.5), switch/popkl/jvar balanced (0.9), dense attention
    leaves its initialisation (0.95 -> 0.6), couplings 0.8 (attention) and 0 (MoE); ``noise``
    scatters every per-seed value."""
    rng = np.random.default_rng(seed)
    arms = [("moe", 2, "none", 0.5, 2.0), ("moe", 2, "switch", 0.9, 0.0),
            ("moe", 2, "popkl", 0.9, 0.0), ("moe", 2, "jvar", 0.9, 0.0),
            ("gelu", None, "none", None, None)]
    runs = []
    for s in range(seeds):
        for ffn, k, method, usage, dead in arms:
            e = noise * rng.normal(size=5)
            moe = ffn == "moe"
            cfg = {"ffn": ffn, "top_k": k, "method": method, "seed": s, "n_experts": 8}
            final = _row(moe, (usage or 0) + e[0], max((dead or 0) + e[1], 0.0), 0.6 + e[2],
                         0.8 + e[3], e[4])
            start = _row(moe, 1.0, 0.0, 0.95, 0.0, 0.0)
            runs.append({"config": cfg, "final": final, "history": [start, final]})
    return runs


def test_every_verdict_is_decided_by_a_bonferroni_t_bound():
    script = _script()
    v = script.verdicts(_runs(5, 0.02), [1, 2])
    decisions = [d for e in v.values() for d in e["decisions"]]
    m = len(decisions)
    assert m == 10 and all(d["comparisons"] == m for d in decisions)
    for d in decisions:
        x = np.asarray(d["values"])
        t = scipy.stats.t.ppf(1 - 0.05 / m, len(x) - 1)
        half = t * x.std(ddof=1) / math.sqrt(len(x))
        want = x.mean() - half if d["side"] == "above" else x.mean() + half
        assert d["bound"] == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert {k: e["reproduced"] for k, e in v.items()} == {
        "moe_collapses": True, "attention_healthy": True, "popkl_as_switch": True,
        "jvar_as_switch": True, "coupling": True}


def test_the_same_means_scattered_over_seeds_are_not_reproduced():
    """Noise of 0.5 per seed: the means are those of the clear case, the intervals are wide."""
    v = _script().verdicts(_runs(5, 0.5, seed=3), [1, 2])
    assert v["moe_collapses"]["reproduced"] is False
    assert v["coupling"]["reproduced"] is False


def test_one_seed_is_undecided_and_top1_is_not_a_test_of_routing():
    script = _script()
    v = script.verdicts(_runs(1, 0.02), [1, 2])
    assert all(e["reproduced"] is None for e in v.values())
    only_top1 = script.verdicts(_runs(5, 0.02), [1])
    assert only_top1["moe_collapses"]["decisions"] == []
    assert only_top1["moe_collapses"]["reproduced"] is None


def test_a_switch_gated_top1_router_is_counted():
    """With ``--gate switch`` a top-1 router is trained by the task, so the top-1 arms enter the
    MoE decisions (the same runs relabelled top-1)."""
    script = _script()
    runs = _runs(5, 0.02)
    for r in runs:
        if r["config"]["top_k"] == 2:
            r["config"]["top_k"] = 1
    assert script.verdicts(runs, [1])["moe_collapses"]["decisions"] == []
    v = script.verdicts(runs, [1], gate="switch")
    assert [d["what"] for d in v["moe_collapses"]["decisions"]] == [
        "top-1: H(f)/log E of switch - none (paired by seed)"]
    assert v["moe_collapses"]["reproduced"] is True
