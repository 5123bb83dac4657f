"""Argument types of the command-line flags: each turns a flag's text into a value or one
`argparse.ArgumentTypeError` line that says what to type instead.

Why a module of its own: several subcommand modules share them, and a flag must reject the same
bad input with the same words whichever command it belongs to. It must never import torch nor
read or write a file.
"""

from __future__ import annotations

import argparse
import math

from roundpipe.errors import ConfigError
from roundpipe.plan import sizes


def parse_bytes(text: str) -> int:
    """The memory limit flag: ``"24GB"`` -> 24e9, ``"24GiB"`` -> 24 * 2**30, ``"1.5e9"`` bytes."""
    try:
        return sizes.parse_bytes(text, "memory limit")
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; give bytes or a number with a unit: 24GB, 24GiB, 512MiB, 2.5e10"
        ) from None


def whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum} (got {value})")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return whole_number(text, 0)


def layer_indices(text: str) -> tuple[int, ...]:
    from roundpipe.config import layer_indices as parse_indices

    try:
        return parse_indices(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def finite_number(text: str, *, zero_allowed: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
        raise argparse.ArgumentTypeError(f"must be a number {'>=' if zero_allowed else '>'} 0 (got {text})")
    return value


def positive_float(text: str) -> float:
    return finite_number(text, zero_allowed=False)


def non_negative_float(text: str) -> float:
    return finite_number(text, zero_allowed=True)


__all__ = [
    "finite_number",
    "layer_indices",
    "non_negative_float",
    "non_negative_int",
    "parse_bytes",
    "positive_float",
    "positive_int",
    "whole_number",
]
