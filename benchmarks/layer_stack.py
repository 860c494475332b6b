"""Decode steps with the fused layers as one ``LayerStack`` call against one call per layer, in one run.

Each case decodes the same prompts on ``default-e2e`` twice per round: the model as packed (a step
whose rows all run the same layers is one kernel call, ``Transformer.build_layer_stack``) and the
same model with its stack removed (one ``decode_block`` call per layer, as before the stack).
Rounds interleave the two with the order alternating; best of the rounds; both must decode the
same tokens. Writes benchmarks/results/layer-stack.json.
Run from the repository root: .venv/bin/python benchmarks/layer_stack.py [OUT.json]
"""

from __future__ import annotations

import sys
from pathlib import Path

from kernel_ab import NEW_TOKENS, ROUNDS, case_rows, write_report  # the same cases and report
from skipdecode import LLM
from skipdecode.generate import generate_tokens

DTYPES = ("float32", "int8", "int4", "w8a8", "w4a8", "w8a16", "w4a16")
CASES = [(1, 1.0), (1, 3.0), (8, 1.0)]


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/layer-stack.json")
    results = []
    for dtype in DTYPES:
        llm = LLM.load("default-e2e", dtype=dtype)
        net = llm.model
        stack = net._stack
        if stack is None:
            raise SystemExit(f"{dtype}: the model has no layer stack here (fused kernels not in use)")
        for batch, speedup in CASES:
            ids, sched = case_rows(llm, batch, speedup)
            ms: dict[str, list[float]] = {"stack": [], "per_layer": []}
            tokens = {}
            for rnd in range(ROUNDS + 1):  # the first round warms up
                for name in ("stack", "per_layer")[::1 if rnd % 2 else -1]:
                    net._stack = stack if name == "stack" else None
                    rows, st = generate_tokens(net, ids, sched, NEW_TOKENS, eos_token_ids=())
                    ms[name].append(st["decode_seconds"] / (NEW_TOKENS - 1) * 1000)
                    tokens[name] = [r.token_ids for r in rows]
            net._stack = stack
            if tokens["stack"] != tokens["per_layer"]:
                raise SystemExit(f"{dtype} batch {batch} {speedup:g}x: the two paths decode different tokens")
            best = {k: min(v[1:]) for k, v in ms.items()}
            r = {"dtype": dtype, "batch": batch, "speedup": speedup,
                 "ms_per_step_per_layer": round(best["per_layer"], 3), "ms_per_step_stack": round(best["stack"], 3),
                 "stack_over_per_layer_tokens_per_s": round(best["per_layer"] / best["stack"], 3)}
            results.append(r)
            print(f"{dtype:8s} B={batch:<2} {speedup:g}x  per layer {best['per_layer']:6.2f}  stack "
                  f"{best['stack']:6.2f} ms/step  {r['stack_over_per_layer_tokens_per_s']:.3f}x", flush=True)
    write_report(out, "layer_stack.py", "paths", results)


if __name__ == "__main__":
    main()
