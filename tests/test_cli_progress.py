"""What a person sees while and after an ``svflow`` command runs: ``train``'s progress from
step 0, Ctrl-C as one line and exit code 130 with the command that resumes, the end of a
training run (``loss.png``, a one-line summary, a resumed run's figure over every step), and
``sweep``'s ``convergence.png`` and ``report.md``. The tiniest sizes of the other tests."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

from scripts_for_tests import ROOT

from svflow_jax import cli
from svflow_jax.cli import runtime

TINY_TRAIN = ["train", "--method", "euler", "--num-steps", "2", "--anchors", "2", "--d-model",
              "16", "--heads", "2", "--d-head", "8", "--d-ff", "32", "--context", "16",
              "--batch-size", "4", "--warmup", "0"]


def _svflow(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "svflow_jax", *argv]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")


def test_ctrl_c_in_train_is_one_line_exit_130_and_the_command_resumes(tmp_path):
    """A training run in a subprocess, with its progress bar: ``compiling`` before the first
    step, then the loss and the validation bits per character; SIGINT once it has validated
    (step 20): exit 130, one line (``interrupted at step N; last checkpoint step M; resume
    with: ...``), no traceback. The command that line gives resumes the run from step M, and
    its end is a one-line summary and a figure over every step."""
    out = tmp_path / "run"
    argv = [*TINY_TRAIN, "--steps", "200", "--eval-every", "20", "--checkpoint-every", "10",
            "--out", str(out)]
    proc = subprocess.Popen(_svflow(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and "val_bpc" in metrics.read_text():
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == runtime.EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
    lines = stderr.replace("\r", "\n").splitlines()
    assert lines[0].startswith("svflow train: compiling ")  # before anything compiles
    assert any("0/200" in line and "compiling the training step" in line for line in lines)
    assert any("val_bpc=" in line for line in lines)
    said = [line for line in lines if "interrupted" in line]
    assert len(said) == 1 and said[0] == lines[-1], stderr
    words = said[0].split("; ")
    assert words[0].startswith("svflow train: interrupted at step ")
    step = int(words[0].rsplit(" ", 1)[1])
    checkpoint = int(words[1].removeprefix("last checkpoint step "))
    assert 20 <= checkpoint <= step < 200 and checkpoint % 10 == 0
    command = words[2].removeprefix("resume with: ")
    assert shlex.split(command) == ["svflow", *argv]
    assert stdout == ""

    again = subprocess.run(_svflow([*shlex.split(command)[1:], "--no-progress"]), env=_env(),
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    final = json.loads((out / "final.json").read_text())
    assert final["resumed_from"] == checkpoint and final["steps"] == 200
    [summary] = again.stdout.splitlines()
    assert summary.startswith("done: 200 steps in ") and f"(resumed at step {checkpoint})" \
        in summary, summary
    assert " bits/char (best " in summary and summary.endswith(f"; out: {out}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(10, 201, 10))  # both runs' rows
    assert (out / "loss.png").stat().st_size > 10_000


def test_train_ends_on_a_summary_line_or_json_with_a_figure(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [*TINY_TRAIN, "--steps", "4", "--eval-every", "2", "--no-progress", "--out",
            str(out)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    [line] = captured.out.splitlines()
    assert line.startswith("done: 4 steps in ") and f"; out: {out}" in line
    assert ", validation " in line and "bits/char (best " in line and " at step " in line
    assert captured.err.startswith("svflow train: compiling ")
    assert (out / "loss.png").stat().st_size > 10_000
    assert json.loads((out / runtime.MARKER).read_text())["files"] == [
        "checkpoints", "config.json", "final.json", "loss.png", "metrics.csv", "metrics.jsonl",
        "run.json"]
    assert cli.main([*argv, "--json"]) == 0  # resumed, nothing to train: final.json's line
    final = json.loads(capsys.readouterr().out)
    assert final == json.loads((out / "final.json").read_text())
    assert final["resumed_from"] == 4


def test_sweep_writes_a_convergence_figure_and_a_report_verdicts_first(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--methods", "euler", "heun", "--steps", "16", "256", "--num-sizes", "5",
            "--tokens", "4", "--dim", "8", "--repeats", "1", "--no-progress", "--out",
            str(out)]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "svflow sweep: compiling " in err and " programs" in err
    assert (out / "convergence.png").stat().st_size > 10_000
    report = (out / "report.md").read_text().splitlines()
    rows = {name: json.loads((out / f"{name}.json").read_text()) for name in ("euler", "heun")}
    assert report[0] == "# svflow sweep"
    for line, (name, row) in zip(report[2:4], rows.items(), strict=True):
        assert line.startswith(f"- **PASS** `{name}`: fitted order ")
        assert f"against its nominal order {row['expected_order']}" in line
    table = [line for line in report if line.startswith("| `")]
    assert len(table) == 10 and table[0].startswith("| `euler` | 16 |")
    assert "![convergence](convergence.png)" in report
    assert cli.main(argv) == 0  # resumed: the report again, nothing compiled
    assert "compiling" not in capsys.readouterr().err


def test_ctrl_c_in_any_command_is_one_line_and_exit_130(capsys):
    """Where the command says nothing of its own: ``svflow <command>: interrupted``."""
    import argparse

    def interrupted(args, parser):
        raise KeyboardInterrupt

    parser = argparse.ArgumentParser(prog="svflow verify")
    assert runtime.execute(interrupted, argparse.Namespace(), parser) == 130
    assert capsys.readouterr().err == "svflow verify: interrupted\n"
    args = argparse.Namespace(argv=["sweep", "--methods", "euler"], out=None)
    assert runtime.command_line(args, "results/s x") == (
        "svflow sweep --methods euler --out 'results/s x'")
