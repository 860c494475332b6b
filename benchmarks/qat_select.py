"""int4 after quantization-aware fine-tuning (`skipdecode train --qat int4`,
recipes/default-e2e-int4-qat.yaml) against the int4 it starts from (`skipdecode awq`'s AWQ scales
and GPTQ rounding, runs/default-e2e-gptq), both held against `default-e2e` in fp32, on
e2e-heldout's select part (benchmarks/results/qat-select.json). Greedy, at 1x, 2x and 3x; BLEU
and greedy token agreement with fp32's outputs. Select only: it chooses; the report part is
scored once afterwards (`skipdecode bench --dtype-parity --model runs/default-e2e-int4-qat`).
Run from the repository root after benchmarks/train_e2e_int4_qat.sh has trained the model:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/qat_select.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from skipdecode.bench.dtype_parity import against_reference
from skipdecode.evaluation.evaluate import evaluate

OUT = Path("benchmarks/results/qat-select.json")
DATA = "../shared/data/e2e/devset.csv"
SPEEDUPS = (1.0, 2.0, 3.0)
START, QAT = "runs/default-e2e-gptq", "runs/default-e2e-int4-qat"


def score(model: str, dtype: str) -> dict:
    return evaluate("e2e", DATA, model=model, speedups=SPEEDUPS, split="select", dtype=dtype, bertscore=False)


def main() -> None:
    torch.set_num_threads(2)
    runs = {"float32": score("default-e2e", "float32"),
            f"int4, awq + gptq ({START})": score(START, "int4"),
            f"int4, qat ({QAT})": score(QAT, "int4"),
            f"w4a8, qat ({QAT})": score(QAT, "w4a8")}
    ref = runs["float32"]
    rows = against_reference(runs, ref)
    meta = json.loads((Path(QAT) / "skipdecode.json").read_text())
    OUT.write_text(json.dumps({"model": "default-e2e", "split": "e2e-heldout select",
                               "n_examples": ref["results"][0]["n_examples"], "results": rows,
                               "qat_run": {"config": meta["config"], "validation_loss": meta.get("validation_loss"),
                                           "seconds": meta.get("seconds")},
                               "torch": torch.__version__, "command": "python " + " ".join(sys.argv)}, indent=1)
                   + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
