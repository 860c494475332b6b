"""What a lossless round costs, per weight dtype (benchmarks/results/verify-cost.json).

A lossless request (docs/lossless.md) drafts up to K tokens on its skip schedule,
one engine step each, then verifies them in one full-depth step over K + 1
positions, in the kernel forms of a one-row step (``dispatch.single_row_forms``)
so each position gets 1x's logits. Where a one-row step streams weights from
memory, K + 1 rows cost about one row; where it is bound by arithmetic (int8
weights widened to fp32 for fp32 FMAs), they cost up to K + 1 times as much, and
no acceptance rate pays that back.

This times every model pass of real generations (``ModelRunner.decode``, timed
around each call): `default-e2e`, batch 1, greedy, 48 new tokens on the bench's
8 E2E prompts, at 1x and lossless (5x drafts, K = 4, confidence 0.6, the
default), in fp32, int8 and w8a8, one process, 2 threads. Per dtype it reports
the median milliseconds of a full-depth one-row step, of a draft step at the 5x
schedule's smallest budget, and of a verification over M rows; and from them the
most a round of K drafts can gain at batch 1 if every draft is accepted:
``(K + 1) * step / (K * draft + verify(K + 1))``.
Run from the repository root: .venv/bin/python benchmarks/verify_cost.py [OUT.json]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from skipdecode.bench.decode import PROMPTS, machine_info
from skipdecode.engine.runner import ModelRunner
from skipdecode.llm import LLM

DTYPES = ("float32", "int8", "w8a8")
NEW_TOKENS = 48
LOSSLESS = dict(speedup=5.0, lossless=True, draft_tokens=4, draft_confidence=0.6)


def main() -> None:
    torch.set_num_threads(2)
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/verify-cost.json")
    passes: dict[str, list[float]] = defaultdict(list)  # kind -> milliseconds of each model pass
    decode = ModelRunner.decode

    def timed(self, plan):
        t = time.perf_counter()
        logits = decode(self, plan)
        ms = (time.perf_counter() - t) * 1e3
        if plan.verify:
            passes[f"verify {sum(len(st.drafts) + 1 for st in plan.verify)}"].append(ms)
        else:
            passes[f"budget {plan.budgets[0]}"].append(ms)
        return logits

    ModelRunner.decode = timed
    results = []
    try:
        for dtype in DTYPES:
            llm = LLM.load("default-e2e", dtype=dtype)
            L, draft_budget = llm.num_layers, llm.make_schedule(speedup=5).min_exit_layer
            for kw in ({"speedup": 1.0}, LOSSLESS):  # warm-up
                llm.generate(PROMPTS[0], max_new_tokens=8, **kw)
            passes.clear()
            seconds = {}
            for name, kw in (("1x", {"speedup": 1.0}), ("lossless", LOSSLESS)):
                t = time.perf_counter()
                for p in PROMPTS:
                    llm.generate(p, max_new_tokens=NEW_TOKENS, ignore_eos=True, **kw)
                seconds[name] = time.perf_counter() - t
            med = {k: statistics.median(v) for k, v in passes.items()}
            step, draft = med[f"budget {L}"], med[f"budget {draft_budget}"]
            verify = {int(k.split()[1]): v for k, v in med.items() if k.startswith("verify")}
            bound = {K: (K + 1) * step / (K * draft + verify[K + 1]) for K in range(1, 5) if K + 1 in verify}
            results.append({
                "dtype": dtype, "full_depth_step_ms": round(step, 3),
                "draft_step_ms": round(draft, 3), "draft_budget": draft_budget,
                "verify_ms": {M: round(v, 3) for M, v in sorted(verify.items())},
                "verify_in_steps": {M: round(v / step, 3) for M, v in sorted(verify.items())},
                "passes": {k: len(v) for k, v in sorted(passes.items())},
                "best_round_speedup_if_all_accepted": {K: round(b, 3) for K, b in bound.items()},
                "generation_seconds": {k: round(v, 3) for k, v in seconds.items()},
                "lossless_over_1x_whole_generation": round(seconds["1x"] / seconds["lossless"], 3)})
            r = results[-1]
            print(f"{dtype}: step {step:.2f} ms, draft {draft:.2f} ms, verify(M)/step "
                  + " ".join(f"{M}:{v:.2f}" for M, v in r["verify_in_steps"].items())
                  + "; best round if all accepted " + " ".join(f"K={K}:{b:.2f}" for K, b in bound.items())
                  + f"; lossless/1x (whole generations) {r['lossless_over_1x_whole_generation']:.2f}", flush=True)
    finally:
        ModelRunner.decode = decode
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"model": "default-e2e", "prompts": len(PROMPTS), "new_tokens": NEW_TOKENS, "lossless": LOSSLESS,
              "results": results, "commit": commit, "machine": machine_info(),
              "command": "python benchmarks/verify_cost.py"}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
