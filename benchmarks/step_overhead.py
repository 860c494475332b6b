"""Python time around the kernels of a one-row decode step (benchmarks/results/step-overhead.json).

The kernels are replaced by no-ops (each fused layer call and the layer stack's
call return their input, the LM head a fixed row), so what is timed is the
Python a step runs around them: one fused layer call, and the runner's and
model's whole decode step (step plan to logits) at batch 1 (``--rows R``: R rows, the E2E
benchmark prompts), with the layers as one stack call and as one call per layer, on
`default-e2e` in w4a8. Best of 5 rounds.
Run from the repository root: .venv/bin/python benchmarks/step_overhead.py [OUT.json] [--rows R]
(with PYTHONPATH=<another checkout>/src it times that checkout's code).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

import skipdecode
from skipdecode.bench.decode import PROMPTS, _best_time, machine_info
from skipdecode.engine import runner as runner_mod
from skipdecode.llm import LLM


def best_us(f, n: int = 3000, rounds: int = 5) -> float:
    """Microseconds per call of ``f``: ``n`` calls timed together, the best of ``rounds``."""
    def calls() -> None:
        for _ in range(n):
            f()

    return _best_time(calls, rounds) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description="Python time around the kernels of a decode step")
    ap.add_argument("out", nargs="?", default="benchmarks/results/step-overhead.json")
    ap.add_argument("--rows", type=int, default=1, help="rows of the decode step (E2E benchmark prompts)")
    args = ap.parse_args()
    rows = args.rows
    torch.set_num_threads(2)
    llm = LLM.load("default-e2e", dtype="w4a8")
    m = llm.model
    seen = {}
    real_decode = runner_mod.ModelRunner.decode

    def capture(self, plan):  # keep a decode plan with all the rows decoding, and their reservations
        if len(plan.decode) == rows:
            seen.update(runner=self, plan=plan, res=[st.reservation for st in plan.decode])
        return real_decode(self, plan)

    runner_mod.ModelRunner.decode = capture
    prompts = ["name[Blue Spice], eatType[coffee shop], food[Chinese]"] if rows == 1 else \
        [PROMPTS[i % len(PROMPTS)] for i in range(rows)]
    llm.generate(prompts, max_new_tokens=4, ignore_eos=True)
    runner_mod.ModelRunner.decode = real_decode
    for st, res in zip(seen["plan"].decode, seen["res"]):
        st.reservation = res  # released when the request finished; reused here only to time the plan

    real = m.layers[0].kernels

    class NoKernels:  # the fused layer call returns its input; every other kernel is the real one
        def decode_block(self, x, *args):
            return x

        def __getattr__(self, name):
            return getattr(real, name)

    class NoStack:  # the step's one layer-stack call returns its input
        def run(self, x, *args):
            return x

    nk = NoKernels()
    for b in m.layers:
        b.kernels = nk
    m._stack, m._stack_kernels = NoStack(), nk
    row = torch.zeros(rows, 1, m.cfg.vocab_size)
    m.head = lambda x: row
    b = m.layers[0]
    x = torch.zeros(1, 1, m.cfg.dim)
    rope = m._rope(torch.tensor([[40]]), torch.float32)
    slots = torch.tensor([[0, 41]])
    with torch.inference_mode():
        layer = best_us(lambda: b.decode(x, rope, None, None, slots), n=20000)
        step = best_us(lambda: seen["runner"].decode(seen["plan"]))
        m._stack = None
        step_per_layer = best_us(lambda: seen["runner"].decode(seen["plan"]))
    out = {"model": "default-e2e", "dtype": "w4a8", "layers": m.n_layers, "rows": rows,
           "python_us_per_fused_layer_call": round(layer, 2), "python_us_per_decode_step": round(step, 1),
           "python_us_per_decode_step_one_call_per_layer": round(step_per_layer, 1),
           "commit": subprocess.run(["git", "-C", str(Path(skipdecode.__file__).parent), "rev-parse", "--short",
                                     "HEAD"], capture_output=True, text=True).stdout.strip(),
           "machine": machine_info(),
           "command": "python benchmarks/step_overhead.py " + " ".join(sys.argv[1:])}
    path = Path(args.out)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
