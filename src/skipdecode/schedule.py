"""The SkipDecode schedule: which layers each generated position runs.

Pure arithmetic, free of torch, so the generator, the trainer and tests share
it. Conventions (see SKIPDECODE.md):

- ``b(i)`` is the layer budget of generated token ``i`` (the i-th sampled
  token, fed back as input). Prompt tokens always run at full depth.
- ``b(i) = round(max_exit - (max_exit - min_exit) * min(i / horizon, 1))``,
  non-increasing in ``i``, so every key/value an active layer attends to was
  written by an earlier, deeper position.
- ``mode="skip"`` (the paper) runs the first ``warmup_layers`` layers, then the
  top ``b - warmup_layers`` layers. ``mode="early_exit"`` runs the bottom ``b``
  layers (same budget, the ablation the paper never measured). ``mode="nested"``
  runs the first ``b`` layers of a measured ``layer_order`` (policies/importance).
  Each is a nested family: budget ``b`` runs the ``b`` lowest-ranked layers, so a
  smaller budget runs a subset of a larger one's layers, which is all the KV
  argument needs.
- The decode-layer speedup of a generation of ``n`` new tokens is
  ``L / mean(b(i) for i < n - 1)``: only the first ``n - 1`` tokens are fed
  back through the model (the last one ends generation and runs nothing).
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from .errors import SkipDecodeError

MODES = ("skip", "early_exit", "nested")
DEFAULT_DECAY = 1.5  # preferred first budget / mean budget (see SkipSchedule.for_speedup)


class ScheduleError(SkipDecodeError):
    """A schedule that cannot be run as asked (a clear, user-facing error)."""


def _round_half_up(x: float) -> int:
    # Python's round() is banker's rounding; a schedule should not depend on it.
    return int(math.floor(x + 0.5))


@dataclass(frozen=True)
class SkipSchedule:
    """A linear-decay SkipDecode schedule for a model of ``num_layers`` layers."""

    num_layers: int
    max_exit_layer: int
    min_exit_layer: int
    horizon: int
    warmup_layers: int = 1
    mode: str = "skip"
    layer_order: tuple[int, ...] | None = None  # mode "nested": layers, most important first

    def __post_init__(self) -> None:
        L, w = self.num_layers, self.warmup_layers
        if not isinstance(L, int) or L < 1:
            raise ScheduleError(f"num_layers must be a positive integer, got {L!r}")
        if self.mode not in MODES:
            raise ScheduleError(f"mode must be one of {MODES}, got {self.mode!r}")
        check_layer_order(self.layer_order, L, self.mode)
        if self.mode != "skip":
            w_floor = 0  # early exit and nested sets have no warm-up block
        else:
            if not isinstance(w, int) or w < 0:
                raise ScheduleError(f"warmup_layers must be an integer >= 0, got {w!r}")
            w_floor = w
        if self.horizon < 1:
            raise ScheduleError(f"horizon must be >= 1 generated positions, got {self.horizon}")
        if not (self.min_exit_layer <= self.max_exit_layer):
            raise ScheduleError(
                f"min_exit_layer ({self.min_exit_layer}) must be <= max_exit_layer "
                f"({self.max_exit_layer}): budgets may never increase along the sequence"
            )
        if self.max_exit_layer > L:
            raise ScheduleError(
                f"max_exit_layer ({self.max_exit_layer}) exceeds the model's {L} layers"
            )
        if self.min_exit_layer < w_floor + 1:
            raise ScheduleError(
                f"min_exit_layer ({self.min_exit_layer}) must be >= warmup_layers + 1 "
                f"= {w_floor + 1}: the last layer always runs after the warm-up block"
            )

    # -- budgets -----------------------------------------------------------
    def budget(self, i: int) -> int:
        """Number of layers run by generated token ``i`` (0-based)."""
        if i < 0:
            raise ScheduleError(f"generated position must be >= 0, got {i}")
        frac = min(i / self.horizon, 1.0)
        return _round_half_up(self.max_exit_layer - (self.max_exit_layer - self.min_exit_layer) * frac)

    def budgets(self, n: int) -> list[int]:
        return [self.budget(i) for i in range(n)]

    def layers(self, i: int) -> list[int]:
        """The exact, sorted layer indices generated token ``i`` runs."""
        return layers_for_budget(self.num_layers, self.budget(i), self.warmup_layers, self.mode, self.layer_order)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Per layer, its rank in the family: layer ``l`` runs at budget ``b`` iff ``ranks[l] < b``."""
        return layer_ranks(self.num_layers, self.warmup_layers, self.mode, self.layer_order)

    def layer_runs(self, layer: int, budget: int) -> bool:
        """Whether ``layer`` runs at this budget (without building the list)."""
        return self.ranks[layer] < budget

    def steps_using_layer(self, layer: int, n_steps: int) -> int:
        """How many of the first ``n_steps`` decode steps run ``layer``.

        Budgets never increase, so they are always a prefix of the steps; the
        KV cache of ``layer`` therefore needs only ``prompt + this`` slots. The
        prefix ends at the first step that skips the layer, found by bisection
        (a request's admission sizes every layer's slots from this, for up to
        ``max_new_tokens`` steps).
        """
        rank = self.ranks[layer]
        return bisect.bisect_left(range(n_steps), True, key=lambda i: self.budget(i) <= rank)

    def decode_layer_speedup(self, new_tokens: int) -> float:
        """``L / mean b(i)`` over the decode steps of ``new_tokens`` new tokens."""
        steps = max(new_tokens - 1, 0)
        if steps == 0:
            return 1.0
        return self.num_layers * steps / sum(self.budgets(steps))

    def with_order(self, layer_order: tuple[int, ...] | None) -> "SkipSchedule":
        """The same budgets on the nested family of ``layer_order`` (None: unchanged)."""
        if layer_order is None:
            return self
        return SkipSchedule(self.num_layers, self.max_exit_layer, self.min_exit_layer, self.horizon,
                            warmup_layers=0, mode="nested", layer_order=tuple(layer_order))

    # -- construction ------------------------------------------------------
    @classmethod
    def full_depth(cls, num_layers: int) -> "SkipSchedule":
        return cls(num_layers, num_layers, num_layers, horizon=1, warmup_layers=0)

    @classmethod
    def for_speedup(
        cls,
        target: float,
        expected_new_tokens: int,
        num_layers: int,
        *,
        horizon: int | None = None,
        warmup_layers: int = 1,
        mode: str = "skip",
        decay: float = DEFAULT_DECAY,
        layer_order: tuple[int, ...] | None = None,
    ) -> "SkipSchedule":
        """Solve ``max/min_exit_layer`` so the decode-layer speedup is ``target``.

        ``horizon`` defaults to the ``expected_new_tokens - 1`` decode steps
        (the paper used the median generation length). Among schedules that
        reach the target equally well, the one whose first budget is closest
        to ``decay`` times the mean budget (at most full depth) is chosen: with
        the default 1.5, early positions get more depth, later ones less, and
        the floor stays near half the mean (a 3x ratio between first and last
        budget, as in the schedules of SKIPDECODE.md); ``decay=1`` prefers a
        flat budget. A ``decay`` of at least ``target`` with a short
        ``horizon`` front-loads the schedule: the first few tokens run at (or
        near) full depth, then the budget drops to its floor. On E2E those
        first tokens copy the restaurant name from the prompt, which skipped
        lower layers otherwise garble.
        The achieved figure is ``schedule.decode_layer_speedup(expected_new_tokens)``.
        """
        if not (isinstance(target, (int, float)) and math.isfinite(target)) or target < 1:
            raise ScheduleError(f"target speedup must be a number >= 1, got {target!r}")
        if isinstance(decay, bool) or not (isinstance(decay, (int, float)) and math.isfinite(decay) and decay >= 1):
            raise ScheduleError(f"decay must be a finite number >= 1 (first budget / mean budget), got {decay!r}")
        if isinstance(expected_new_tokens, bool) or not isinstance(expected_new_tokens, int) \
                or expected_new_tokens < 1:
            raise ScheduleError(f"expected_new_tokens must be an integer >= 1, got {expected_new_tokens!r}")
        if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1):
            raise ScheduleError(f"horizon must be an integer >= 1, got {horizon!r}")
        if isinstance(warmup_layers, bool) or not isinstance(warmup_layers, int) or warmup_layers < 0:
            raise ScheduleError(f"warmup_layers must be an integer >= 0, got {warmup_layers!r}")
        if mode not in MODES:
            raise ScheduleError(f"mode must be one of {MODES}, got {mode!r}")
        check_layer_order(layer_order, num_layers, mode)
        w = warmup_layers if mode == "skip" else 0
        best_possible = num_layers / (w + 1)
        if target > best_possible + 1e-9:
            raise ScheduleError(
                f"a {target}x decode-layer speedup is impossible on {num_layers} layers with "
                f"{w} warm-up layer(s): at most {best_possible:.2f}x (budget {w + 1} everywhere)"
            )
        H = horizon if horizon is not None else max(expected_new_tokens - 1, 1)
        max_e, min_e = _solve(num_layers, target, max(expected_new_tokens - 1, 1), H, w, decay)
        return cls(num_layers, max_e, min_e, horizon=H, warmup_layers=w if mode == "nested" else warmup_layers,
                   mode=mode, layer_order=None if layer_order is None else tuple(layer_order))

    # -- files ---------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        if d["layer_order"] is None:
            del d["layer_order"]
        else:
            d["layer_order"] = list(d["layer_order"])
        return d

    @classmethod
    def from_dict(cls, d: dict, num_layers: int | None = None) -> "SkipSchedule":
        d = dict(d)
        known = {"num_layers", "max_exit_layer", "min_exit_layer", "horizon", "warmup_layers", "mode", "layer_order"}
        unknown = set(d) - known
        if unknown:
            raise ScheduleError(f"unknown schedule field(s) {sorted(unknown)}; expected {sorted(known)}")
        if num_layers is not None:
            if "num_layers" in d and d["num_layers"] != num_layers:
                raise ScheduleError(
                    f"schedule is for {d['num_layers']} layers but the model has {num_layers}"
                )
            d["num_layers"] = num_layers
        missing = {"num_layers", "max_exit_layer", "min_exit_layer", "horizon"} - set(d)
        if missing:
            raise ScheduleError(f"schedule is missing field(s) {sorted(missing)}")
        for k, v in d.items():
            if k not in ("mode", "layer_order") and (not isinstance(v, int) or isinstance(v, bool)):
                raise ScheduleError(f"schedule field {k!r} must be an integer, got {v!r}")
        if d.get("layer_order") is not None:
            if not isinstance(d["layer_order"], (list, tuple)):
                raise ScheduleError(f"schedule field 'layer_order' must be a list of layer indices, "
                                    f"got {d['layer_order']!r}")
            d["layer_order"] = tuple(d["layer_order"])
        return cls(**d)

    @classmethod
    def from_file(cls, path: str | Path, num_layers: int | None = None) -> "SkipSchedule":
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise ScheduleError(f"schedule file {p} does not exist") from None
        except json.JSONDecodeError as e:
            raise ScheduleError(f"schedule file {p} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ScheduleError(f"schedule file {p} must hold a JSON object")
        return cls.from_dict(d, num_layers)


def check_layer_order(order, num_layers: int, mode: str) -> None:
    if mode != "nested":
        if order is not None:
            raise ScheduleError(f"layer_order is only for mode 'nested', not {mode!r}")
        return
    if order is None:
        raise ScheduleError("mode 'nested' needs a layer_order (policies.importance.nested_order measures one)")
    if sorted(order) != list(range(num_layers)) or any(isinstance(x, bool) for x in order):
        raise ScheduleError(f"layer_order must list each of the {num_layers} layers once, got {list(order)!r}")


@lru_cache(maxsize=256)
def layer_ranks(num_layers: int, warmup_layers: int, mode: str = "skip",
                layer_order: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Per layer, its rank in the family (layer ``l`` runs at budget ``b`` iff ``rank[l] < b``):
    skip ranks the warm-up block first, then the layers from the top down; early exit from
    the bottom up; nested as ``layer_order`` lists them."""
    L, w = num_layers, warmup_layers
    if mode == "early_exit":
        order = tuple(range(L))
    elif mode == "nested":
        order = tuple(layer_order)
    else:
        order = tuple(range(w)) + tuple(range(L - 1, w - 1, -1))
    ranks = [0] * L
    for r, l in enumerate(order):
        ranks[l] = r
    return tuple(ranks)


def layers_for_budget(num_layers: int, budget: int, warmup_layers: int, mode: str = "skip",
                      layer_order: tuple[int, ...] | None = None) -> list[int]:
    """Active layer set, in depth order: ``{0..w-1} ∪ {L-(b-w)..L-1}`` (skip), ``{0..b-1}``
    (early exit), or the first ``b`` layers of ``layer_order`` (nested)."""
    ranks = layer_ranks(num_layers, warmup_layers, mode, layer_order)
    return [l for l in range(num_layers) if ranks[l] < budget]


SOLVER_TOLERANCE = 0.01  # relative: schedules this close to the target count as hitting it


@lru_cache(maxsize=256)
def _solve(L: int, target: float, steps: int, H: int, w: int, decay: float = DEFAULT_DECAY) -> tuple[int, int]:
    """Exhaustive search over (max_exit, min_exit).

    Keep the schedules within 1% of the target (or the closest, if none is);
    among those prefer a first budget near ``decay`` x the target mean budget, so
    the budget really decays instead of staying flat (nor collapsing to a
    floor of 1-2 layers); then the smaller error.
    """
    cands = []
    for max_e in range(w + 1, L + 1):
        for min_e in range(w + 1, max_e + 1):
            s = SkipSchedule(L, max_e, min_e, horizon=H, warmup_layers=w)
            cands.append((abs(s.decode_layer_speedup(steps + 1) - target), max_e, min_e))
    tol = max(min(c[0] for c in cands), SOLVER_TOLERANCE * target) + 1e-12
    preferred_start = min(L, decay * L / target)
    _, max_e, min_e = min((c for c in cands if c[0] <= tol),
                          key=lambda c: (abs(c[1] - preferred_start), c[0], -c[2]))
    return max_e, min_e


def parse_speedups(text: str) -> list[float]:
    """``1,2,3`` -> ``[1.0, 2.0, 3.0]`` (the argparse type of every ``--speedups`` flag)."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"speedups must be numbers like 1,2,3; got {text!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("give at least one speedup")
    bad = [v for v in vals if not math.isfinite(v) or v < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"each speedup must be a finite number >= 1; got {text!r}")
    return vals
