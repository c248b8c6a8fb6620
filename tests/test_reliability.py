"""Reliability of the ``svflow`` commands: file modes of the atomic writes, ``--overwrite``
that never replaces a file the command did not write, sizes refused before anything is
allocated, bad numbers refused as option errors, and what a killed run leaves behind. Every
refusal here happens before anything is compiled."""

from __future__ import annotations

import contextlib
import os
import stat

import pytest

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
