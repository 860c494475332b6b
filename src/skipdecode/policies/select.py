"""The one place a target speedup becomes a schedule: training, generation, evaluation, the
engine and the server all come here.

A target a checkpoint was trained at (with no explicit length, horizon or warm-up) means
exactly its training schedule; 1x is full depth; any other target is solved by
``SkipSchedule.for_speedup`` in the checkpoint's shape (its expected length, warm-up and decay),
or with the defaults for a model that was never skip-trained.
"""

from __future__ import annotations

import math
from typing import Mapping

from ..schedule import DEFAULT_DECAY, ScheduleError, SkipSchedule


def schedule_for_speedup(target: float, num_layers: int, expected_new_tokens: int, *, mode: str = "skip",
                         warmup_layers: int | None = None, horizon: int | None = None, decay: float | None = None,
                         trained: Mapping[str, dict] | None = None, solve: bool = False) -> SkipSchedule:
    """``trained``: the schedules a checkpoint records (``skipdecode.json``), keyed ``"2x"``;
    ``solve``: solve even a trained target (an explicit length was asked for)."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target) or target < 1:
        raise ScheduleError(f"target speedup must be a number >= 1, got {target!r}")
    if target == 1:
        return SkipSchedule.full_depth(num_layers)
    trained = trained or {}
    if not solve and horizon is None and warmup_layers is None:
        entry = trained.get(f"{target:g}x")
        if entry and entry.get("mode", "skip") == mode:
            return SkipSchedule.from_dict(entry, num_layers)
    if warmup_layers is None:  # the warm-up of the checkpoint's skipping schedules (a full-depth one has none)
        skipping = [d for d in trained.values() if d["max_exit_layer"] < num_layers]
        warmup_layers = skipping[0]["warmup_layers"] if skipping else 1
    return SkipSchedule.for_speedup(target, expected_new_tokens, num_layers, horizon=horizon,
                                    warmup_layers=warmup_layers, mode=mode,
                                    decay=DEFAULT_DECAY if decay is None else decay)
