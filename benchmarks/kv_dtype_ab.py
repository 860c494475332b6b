"""Decode steps with a float16 (or bfloat16) KV cache against a float32 one, in one run.

One model is loaded per case; the two KV dtypes take turns on it (``model.kv_dtype``, which each
generation's engine sizes its pool in; interleaved rounds, order alternating, best of each, as in
kernel_ab.py). A half-width cache rounds keys and values, so the tokens may differ: each case
records how many rows decode the same tokens under both. What a step saves is the KV bytes it
reads, which grow with the rows and the context: the cases run 1, 8 and 32 rows.
Writes benchmarks/results/kv-dtype-ab.json (or OUT.json).
Run from the repository root: .venv/bin/python benchmarks/kv_dtype_ab.py [OUT.json] [--kv-dtype bfloat16]
[--case DTYPE:BATCH:SPEEDUP ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from kernel_ab import ab_model, case_rows, parse_cases, pop_option, write_report  # the same timing and cases
from skipdecode import LLM, kernels
from skipdecode.engine.kv_cache import KV_DTYPES

CASES = [("float32", 1, 1.0), ("float32", 8, 1.0), ("float32", 32, 1.0), ("float32", 8, 3.0), ("int8", 32, 1.0)]
OUT = Path("benchmarks/results/kv-dtype-ab.json")


def set_kv(net, name: str) -> None:
    net.kv_dtype = KV_DTYPES[name]


def main() -> None:
    args, cases = parse_cases(sys.argv[1:])
    half = pop_option(args, "--kv-dtype") or "float16"
    if half not in KV_DTYPES:
        raise SystemExit(f"--kv-dtype takes one of {', '.join(KV_DTYPES)}, got {half!r}")
    out = Path(args[0]) if args else OUT
    results = []
    for dtype, batch, speedup in cases or CASES:
        llm = LLM.load("default-e2e", dtype=dtype)
        ids, sched = case_rows(llm, batch, speedup)
        best, same_rows = ab_model(llm.model, set_kv, {"float32": "float32", half: half}, ids, sched,
                                   f"{dtype} batch {batch} {speedup:g}x", rounds_differ=True)
        r = {"dtype": dtype, "batch": batch, "speedup": speedup, "ms_per_step_kv_float32": round(best["float32"], 3),
             f"ms_per_step_kv_{half}": round(best[half], 3),
             f"kv_{half}_over_float32_tokens_per_s": round(best["float32"] / best[half], 3),
             "rows_with_the_same_tokens": same_rows, "rows": batch,
             "context_tokens": [len(x) for x in ids[:8]]}
        results.append(r)
        print(f"{dtype:8s} B={batch:<2} {speedup:g}x  kv float32 {best['float32']:6.2f}  kv {half} {best[half]:6.2f} "
              f"ms/step  {r[f'kv_{half}_over_float32_tokens_per_s']:.3f}x  same tokens {same_rows}/{batch}",
              flush=True)
    write_report(out, "kv_dtype_ab.py", "KV dtypes", results,
                 kernel_forms={"isa": kernels.isa(), "a8": kernels.a8_form()}, kv_dtypes=["float32", half])


if __name__ == "__main__":
    main()
