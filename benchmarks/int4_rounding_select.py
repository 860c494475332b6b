"""int4 rounding rules scored on e2e-heldout's select part (benchmarks/results/int4-rounding-select.json).

skipdecode's int4 rounds as llama.cpp's Q4_0 does (the group's largest-magnitude weight maps to
-8). A least-squares scale per group of 32 (llama.cpp's make_qx_quants search: 19 candidate
scales around the Q4_0 one, each refitted by least squares and kept only if it lowers the
group's error) lowers the weights' rounding error. This scores `default-e2e` in int4 with that
rule at 1x and 3x on select, beside the shipped rule (eval-select-default-e2e-int4.json), with
the error weighted three ways: not at all; by w^2 (llama.cpp without an importance matrix); and
by an importance matrix, llama.cpp's imatrix rule (each input's summed squared activation over
64 training examples of e2e-heldout, times sqrt(sigma^2 + w^2), sigma^2 the row's mean w^2).
Select only: it chooses the rule. The committed figures are from the skip-the-bottom
`default-e2e` shipped before (its fp32 scores: eval-select-default-e2e-skip.json); a rerun
scores whatever `default-e2e` is now, and its fp32 row must then be scored again. Run from the
repository root:
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/int4_rounding_select.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import skipdecode.model as model
from skipdecode import kernels
from skipdecode.data import encode_example, left_pad, load_task
from skipdecode.evaluation.evaluate import evaluate
from skipdecode.llm import LLM

OUT = Path("benchmarks/results/int4-rounding-select.json")
DATA = "../shared/data/e2e/devset.csv"


def least_squares_int4(w: torch.Tensor, imp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int4``'s output format, each group's scale searched for least ``imp``-weighted squared error."""
    g = kernels.INT4_GROUP
    n, k = w.shape
    wg = w.float().reshape(n, k // g, g)
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


def importance_matrix(llm: LLM, examples: int = 64) -> dict[int, torch.Tensor]:
    """Per block linear (keyed by its weight's storage): each input's summed squared activation over
    ``examples`` teacher-forced training examples of e2e-heldout (padding columns left out)."""
    net, out, mask = llm.model, {}, {}
    items = [encode_example(llm.tokenizer, e.prompt, e.target) for e in load_task("e2e-heldout").train[:examples]]
    hooks = []
    for blk in net.layers:
        for name in ("wqkv", "wo", "w13", "w2"):
            lin = getattr(blk, name)

            def hook(mod, inp, _out, key=lin.weight.data_ptr()):
                x = inp[0].detach().float()
                out[key] = out.get(key, 0) + (x * x * mask["m"][..., None]).sum((0, 1))
            hooks.append(lin.register_forward_hook(hook))
    with torch.no_grad():
        for i in range(0, len(items), 16):
            lay = left_pad(items[i:i + 16])
            mask["m"] = lay.key_valid.float()
            net(lay.tokens, lay.positions, key_valid=lay.key_valid)
    for h in hooks:
        h.remove()
    return out


def main() -> None:
    torch.set_num_threads(2)
    g = kernels.INT4_GROUP
    rows = {}
    for name in ("least squares", "least squares, weighted by w^2", "least squares, llama.cpp's imatrix weighting"):
        llm = LLM.load("default-e2e", pack=False)
        imat = importance_matrix(llm) if "imatrix" in name else {}

        def rule(w: torch.Tensor, name: str = name, imat: dict = imat) -> tuple[torch.Tensor, torch.Tensor]:
            n, k = w.shape
            wg = w.float().reshape(n, k // g, g)
            if "w^2" in name:
                return least_squares_int4(w, wg * wg)
            if "imatrix" in name:  # llama.cpp's quantize_row_q4_0_impl with quant_weights
                sigma2 = (w.float() ** 2).sum(1).reshape(n, 1, 1) / k
                return least_squares_int4(w, imat[w.data_ptr()].reshape(1, k // g, g) * torch.sqrt(sigma2 + wg * wg))
            return least_squares_int4(w, torch.ones_like(wg))
        model.quantize_int4 = rule
        llm.model.pack_for_inference(True, weights="int4")
        r = evaluate("e2e", DATA, model="default-e2e", speedups=(1, 3), split="select", llm=llm, dtype="int4",
                     bertscore=False)
        rows[name] = {str(x["speedup_target"]): x["bleu"] for x in r["results"]}
    shipped = json.loads(Path("benchmarks/results/eval-select-default-e2e-int4.json").read_text())["results"]
    fp32 = json.loads(Path("benchmarks/results/eval-select-default-e2e-skip.json").read_text())["results"]
    rows["Q4_0 rule (shipped; eval-select-default-e2e-int4.json)"] = {str(r["speedup_target"]): r["bleu"] for r in shipped}
    rows["float32 (eval-select-default-e2e-skip.json)"] = {str(r["speedup_target"]): r["bleu"] for r in fp32
                                                       if r["speedup_target"] in (1.0, 3.0)}
    OUT.write_text(json.dumps({"model": "default-e2e", "split": "e2e-heldout select", "metric": "BLEU",
                               "bleu": rows, "command": "python " + " ".join(sys.argv)}, indent=1) + "\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
