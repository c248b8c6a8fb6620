"""The MoE study's verdicts (``experiments/objective_moe.py``) are decided by intervals.

Synthetic runs with known per-seed numbers: every decision's bound is the one-sided Student-t
bound at the Bonferroni-adjusted level, recomputed here with SciPy; the same means give
"reproduced" when the seeds agree and not when they scatter (the old rule compared means with
thresholds and could not tell the two apart); one seed leaves a verdict undecided.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import scipy.stats
from scripts_for_tests import import_script


def _script():
    return import_script("objective_moe.py")


def _row(moe: bool, usage: float, dead: float, attn: float, cos_attn: float, cos_moe: float):
    row = {"val_loss": 2.0, "val_bpc": 2.9, "ece": 0.05, "attn_entropy_uniform": 2.0,
           "attn_entropy": [2.0 * attn] * 2, "attn_j_var": [0.1] * 2,
           "coupling_attn_cos": [cos_attn] * 2, "coupling_attn_token_cos": [cos_attn] * 2,
           "coupling_attn_post_share": [0.3] * 2}
    if moe:
        row |= {"usage_entropy": [usage * math.log(8)] * 2, "max_load": [1.5] * 2,
                "dead": [dead] * 2, "router_entropy": [1.0] * 2, "moe_j_var": [0.1] * 2,
                "coupling_ffn_cos": [cos_moe] * 2, "coupling_ffn_token_cos": [cos_moe] * 2,
                "coupling_ffn_post_share": [0.1] * 2, "coupling_ffn_norm_ratio": [1.0] * 2}
    return row


# (ffn, top-k, method, coefficient, final usage, final dead, final attention entropy, control)
ARMS = [("moe", 2, "none", 0.01, 0.5, 2.0, 0.6, False),
        ("moe", 2, "switch", 0.01, 0.9, 0.0, 0.6, False),
        ("moe", 2, "popkl", 0.01, 0.9, 0.0, 0.6, False),
        ("moe", 2, "jvar", 0.01, 0.9, 0.0, 0.6, False),
        ("gelu", None, "none", 0.01, None, None, 0.6, False),
        ("gelu", None, "none", 0.01, None, None, 0.3, True)]


def _runs(seeds: int, noise: float, seed: int = 0, arms=ARMS) -> list[dict]:
    """top-2 none collapses (usage 0.5), switch/popkl/jvar balanced (0.9), dense attention
    leaves its initialisation (0.95 -> 0.6; the stop-gradient control's to 0.3), couplings 0.8
    (attention) and 0 (MoE); ``noise`` scatters every per-seed value."""
    rng = np.random.default_rng(seed)
    runs = []
    for s in range(seeds):
        for ffn, k, method, coef, usage, dead, attn, control in arms:
            e = noise * rng.normal(size=5)
            moe = ffn == "moe"
            cfg = {"ffn": ffn, "top_k": k, "method": method, "seed": s, "n_experts": 8,
                   "coef": coef, "qk_stop_gradient": control}
            final = _row(moe, (usage or 0) + e[0], max((dead or 0) + e[1], 0.0), attn + e[2],
                         0.8 + e[3], e[4])
            start = _row(moe, 1.0, 0.0, 0.95, 0.0, 0.0)
            runs.append({"config": cfg, "final": final,
                         "history": [{"step": 0, **start}, {"step": 50, **final}]})
    return runs


def test_every_verdict_is_decided_by_a_bonferroni_t_bound():
    script = _script()
    v = script.verdicts(_runs(5, 0.01), [1, 2])
    decisions = [d for e in v.values() for d in e["decisions"]]
    m = len(decisions)
    assert m == 14 and all(d["comparisons"] == m for d in decisions)
    for d in decisions:
        x = np.asarray(d["values"])
        t = scipy.stats.t.ppf(1 - 0.05 / m, len(x) - 1)
        half = t * x.std(ddof=1) / math.sqrt(len(x))
        want = x.mean() - half if d["side"] == "above" else x.mean() + half
        assert d["bound"] == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert {k: e["reproduced"] for k, e in v.items()} == {
        "moe_collapses": True, "attention_healthy": True, "popkl_as_switch": True,
        "jvar_as_switch": True, "coupling": True, "coupling_causal": True}


def test_the_same_means_scattered_over_seeds_are_not_reproduced():
    """Noise of 0.5 per seed: the means are those of the clear case, the intervals are wide."""
    v = _script().verdicts(_runs(5, 0.5, seed=3), [1, 2])
    assert v["moe_collapses"]["reproduced"] is False
    assert v["coupling"]["reproduced"] is False
    assert v["coupling_causal"]["reproduced"] is False
    assert v["popkl_as_switch"]["reproduced"] is False
    assert v["popkl_as_switch"]["passing_coefs"] == []


def test_one_seed_is_undecided_and_top1_is_not_a_test_of_routing():
    script = _script()
    v = script.verdicts(_runs(1, 0.02), [1, 2])
    assert all(e["reproduced"] is None for e in v.values())
    only_top1 = script.verdicts(_runs(5, 0.01), [1])
    assert only_top1["moe_collapses"]["decisions"] == []
    assert only_top1["moe_collapses"]["reproduced"] is None


def test_a_switch_gated_top1_router_is_counted():
    """With ``--gate switch`` a top-1 router is trained by the task, so the top-1 arms enter the
    MoE decisions (the same runs relabelled top-1)."""
    script = _script()
    runs = _runs(5, 0.01)
    for r in runs:
        if r["config"]["top_k"] == 2:
            r["config"]["top_k"] = 1
    assert script.verdicts(runs, [1])["moe_collapses"]["decisions"] == []
    v = script.verdicts(runs, [1], gate="switch")
    assert [d["what"] for d in v["moe_collapses"]["decisions"]] == [
        "top-1: H(f)/log E of switch - none (paired by seed)"]
    assert v["moe_collapses"]["reproduced"] is True


def test_each_coefficient_is_decided_and_counted():
    """popKL / J_var at three coefficients: each coefficient's two decisions count in ``m``;
    only the coefficient whose per-seed values clear both bounds passes. The means of the
    middle coefficient clear the thresholds but its seeds scatter: not passed."""
    script = _script()
    arms = [a for a in ARMS if a[2] not in ("popkl", "jvar")] + [
        ("moe", 2, method, coef, usage, dead, 0.6, False)
        for method in ("popkl", "jvar")
        for coef, usage, dead in ((0.01, 0.5, 2.0), (0.1, 0.9, 0.0), (1.0, 0.9, 0.0))]
    runs = _runs(5, 0.01, arms=arms)
    for r in runs:  # scatter coefficient 0.1 only: mean kept, per seed +-0.4
        if r["config"]["coef"] == 0.1 and r["config"]["method"] in ("popkl", "jvar"):
            shift = (-0.4, 0.4, -0.3, 0.3, 0.0)[r["config"]["seed"]]
            r["final"]["usage_entropy"] = [(0.9 + shift) * math.log(8)] * 2
    v = script.verdicts(runs, [1, 2])
    decisions = [d for e in v.values() for d in e["decisions"]]
    assert len(decisions) == 14 + 2 * 2 * 2
    for key in ("popkl_as_switch", "jvar_as_switch"):
        e = v[key]
        assert [d["what"][:15] for d in e["decisions"][::2]] == [
            "top-2, coef 0.0", "top-2, coef 0.1", "top-2, coef 1: "]
        assert e["passing_coefs"] == [1.0] and e["reproduced"] is True
        middle = e["decisions"][2]
        assert middle["mean"] > -0.05 and middle["passed"] is False
    # without the good coefficient nothing passes
    runs = [r for r in runs if r["config"]["coef"] != 1.0 or r["config"]["method"] == "switch"]
    v = script.verdicts(runs, [1, 2])
    assert v["popkl_as_switch"]["reproduced"] is False
    assert v["popkl_as_switch"]["passing_coefs"] == []


def test_an_undecided_coefficient_leaves_the_verdict_undecided():
    """No coefficient passes, one failed and one undecided (run at one seed): the verdict is
    undecided (None), not "not reproduced", since the undecided one might pass."""
    script = _script()
    arms = [a for a in ARMS if a[2] not in ("popkl", "jvar")] + [
        ("moe", 2, method, coef, 0.5, 2.0, 0.6, False)
        for method in ("popkl", "jvar") for coef in (0.01, 0.1)]
    runs = [r for r in _runs(5, 0.01, arms=arms)
            if r["config"]["coef"] != 0.1 or r["config"]["seed"] == 0
            or r["config"]["method"] not in ("popkl", "jvar")]
    v = script.verdicts(runs, [1, 2])
    for key in ("popkl_as_switch", "jvar_as_switch"):
        assert v[key]["passing_coefs"] == [] and v[key]["reproduced"] is None, key
    decided = [r for r in runs if r["config"]["coef"] != 0.1
               or r["config"]["method"] not in ("popkl", "jvar")]
    assert script.verdicts(decided, [1, 2])["popkl_as_switch"]["reproduced"] is False


def test_the_coupling_control_is_decided_paired_by_seed():
    """The stop-gradient control's verdict is the paired (control - plain) attention entropy's
    upper bound; a control whose entropy is higher is not reproduced, and one whose mean is
    lower but whose seeds scatter is not either."""
    script = _script()
    higher = [a[:6] + ((0.8,) if a[7] else (a[6],)) + a[7:] for a in ARMS]
    v = script.verdicts(_runs(5, 0.01, arms=higher), [2])
    d = v["coupling_causal"]["decisions"][0]
    assert d["mean"] > 0 and v["coupling_causal"]["reproduced"] is False
    runs = _runs(5, 0.01)
    for r in runs:
        if r["config"]["qk_stop_gradient"]:
            shift = (-0.5, 0.5, -0.4, 0.4, 0.0)[r["config"]["seed"]]
            r["final"]["attn_entropy"] = [2.0 * (0.55 + shift)] * 2
    d = script.verdicts(runs, [2])["coupling_causal"]
    assert d["decisions"][0]["mean"] < 0 and d["reproduced"] is False
    # the control's coupling (no posterior gradient) is not averaged into attention's
    assert all(not math.isnan(x) for x in
               script.verdicts(runs, [2])["coupling"]["decisions"][0]["values"])


def test_attention_coupling_is_the_mean_of_the_other_arms_at_each_seed():
    """The attention coupling of seed ``s`` is the mean over that seed's arms, the
    stop-gradient control left out: a control at -5 and other seeds' values change nothing."""
    script = _script()
    runs = _runs(3, 0.01)
    for r in runs:
        if r["config"]["qk_stop_gradient"]:
            r["final"]["coupling_attn_cos"] = [-5.0] * 2
    expected = [np.mean([r["final"]["coupling_attn_cos"][0] for r in runs
                         if r["config"]["seed"] == s and not r["config"]["qk_stop_gradient"]])
                for s in range(3)]
    got = script.verdicts(runs, [2])["coupling"]["decisions"][0]["values"]
    assert got == pytest.approx(expected, abs=1e-12)
    assert len(set(np.round(expected, 12))) == 3  # the seeds differ: a mix of them would show


def test_attention_that_collapsed_below_a_quarter_of_the_uniform_entropy_is_not_healthy():
    """The "no collapse" floor is a quarter of the uniform posterior's entropy: dense
    attention ending at 0.3 of it (the seeds agreeing) is healthy, at 0.2 it is not, however
    far it fell from its initialisation."""
    script = _script()

    def healthy(share):
        arms = [a[:6] + ((share,) if a[0] == "gelu" and not a[7] else (a[6],)) + a[7:]
                for a in ARMS]
        return script.verdicts(_runs(5, 0.01, arms=arms), [2])["attention_healthy"]

    assert healthy(0.3)["reproduced"] is True
    low = healthy(0.2)
    assert low["reproduced"] is False
    assert [d["passed"] for d in low["decisions"]] == [True, False]


def test_when_attention_leaves_its_initialisation():
    """The first evaluated step whose one-sided 95% t upper bound of ``H_t - H_0`` is below 0,
    recomputed with SciPy; a step whose mean falls but whose seeds scatter does not count."""
    script = _script()
    runs = _runs(4, 0.0)
    drops = {50: [0.1, -0.3, 0.05, -0.2], 100: [-0.2, -0.25, -0.3, -0.22]}
    plain = [r for r in runs if r["config"]["ffn"] == "gelu" and not
             r["config"]["qk_stop_gradient"]]
    for r in plain:
        start = r["history"][0]
        r["history"] = [start] + [
            {**start, "step": t, "attn_entropy": [2.0 * (0.95 + d[r["config"]["seed"]])] * 2}
            for t, d in drops.items()]
    e = script.leaves_initialisation(runs, "dense / none")
    for row, (t, d) in zip(e["steps"], drops.items(), strict=True):
        x = np.asarray(d)  # H_0 = 0.95 in every seed
        want = x.mean() + scipy.stats.t.ppf(0.95, 3) * x.std(ddof=1) / 2.0
        assert row["step"] == t and row["upper"] == pytest.approx(want, abs=1e-12)
    assert np.mean(drops[50]) < 0 and e["steps"][0]["upper"] > 0
    assert e["step"] == 100


def _decided(values, side, threshold, others=0):
    script = _script()
    ds = [script.decision("d", values, side, threshold)]
    ds += [script.decision("other", [0.0, 1.0], "above", 0.0) for _ in range(others)]
    script.decide(ds)
    return ds[0]


def test_a_decision_at_its_threshold_does_not_pass():
    """Seeds that agree (no scatter): the bound is the mean; a bound equal to the threshold
    fails on either side, the next number passes."""
    for t in (0.0, 0.25, -0.05):
        assert _decided([t, t], "above", t)["passed"] is False
        assert _decided([t, t], "below", t)["passed"] is False
        up, down = math.nextafter(t, math.inf), math.nextafter(t, -math.inf)
        assert _decided([up, up], "above", t)["passed"] is True
        assert _decided([down, down], "below", t)["passed"] is True
        assert _decided([down, down], "above", t)["passed"] is False
        assert _decided([up, up], "below", t)["passed"] is False


def test_a_decision_bound_is_one_sided_at_the_bonferroni_level():
    script = _script()
    v = [0.3, 0.5, 0.4]
    for m, side in ((1, "above"), (4, "above"), (4, "below")):
        d = _decided(v, side, 0.0, others=m - 1)
        half = scipy.stats.t.ppf(1 - script.ALPHA / m, 2) * np.std(v, ddof=1) / math.sqrt(3)
        assert d["comparisons"] == m and d["mean"] == pytest.approx(0.4)
        assert d["bound"] == pytest.approx(0.4 - half if side == "above" else 0.4 + half)
    # two seeds decide, one does not; non-finite values are dropped before counting
    assert _decided([1.0, 1.1], "above", 0.0)["passed"] is True
    assert _decided([1.0], "above", 0.0)["passed"] is None
    assert _decided([1.0, math.nan], "above", 0.0)["passed"] is None
    assert math.isnan(_decided([], "above", 0.0)["mean"])


def test_a_verdict_is_reproduced_when_every_decision_passes():
    v = _script()._verdict
    assert v([]) is None
    assert v([{"passed": True}, {"passed": True}]) is True
    assert v([{"passed": True}, {"passed": False}]) is False
    assert v([{"passed": False}, {"passed": None}]) is None
    assert v([{"passed": None}]) is None


def test_every_threshold_is_the_one_its_criterion_states():
    """The thresholds and sides of the decisions are those the criteria print (the margin,
    the attention floor, the dead-expert and coupling bounds)."""
    script = _script()
    v = script.verdicts(_runs(3, 0.01), [2])
    got = {k: [(d["side"], d["threshold"]) for d in e["decisions"]] for k, e in v.items()}
    assert got["moe_collapses"] == [("above", 0.0)]
    assert got["attention_healthy"] == [("below", 0.0), ("above", script.ATTENTION_FLOOR)]
    assert got["popkl_as_switch"] == got["jvar_as_switch"] == [("above", -script.MARGIN),
                                                                ("below", 1.0)]
    assert "< 1 dead expert per layer" in v["popkl_as_switch"]["criterion"]
    coupling = v["coupling"]["criterion"]
    attention = float(re.search(r"attention's lower bound > ([0-9.]+)", coupling)[1])
    low, high = map(float, re.search(r"inside \((-?[0-9.]+), ([0-9.]+)\)", coupling).groups())
    assert got["coupling"] == [("above", attention), ("above", low), ("below", high)] * 2
    assert got["coupling_causal"] == [("below", 0.0)]
    assert f"> {script.ATTENTION_FLOOR}" in v["attention_healthy"]["criterion"]
    assert f"by more than {script.MARGIN}" in v["popkl_as_switch"]["criterion"]
    # the study's constants: a 5% family-wise error rate, margins on a [0, 1] scale
    assert 0 < script.ALPHA <= 0.05 and 0 < script.MARGIN < 0.5 < 1
    assert 0 < script.ATTENTION_FLOOR < 1


def test_top1_routers_count_with_the_switch_gate_only():
    script = _script()
    runs = _runs(3, 0.01, arms=[a if a[1] is None else ("moe", 1) + a[2:] for a in ARMS]
                 + [a for a in ARMS if a[1] == 2])
    plain = script.verdicts(runs, [1, 2])
    switch = script.verdicts(runs, [1, 2], gate="switch")
    assert [d["what"][:5] for d in plain["moe_collapses"]["decisions"]] == ["top-2"]
    assert [d["what"][:5] for d in switch["moe_collapses"]["decisions"]] == ["top-1", "top-2"]
    assert "top-k >= 2" in plain["coupling"]["decisions"][1]["what"]
    assert "every top-k" in switch["coupling"]["decisions"][1]["what"]


def test_legend_under_the_verdict_table(monkeypatch):
    """The legend follows the table's last row and quotes the rule's level (ALPHA over the
    decisions, Bonferroni); change ALPHA and the legend follows."""
    script = _script()
    v = script.verdicts(_runs(5, 0.01), [1, 2])
    m = next(d["comparisons"] for e in v.values() for d in e["decisions"])
    table, legend = script.verdict_lines(v).split("\n\n")
    assert table.startswith("| paper's statement") and legend.startswith("*Legend.* Columns:")
    assert f"level 1 - {script.ALPHA}/{m} ({m} decisions, Bonferroni)" in legend
    monkeypatch.setattr(script, "ALPHA", 0.01)
    assert f"level 1 - 0.01/{m}" in script.verdict_lines(v)
