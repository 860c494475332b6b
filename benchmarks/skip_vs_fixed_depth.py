"""Skipping steps against fixed-depth steps of the same model, in one process.

`skipdecode bench`'s cost model predicts a skipping step's time from a line through two
fixed-depth steps (full depth and ``k`` layers, ``bench.decode.calibration_schedule``). On a shared
host one bench run's best round can still sit 10% off, so this times the skipping schedules and
the line's steps (and a fixed-depth step of the skipping schedule's mean layer count) round by
round, interleaved, and reports each skipping step against the line (the line through the best
steps, and paired: the median over the rounds of each round's own ratio), against that step, and
against as many layers of the schedule's own family (a nested schedule's order: the line's steps
run the top layers). It also reports the line's own error at that fixed-depth step (the step over
the line's prediction for it): where a step's time is not a straight line in its layers (a
last-level cache that holds more of a shallow step's weights and head), the line misses fixed-depth
steps as it misses skipping ones. Last, each skipping step against the fixed-depth step of its own
budget at the same step (the schedule's family, so the same layers over as many cached positions):
the sum of those over the skipping run's is what skipping costs beyond the layers it runs.

    .venv/bin/python benchmarks/skip_vs_fixed_depth.py OUT.json [--dtype D] [--rows R] [--speedups 2,3,5] [--rounds 8]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from kernel_ab import NEW_TOKENS, case_rows, pop_option, write_report  # the same cases and report

from skipdecode import LLM
from skipdecode.bench.decode import calibration_schedule, cost_line, round_median, round_ratios
from skipdecode.generate import generate_tokens
from skipdecode.schedule import SkipSchedule

ROUNDS = 8


def same_layers_each_step(budgets: list[int], skipping: list[list[float]], fixed: dict[int, list[list[float]]],
                          rnd: int | None) -> tuple[float, float]:
    """(fixed-depth time, skipping time) summed over the decode steps: step j of the skipping run
    (``budgets[j]`` layers) against step j of the fixed-depth run of that budget (``fixed[b]``); each
    run's step times per round (``skipping``, ``fixed[b]``: [round][step]). From round ``rnd``, or
    (None) each step's best over the rounds, as the bench sums them. The engine times its steps a
    burst at a time (generate.DECODE_BURST), each step its burst's share, the bursts at the same
    steps in every run."""

    def step(run: list[list[float]], j: int) -> float:
        return run[rnd][j] if rnd is not None else min(r[j] for r in run)

    return (sum(step(fixed[b], j) for j, b in enumerate(budgets)),
            sum(step(skipping, j) for j in range(len(budgets))))


def main() -> None:
    args = sys.argv[1:]
    if not args or {"-h", "--help"} & set(args):
        print(__doc__)
        raise SystemExit(0 if args else 2)
    dtype = pop_option(args, "--dtype") or "float32"
    rows = int(pop_option(args, "--rows") or 1)
    speedups = [float(s) for s in (pop_option(args, "--speedups") or "2,3,5").split(",")]
    rounds = int(pop_option(args, "--rounds") or ROUNDS)
    llm = LLM.load("default-e2e", dtype=dtype)
    L = llm.num_layers
    ids, _ = case_rows(llm, rows, 1.0)
    cal = calibration_schedule(llm)
    k = cal.min_exit_layer
    scheds = {"full": SkipSchedule.full_depth(L), f"fixed{k}": cal}
    mean_layers = {}
    for s in speedups:
        _, sched = case_rows(llm, rows, s)
        mean_layers[s] = L / sched.decode_layer_speedup(NEW_TOKENS)  # as the bench counts a step's layers
        scheds[f"{s:g}x"] = sched
        n = round(mean_layers[s])
        scheds.setdefault(f"fixed{n}", SkipSchedule(L, n, n, horizon=1, warmup_layers=0))
        # n layers of the schedule's own family (a nested schedule's order runs other layers than the top
        # n), and so every budget its steps take: skipping step j of b layers runs the layers that step j
        # of that family's fixed b layers runs
        for b in sorted(set(sched.budgets(NEW_TOKENS - 1)) | {n}):
            scheds.setdefault(f"order{b}", SkipSchedule(L, b, b, horizon=1, warmup_layers=0, mode=sched.mode,
                                                        layer_order=sched.layer_order))
    ms: dict[str, list[float]] = {name: [] for name in scheds}
    steps: dict[str, list[list[float]]] = {name: [] for name in scheds}  # each decode step's ms, per round
    for rnd in range(rounds + 1):  # a warm-up round, then each schedule once a round, the order alternating
        for name in list(scheds)[::1 if rnd % 2 else -1]:
            _, st = generate_tokens(llm.model, ids, scheds[name], NEW_TOKENS, eos_token_ids=())
            if rnd:
                ms[name].append(st["decode_seconds"] / (NEW_TOKENS - 1) * 1000)
                steps[name].append([x * 1000 for x in st["step_seconds"]])
    best = {name: min(v) for name, v in ms.items()}

    def line_at(full_ms: float, short_ms: float, layers: float) -> float:
        """The line's ms per step at ``layers`` a step, through these full-depth and k-layer steps."""
        return full_ms / cost_line(full_ms, L, short_ms, k, layers)[1]

    results = []
    for s in speedups:
        m, n = mean_layers[s], round(mean_layers[s])
        budgets = scheds[f"{s:g}x"].budgets(NEW_TOKENS - 1)
        fixed = {b: steps[f"order{b}"] for b in set(budgets)}
        same = {i: same_layers_each_step(budgets, steps[f"{s:g}x"], fixed, i) for i in [None, *range(rounds)]}
        line = line_at(best["full"], best[f"fixed{k}"], m)  # the bench's line
        r = {"speedup": s, "mean_layers": round(m, 2), "ms_per_step": round(best[f"{s:g}x"], 3),
             "line_ms": round(line, 3), "measured_over_line": round(line / best[f"{s:g}x"], 3),
             # the same within each round (the line's steps and this schedule's from one round), the median
             "measured_over_line_round_median": round(statistics.median(
                 round_ratios(ms["full"], ms[f"fixed{k}"], ms[f"{s:g}x"], L, k, m)), 3),
             f"fixed_{n}_ms": round(best[f"fixed{n}"], 3),
             "measured_over_fixed_same_layers": round(best[f"fixed{n}"] * m / n / best[f"{s:g}x"], 3),
             "measured_over_fixed_same_layers_round_median": round(round_median(
                 [f * m / n for f in ms[f"fixed{n}"]], ms[f"{s:g}x"]), 3),
             f"order_{n}_ms": round(best[f"order{n}"], 3),
             "measured_over_fixed_same_layers_in_order": round(best[f"order{n}"] * m / n / best[f"{s:g}x"], 3),
             "measured_over_fixed_same_layers_in_order_round_median": round(round_median(
                 [f * m / n for f in ms[f"order{n}"]], ms[f"{s:g}x"]), 3),
             # the line's own error where it has a measured step to meet: the fixed-depth step of n
             # layers over the line's step of n layers (above 1: the line predicts n layers faster
             # than n layers run, whatever skipping does)
             f"fixed_{n}_over_line": round(best[f"fixed{n}"] / line_at(best["full"], best[f"fixed{k}"], n), 3),
             f"fixed_{n}_over_line_round_median": round(statistics.median(
                 f / line_at(a, c, n) for a, c, f in zip(ms["full"], ms[f"fixed{k}"], ms[f"fixed{n}"])), 3),
             # every step against the same layers at the same step without skipping: what skipping itself
             # costs, whatever a step's time does with its depth (the fixed steps' sum over the skipping's)
             "measured_over_same_layers_each_step": round(same[None][0] / same[None][1], 3),
             "measured_over_same_layers_each_step_round_median": round(statistics.median(
                 a / b for a, b in (same[i] for i in range(rounds))), 3)}
        results.append(r)
        print(r, flush=True)
    write_report(Path(args[0]), "skip_vs_fixed_depth.py", "schedules", results, rounds=rounds, dtype=dtype, rows=rows,
                 calibration_layers=k, ms_per_step={n: round(v, 3) for n, v in best.items()},
                 rounds_ms={n: [round(x, 3) for x in v] for n, v in ms.items()})


if __name__ == "__main__":
    main()
