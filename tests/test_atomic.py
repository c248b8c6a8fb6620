"""Atomic writes, strict JSON and append-only logs (``svflow_jax.atomic``): a failure injected
in the middle of a write leaves the old file intact and no temporary file behind."""

from __future__ import annotations

import json
import math

import pytest

from svflow_jax import atomic
from svflow_jax.reporting import write_csv


def _refuse_constants(name):
    raise AssertionError(f"bare {name} in a JSON output")


def _interrupt(*_args):
    raise KeyboardInterrupt  # a kill arriving while the new content is being flushed


def test_a_write_interrupted_midway_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    atomic.write_json(path, {"old": 1})
    monkeypatch.setattr(atomic.os, "fsync", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        atomic.write_json(path, {"new": list(range(10_000))})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left
    atomic.write_json(path, {"new": 2})
    assert json.loads(path.read_text()) == {"new": 2}


def test_a_failed_rename_leaves_the_old_table(tmp_path, monkeypatch):
    path = tmp_path / "metrics.csv"
    write_csv(path, [{"step": 1, "loss": 2.5}])
    before = path.read_bytes()

    def failing_replace(*_args):
        raise OSError("disk full")

    monkeypatch.setattr(atomic.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        write_csv(path, [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}])
    monkeypatch.undo()
    assert path.read_bytes() == before == b"step,loss\r\n1,2.5\r\n"  # csv: RFC 4180 ends
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]


def test_json_is_strict_and_names_what_was_not_finite(tmp_path):
    import numpy as np

    path = tmp_path / "final.json"
    atomic.write_json(path, {"loss": math.nan, "curve": [1.0, math.inf], "ok": 0.5,
                             "array": np.array([1.5, np.nan], np.float32)})
    data = json.loads(path.read_text(), parse_constant=_refuse_constants)
    assert data["loss"] is None and data["curve"] == [1.0, None] and data["ok"] == 0.5
    assert data["array"] == [1.5, None]
    assert data["non_finite"] == ["loss: nan", "curve[1]: inf", "array[1]: nan"]
    assert "non_finite" not in json.loads(atomic.dumps({"a": 1.0}))


def test_a_log_cut_mid_line_is_repaired(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2):
        atomic.append_line(path, json.dumps({"step": step}))
    with path.open("a") as f:
        f.write('{"step": 3, "lo')  # a kill during the third append
    assert atomic.read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert path.read_text().endswith('"lo')  # reading alone changes nothing
    assert atomic.read_jsonl(path, repair=True) == [{"step": 1}, {"step": 2}]
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    with pytest.raises(ValueError, match="one line"):
        atomic.append_line(path, "a\nb")


def test_a_damaged_line_inside_a_log_is_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON record"):
        atomic.read_jsonl(path, repair=True)
    assert atomic.read_jsonl(tmp_path / "absent.jsonl") == []


def test_a_figure_and_an_npz_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """Writers that take a file (Matplotlib, ``np.savez``) go through ``atomic.replacing``: a
    failure inside the writer leaves the old file and no temporary file behind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from svflow_jax.reporting import save_figure

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    assert save_figure(fig, tmp_path / "f.png") == "f.png"
    png = (tmp_path / "f.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    fig, _ = plt.subplots()
    monkeypatch.setattr(fig, "savefig", lambda *a, **k: (_ for _ in ()).throw(OSError("disk")))
    with pytest.raises(OSError, match="disk"):
        save_figure(fig, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes() == png
    with atomic.replacing(tmp_path / "a.npz") as f:
        np.savez(f, x=np.arange(3))
    with pytest.raises(RuntimeError, match="killed"), atomic.replacing(tmp_path / "a.npz") as f:
        np.savez(f, x=np.arange(5))
        raise RuntimeError("killed mid-write")
    assert np.load(tmp_path / "a.npz")["x"].tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "f.png"]
