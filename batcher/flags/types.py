"""Argparse value types that refuse a bad value while the command line is read: a server must
never load a model for minutes and then find that `--port 99999` cannot be bound or that
`--max-num-seqs 0` means nothing.

Each type raises `argparse.ArgumentTypeError`, which argparse reports as one line naming the
flag, with exit status 2.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from batcher.core.config import parse_bytes
from batcher.core.config import DEVICES, DTYPES

LOG_LEVELS = ("debug", "info", "warning", "error")
__all__ = ["DEVICES", "DTYPES", "LOG_LEVELS"]


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def port(text: str) -> int:
    """A TCP port, 1-65535, or 0 for any free port."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535 (0: any free port), got {value}")
    return value


def float_at_least(low: float, *, strict: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if strict else '>='} {low:g} and finite, got {text}")
        return value

    parse.__name__ = "number"
    return parse


non_negative_float = float_at_least(0.0)
positive_float = float_at_least(0.0, strict=True)


def positive_rate(text: str) -> float:
    """A rate > 0, or `inf` for work that costs nothing."""
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    return positive_float(text)


positive_rate.__name__ = "rate"


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {value}")
    return value


def byte_size(text: str) -> str:
    """A size such as 512MiB or 2GiB; kept as text (the engine parses it), checked here."""
    try:
        value = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 512MiB or 2GiB, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return text


def lower(text: str) -> str:
    """Choices compared case-insensitively (`--log-level INFO`)."""
    return text.lower()
