"""CSV tables of result rows, one writer for every report of the project."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

__all__ = ["write_csv"]


def write_csv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Writes ``rows`` (dictionaries) as CSV: the columns are every key in order of first
    appearance, a list or tuple value is written joined by ``;``, a missing value is empty.
    Nothing is written when there are no rows."""
    if not rows:
        return
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with Path(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (";".join(map(str, v)) if isinstance(v, (list, tuple)) else v)
                             for k, v in row.items()})
