"""int4 rounded to nearest against GPTQ's error-compensating rounding (skipdecode.gptq), both after
`skipdecode awq`'s channel scales, scored on e2e-heldout's select part
(benchmarks/results/gptq-select.json): which rounding `skipdecode awq` writes.

`default-e2e` in fp32 (the reference), then in int4 after the scales (`skipdecode awq`'s default,
round to nearest at load), and after the scales with the block linears rounded by GPTQ, X^T X from
the same 64 training examples of e2e-heldout run with the checkpoint's schedules at 1x, 2x and 3x.
Greedy, at 1x, 2x and 3x; BLEU and greedy token agreement with fp32's outputs. Select only: it
chooses; the report part is scored once afterwards (`skipdecode bench --dtype-parity --model ...`).
Run from the repository root:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/gptq_select.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from skipdecode import gptq
from skipdecode.awq import fit
from skipdecode.bench.dtype_parity import against_reference
from skipdecode.evaluation.evaluate import evaluate
from skipdecode.llm import LLM

OUT = Path("benchmarks/results/gptq-select.json")
DATA = "../shared/data/e2e/devset.csv"
SPEEDUPS = (1.0, 2.0, 3.0)


def score(dtype: str, awq: bool, rounding: str, fits: dict) -> dict:
    llm = LLM.load("default-e2e", pack=False)
    t0 = time.perf_counter()
    if awq:
        fit(llm, "e2e-heldout", 64, SPEEDUPS)
    if rounding == "gptq":
        rec = gptq.fit(llm, "e2e-heldout", 64, SPEEDUPS)
        shares = [r["error_share"] for r in rec["linears"]]
        fits[f"awq={awq}"] = {"seconds": round(time.perf_counter() - t0, 1),
                              "error_share_median": statistics.median(shares),
                              "error_share_min": min(shares), "error_share_max": max(shares)}
    llm.model.pack_for_inference(True, weights=dtype)
    return evaluate("e2e", DATA, model="default-e2e", speedups=SPEEDUPS, split="select", llm=llm, dtype=dtype,
                    bertscore=False)


def main() -> None:
    torch.set_num_threads(2)
    fits: dict = {}
    runs = {"float32": score("float32", False, "nearest", fits),
            "int4, awq, round to nearest (skipdecode awq's default)": score("int4", True, "nearest", fits),
            "int4, awq, gptq": score("int4", True, "gptq", fits),
            "int4, gptq without awq": score("int4", False, "gptq", fits)}
    ref = runs["float32"]["results"]
    rows = against_reference(runs, runs["float32"])
    OUT.write_text(json.dumps({"model": "default-e2e", "split": "e2e-heldout select",
                               "n_examples": ref[0]["n_examples"], "results": rows,
                               "gptq_fit (product error on the calibration inputs, share of nearest's)": fits,
                               "torch": torch.__version__, "command": "python " + " ".join(sys.argv)}, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
