"""Adaptive per-request monotone budgets: a schedule whose clock ticks only on confident tokens.

A static schedule gives generated token ``i`` the budget ``b(i)`` whatever the
model is doing. An adaptive request follows the same non-increasing ``b``, but
its position on it is a *clock* that advances only when the token just chosen
had a top-1 probability of at least ``threshold``: while the model hesitates
(the start of an answer, a name being copied) the request stays as deep as it
is; once it is sure, it steps down. The clock never goes back, so the budget
never increases and every key/value a later token reads was written
(SKIPDECODE.md's invariant holds per request).

``threshold = 0`` is exactly the static schedule; higher thresholds run deeper
and so achieve less than the schedule's speedup. One threshold per target is
calibrated on data you choose on (``e2e-heldout``'s select part) so the
achieved decode-layer speedup matches the target; ``calibrate`` does that by
bisection, and the report scores it once.
"""

from __future__ import annotations

import math
from typing import Callable

from ..schedule import ScheduleError, SkipSchedule


def check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold) \
            or not 0 <= threshold <= 1:
        raise ScheduleError(f"an adaptive threshold is a top-1 probability in [0, 1], got {threshold!r}")
    return float(threshold)


def clock_budget(schedule: SkipSchedule, confident: int) -> int:
    """The budget of the next fed token after ``confident`` confident tokens: with every
    token confident this is ``schedule.budget(i)`` for token ``i`` (the static schedule)."""
    return schedule.budget(max(confident - 1, 0))


def worst_case(schedule: SkipSchedule) -> SkipSchedule:
    """The schedule an adaptive request reserves KV for: it may never step down."""
    b0 = schedule.budget(0)
    return SkipSchedule(schedule.num_layers, b0, b0, horizon=1, warmup_layers=schedule.warmup_layers,
                        mode=schedule.mode, layer_order=schedule.layer_order)


def calibrate(achieved: Callable[[float], float], target: float, *, iters: int = 8,
              tol: float = 0.02) -> tuple[float, float]:
    """The threshold whose achieved speedup is closest to ``target`` (bisection: achieved
    speedup falls as the threshold rises). ``achieved(t)`` runs the selection data at ``t``.
    Returns ``(threshold, achieved speedup)``; ``(0, s)`` when even threshold 0 reaches only ``s``."""
    lo, hi = 0.0, 1.0
    s_lo = achieved(lo)
    if s_lo <= target * (1 + tol):
        return lo, s_lo
    best = (lo, s_lo)
    for _ in range(iters):
        mid = (lo + hi) / 2
        s = achieved(mid)
        if abs(s - target) < abs(best[1] - target) or (abs(s - target) == abs(best[1] - target) and s >= target):
            best = (mid, s)
        if abs(s - target) <= tol * target:
            return mid, s
        if s > target:
            lo = mid
        else:
            hi = mid
    return best
