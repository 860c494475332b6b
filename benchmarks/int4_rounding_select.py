"""int4 rounding rules scored on e2e-heldout's select part (benchmarks/results/int4-rounding-select.json).

skipdecode's int4 rounds as llama.cpp's Q4_0 does (the group's largest-magnitude weight maps to
-8). A least-squares scale per group of 32 (llama.cpp's make_qx_quants search: 19 candidate
scales around the Q4_0 one, each refitted by least squares and kept if it lowers the group's
error) lowers the weights' rounding error; this scores `default-e2e` in int4 with that rule,
unweighted and weighted by w^2 (what llama.cpp weighs by without an importance matrix), at 1x
and 3x on select, beside the shipped rule (eval-select-default-e2e-int4.json). Select only: it
chooses the rule. Run from the repository root:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/int4_rounding_select.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import skipdecode.model as model
from skipdecode import kernels
from skipdecode.cli import main as cli

OUT = Path("benchmarks/results/int4-rounding-select.json")


def least_squares_int4(w: torch.Tensor, weighted: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int4``'s output format, with each group's scale searched for least (weighted) squared error."""
    g = kernels.INT4_GROUP
    n, k = w.shape
    wg = w.float().reshape(n, k // g, g)
    imp = wg * wg if weighted else torch.ones_like(wg)
    m = wg.gather(-1, wg.abs().argmax(dim=-1, keepdim=True))
    d0 = (m / -8).bfloat16().float()

    def codes(d: torch.Tensor) -> torch.Tensor:
        return torch.round(wg * torch.where(d == 0, torch.zeros_like(d), 1 / d)).clamp(-8, 7)

    def err(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return (imp * (wg - d * q) ** 2).sum(-1, keepdim=True)

    best_d, best_q = d0, codes(d0)
    best_e = err(best_d, best_q)
    for s in range(-9, 10):
        q = torch.round(wg * torch.where(m == 0, torch.zeros_like(m), -(8 + 0.1 * s) / m)).clamp(-8, 7)
        sumlx, suml2 = (imp * wg * q).sum(-1, keepdim=True), (imp * q * q).sum(-1, keepdim=True)
        d = torch.where(suml2 > 0, sumlx / suml2.clamp(min=1e-30), d0).bfloat16().float()
        q = codes(d)
        e = err(d, q)
        better = e < best_e
        best_d, best_q, best_e = (torch.where(better, d, best_d), torch.where(better, q, best_q),
                                  torch.where(better, e, best_e))
    return (best_q + 8).to(torch.uint8).reshape(n, k).contiguous(), best_d.squeeze(-1).bfloat16().contiguous()


def main() -> None:
    rows = {}
    for name, weighted in (("least squares", False), ("least squares, weighted by w^2", True)):
        model.quantize_int4 = lambda w, weighted=weighted: least_squares_int4(w, weighted)
        out = Path(f"runs/int4-rounding-select-{'weighted' if weighted else 'plain'}.json")
        cli(["evaluate", "--task", "e2e", "--data", "../shared/data/e2e/devset.csv", "--split", "select",
             "--model", "default-e2e", "--dtype", "int4", "--speedups", "1,3", "--out", str(out)])
        rows[name] = {str(r["speedup_target"]): r["bleu"] for r in json.loads(out.read_text())["results"]}
    shipped = json.loads(Path("benchmarks/results/eval-select-default-e2e-int4.json").read_text())["results"]
    fp32 = json.loads(Path("benchmarks/results/eval-select-default-e2e.json").read_text())["results"]
    rows["Q4_0 rule (shipped; eval-select-default-e2e-int4.json)"] = {str(r["speedup_target"]): r["bleu"] for r in shipped}
    rows["float32 (eval-select-default-e2e.json)"] = {str(r["speedup_target"]): r["bleu"] for r in fp32
                                                       if r["speedup_target"] in (1.0, 3.0)}
    OUT.write_text(json.dumps({"model": "default-e2e", "split": "e2e-heldout select", "metric": "BLEU",
                               "bleu": rows, "command": "python " + " ".join(sys.argv)}, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
