"""int4 with and without activation-aware channel scales (skipdecode.awq), scored on e2e-heldout's
select part (benchmarks/results/awq-select.json): which calibration `skipdecode awq` uses.

`default-e2e` in fp32 and in int4 (llama.cpp's Q4_0 rounding) as shipped, then in int4 after
scales fitted on 64 training examples of e2e-heldout run at full depth only, and run with the
checkpoint's schedules at 1x, 2x and 3x (the command's default). Greedy, at 1x, 2x and 3x; BLEU
and greedy token agreement with fp32's outputs. Select only: it chooses; the report part is
scored once afterwards (`skipdecode bench --dtype-parity --model ...`). Run from the repository root:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/awq_select.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from skipdecode.awq import fit
from skipdecode.bench.dtype_parity import against_reference
from skipdecode.evaluation.evaluate import evaluate
from skipdecode.llm import LLM

OUT = Path("benchmarks/results/awq-select.json")
DATA = "../shared/data/e2e/devset.csv"
SPEEDUPS = (1.0, 2.0, 3.0)


def score(calibration: tuple[float, ...] | None, dtype: str) -> dict:
    llm = LLM.load("default-e2e", pack=False)
    if calibration:
        fit(llm, "e2e-heldout", 64, calibration)
    llm.model.pack_for_inference(True, weights=dtype)
    return evaluate("e2e", DATA, model="default-e2e", speedups=SPEEDUPS, split="select", llm=llm, dtype=dtype,
                    bertscore=False)


def main() -> None:
    torch.set_num_threads(2)
    runs = {"float32": score(None, "float32"), "int4 (Q4_0 rounding)": score(None, "int4"),
            "int4, awq fitted at 1x": score((1.0,), "int4"),
            "int4, awq fitted at 1x, 2x, 3x (skipdecode awq's default)": score(SPEEDUPS, "int4")}
    ref = runs["float32"]["results"]
    rows = against_reference(runs, runs["float32"])
    OUT.write_text(json.dumps({"model": "default-e2e", "split": "e2e-heldout select",
                               "n_examples": ref[0]["n_examples"], "results": rows,
                               "command": "python " + " ".join(sys.argv)}, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
