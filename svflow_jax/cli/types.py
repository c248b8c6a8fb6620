"""Argparse types shared by the ``svflow`` subcommands: a bad value is an argparse error (exit
code 2) naming what was expected."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["int_at_least", "int_in", "positive_int", "nonnegative_int", "seed",
           "positive_float", "fraction"]


def int_at_least(minimum: int, words: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer ``>= minimum``, else an error naming ``words`` (default
    ``"whole number >= minimum"``)."""
    words = words or f"whole number >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be a {words}, got {text!r}")
        return value

    return parse


def int_in(minimum: int, maximum: int, words: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``[minimum, maximum]``, else an error naming ``words``."""
    words = words or f"whole number in [{minimum}, {maximum}]"
    at_least = int_at_least(minimum, words)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be a {words}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1, "positive integer")
nonnegative_int = int_at_least(0, "non-negative integer")
#: a random seed: NumPy and JAX keys take 32-bit seeds everywhere (0 <= seed < 2**32)
seed = int_in(0, 2**32 - 1, "seed in [0, 2**32 - 1]")


def _float_in(text: str, ok: Callable[[float], bool], words: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number ``> 0``."""
    return _float_in(text, lambda v: math.isfinite(v) and v > 0, "a finite positive number")


def step_multiplier(text: str) -> float:
    """An argparse type: a step-size multiplier ``alpha`` in ``[0, 10]``."""
    return _float_in(text, lambda v: 0 <= v <= 10, "a number in [0, 10]")


def fraction(text: str) -> float:
    """An argparse type: a number in ``[0, 1]``."""
    return _float_in(text, lambda v: 0 <= v <= 1, "a number in [0, 1]")
