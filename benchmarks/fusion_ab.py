"""Decode steps with each bucket's fused-or-not choice made from whole layers (``dispatch.layers_fused_plan``)
against the choice from the linears' times alone (``dispatch.fused_plan``), in one run.

The model is loaded once; the two plans take turns on it (interleaved rounds, order alternating,
best of each, as in kernel_ab.py) and must decode the same tokens; --rounds-differ records how
many rows do instead, for a dtype whose library form rounds differently from the panels (int8:
torch's int8 GEMM rounds activations to bf16, the panels keep fp32). The layers' plan is this
machine's (measured on the first load, then read from the autotune cache); both plans are
recorded. A case whose two plans agree is timed too (a check of the timing's noise).
Writes benchmarks/results/fusion-ab.json.
Run from the repository root: .venv/bin/python benchmarks/fusion_ab.py [OUT.json] [--case DTYPE:BATCH:SPEEDUP ...]
[--rounds-differ]; SKIPDECODE_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 times the forms an AVX2-only CPU runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kernel_ab import ab_model, case_rows, parse_cases, write_report  # the same timing and cases
from skipdecode import LLM, dispatch, kernels
from skipdecode.model import BLOCK_LINEARS

CASES = [("float32", 32, 1.0), ("float32", 32, 3.0), ("float32", 8, 1.0), ("bfloat16", 32, 1.0)]
OUT = Path("benchmarks/results/fusion-ab.json")


def use_plan(net, plan: tuple[bool, ...]) -> None:
    """Every layer of ``net`` fused at the buckets ``plan`` fuses."""
    for b in net.layers:
        b.fuse_plan = plan


def main() -> None:
    rounds_differ = "--rounds-differ" in sys.argv[1:]
    args, cases = parse_cases([a for a in sys.argv[1:] if a != "--rounds-differ"])
    out = Path(args[0]) if args else OUT
    results = []
    for dtype, batch, speedup in cases or CASES:
        llm = LLM.load("default-e2e", dtype=dtype)
        net = llm.model
        layers_plan = net._stack_plan
        first = net.layers[0]
        linears_plan = dispatch.fused_plan([(getattr(first, n).out_features, getattr(first, n).in_features)
                                            for n in BLOCK_LINEARS], net.kernels, net.weights)
        ids, sched = case_rows(llm, batch, speedup)
        best, same_rows = ab_model(net, use_plan, {"linears": linears_plan, "layers": layers_plan}, ids, sched,
                                   f"{dtype} batch {batch} {speedup:g}x", rounds_differ)
        b = dispatch.bucket(batch)
        r = {"dtype": dtype, "batch": batch, "speedup": speedup,
             "fused_by_linears": linears_plan[b], "fused_by_layers": layers_plan[b],
             "ms_per_step_linears_plan": round(best["linears"], 3), "ms_per_step_layers_plan": round(best["layers"], 3),
             "layers_over_linears_tokens_per_s": round(best["linears"] / best["layers"], 3),
             "rows_with_the_same_tokens": same_rows,
             "plans": {"buckets": list(dispatch.BUCKETS), "linears": list(linears_plan), "layers": list(layers_plan)}}
        results.append(r)
        print(f"{dtype:8s} B={batch:<2} {speedup:g}x  fused by linears {r['fused_by_linears']!s:5} "
              f"{best['linears']:6.2f}  by layers {r['fused_by_layers']!s:5} {best['layers']:6.2f} ms/step  "
              f"{r['layers_over_linears_tokens_per_s']:.3f}x", flush=True)
    write_report(out, "fusion_ab.py", "plans", results, kernel_forms={"isa": kernels.isa(), "a8": kernels.a8_form()})


if __name__ == "__main__":
    main()
