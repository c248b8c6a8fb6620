"""Training tasks, offline and deterministic by (seed, step).

A batch is ``(inputs, targets, weights)``, each ``(B, n)``: the model sees ``inputs`` and is
scored on ``-log p(targets)`` where ``weights`` is 1 (next-token prediction, causal).

* :class:`AustenBytes`: byte-level language modelling on Jane Austen (shipped with the package,
  ``svflow_jax/data/austen/``, see its README for provenance). Training windows come from five
  of the six novels (3.56 million characters); validation from the first 50k characters of
  *Persuasion*, the held-out sixth. The metric is bits per character ``= mean nats / ln 2``
  (the text is ASCII: one byte per character).
* :class:`MultiHopRecall`: the ``S`` pairs ``k f(k)`` of a random permutation ``f`` of ``S``
  symbols, a separator, then query symbols ``x``; the target at each query is ``f^hops(x)``
  (two hops by default). Only the answers are scored; the metric is accuracy. Each hop needs an
  attention look-up, so depth matters.

The batch of training step ``i`` is a function of ``(seed, i)`` only, so a resumed run sees the
same batches as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

__all__ = ["AustenBytes", "MultiHopRecall", "get_task", "DATA_DIR", "Task"]

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "austen"


def _rng(seed: int, step: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, step])


@dataclasses.dataclass(frozen=True)
class AustenBytes:
    """Byte-level LM on Jane Austen (module docstring). ``context`` tokens per window."""

    context: int = 64
    metric: str = "bpc"
    vocab_size: int = 256
    name: str = "austen"

    @staticmethod
    def text(split: str) -> np.ndarray:
        """The ``"train"`` or ``"valid"`` bytes as ``uint8``."""
        if split not in ("train", "valid"):
            raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
        return np.frombuffer((DATA_DIR / f"{split}.txt").read_bytes(), np.uint8)

    def check_text(self) -> None:
        """``ValueError`` naming the file when a split holds less than one window of
        ``context`` bytes and the byte after it."""
        for split in ("train", "valid"):
            self._data(split)

    def _data(self, split: str) -> np.ndarray:
        data = self.text(split)
        if len(data) < self.context + 2:
            raise ValueError(f"{DATA_DIR / f'{split}.txt'}: {len(data)} bytes, too short for one "
                             f"window of {self.context} bytes and the byte after it (context "
                             f"at most {max(len(data) - 2, 0)} with this text)")
        return data

    def _windows(self, data: np.ndarray, starts: np.ndarray):
        idx = starts[:, None] + np.arange(self.context + 1)[None, :]
        w = data[idx].astype(np.int32)
        return w[:, :-1], w[:, 1:], np.ones((len(starts), self.context), np.float32)

    def batch(self, seed: int, step: int, batch_size: int):
        """Training batch ``step``: windows at uniformly random offsets."""
        data = self._data("train")
        starts = _rng(seed, step, 0).integers(0, len(data) - self.context - 1, batch_size)
        return self._windows(data, starts)

    def eval_batches(self, num_sequences: int, batch_size: int):
        """Validation windows, evenly spaced over the held-out novel (the same for every
        seed)."""
        data = self._data("valid")
        starts = np.linspace(0, len(data) - self.context - 1, num_sequences).astype(np.int64)
        return [self._windows(data, starts[i:i + batch_size])
                for i in range(0, num_sequences, batch_size)]

    def score(self, mean_nll: float) -> float:
        """Bits per character."""
        return mean_nll / math.log(2)

    def log_prior(self) -> np.ndarray:
        """``log p(v)`` of each byte in the training text, add-one smoothed: the logits of the
        best context-free (unigram) model, ``(vocab_size,)`` float32."""
        counts = np.bincount(self.text("train"), minlength=self.vocab_size) + 1.0
        return np.log(counts / counts.sum()).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class MultiHopRecall:
    """Multi-hop associative recall (module docstring).

    A sequence lists the ``S`` pairs ``k f(k)`` of a random permutation ``f`` of ``S`` symbols
    (in random order), then a separator, then ``queries`` query symbols ``x_1 .. x_Q``; the
    target at query ``x_i`` is ``f^hops(x_i)`` (predicted at the query's own position, so the
    answer is never in the input). Only the query positions are scored.
    """

    symbols: int = 8
    hops: int = 2
    queries: int = 8
    separate_values: bool = False
    metric: str = "accuracy"
    name: str = "recall"

    def __post_init__(self):
        if self.separate_values and self.hops != 1:
            raise ValueError("separate_values needs hops=1 (a value must be a key again to "
                             "take another hop)")

    @property
    def vocab_size(self) -> int:
        # keys 0..S-1, values S..2S-1 when separate; then the separator
        return (2 if self.separate_values else 1) * self.symbols + 1

    @property
    def context(self) -> int:
        return 2 * self.symbols + 1 + self.queries

    def _make(self, rng: np.random.Generator, batch_size: int):
        S, n, Q = self.symbols, self.context, self.queries
        shift = S if self.separate_values else 0  # value tokens
        inputs = np.zeros((batch_size, n), np.int32)
        targets = np.zeros((batch_size, n), np.int32)
        weights = np.zeros((batch_size, n), np.float32)
        for b in range(batch_size):
            f = rng.permutation(S)
            order = rng.permutation(S)
            inputs[b, 0:2 * S:2] = order
            inputs[b, 1:2 * S:2] = f[order] + shift
            inputs[b, 2 * S] = self.vocab_size - 1
            x = rng.integers(0, S, Q)
            y = x
            for _ in range(self.hops):
                y = f[y]
            inputs[b, 2 * S + 1:] = x
            targets[b, 2 * S + 1:] = y + shift
            weights[b, 2 * S + 1:] = 1.0
        return inputs, targets, weights

    def batch(self, seed: int, step: int, batch_size: int):
        return self._make(_rng(seed, step, 1), batch_size)

    def eval_batches(self, num_sequences: int, batch_size: int):
        rng = np.random.default_rng([12345, 2])  # fixed held-out problems, whatever the seed
        return [self._make(rng, min(batch_size, num_sequences - i))
                for i in range(0, num_sequences, batch_size)]

    def score(self, mean_nll: float) -> float:
        return mean_nll

    def log_prior(self) -> np.ndarray:
        """``log p(v)`` of the scored targets: uniform over the answer alphabet (the values
        when separate, else the symbols), add-one smoothed elsewhere; ``(vocab_size,)``."""
        counts = np.ones(self.vocab_size)
        shift = self.symbols if self.separate_values else 0
        counts[shift:shift + self.symbols] += 1e6
        return np.log(counts / counts.sum()).astype(np.float32)


Task = AustenBytes | MultiHopRecall

#: the task names of :func:`get_task`
TASKS = ("austen", "recall", "recall1")


def get_task(name: str, context: int = 64) -> Task:
    """``"austen"`` (with ``context`` bytes per window), ``"recall"`` (two hops) or
    ``"recall1"`` (one hop)."""
    if name == "austen":
        return AustenBytes(context=context)
    if name == "recall":
        return MultiHopRecall()
    if name == "recall1":
        return MultiHopRecall(hops=1, separate_values=True, name="recall1")
    raise ValueError(f"unknown task {name!r}; use one of {', '.join(TASKS)}")
