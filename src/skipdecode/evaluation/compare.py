"""``skipdecode compare``: is one checkpoint better than another, or is the gap noise?

Two ``skipdecode evaluate`` reports on the same items (the same task file, split
and limit) are compared at every speedup both hold: the score of each, their
difference and ratio, with 95% intervals from a paired bootstrap over the items
(both systems on the same resample). A difference whose interval holds 0 is not
a measured gain on this many items.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from .. import atomic
from ..data import DataError
from .metrics import PAIRED_BOOTSTRAPS

LABELS = {"bleu": "BLEU", "rougeL": "ROUGE-L"}


def _read(path: str | os.PathLike) -> dict[str, Any]:
    try:
        rep = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not JSON ({e.msg} at line {e.lineno}): give a `skipdecode evaluate --out` "
                        f"report") from None
    if not isinstance(rep, dict) or not isinstance(rep.get("results"), list) or not all(
            isinstance(r, dict) and "outputs" in r and "speedup_target" in r for r in rep["results"]):
        raise DataError(f"{path} is not a `skipdecode evaluate` report with outputs (results[*].outputs)")
    return rep


def compare(new: dict[str, Any], old: dict[str, Any], resamples: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Per shared speedup: both scores, new - old and new / old, each with a paired 95% interval."""
    olds = {r["speedup_target"]: r for r in old["results"]}
    rows = []
    for r in new["results"]:
        o = olds.get(r["speedup_target"])
        if o is None:
            continue
        prompts = [x["prompt"] for x in r["outputs"]]
        if prompts != [x["prompt"] for x in o["outputs"]]:
            raise DataError(f"the reports answer different items at {r['speedup_target']:g}x ({len(prompts)} vs "
                            f"{len(o['outputs'])}, or another order): evaluate both on the same --data, --split "
                            f"and --limit")
        refs = [x["references"] for x in r["outputs"]]
        row: dict[str, Any] = {"speedup_target": r["speedup_target"]}
        for m, boot in PAIRED_BOOTSTRAPS.items():
            ci = boot([x["text"] for x in r["outputs"]], [x["text"] for x in o["outputs"]], refs,
                      resamples=resamples, seed=seed)
            row[m] = {"new": r[m], "old": o[m], "difference": round(r[m] - o[m], 3),
                      "difference_95ci": ci["difference"],
                      "ratio": round(r[m] / o[m], 4) if o[m] else None, "ratio_95ci": ci["ratio"]}
        rows.append(row)
    if not rows:
        raise DataError(f"the reports share no speedup (new: {[r['speedup_target'] for r in new['results']]}, "
                        f"old: {sorted(olds)})")
    return {"new": new.get("model"), "old": old.get("model"), "data": new.get("data"), "split": new.get("split"),
            "n_examples": len(new["results"][0]["outputs"]), "resamples": resamples, "seed": seed, "results": rows}


def add_compare_cli(subparsers: Any) -> argparse.ArgumentParser:
    c = subparsers.add_parser("compare", help="paired comparison of two evaluate reports (is the gap noise?)")
    c.add_argument("new", help="report JSON of the candidate (skipdecode evaluate --out)")
    c.add_argument("old", help="report JSON it is compared against, on the same items")
    c.add_argument("--out", default=None, help="write the comparison as JSON")

    def run(a: argparse.Namespace) -> int:
        res = compare(_read(a.new), _read(a.old))
        for row in res["results"]:
            cells = []
            for m in PAIRED_BOOTSTRAPS:
                d = row[m]
                lo, hi = d["difference_95ci"]
                cells.append(f"{LABELS[m]} {d['new']:.2f} vs {d['old']:.2f}: {d['difference']:+.2f} "
                             f"({lo:+.2f} to {hi:+.2f})")
            print(f"{row['speedup_target']:g}x  " + "  ".join(cells))
        print(f"({res['n_examples']} items; 95% intervals from a paired bootstrap, {res['resamples']} resamples)")
        if a.out:
            atomic.write_text(a.out, json.dumps(res, indent=2) + "\n")
        return 0

    c.set_defaults(func=run)
    return c
