"""The shipped model's choice, on e2e-heldout's select part only (benchmarks/results/choice-on-select.json).

The rule, fixed before the last candidate was scored: the most quality goals met on select
(2x >= 99%, 3x >= 97% and 5x >= 93% of the candidate's own 1x BLEU; names right at 3x >= 95%
of its 1x share), ties broken by mean select BLEU over 1x-5x. Reads each candidate's
benchmarks/results/eval-select-STEM.json (skipdecode evaluate --split select --speedups 1,2,3,4,5).
Run from the repository root:
    .venv/bin/python benchmarks/choose_on_select.py default-e2e-skip default-e2e-nested default-e2e-nested-removal
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path("benchmarks/results")
KEPT_GOALS = {2.0: 0.99, 3.0: 0.97, 5.0: 0.93}
NAMES_GOAL = 0.95  # names right at 3x, as a share of the 1x count


def candidate(stem: str) -> dict:
    res = {r["speedup_target"]: r for r in json.loads((RESULTS / f"eval-select-{stem}.json").read_text())["results"]}
    b1, names1 = res[1.0]["bleu"], res[1.0]["names_copied"]
    kept = {s: res[s]["bleu"] / b1 for s in sorted(res) if s != 1.0}
    goals = {f"{s:g}x kept >= {g:.0%}": kept[s] >= g for s, g in KEPT_GOALS.items()}
    goals[f"names at 3x >= {NAMES_GOAL:.0%} of 1x"] = res[3.0]["names_copied"] >= NAMES_GOAL * names1
    return {"stem": stem, "goals": goals, "goals_met": sum(goals.values()),
            "kept": {f"{s:g}x": round(k, 4) for s, k in kept.items()},
            "names_copied": {f"{s:g}x": res[s]["names_copied"] for s in sorted(res)},
            "mean_bleu": round(sum(r["bleu"] for r in res.values()) / len(res), 3)}


def main() -> None:
    rows = [candidate(stem) for stem in sys.argv[1:]]
    best = max(rows, key=lambda r: (r["goals_met"], r["mean_bleu"]))
    for r in rows:
        print(f"{r['stem']:30s} goals met {r['goals_met']}  kept " + " ".join(f"{100 * k:.1f}" for k in r["kept"].values())
              + f"  mean BLEU {r['mean_bleu']:.2f}")
    print(f"chosen: {best['stem']}")
    out = {"split": "e2e-heldout select", "candidates": rows, "chosen": best["stem"],
           "command": "python benchmarks/choose_on_select.py " + " ".join(sys.argv[1:])}
    (RESULTS / "choice-on-select.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
