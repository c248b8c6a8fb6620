"""Reliability of the ``svflow`` commands: file modes of the atomic writes, ``--overwrite``
that never replaces a file the command did not write, sizes refused before anything is
allocated, bad numbers refused as option errors, and what a killed run leaves behind. Every
refusal here happens before anything is compiled."""

from __future__ import annotations

import contextlib
import os
import stat
import time

import pytest
from test_cli import refused

from svflow_jax import atomic


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_outputs_get_the_mode_of_a_plain_open(tmp_path, mask, mode):
    with _umask(mask):
        atomic.write_json(tmp_path / "summary.json", {"a": 1})
        atomic.write_text(tmp_path / "report.md", "# report\n")
        with atomic.replacing(tmp_path / "figure.png") as f:
            f.write(b"\x89PNG")
        (tmp_path / "plain.txt").write_text("plain open()")
    for name in ("summary.json", "report.md", "figure.png", "plain.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name


def test_an_existing_files_mode_is_kept_when_it_is_replaced(tmp_path):
    path = tmp_path / "config.json"
    atomic.write_json(path, {"a": 1})
    path.chmod(0o640)
    with _umask(0o077):
        atomic.write_json(path, {"a": 2})
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


# ---------------------------------------------------------------------------------------------
# --overwrite replaces only the command's own earlier outputs
# ---------------------------------------------------------------------------------------------


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _model_folder(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "tokenizer.json").write_text("{}")
    return model


def test_diagnose_overwrite_into_the_models_own_folder_is_refused(tmp_path, capsys):
    model = _model_folder(tmp_path)
    before = _files(model)
    refused(["diagnose", str(model), "--overwrite", "--out", str(model)],
            f"--out {model}: the folder holds a model (config.json, model.safetensors)", capsys)
    assert _files(model) == before  # config.json intact: the model still loads
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "m.gguf").write_bytes(b"GGUF")
    refused(["verify", "--overwrite", "--out", str(gguf)], "holds a GGUF model (m.gguf)", capsys)


def _training_run(folder, manifest: bool):
    from svflow_jax.cli import runtime

    if manifest:
        runtime.prepare_out(folder, "train", resumable=True).release()
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "config.json").write_text('{"steps": 10}')
    (folder / "run.json").write_text('{"devices": 1}')
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    if manifest:
        marker = folder / runtime.MARKER
        marker.write_text(marker.read_text().replace('"files": null', '"files": ["checkpoints", '
                                                     '"config.json", "metrics.jsonl", '
                                                     '"run.json"]'))


@pytest.mark.parametrize("manifest", [True, False])
def test_verify_overwrite_into_a_training_run_is_refused(tmp_path, capsys, manifest):
    run = tmp_path / "run"
    _training_run(run, manifest)
    before = _files(run)
    named = "holds the results of svflow train" if manifest else \
        "holds a training run (checkpoints, metrics.jsonl, run.json)"
    err = refused(["verify", "--quick", "--overwrite", "--out", str(run)], named, capsys)
    assert "--overwrite never writes into it" in err
    assert _files(run) == before  # the run's config.json: it can still resume


def test_train_overwrite_keeps_another_runs_metrics(tmp_path, capsys):
    """A training run that no manifest names (written by ``svflow_jax.training.train``) and
    another command's results are both refused, metrics.jsonl untouched."""
    run = tmp_path / "run"
    _training_run(run, manifest=False)
    before = _files(run)
    argv = ["train", "--method", "euler", "--num-steps", "2", "--d-model", "16", "--heads",
            "2", "--d-head", "8", "--d-ff", "32", "--context", "16", "--steps", "3",
            "--overwrite", "--no-progress"]
    refused([*argv, "--out", str(run)], "holds a training run", capsys)
    assert _files(run) == before
    from svflow_jax.cli import runtime

    verified = runtime.prepare_out(tmp_path / "verified", "verify")
    (verified.path / "summary.json").write_text("{}")
    verified.finish()
    refused([*argv, "--out", str(verified.path)], "holds the results of svflow verify", capsys)


def test_overwrite_writes_beside_other_files_but_never_replaces_them(tmp_path, capsys):
    from svflow_jax.cli import runtime

    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "config.json").write_text("mine too")
    refused(["verify", "--quick", "--out", str(folder)], "pass --overwrite (which keeps them)",
            capsys)
    refused(["verify", "--quick", "--overwrite", "--out", str(folder)],
            "svflow verify would replace config.json, which it did not write", capsys)
    (folder / "config.json").unlink()
    out = runtime.prepare_out(folder, "verify", overwrite=True)  # beside notes.txt: allowed
    (folder / "report.md").write_text("first")
    out.finish()
    again = runtime.prepare_out(folder, "verify")  # its own report is replaced, notes kept
    assert again.files() == ["notes.txt"] and (folder / "notes.txt").read_text() == "mine"
    again.release()


def test_the_manifest_names_the_command_and_its_files(tmp_path):
    import json

    from svflow_jax.cli import runtime

    out = runtime.prepare_out(tmp_path / "sweep", "sweep", resumable=True)
    (out.path / "euler.json").write_text("{}")
    out.finish()
    again = runtime.prepare_out(tmp_path / "sweep", "sweep", resumable=True)
    (again.path / "heun.json").write_text("{}")
    again.finish()  # a resumed run: the files of both runs are its own
    manifest = json.loads((tmp_path / "sweep" / runtime.MARKER).read_text())
    assert manifest == {"command": "sweep", "before": [], "files": ["euler.json", "heun.json"]}


# ---------------------------------------------------------------------------------------------
# What a killed run leaves: its lock, its temporary files
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_a_lock_naming_a_live_process_that_is_not_the_run_is_taken_over(tmp_path):
    """The process id of a killed run is reused by another program: the lock is stale."""
    import subprocess
    import sys

    from svflow_jax.cli import runtime

    out = tmp_path / "out"
    runtime.prepare_out(out, "train", resumable=True).release()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for lock in (str(other.pid), f"{other.pid} 1"):  # no start time; another start time
            (out / runtime.LOCK).write_text(lock)
            runtime.prepare_out(out, "train", resumable=True).release()
            assert not (out / runtime.LOCK).exists()
        # the live run itself (same process, same start time) keeps the folder
        held = runtime.prepare_out(out, "train", resumable=True)
        assert (out / runtime.LOCK).read_text().split()[0] == str(os.getpid())
        with pytest.raises(runtime.UsageError, match=r"another svflow run \(process \d+\)"):
            runtime.prepare_out(out, "train", resumable=True)
        held.release()
    finally:
        other.kill()
        other.wait()


def test_the_temporary_files_of_a_killed_run_are_removed_when_it_resumes(tmp_path):
    from svflow_jax.cli import runtime

    out = tmp_path / "sweep"
    runtime.prepare_out(out, "sweep", resumable=True)  # killed: never finished nor released
    (out / "euler.json").write_text("{}")
    (out / ".heun.json.k3x_9a2b.tmp").write_text('{"half": ')  # atomic.replacing's, cut
    (out / "tables").mkdir()
    (out / "tables" / ".a.csv.0a1b2c3d.tmp").write_text("x,")
    (out / runtime.LOCK).unlink()
    runtime.prepare_out(out, "sweep", resumable=True).release()
    assert sorted(p.name for p in out.rglob("*") if p.name != runtime.MARKER) == [
        "euler.json", "tables"]
    # a folder that is not an svflow run's keeps its files, temporary-looking or not
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ".draft.abcdefgh.tmp").write_text("mine")
    runtime.prepare_out(mine, "verify", overwrite=True).release()
    assert (mine / ".draft.abcdefgh.tmp").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# Sizes: bounded or estimated before anything is allocated
# ---------------------------------------------------------------------------------------------

_SMALL_TRAIN = ["train", "--method", "euler", "--weights", "chebyshev"]


@pytest.mark.parametrize(("argv", "named"), [
    (["verify", "--dim", "100000"], "--dim: the weights of 140 layers in d = 100000 needs about"),
    (["sweep", "--dim", "100000"], "--dim: the weights of"),
    (["verify", "--layers", "100000"], "--layers 100000: at most 4096"),
    (["diagnose", "--bootstrap", "10000000"], "--bootstrap: the bootstrap (10000000 resamples"),
    (["diagnose", "--permutations", "500"], "--permutations: one window's batch (2501 sequences"),
    (["diagnose", "--permutations", "100000"], "--permutations 100000: at most 1000"),
    ([*_SMALL_TRAIN, "--anchors", "100000"], "--anchors 100000: at most 4096"),
    ([*_SMALL_TRAIN, "--random-depths", "100000"], "--random-depths 100000: at most 4096"),
    ([*_SMALL_TRAIN, "--extra-depths", "100000"], "--extra-depths 100000: at most 4096"),
    (["train", "--num-steps", "100000", "--anchors", "4"], "--num-steps 100000: at most 4096"),
    (["inspect", "smollm2-135m-instruct", "--substeps", "2", "1000000"],
     "--substeps 1000000: at most 1024"),
])
def test_sizes_are_refused_in_seconds_naming_the_option(argv, named, tmp_path, capsys):
    start = time.perf_counter()
    err = refused([*argv, "--out", str(tmp_path / "out")], named, capsys)
    assert time.perf_counter() - start < 5
    if "needs about" in named:
        assert "more than the limit of" in err and "GiB" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("argv", "named"), [
    ([*_SMALL_TRAIN, "--anchors", "4000"], "--anchors: training this model (d = 192, 4000 anchors"),
    ([*_SMALL_TRAIN, "--random-depths", "4000"], "--random-depths: training this model"),
    ([*_SMALL_TRAIN, "--extra-depths", "2000", "2000"], "--extra-depths: training this model"),
])
def test_a_training_state_larger_than_the_memory_names_the_option_behind_it(
        argv, named, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SVFLOW_MEMORY_BYTES", str(2**31))  # a 2 GiB machine: limit 1 GiB
    start = time.perf_counter()
    err = refused([*argv, "--out", str(tmp_path / "out")], named, capsys)
    assert time.perf_counter() - start < 5
    assert "more than the limit of 1 GiB (half of this machine's 2 GiB" in err


def test_the_memory_limit_is_half_the_machine_whatever_is_free_now(monkeypatch):
    from svflow_jax.cli import runtime

    monkeypatch.delenv("SVFLOW_MEMORY_BYTES", raising=False)
    assert runtime.memory_limit() == int(runtime.machine_memory() / 2) > 0
    with pytest.raises(runtime.UsageError, match=r"^--x: y needs about 1\.61e\+09 GiB"):
        runtime.check_memory(2**60 * 1.5, "--x", "y")


# ---------------------------------------------------------------------------------------------
# Bad numbers and bad files: option errors naming what is wrong
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("content", "words"), [
    (b"", "the file is empty"),
    (b"GGUF\x03\x00\x00\x00\x01", "header at byte 0 needs 24 bytes, the file has 9 left"),
    (b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little") * 2,
     "cannot fit in the file"),
    (b"PK\x03\x04" + bytes(40), "not a GGUF file (magic"),
])
def test_a_damaged_gguf_is_refused_in_words(tmp_path, capsys, content, words):
    path = tmp_path / "damaged.gguf"
    path.write_bytes(content)
    err = refused(["inspect", str(path), "--quick", "--out", str(tmp_path / "out")],
                  f"{path}: unreadable GGUF header or tensor table", capsys)
    assert words in err and "_Bad" not in err and "Error:" not in err


@pytest.mark.parametrize(("content", "named"), [
    ("{not json", "not JSON (Expecting property name"),
    ('{"steps": 3}', 'not the config.json of a training run'),
    ('{"steps": 3, "stepz": 4, "model": {}}', "unknown field 'stepz'"),
    ('{"model": {"d_modl": 16}}', "unknown field 'model.d_modl'"),
    ('{"model": {"weights": "cubic"}}', "weights must be"),
])
def test_a_bad_train_config_names_the_file_and_the_field(tmp_path, capsys, content, named):
    config = tmp_path / "config.json"
    config.write_text(content)
    refused(["train", "--config", str(config), "--out", str(tmp_path / "out")],
            f"--config {config}: {named}", capsys)


@pytest.mark.parametrize(("argv", "named"), [
    (["verify", "--strength", "1e6"], "--strength 1e+06: at most 30 (the float64 reference"),
    (["sweep", "--strength", "31"], "--strength 31: at most 30"),
    (["verify", "--t1", "1e308"], "--t1 x --strength 1e+308: at most 30"),
    (["verify", "--t1", "10", "--strength", "4"], "--t1 x --strength 40: at most 30"),
    (["diagnose", "--scaling-factors", "1", "1e308"], "--scaling-factors 1e+308: at most 100"),
])
def test_bad_numbers_are_option_errors(argv, named, tmp_path, capsys):
    refused([*argv, "--out", str(tmp_path / "out")], named, capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("split", "content"), [
    ("valid", b""), ("valid", b"x"), ("train", b"x"), ("train", b"x" * 129)])
def test_a_training_text_too_short_for_one_window_is_refused_by_name(
        tmp_path, capsys, monkeypatch, split, content):
    from pathlib import Path

    from svflow_jax.training import tasks

    data = tmp_path / "austen"
    data.mkdir()
    for name in ("train", "valid"):
        (data / f"{name}.txt").write_bytes(b"Emma Woodhouse, handsome, clever, and rich. " * 8)
    (data / f"{split}.txt").write_bytes(content)
    monkeypatch.setattr(tasks, "DATA_DIR", Path(data))
    err = refused(["train", "--context", "128", "--out", str(tmp_path / "out")],
                  f"{data / f'{split}.txt'}: {len(content)} bytes, too short for one window of "
                  "128 bytes", capsys)
    assert "high <= 0" not in err and "IndexError" not in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="too short for one window"):  # the library too
        tasks.AustenBytes(context=128).batch(0, 0, 2) if split == "train" else \
            tasks.AustenBytes(context=128).eval_batches(2, 2)


def test_a_text_too_short_for_the_windows_is_refused_before_the_model_loads(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("Emma")
    refused(["inspect", "smollm2-135m-instruct", "--text", str(text), "--out",
             str(tmp_path / "o")], f"--text {text}: 4 bytes, too short for 8 windows of 128 "
            "tokens", capsys)
    refused(["diagnose", "--text", str(text), "--quick", "--out", str(tmp_path / "o")],
            f"--text {text}: 4 bytes, too short for 6 windows of 48 tokens", capsys)
    text.write_text("")
    refused(["diagnose", "--text", str(text), "--out", str(tmp_path / "o")],
            f"--text {text}: 0 bytes", capsys)
    assert not (tmp_path / "o").exists()


def test_an_unwritable_cache_dir_is_refused_with_the_other_folders(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    refused(["verify", "--quick", "--cache-dir", str(a_file), "--out", str(tmp_path / "o")],
            f"--cache-dir {a_file}: is a file, not a folder", capsys)
    refused(["sweep", "--cache-dir", str(a_file / "sub"), "--out", str(tmp_path / "o")],
            f"--cache-dir {a_file / 'sub'}: cannot create it", capsys)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # (root may write anywhere)
            refused(["verify", "--quick", "--cache-dir", str(locked), "--out",
                     str(tmp_path / "o")], f"--cache-dir {locked}: the folder is not writable",
                    capsys)
    finally:
        locked.chmod(0o700)
    assert not (tmp_path / "o").exists()
