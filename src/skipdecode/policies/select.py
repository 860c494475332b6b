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


def schedule_for_speedup(target: float, num_layers: int, expected_new_tokens: int, *, mode: str | None = None,
                         warmup_layers: int | None = None, horizon: int | None = None, decay: float | None = None,
                         trained: Mapping[str, dict] | None = None, solve: bool = False,
                         layer_order: tuple[int, ...] | None = None) -> SkipSchedule:
    """``trained``: the schedules a checkpoint records (``skipdecode.json``), keyed ``"2x"``;
    ``solve``: solve even a trained target (an explicit length was asked for); ``mode``: the
    layer family (None: the one the checkpoint was trained with, ``skip`` for others), and
    ``layer_order`` (required for ``nested``): the checkpoint's, unless given."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target) or target < 1:
        raise ScheduleError(f"target speedup must be a number >= 1, got {target!r}")
    if target == 1:
        return SkipSchedule.full_depth(num_layers)
    trained = trained or {}
    skipping = [d for d in trained.values() if d["max_exit_layer"] < num_layers]
    trained_mode = skipping[0].get("mode", "skip") if skipping else "skip"
    mode = trained_mode if mode is None else mode
    if mode == "nested" and layer_order is None:
        layer_order = next((tuple(d["layer_order"]) for d in skipping if d.get("layer_order")), None)
        if layer_order is None:
            raise ScheduleError("mode 'nested' needs a layer order measured on this model: train it with "
                                "mode nested (skipdecode train --mode nested), which records one")
    if not solve and horizon is None and warmup_layers is None:
        entry = trained.get(f"{target:g}x")
        if entry and entry.get("mode", "skip") == mode and \
                (mode != "nested" or tuple(entry.get("layer_order") or ()) == tuple(layer_order)):
            return SkipSchedule.from_dict(entry, num_layers)
    if warmup_layers is None:  # the warm-up of the checkpoint's skipping schedules (a full-depth one has none)
        warmup_layers = skipping[0]["warmup_layers"] if skipping else 1
    return SkipSchedule.for_speedup(target, expected_new_tokens, num_layers, horizon=horizon,
                                    warmup_layers=warmup_layers, mode=mode,
                                    decay=DEFAULT_DECAY if decay is None else decay,
                                    layer_order=layer_order if mode == "nested" else None)
