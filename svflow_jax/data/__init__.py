"""Text shipped with the package (public domain; provenance in ``README.md`` here)."""

from __future__ import annotations

from importlib import resources

__all__ = ["emma_opening"]


def emma_opening() -> str:
    """The first 20,000 characters of Jane Austen's *Emma* (1815), public domain."""
    return resources.files(__name__).joinpath("emma_opening.txt").read_text(encoding="utf-8")
