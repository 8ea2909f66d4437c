"""argparse ``type=`` converters: a bad value is a usage error naming it, never a traceback."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def whole(minimum: int) -> Callable[[str], int]:
    """An integer of at least ``minimum``."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}: {text!r}")
        return value

    return convert


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def positive(text: str) -> float:
    """A finite number above zero."""
    value = _number(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value


def share(text: str) -> float:
    """A number in (0, 1]."""
    value = positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]: {text!r}")
    return value


def nonnegative(text: str) -> float:
    """A finite number of at least zero."""
    value = _number(text)
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a number of at least 0: {text!r}")
    return value


def below_one(text: str) -> float:
    """A number in [0, 1)."""
    value = nonnegative(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1): {text!r}")
    return value
