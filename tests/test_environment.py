"""``svflow_jax.environment``: what every report records about the software and the machine,
checked against each package's own ``__version__``, ``pyproject.toml`` and git."""

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import diffrax
import equinox
import flax
import jax
import numpy as np
import optax

import svflow_jax
from svflow_jax.environment import PACKAGES, environment

ROOT = Path(__file__).resolve().parent.parent


def test_versions_are_the_packages_own():
    env = environment()
    own = {"jax": jax.__version__, "flax": flax.__version__, "diffrax": diffrax.__version__,
           "equinox": equinox.__version__, "optax": optax.__version__, "numpy": np.__version__}
    assert {k: env["versions"][k] for k in own} == own
    assert set(env["versions"]) == set(PACKAGES)
    assert env["versions"]["jaxlib"] is not None
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert env["svflow_jax"] == svflow_jax.__version__ == pyproject["project"]["version"]


def test_machine_backend_and_flags():
    env = environment()
    assert env["cpu_count"] == os.cpu_count()
    assert env["backend"] == jax.default_backend()
    assert len(env["devices"]) == jax.device_count()
    assert env["xla_flags"] == os.environ.get("XLA_FLAGS", "")
    assert json.loads(json.dumps(env)) == env  # JSON-ready as it is


def test_git_commit_of_a_checkout():
    commit = environment()["git_commit"]
    if not (ROOT / ".git").exists():  # an installed package records none
        assert commit is None
        return
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit)
    assert commit.split("+")[0] == head
