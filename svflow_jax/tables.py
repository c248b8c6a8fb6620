"""CSV tables of result rows, one writer for every report of the project."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from . import atomic

__all__ = ["write_csv"]


def write_csv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Writes ``rows`` (dictionaries) as CSV: the columns are every key in order of first
    appearance, a list or tuple value is written joined by ``;``, a missing value is empty.
    Nothing is written when there are no rows. The file is replaced atomically
    (:func:`svflow_jax.atomic.write_text`): a kill leaves the old table or the new one."""
    if not rows:
        return
    fields = list(dict.fromkeys(k for row in rows for k in row))
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=fields)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (";".join(map(str, v)) if isinstance(v, (list, tuple)) else v)
                         for k, v in row.items()})
    atomic.write_text(Path(path), buffer.getvalue())
