"""Formatting, tables, figures and files of every report (``svflow verify``, ``inspect``,
``diagnose``): one place for the helpers the report writers share.

* numbers: :func:`fmt` (3 significant digits, ``nan``, ``-`` for missing), :func:`ci`
  (``[lo, hi]``), :func:`verdict` (PASS / FAIL / UNRESOLVED);
* tables: :func:`write_csv` (CSV of result rows) and :func:`markdown_table`;
* figures: :func:`save_figure` (lay out, write, close);
* files: :func:`write_json` (strict JSON: a non-finite number is written as ``null`` and listed
  under ``non_finite``, never as the bare ``NaN`` that JSON parsers reject) and
  :func:`write_text`, both from :mod:`svflow_jax.atomic` (written to a temporary file in the
  same folder, fsync-ed and renamed into place, so a reader never sees half a file);
  :func:`display_path` (no absolute path of the user's machine in a report);
  :func:`provenance` (one sentence naming the software and machine that produced a report).

The writers themselves (:mod:`svflow_jax.claims.report`, :mod:`svflow_jax.inspection.report`,
:mod:`svflow_jax.diagnose.output`) read their summaries and measure nothing.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from .atomic import dumps, replacing, write_json, write_text

__all__ = [
    "fmt",
    "ci",
    "verdict",
    "write_csv",
    "markdown_table",
    "save_figure",
    "write_json",
    "write_text",
    "dumps",
    "display_path",
    "provenance",
]


def fmt(v: Any, digits: int = 3) -> str:
    """A value for a table: floats to ``digits`` significant digits (``nan``, ``inf``),
    ``None`` as ``-``, anything else as ``str``."""
    if v is None:
        return "-"
    if isinstance(v, bool) or isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else (str(v) if math.isinf(v) else f"{v:.{digits}g}")
    return str(v)


def ci(interval) -> str:
    """``[lo, hi]`` of a two-number interval."""
    lo, hi = interval
    return f"[{fmt(lo)}, {fmt(hi)}]"


def verdict(passed: bool | None) -> str:
    """PASS, FAIL, or UNRESOLVED (``None``: in float32, too few points above round-off to fit
    an order)."""
    if passed is None:
        return "UNRESOLVED (float32 round-off)"
    return "PASS" if passed else "FAIL"


def write_csv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Writes ``rows`` (dictionaries) as CSV: the columns are every key in order of first
    appearance, a list or tuple value is written joined by ``;``, a missing value is empty.
    Nothing is written when there are no rows."""
    if not rows:
        return
    fields = list(dict.fromkeys(k for row in rows for k in row))
    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=fields)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (";".join(map(str, v)) if isinstance(v, (list, tuple)) else v)
                         for k, v in row.items()})
    write_text(path, buffer.getvalue())  # atomic: a kill leaves the old table or the new one


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A Markdown table of ``rows`` (``columns``: default the first row's keys), cells by
    :func:`fmt`; ``(none)`` for no rows."""
    if not rows:
        return "(none)\n"
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)).replace("|", "\\|") for c in columns) + " |"
              for r in rows]
    return "\n".join(lines) + "\n"


def save_figure(fig, path: str | Path, dpi: int = 110) -> str:
    """Lays out, writes and closes a Matplotlib figure; returns its file name."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    with replacing(path) as f:  # atomic, as every file the project writes
        fig.savefig(f, format=path.suffix.lstrip(".") or "png", dpi=dpi)
    plt.close(fig)
    return path.name


def display_path(path: str | Path) -> str:
    """``path`` for a report: relative to the current folder when inside it, else its last
    component (a report names no absolute path of the user's machine)."""
    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    try:
        return p.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return p.name


def provenance(env: dict[str, Any] | None) -> str:
    """One sentence naming what produced a report (from
    :func:`svflow_jax.environment.environment`), or ``""``."""
    if not env:
        return ""
    head, _, dirty = (env.get("git_commit") or "").partition("+")
    commit = f", commit {head[:12]}{' with local changes' if dirty else ''}" if head else ""
    v = env["versions"]
    return (f"Run with svflow-jax {env['svflow_jax']}{commit}; jax {v['jax']}, flax "
            f"{v['flax']}, diffrax {v['diffrax']}; Python {env['python']} on "
            f"{env['platform']}, {env['cpu_count']} CPUs, {env['backend']} backend; "
            f"XLA_FLAGS {env['xla_flags'] or '(none)'}.")
