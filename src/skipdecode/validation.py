"""Typed, finite, in-range values: the checks every boundary (CLI flags, API
arguments, schedule and data fields) runs on what a user hands in.

``check_int`` / ``check_float`` raise ``error`` (a ``SkipDecodeError``) naming
the value, the allowed range and what was given; ``int_arg`` / ``float_arg``
are the same checks as argparse types, so a bad flag is refused before any
model loads. Torch-free.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

from .errors import SkipDecodeError

SEED_MAX = 2 ** 63  # torch.Generator.manual_seed takes [-2**63, 2**64); one range everywhere


def _g(x: float) -> str:
    return "2**63 - 1" if x == SEED_MAX - 1 else (str(x) if isinstance(x, int) else f"{x:g}")


def _range(lo, hi, lo_open: bool = False, hi_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_g(lo)}, {_g(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_g(lo)}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {_g(hi)}"
    return "finite"


def int_problem(v: object, lo: int | None = None, hi: int | None = None) -> str | None:
    """Why ``v`` is not an integer in ``[lo, hi]`` (None if it is)."""
    if isinstance(v, bool) or not isinstance(v, int):
        return f"must be an integer {_range(lo, hi)}, got {v!r}"
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        return f"must be an integer {_range(lo, hi)}, got {v}"
    return None


def float_problem(v: object, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                  hi_open: bool = False) -> str | None:
    """Why ``v`` is not a finite number in the range (None if it is)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return f"must be a finite number {_range(lo, hi, lo_open, hi_open)}, got {v!r}"
    if lo is not None and (v < lo or (lo_open and v == lo)) or hi is not None and (v > hi or (hi_open and v == hi)):
        return f"must be a number {_range(lo, hi, lo_open, hi_open)}, got {v:g}"
    return None


def check_int(name: str, v: object, lo: int | None = None, hi: int | None = None,
              error: type[SkipDecodeError] = SkipDecodeError, hint: str = "") -> int:
    p = int_problem(v, lo, hi)
    if p:
        raise error(f"{name} {p}{hint}")
    return v  # type: ignore[return-value]


def check_float(name: str, v: object, lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                hi_open: bool = False, error: type[SkipDecodeError] = SkipDecodeError, hint: str = "") -> float:
    p = float_problem(v, lo, hi, lo_open, hi_open)
    if p:
        raise error(f"{name} {p}{hint}")
    return float(v)  # type: ignore[arg-type]


def int_arg(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[lo, hi]``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {_range(lo, hi)}, got {text!r}") from None
        p = int_problem(v, lo, hi)
        if p:
            raise argparse.ArgumentTypeError(p)
        return v
    parse.__name__ = "integer"
    return parse


def float_arg(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
              hi_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in the range."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be a finite number {_range(lo, hi, lo_open, hi_open)}, got {text!r}") from None
        p = float_problem(v, lo, hi, lo_open, hi_open)
        if p:
            raise argparse.ArgumentTypeError(p)
        return v
    parse.__name__ = "number"
    return parse


SEED = int_arg(0, SEED_MAX - 1)
POSITIVE = int_arg(1)
NON_NEGATIVE = int_arg(0)
SPEEDUP = float_arg(1)


def _val_groups(text: str) -> float:
    """Held-out groups: a count >= 1 or a fraction in (0, 1)."""
    v = float_arg(0, lo_open=True)(text)
    if v >= 1:
        if v != int(v):
            raise argparse.ArgumentTypeError(f"must be a whole number of groups or a fraction < 1, got {text!r}")
        return int(v)
    return v


VAL_GROUPS = _val_groups


def int_list(lo: int | None = None, hi: int | None = None) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated integers, each in ``[lo, hi]``."""
    one = int_arg(lo, hi)

    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"give comma-separated integers, got {text!r}")
        return [one(t) for t in items]
    parse.__name__ = "integer list"
    return parse


def adaptive_arg(text: str) -> float:
    """``--adaptive THRESHOLD``: a top-1 probability in [0, 1]."""
    try:
        t = float(text)
    except ValueError:
        t = float("nan")
    if not 0 <= t <= 1:
        raise argparse.ArgumentTypeError(f"an adaptive threshold is a probability in [0, 1], got {text!r}")
    return t
