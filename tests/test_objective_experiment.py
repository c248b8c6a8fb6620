"""Smoke test of ``experiments/objective_moe.py``: a tiny run writes every output and the
report reads its own numbers back; bad options exit with status 2."""

import json
import os

import pytest
from scripts_for_tests import assert_refused, run_script


def _run(*args):
    return run_script("objective_moe.py", *args)


def test_quick_subset_writes_report(tmp_path):
    out = tmp_path / "r"
    proc = _run("--quick", "--out", str(out), "--methods", "none", "switch", "--steps", "2",
                "--dense-methods", "--control-methods", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("config.json", "runs.jsonl", "curves.csv", "final.csv", "table.csv",
                 "summary.json", "report.md", "usage_entropy.png", "coupling_attn.png"):
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"] == 2 and summary["quick"]
    assert summary["environment"]["cpu_count"] == os.cpu_count()
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["environment"]["cpu_count"] for r in runs] == [os.cpu_count()] * 2
    table = summary["table"]
    assert set(table) == {"moe top-1 / none", "moe top-1 / switch"}
    h = table["moe top-1 / none"]["usage_entropy_norm"]["mean"]
    assert 0.0 <= h <= 1.0 + 1e-9
    assert "QUICK" in (out / "report.md").read_text()
    # --report-only reads runs.jsonl back without training
    again = _run("--quick", "--out", str(out), "--report-only", "--no-progress")
    assert again.returncode == 0, again.stderr[-2000:]


@pytest.mark.parametrize(("bad", "named"), [
    (["--steps", "0"], "--steps"), (["--seeds", "x"], "--seeds"), (["--coef", "-1"], "--coef"),
    (["--coefs", "0.1", "nan"], "--coefs"), (["--control-methods", "switch"], "switch"),
    (["--methods", "bogus"], "bogus"), (["--top-ks", "0"], "--top-ks"),
    (["--top-ks", "1", "9"], "at most the 8 experts")])
def test_bad_options_exit_2(tmp_path, bad, named):
    proc = _run("--quick", "--out", str(tmp_path / "r"), *bad)
    assert_refused(proc, named, tmp_path / "r")
