"""The decode layers' GEMMs with their weights streamed from memory against the same GEMMs on
weights the caches hold (benchmarks/results/gemm-streamed.json).

Why: batched decode is where skipdecode is furthest from 2x llama.cpp at fp32 (llamacpp.md). A step
at 8 or 32 rows is neither at the FMA peak nor at the read bandwidth; this splits the two. On
``default-e2e`` packed as a decode step runs it (the fused layers' panels, on 2 MB pages), per
dtype and row count:
  streamed -- every decode layer's four linears once, in layer order: each weight comes from memory
              (fp32: 424 MB, far beyond the caches), as in a step;
  resident -- the first layer's four linears, as many times as there are layers: the same shapes and
              the same multiply-adds on 14 MB (fp32) that stay in the last-level cache.
streamed / resident is what streaming costs on top of the arithmetic (1.0: fully hidden). The
LM head, attention, norms and the engine are left out. Both are timed in interleaved rounds
(best of each); the machine's read bandwidth and fp32 multiply-add rate (``kernels.fma_peak_gflops``,
in the kernels' form) are measured in the same run, and the fp32-activation dtypes (FP32_FMA_DTYPES: each
weight widened to fp32, one FMA per multiply-add) get their GFLOP/s as a fraction of that rate.
Run from the repository root:
    .venv/bin/python benchmarks/gemm_streamed.py [OUT.json] [--rows 1,8,32] [--dtypes float32,int8,...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from skipdecode import LLM, kernels
from skipdecode.bench.decode import layer_linears, machine_info
from skipdecode.bench.llamacpp import FP32_FMA_DTYPES, read_bandwidth_gbs, read_probe

DTYPES = ("float32", "int8", "int4", "w8a8", "w4a8", "w8a16", "w4a16")
ROWS = (1, 8, 32)
ROUNDS, CALLS = 6, 3


def _best(fns: dict, rounds: int = ROUNDS) -> dict[str, float]:
    best = {name: float("inf") for name in fns}
    for rnd in range(rounds):
        for name in list(fns)[::1 if rnd % 2 else -1]:
            fns[name]()  # warm: the resident weights back in the caches, the streamed ones out
            t = time.perf_counter()
            for _ in range(CALLS):
                fns[name]()
            best[name] = min(best[name], (time.perf_counter() - t) / CALLS)
    return best


def measure(dtype: str, rows: int) -> dict:
    net = LLM.load("default-e2e", dtype=dtype).model
    linears = layer_linears(net, rows)
    mods, calls = [m for m, _ in linears], [c for _, c in linears]
    xs = [torch.randn(rows, 1, m.in_features) for m in mods]
    nbytes = sum(kernels.panel_bytes(m) for m in mods)
    flops = 2 * rows * sum(m.in_features * m.out_features for m in mods)
    layers = len(net.layers)

    def streamed() -> None:
        for c, x in zip(calls, xs):
            c(x)

    def resident() -> None:
        for _ in range(layers):
            for c, x in zip(calls[:4], xs[:4]):
                c(x)

    with torch.inference_mode():
        best = _best({"streamed": streamed, "resident": resident})
    s, r = best["streamed"], best["resident"]
    return {"dtype": dtype, "rows": rows, "weight_mb": round(nbytes / 1e6, 1),
            "streamed_ms": round(s * 1e3, 3), "resident_ms": round(r * 1e3, 3),
            "streamed_over_resident": round(s / r, 3),
            "streamed_gflops": round(flops / s / 1e9, 1), "resident_gflops": round(flops / r / 1e9, 1),
            "streamed_gbs": round(nbytes / s / 1e9, 1)}


def main() -> None:
    args = sys.argv[1:]
    rows, dtypes = ROWS, DTYPES
    if "--rows" in args:
        i = args.index("--rows")
        rows = tuple(int(x) for x in args[i + 1].split(","))
        del args[i:i + 2]
    if "--dtypes" in args:
        i = args.index("--dtypes")
        dtypes = tuple(args[i + 1].split(","))
        del args[i:i + 2]
    out = Path(args[0]) if args else Path("benchmarks/results/gemm-streamed.json")
    k = kernels.load()
    probe = read_probe()
    bw = read_bandwidth_gbs(probe=probe, module=k)
    fma = kernels.fma_peak_gflops(k) if k is not None else None
    results = []
    for dt in dtypes:
        for b in rows:
            r = measure(dt, b)
            results.append(r)
            print(f"{dt:8s} rows {b:<2}  streamed {r['streamed_ms']:7.2f} ms ({r['streamed_gflops']:6.1f} GF/s, "
                  f"{r['streamed_gbs']:5.1f} GB/s)  resident {r['resident_ms']:7.2f} ms ({r['resident_gflops']:6.1f} GF/s)"
                  f"  {r['streamed_over_resident']:.2f}x", flush=True)
    bw = max(bw, read_bandwidth_gbs(probe=probe, module=k))
    if fma:
        fma = max(fma, kernels.fma_peak_gflops(k))
        for r in results:
            if r["dtype"] in FP32_FMA_DTYPES:
                r["streamed_of_fma_peak"] = round(r["streamed_gflops"] / fma, 3)
                r["resident_of_fma_peak"] = round(r["resident_gflops"] / fma, 3)
    report = {"machine": machine_info(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "model": "default-e2e", "read_bandwidth_gbs": round(bw, 1),
              "fma_peak_gflops": round(fma, 1) if fma else None,
              "kernel_forms": {"isa": kernels.isa(), "a8": kernels.a8_form()} if k is not None else None,
              "timing": f"best of {ROUNDS} interleaved rounds of {CALLS} passes each, after a warm-up pass",
              "command": "python benchmarks/gemm_streamed.py " + " ".join(sys.argv[1:]), "results": results}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"read bandwidth {bw:.1f} GB/s" + (f", fp32 FMA rate {fma:.0f} GFLOP/s" if fma else "") + f"; wrote {out}")


if __name__ == "__main__":
    main()
