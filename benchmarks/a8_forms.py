"""The int8-activation kernels' forms against each other (benchmarks/results/a8-forms.json).

`w8a8`, `w4a8`, `w8a16` and `w4a16` compute exact integer sums in one of four forms: AMX tiles
(`tdpbssd`, from 16 rows in w8a8 and 12 in the others; VNNI below), AVX512-VNNI (`vpdpbusd`),
AVX2 (`vpmaddubsw` + `vpmaddwd`, what a CPU without VNNI runs) and plain C++ (the reference the
tests hold the others to). All give the same outputs bit for bit, so this times one thing:
`default-e2e`'s 30 fused decode layers (weights from memory, not a warm cache: each layer runs
once per pass) at 1, 8, 12, 16 and 32 rows, in each form the CPU has (plain C++ at 1 and 8 rows
only: it is the reference, not a form anyone runs), best of 7 passes taken in turns (one pass
of each form, then the next round), 2 threads.
Run from the repository root: .venv/bin/python benchmarks/a8_forms.py [OUT.json]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import skipdecode
from skipdecode import kernels
from skipdecode.bench.decode import machine_info
from skipdecode.llm import LLM


def layers_ms(model, rows: int, passes: int = 7) -> float:
    """Best milliseconds of one pass of every fused layer over ``rows`` decode positions."""
    cfg = model.cfg
    x = torch.randn(rows, 1, cfg.dim, generator=torch.Generator().manual_seed(0))
    rope = model._rope(torch.tensor([[70]] * rows), torch.float32)
    pools = [(torch.zeros(cfg.n_kv_heads, 128 * rows, cfg.head_dim),
              torch.zeros(cfg.n_kv_heads, 128 * rows, cfg.head_dim)) for _ in model.layers]
    slots = torch.tensor([[128 * i, 71] for i in range(rows)])
    best = float("inf")
    with torch.inference_mode():
        for _ in range(passes):
            t = time.perf_counter()
            for i, layer in enumerate(model.layers):
                layer.decode(x, rope, *pools[i], slots)
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    torch.set_num_threads(2)
    best_form = kernels.a8_form()
    forms = ["portable", "avx2"] + (["vnni"] if best_form in ("vnni", "amx") else []) + \
        (["amx"] if best_form == "amx" else [])
    results = []
    for dtype in ("w8a8", "w4a8", "w8a16", "w4a16"):
        m = LLM.load("default-e2e", dtype=dtype).model
        k = m.layers[0].kernels
        if k is None:
            raise SystemExit("the compiled kernels did not load; nothing to time")
        for rows in (1, 8, 12, 16, 32):
            run = [f for f in forms if f != "portable" or rows <= 8]
            best = dict.fromkeys(run, float("inf"))
            for rnd in range(8):  # round 0 warms up
                for form in run:
                    prev = k.set_a8(form)
                    try:
                        ms = layers_ms(m, rows, passes=1)
                    finally:
                        k.set_a8(prev)
                    if rnd:
                        best[form] = min(best[form], ms)
            for form in run:
                results.append({"dtype": dtype, "rows": rows, "form": form, "layers_ms": round(best[form], 3)})
                print(f"{dtype} rows={rows} {form:<8} {best[form]:8.3f} ms for {len(m.layers)} layers", flush=True)
    out = {"model": "default-e2e", "kernels_isa": kernels.isa(), "forms": forms, "results": results,
           "commit": subprocess.run(["git", "-C", str(Path(skipdecode.__file__).parent), "rev-parse", "--short",
                                     "HEAD"], capture_output=True, text=True).stdout.strip(),
           "machine": machine_info(), "command": "python benchmarks/a8_forms.py " + " ".join(sys.argv[1:])}
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/a8-forms.json")
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
