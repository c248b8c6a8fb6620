"""Atomic file writes, strict JSON and append-only logs.

A file written with :func:`write_text` (or :func:`write_json`, :func:`write_bytes`) is either
its old content or its complete new content, never a mixture, whatever kills the process: the
new content goes to a temporary file in the same folder (same file system), is flushed and
``fsync``-ed, and is then renamed over the target with :func:`os.replace` (atomic on POSIX and
Windows). The folder entry is ``fsync``-ed too where the platform allows it, so the rename
itself survives a power cut. The new file gets the mode a plain ``open(path, "w")`` would give
it: an existing file's mode, else ``0o666`` less the process's umask (the temporary file itself
is created owner-only, and the rename would keep that).

:func:`append_line` is for logs that grow (``metrics.jsonl``): a record is one line, appended
and flushed; a kill can at worst leave the LAST line half-written, which
:func:`read_jsonl` detects and drops (and can cut off the file).

JSON is strict (RFC 8259): :func:`strict_json` replaces a non-finite float by ``null`` and
records which fields were replaced under ``"non_finite"``, so the output never holds a bare
``NaN`` or ``Infinity`` that other readers reject.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["replacing", "write_bytes", "write_text", "write_json", "dumps", "strict_json",
           "append_line", "read_jsonl"]


def _fsync_folder(folder: Path) -> None:
    if os.name != "posix":  # a folder cannot be opened for fsync on Windows
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (``/proc``); else
    set and restored at once, under a lock."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def _mode_for(path: Path) -> int:
    """The mode ``open(path, "w")`` would leave: the existing file's, else ``0o666 & ~umask``."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


@contextlib.contextmanager
def replacing(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content into, for writers that take a file (a
    Matplotlib figure, ``np.savez``): the content goes to a temporary file in the same folder,
    which replaces ``path`` atomically when the block ends without an error (module
    docstring). On any error the old file (or its absence) is left as it was and the temporary
    file is removed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        if hasattr(os, "fchmod"):  # mkstemp's file is owner-only (0o600) whatever the umask
            os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_folder(path.parent)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Replaces ``path`` by ``data`` atomically (:func:`replacing`)."""
    with replacing(path) as f:
        f.write(data)


def write_text(path: str | Path, text: str) -> None:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def strict_json(data: Any, _where: str = "", _found: list[str] | None = None) -> Any:
    """``data`` with every non-finite float replaced by ``None``; the dotted paths of the
    replaced values are listed under the top-level key ``"non_finite"`` of a dictionary."""
    top = _found is None
    found: list[str] = [] if _found is None else _found
    if isinstance(data, float) and not math.isfinite(data):
        found.append(f"{_where or '.'}: {data!r}")
        return None
    if isinstance(data, dict):
        out = {k: strict_json(v, f"{_where}.{k}" if _where else str(k), found)
               for k, v in data.items()}
        if top and found:
            out["non_finite"] = list(found)
        return out
    if isinstance(data, list | tuple):
        return [strict_json(v, f"{_where}[{i}]", found) for i, v in enumerate(data)]
    return data


def _plain(value: Any) -> Any:
    """A NumPy/JAX scalar or array as Python numbers and lists; anything else as its text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def dumps(data: Any, *, indent: int | None = None) -> str:
    """``data`` as strict JSON text (:func:`strict_json`); NumPy and JAX values become numbers
    and lists, other unknown objects their ``str``."""
    plain = json.loads(json.dumps(data, default=_plain))  # NaN survives this round trip
    return json.dumps(strict_json(plain), indent=indent, allow_nan=False)


def write_json(path: str | Path, data: Any, *, indent: int | None = 2) -> None:
    """``data`` as strict JSON (:func:`dumps`), written atomically, ending in a newline."""
    write_text(path, dumps(data, indent=indent) + "\n")


def append_line(path: str | Path, line: str) -> None:
    """Appends ``line`` (without its newline) and a newline to ``path``, flushed and
    ``fsync``-ed. A kill during the call leaves at most this last line incomplete."""
    if "\n" in line:
        raise ValueError("append_line writes one line; the text holds a newline")
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """The records of a JSON-lines file written by :func:`append_line`. A last line that is
    not a complete record (no final newline, or not valid JSON: a write cut short) is dropped,
    and with ``repair=True`` cut off the file. A damaged line before the last one is not a cut
    write: ``ValueError`` naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # ``tail`` is empty when the file ends in "\n"
    rows: list[dict[str, Any]] = []
    keep = len(raw) - len(tail)
    for i, line in enumerate(complete):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            if i < len(complete) - 1:
                raise ValueError(f"{path}: line {i + 1} is not a JSON record ({err}); the "
                                 "log is damaged, not merely cut short") from err
            keep -= len(line) + 1
    if repair and keep < len(raw):
        with path.open("r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return rows
