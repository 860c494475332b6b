"""Skipping steps against fixed-depth steps of the same model, in one process.

`skipdecode bench`'s cost model predicts a skipping step's time from a line through two
fixed-depth steps (full depth and ``k`` layers, ``bench.decode.calibration_schedule``). On a shared
host one bench run's best round can still sit 10% off, so this times the skipping schedules and
the line's steps (and a fixed-depth step of the skipping schedule's mean layer count) round by
round, interleaved, and reports each skipping step against the line (the line through the best
steps, and paired: the median over the rounds of each round's own ratio), against that step, and
against as many layers of the schedule's own family (a nested schedule's order: the line's steps
run the top layers).

    .venv/bin/python benchmarks/skip_vs_fixed_depth.py OUT.json [--dtype D] [--rows R] [--speedups 2,3,5]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from kernel_ab import NEW_TOKENS, case_rows, pop_option, write_report  # the same cases and report

from skipdecode import LLM
from skipdecode.bench.decode import calibration_schedule, cost_line, round_ratios
from skipdecode.generate import generate_tokens
from skipdecode.schedule import SkipSchedule

ROUNDS = 8


def main() -> None:
    args = sys.argv[1:]
    if not args or {"-h", "--help"} & set(args):
        print(__doc__)
        raise SystemExit(0 if args else 2)
    dtype = pop_option(args, "--dtype") or "float32"
    rows = int(pop_option(args, "--rows") or 1)
    speedups = [float(s) for s in (pop_option(args, "--speedups") or "2,3,5").split(",")]
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
        # and n layers of the schedule's own family (a nested schedule's order runs other layers than the top n)
        scheds.setdefault(f"order{n}", SkipSchedule(L, n, n, horizon=1, warmup_layers=0, mode=sched.mode,
                                                    layer_order=sched.layer_order))
    ms: dict[str, list[float]] = {name: [] for name in scheds}
    for rnd in range(ROUNDS + 1):  # a warm-up round, then each schedule once a round, the order alternating
        for name in list(scheds)[::1 if rnd % 2 else -1]:
            _, st = generate_tokens(llm.model, ids, scheds[name], NEW_TOKENS, eos_token_ids=())
            if rnd:
                ms[name].append(st["decode_seconds"] / (NEW_TOKENS - 1) * 1000)
    best = {name: min(v) for name, v in ms.items()}
    results = []
    for s in speedups:
        m, n = mean_layers[s], round(mean_layers[s])
        _, predicted = cost_line(best["full"], L, best[f"fixed{k}"], k, m)  # the bench's line
        line = best["full"] / predicted
        r = {"speedup": s, "mean_layers": round(m, 2), "ms_per_step": round(best[f"{s:g}x"], 3),
             "line_ms": round(line, 3), "measured_over_line": round(line / best[f"{s:g}x"], 3),
             # the same within each round (the line's steps and this schedule's from one round), the median
             "measured_over_line_round_median": round(statistics.median(
                 round_ratios(ms["full"], ms[f"fixed{k}"], ms[f"{s:g}x"], L, k, m)), 3),
             f"fixed_{n}_ms": round(best[f"fixed{n}"], 3),
             "measured_over_fixed_same_layers": round(best[f"fixed{n}"] * m / n / best[f"{s:g}x"], 3),
             f"order_{n}_ms": round(best[f"order{n}"], 3),
             "measured_over_fixed_same_layers_in_order": round(best[f"order{n}"] * m / n / best[f"{s:g}x"], 3)}
        results.append(r)
        print(r, flush=True)
    write_report(Path(args[0]), "skip_vs_fixed_depth.py", "schedules", results, dtype=dtype, rows=rows,
                 calibration_layers=k, ms_per_step={n: round(v, 3) for n, v in best.items()},
                 rounds_ms={n: [round(x, 3) for x in v] for n, v in ms.items()})


if __name__ == "__main__":
    main()
