"""int4 after quantization-aware fine-tuning (`skipdecode train --qat int4`,
recipes/default-e2e-int4-qat.yaml at lr 5e-5, and at 1e-4) against the int4 it starts from (`skipdecode awq`'s AWQ scales
and GPTQ rounding, runs/default-e2e-gptq), both held against `default-e2e` in fp32, on
e2e-heldout's select part (benchmarks/results/qat-select.json). Greedy, at 1x, 2x and 3x; BLEU
and greedy token agreement with fp32's outputs. The rule, fixed before scoring: the run whose int4
reproduces most of fp32's greedy tokens (mean agreement over 1x-3x; BLEU on 73 MRs moves by a
point or two with a handful of changed outputs) is `chosen`. Select only: it chooses; the report
part is scored once afterwards, for the chosen run (`skipdecode bench --dtype-parity --model RUN`).
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
START = "runs/default-e2e-gptq"
QATS = ("runs/default-e2e-int4-qat", "runs/default-e2e-int4-qat-lr1e-4")


def score(model: str, dtype: str) -> dict:
    return evaluate("e2e", DATA, model=model, speedups=SPEEDUPS, split="select", dtype=dtype, bertscore=False)


def main() -> None:
    torch.set_num_threads(2)
    runs = {"float32": score("default-e2e", "float32"), f"int4, awq + gptq ({START})": score(START, "int4")}
    for q in QATS:
        runs[f"int4, qat ({q})"] = score(q, "int4")
        runs[f"w4a8, qat ({q})"] = score(q, "w4a8")
    ref = runs["float32"]
    rows = against_reference(runs, ref)
    mean = {q: sum(r["token_agreement"] for r in rows[f"int4, qat ({q})"].values()) / len(SPEEDUPS) for q in QATS}
    chosen = max(QATS, key=mean.get)
    qat_runs = {}
    for q in QATS:
        meta = json.loads((Path(q) / "skipdecode.json").read_text())
        qat_runs[q] = {"lr": meta["config"]["lr"], "steps": meta["total_steps"], "seconds": meta.get("seconds"),
                       "validation_loss": meta.get("validation_loss"), "int4_mean_token_agreement": round(mean[q], 4)}
    OUT.write_text(json.dumps({"model": "default-e2e", "split": "e2e-heldout select",
                               "n_examples": ref["results"][0]["n_examples"], "results": rows,
                               "qat_runs": qat_runs, "chosen": chosen,
                               "rule": "the qat run whose int4 has the highest mean greedy token agreement with "
                                       "fp32 over 1x-3x",
                               "torch": torch.__version__, "command": "python " + " ".join(sys.argv)}, indent=1)
                   + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
