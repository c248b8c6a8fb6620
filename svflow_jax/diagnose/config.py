"""The options of ``svflow diagnose`` (:class:`StudyConfig`, :data:`QUICK`), in a module that
imports no JAX: the command checks them, and the sizes they imply, before JAX is imported.
:mod:`.study` runs them."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

__all__ = ["StudyConfig", "QUICK", "CORPORA", "default_text"]


def default_text() -> Path:
    """The opening of *Emma* (first 20,000 characters, public domain), shipped with the package
    (``svflow_jax/data/emma_opening.txt``)."""
    return Path(__file__).resolve().parents[1] / "data" / "emma_opening.txt"


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """Options of a diagnostics run (validated on construction).

    Attributes:
        model: a packaged model name (:data:`..checkpoints.packaged.MODELS`) or a checkpoint path.
        text: a UTF-8 text file: one document, consecutive windows from its start, bootstrap
            over windows (overrides ``corpus``).
        corpus: ``"austen"``: Jane Austen's six novels (:func:`svflow_jax.data.austen_novels`)
            as documents, ``windows / 6`` passages of each spread evenly through it, and the
            bootstrap resamples documents; ``None`` (and no ``text``): :func:`default_text`.
        context: tokens per window ``n``.
        scored: scored tokens ``s`` (the last ``s`` positions; never moved).
        windows: number of windows (a multiple of the documents' number with a corpus).
        levels: shuffled fractions of the ``n - s`` prefix positions; must include 0.
        permutations: random permutations per non-zero level.
        seed: seed of the permutations and of the bootstrap.
        bootstrap: bootstrap resamples of the windows.
        ece_bins: equal-mass bins of the ECE.
        scaling_factors: attention-logit factors ``c`` of the scaling experiment (empty: skip).
        scaling_level: the shuffle level compared with the clean window in that experiment.
        scaling_windows: windows used by the scaling experiment (``None``: ``windows``).
        permutation_tests: permutation draws of the level-controlled tests.
    """

    model: str = "smollm2-135m-instruct"
    text: str | None = None
    corpus: str | None = "austen"
    context: int = 128
    scored: int = 32
    windows: int = 36
    levels: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    permutations: int = 3
    seed: int = 0
    bootstrap: int = 1000
    ece_bins: int = 10
    scaling_factors: tuple[float, ...] = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
    scaling_level: float = 1.0
    scaling_windows: int | None = None
    permutation_tests: int = 2000

    def __post_init__(self):
        for name in ("context", "scored", "windows", "permutations", "bootstrap", "ece_bins",
                     "permutation_tests"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.scored >= self.context:
            raise ValueError(f"scored ({self.scored}) must be smaller than context "
                             f"({self.context})")
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus must be one of {sorted(CORPORA, key=str)}, got "
                             f"{self.corpus!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        lv = tuple(float(v) for v in self.levels)
        if len(lv) < 2 or 0.0 not in lv or any(not 0 <= v <= 1 for v in lv) or (
                sorted(set(lv)) != list(lv)):
            raise ValueError(f"levels must be increasing fractions in [0, 1] including 0, "
                             f"got {self.levels!r}")
        object.__setattr__(self, "levels", lv)
        fs = tuple(float(v) for v in self.scaling_factors)
        if any(not (math.isfinite(v) and v > 0) for v in fs):
            raise ValueError(f"scaling factors must be positive, got {self.scaling_factors!r}")
        object.__setattr__(self, "scaling_factors", fs)
        if not 0 < self.scaling_level <= 1:
            raise ValueError(f"scaling_level must be in (0, 1], got {self.scaling_level!r}")
        if self.scaling_windows is not None and not (
                isinstance(self.scaling_windows, int) and 1 <= self.scaling_windows):
            raise ValueError(f"scaling_windows must be a positive integer, got "
                             f"{self.scaling_windows!r}")
        if self.ece_bins > self.windows * self.scored:
            raise ValueError(f"ece_bins ({self.ece_bins}) exceeds the scored tokens per level "
                             f"({self.windows * self.scored})")

    @property
    def documents(self) -> int:
        """The number of documents of the corpus in use (0: one text, bootstrap over windows)."""
        return 0 if self.text is not None else CORPORA[self.corpus]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: corpus name -> number of documents (``None``: a single text)
CORPORA: dict[str | None, int] = {"austen": 6, None: 0}

QUICK: dict[str, Any] = dict(context=48, scored=16, windows=6, levels=(0.0, 0.25, 0.5, 0.75, 1.0),
                             permutations=1, bootstrap=200, ece_bins=4,
                             scaling_factors=(0.5, 1.0, 3.0), scaling_windows=2,
                             permutation_tests=500)
