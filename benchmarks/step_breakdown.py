"""Where a decode step's time goes, per weight dtype (benchmarks/results/step-breakdown.json).

A 64-token greedy decode of one E2E prompt (``--rows R``: R prompts, row i gets the benchmark prompt i, cycling, as
``skipdecode bench`` does) on ``default-e2e`` at full depth, timed from Python
with wrappers around the model's decode call, its LM head and its layer stack's call. Best of
6 runs by step time. Parts of a step:
  engine       -- the engine's step around the model (scheduling, sampling, bookkeeping)
  python       -- the model's decode minus its layer calls and head (embedding, RoPE tables, the layer loop)
  layer calls  -- the fused layers' one LayerStack call (GEMMs, norms, RoPE, attention, SwiGLU, argument passing)
  head         -- the final norm and LM head
These parts are timed with one Python step a call (generate.DECODE_BURST = 1); native_step_ms is the
step with generate's native bursts (LayerStack.greedy: the same kernel calls without the Python
between them), best of runs interleaved with those, and native_speedup the Python step over it.
Run from the repository root: .venv/bin/python benchmarks/step_breakdown.py [OUT.json] [--rows R]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

import skipdecode.generate as gen
from skipdecode import LLM
from skipdecode.bench.decode import PROMPTS, machine_info
from skipdecode.generate import generate_tokens

DTYPES = ("float32", "int8", "int4", "w8a8", "w4a8", "w8a16", "w4a16")
N, RUNS = 64, 6


def breakdown(dtype: str, rows: int = 1) -> dict:
    llm = LLM.load("default-e2e", dtype=dtype)
    net = llm.model
    ids = [llm.encode(PROMPTS[i % len(PROMPTS)]) for i in range(rows)]
    sched = llm.make_schedule(speedup=1.0, expected_new_tokens=N)
    spent = {"decode": 0.0, "head": 0.0, "layers": 0.0}
    calls = {"decode": 0, "head": 0, "layers": 0}
    real_decode, real_head = net.decode, net.head
    stack = net._stack
    if stack is None:
        raise SystemExit(f"{dtype}: the fused layer kernels are not in use here")

    def timed(name, f):
        def run(*a, **k):
            t = time.perf_counter()
            out = f(*a, **k)
            spent[name] += time.perf_counter() - t
            calls[name] += 1
            return out
        return run

    class Timed:  # the layer stack with its call timed
        run = staticmethod(timed("layers", stack.run))

    burst = gen.DECODE_BURST
    net.decode, net.head = timed("decode", real_decode), timed("head", real_head)
    try:
        generate_tokens(net, ids, sched, 8, eos_token_ids=())
        best, native = None, float("inf")
        for _ in range(RUNS):  # a native run, then a timed Python one: drift hits both alike
            net._stack, gen.DECODE_BURST = stack, burst
            stats = generate_tokens(net, ids, sched, N, eos_token_ids=())[1]
            native = min(native, stats["decode_seconds"] / (N - 1))
            net._stack, gen.DECODE_BURST = Timed(), 1  # Timed has no native loop: every step in Python
            for k in spent:
                spent[k], calls[k] = 0.0, 0
            stats = generate_tokens(net, ids, sched, N, eos_token_ids=())[1]
            steps = calls["decode"]  # one model decode call per decode step (prefill gives the first token)
            # the prefill step also runs the head once: each part per call, times its calls per decode step
            per = {"step": stats["decode_seconds"] / (N - 1), "decode": spent["decode"] / steps,
                   "head": spent["head"] / calls["head"], "layers": spent["layers"] / steps}
            if best is None or per["step"] < best["step"]:
                best = per
    finally:
        del net.decode, net.head
        net._stack = stack
        gen.DECODE_BURST = burst
    ms = lambda s: round(s * 1000, 3)  # noqa: E731
    return {"dtype": dtype, "step_ms": ms(best["step"]), "engine_ms": ms(best["step"] - best["decode"]),
            "python_ms": ms(best["decode"] - best["layers"] - best["head"]), "layer_calls_ms": ms(best["layers"]),
            "head_ms": ms(best["head"]), "native_step_ms": ms(native), "native_speedup": round(best["step"] / native, 3)}


def main() -> None:
    args = sys.argv[1:]
    rows = 1
    if "--rows" in args:
        i = args.index("--rows")
        rows = int(args[i + 1])
        del args[i:i + 2]
    results = []
    for dt in DTYPES:
        r = breakdown(dt, rows)
        results.append(r)
        print(json.dumps(r), flush=True)
    out = {"model": "default-e2e", "rows": rows, "new_tokens": N, "runs": RUNS, "threads": torch.get_num_threads(),
           "torch": torch.__version__, "machine": machine_info(), "results": results,
           "command": "python benchmarks/step_breakdown.py " + " ".join(sys.argv[1:])}
    path = Path(args[0] if args else "benchmarks/results/step-breakdown.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
