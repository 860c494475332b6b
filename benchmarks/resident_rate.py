"""How fast the decode kernels run a layer's linears at one row with the weights already in the caches.

Why: a batch-1 step streams every weight from memory once, and `skipdecode bench --llamacpp`
reports its weight bytes over its time as a fraction of the read bandwidth. No call can stream
faster than its own arithmetic runs (the threads' decode of int8/int4 weights, their FMAs, the
start and join of the threads), so this times that arithmetic alone: each of a decode layer's four
linears (``default-e2e``, packed as a decode step runs them) called natively again and again on the
same weights (``kernels.resident_gbs``: a few MB, held by the caches), and the LM head's linear.
``layer`` is the four together (their bytes over the sum of their times): the most a step's layer
GEMMs could read at. The read bandwidth is measured in the same run (before and after, the best
kept, as the llama.cpp report takes it). Run from the repository root:

    .venv/bin/python benchmarks/resident_rate.py OUT.json [--dtypes float32,int8,int4] [--rows 1]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kernel_ab import pop_option  # the benchmarks' option parsing

from skipdecode import LLM, kernels
from skipdecode.bench.decode import BLOCK_LINEARS, machine_info
from skipdecode.bench.llamacpp import read_bandwidth_gbs, read_probe

DTYPES = ("float32", "int8", "int4", "w8a8", "w4a8")
ROUNDS = 3


def measure(dtype: str, rows: int) -> dict:
    """Each linear's resident GB/s (and the LM head's), and the four together as a layer."""
    net = LLM.load("default-e2e", dtype=dtype).model
    blk = net.layers[0]
    linears = {n: getattr(blk, n) for n in BLOCK_LINEARS}
    gbs: dict[str, float] = {}
    for _ in range(ROUNDS):  # rounds over the linears in turn, each one's best kept
        for name, m in linears.items():
            gbs[name] = max(gbs.get(name, 0.0), kernels.resident_gbs(m, rows))
    nbytes = {n: kernels.panel_bytes(m) for n, m in linears.items()}
    out: dict = {"dtype": dtype, "rows": rows,
                 "linears": {n: {"kb": round(nbytes[n] / 1e3, 1), "gb_per_s": round(gbs[n], 1)} for n in linears},
                 "layer_gb_per_s": round(sum(nbytes.values()) / sum(nbytes[n] / gbs[n] for n in linears), 1)}
    head = net.lm_head
    if head.packed is not None:  # the LM head as a plain linear (28-113 MB: the cache holds some of it at most)
        h = max(kernels.resident_gbs(head, rows) for _ in range(ROUNDS))
        out["lm_head"] = {"mb": round(kernels.panel_bytes(head) / 1e6, 1), "gb_per_s": round(h, 1)}
    return out


def main() -> None:
    args = sys.argv[1:]
    if not args or {"-h", "--help"} & set(args):
        print(__doc__)
        raise SystemExit(0 if args else 2)
    dtypes = tuple((pop_option(args, "--dtypes") or ",".join(DTYPES)).split(","))
    rows = int(pop_option(args, "--rows") or 1)
    k = kernels.load()
    if k is None:
        raise SystemExit("the compiled kernels did not load: nothing to time")
    probe = read_probe()
    bw = read_bandwidth_gbs(probe=probe, module=k)
    results = []
    for dt in dtypes:
        r = measure(dt, rows)
        results.append(r)
        print(f"{dt:8s} rows {rows}: " + ", ".join(f"{n} {v['gb_per_s']:.1f}" for n, v in r["linears"].items())
              + f" GB/s; layer {r['layer_gb_per_s']:.1f} GB/s ({r['layer_gb_per_s'] / bw:.0%} of {bw:.1f})",
              flush=True)
    bw = max(bw, read_bandwidth_gbs(probe=probe, module=k))  # the fractions against the best reading of the two
    for r in results:
        for v in [*r["linears"].values(), *([r["lm_head"]] if "lm_head" in r else [])]:
            v["of_bandwidth"] = round(v["gb_per_s"] / bw, 3)
        r["layer_of_bandwidth"] = round(r["layer_gb_per_s"] / bw, 3)
    report = {"machine": machine_info(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "model": "default-e2e", "read_bandwidth_gbs": round(bw, 1),
              "kernel_forms": {"isa": kernels.isa(), "a8": kernels.a8_form()},
              "timing": f"each linear's best of {ROUNDS} rounds (kernels.resident_gbs: best of 5 native runs of "
                        "~50 ms each); the read bandwidth before and after, the best kept",
              "command": "python benchmarks/resident_rate.py " + " ".join(sys.argv[1:]), "results": results}
    Path(args[0]).write_text(json.dumps(report, indent=2) + "\n")
    print(f"read bandwidth {bw:.1f} GB/s; wrote {args[0]}")


if __name__ == "__main__":
    main()
