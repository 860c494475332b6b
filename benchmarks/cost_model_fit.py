"""The cost model's two points against a line through a bench run's own schedules.

`skipdecode bench` predicts skipping from a line through two steps: full depth and a schedule
that runs one layer per token. This fits, per engine and batch, a least-squares line through
the measured steps of every target (1x, 2x, 3x, 5x: mean layers per step against ms per step)
and reports where the one-layer step falls against it. A one-layer step well below that line
means it ran faster than its layer count says (on a CPU whose last-level cache holds a one-layer
step's weights and LM head), which makes the bench's line predict more than skipping gives.
Prints a table; reads a bench.json. Run from the repository root:
    .venv/bin/python benchmarks/cost_model_fit.py benchmarks/results/xeon-amx/bench.json \
        > benchmarks/results/xeon-amx/cost-model-fit.md
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    report = json.loads(Path(sys.argv[1]).read_text())
    L = report["settings"]["num_layers"]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in report["results"]:
        if "one_layer_ms_per_step" in r or "measured_over_predicted" in r:
            groups.setdefault((r["engine"], r["batch_size"]), []).append(r)
    print(f"# The cost model's one-layer point against the schedules' own line\n\n"
          f"`python benchmarks/cost_model_fit.py {sys.argv[1]}` ({report['machine']['cpu']}, "
          f"{report['machine']['date']}): per engine and batch, a least-squares line through the measured "
          f"1x-5x steps (mean layers per step against ms per step), the one-layer step it implies, the "
          f"one-layer step measured, the bench's `fixed` (its line through full depth and the one-layer "
          f"step) and the bench's worst measured/predicted speedup.\n")
    print("| batch | engine | per layer (ms) | fixed (ms) | one-layer step on the line | measured | "
          "bench's fixed | worst measured/predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for (engine, batch), rows in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        full = next(r for r in rows if r["speedup_target"] == 1.0)
        slope, icept = statistics.linear_regression([L / r["decode_layer_speedup"] for r in rows], [r["ms_per_step"] for r in rows])
        worst = min(r["measured_over_predicted"] for r in rows if r["speedup_target"] != 1.0)
        print(f"| {batch} | {engine} | {slope:.3f} | {icept:.2f} | {icept + slope:.2f} | "
              f"{full['one_layer_ms_per_step']:.2f} | {full['fixed_ms_per_step']:.2f} | {worst:.3f} |")


if __name__ == "__main__":
    main()
