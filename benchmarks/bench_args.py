"""Range-checked argparse types shared by the benchmark scripts.

A count of 0, a size of 0 or a fraction of 1.5 has no meaning in a benchmark: left unchecked it ended in a traceback
deep inside the run (a division by zero, the median of no samples) or, worse, in figures that look real. With these
types argparse refuses the value itself: a one-line usage error naming the flag, exit 2, before any work starts.
Integers and finite floats >= a bound come from the plugin's own CLI (:func:`fsdp_hotload.cli.arg_int`,
:func:`fsdp_hotload.cli.arg_float`); what it has no type for (a size that must be above 0, a fraction, a comma list
of counts) is here.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_hotload.cli import arg_float, arg_int  # noqa: E402

__all__ = ["arg_float", "arg_int", "arg_fraction", "arg_int_list", "arg_positive"]


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def arg_positive() -> Callable[[str], float]:
    """An argparse ``type`` for a size or a duration that must be a finite number > 0 (0 GB measures nothing)."""
    def parse(text: str) -> float:
        value = _number(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} is out of range (must be a finite number > 0)")
        return value

    return parse


def arg_fraction() -> Callable[[str], float]:
    """An argparse ``type`` for a fraction in [0, 1] (the share of elements a step changes)."""
    def parse(text: str) -> float:
        value = _number(text)
        if not 0 <= value <= 1:
            raise argparse.ArgumentTypeError(f"{text} is out of range (must be a fraction from 0 to 1)")
        return value

    return parse


def arg_int_list(lo: int) -> Callable[[str], list[int]]:
    """An argparse ``type`` for a comma list of integers, each >= lo (tensor counts, rank counts, thread counts):
    an empty list, a non-integer or a value below lo is refused by name, not a ValueError from ``int()`` later."""
    one = arg_int(lo)

    def parse(text: str) -> list[int]:
        items = [item.strip() for item in text.split(",")]
        if not any(items):
            raise argparse.ArgumentTypeError(f"{text!r} is empty (give a comma list of integers >= {lo})")
        return [one(item) for item in items]

    return parse
