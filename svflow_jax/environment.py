"""What produced a result: the software, the machine, JAX's backend and the XLA flags.

Every report's JSON carries :func:`environment` under ``"environment"``, so that a number can be
traced to the code and hardware behind it. Timings especially: the same run differs by 2x
between machines, and by 30% on one machine within an hour.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["environment", "PACKAGES"]

PACKAGES = ("jax", "jaxlib", "flax", "diffrax", "equinox", "optax", "numpy")
"""The distributions whose versions are recorded (beside ``svflow-jax`` itself)."""


@functools.cache
def _git_commit() -> str | None:
    """``HEAD`` of the checkout this package runs from, ``+dirty`` when tracked files differ;
    ``None`` for an installed package (or without git). Read once per process."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """The software and machine of this process, as a JSON-ready dictionary.

    Keys: ``svflow_jax`` (the package version), ``git_commit`` (see above), ``versions`` (of
    :data:`PACKAGES`, ``None`` when not installed), ``python``, ``platform``, ``processor``,
    ``cpu_count``, ``backend`` and ``devices`` (JAX's; calling this starts JAX's backend, so
    call it after any ``XLA_FLAGS`` are set), ``xla_flags`` (the ``XLA_FLAGS`` in force) and
    ``load_average`` (1, 5 and 15 minutes, where the system has one).
    """
    import jax

    from . import __version__

    return {
        "svflow_jax": __version__,
        "git_commit": _git_commit(),
        "versions": {name: _version(name) for name in PACKAGES},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": [f"{d.device_kind} ({d.platform})" for d in jax.devices()],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
