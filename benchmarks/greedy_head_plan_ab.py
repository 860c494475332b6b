"""Greedy decode steps where the fp32 LM head's plan has oneDNN: its product on oneDNN in Python
steps against the bf16 pass (kernels.greedy_head) in the native loop.

``dispatch.greedy_head_plan`` times, once per machine, the head's bf16 pass against oneDNN's full
product and argmax at every bucket, and greedy steps take the pass wherever it was no slower, even
where the head's plan (full logits) has oneDNN. This times both settings of ``greedy_plan`` on
``default-e2e`` (fp32, 64 greedy tokens, the bench's E2E prompts, best of interleaved rounds with the
order alternating) at row counts whose bucket the plan gives oneDNN and the measured plan gives the
pass; the two must give the same tokens (the run stops if they do not). Row counts where the two
settings agree are listed under "skipped". Run from the repository root, e.g.:
    .venv/bin/python benchmarks/greedy_head_plan_ab.py OUT.json --rows 2,4,8,16 [--speedups 1,3]
    SKIPDECODE_ISA=avx2 .venv/bin/python benchmarks/greedy_head_plan_ab.py OUT.json --rows 2,8
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kernel_ab import NEW_TOKENS, ROUNDS, ab_model, pop_option  # the same timing and options
from skipdecode import LLM, dispatch, kernels
from skipdecode.bench.decode import PROMPTS, machine_info


def main() -> None:
    args = sys.argv[1:]
    rows = [int(r) for r in (pop_option(args, "--rows") or "2,4,8,16").split(",")]
    speedups = [float(s) for s in (pop_option(args, "--speedups") or "1,3").split(",")]
    out = Path(args[0]) if args else Path("benchmarks/results/greedy-head-plan-ab.json")
    llm = LLM.load("default-e2e", dtype="float32")
    net, head = llm.model, llm.model.lm_head
    if head.approx is None:
        raise SystemExit("the fp32 head has no bf16 copy here (no compiled kernels?)")
    plan_only = tuple(f == "hand" for f in head.plan)  # what greedy steps took before the measured plan
    measured = head.greedy_plan
    results, skipped = [], []
    for b in rows:
        i = dispatch.bucket(b)
        if plan_only[i] == measured[i]:
            skipped.append({"rows": b, "head_form": head.plan[i], "greedy_head": measured[i]})
            continue
        ids = [llm.encode(PROMPTS[j % len(PROMPTS)]) for j in range(b)]
        for sp in speedups:
            sched = llm.make_schedule(speedup=sp, expected_new_tokens=NEW_TOKENS)
            best, _ = ab_model(net, lambda m, p: setattr(m.lm_head, "greedy_plan", p),
                               {"onednn": plan_only, "bf16_pass": measured}, ids, sched, f"{b} rows at {sp:g}x")
            r = {"rows": b, "speedup": sp, "ms_per_step_onednn_head": round(best["onednn"], 3),
                 "ms_per_step_bf16_pass": round(best["bf16_pass"], 3),
                 "onednn_over_bf16_pass": round(best["onednn"] / best["bf16_pass"], 3), "same_tokens": True}
            results.append(r)
            print(json.dumps(r), flush=True)
    head.greedy_plan = measured
    report = {"machine": machine_info(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "kernel_forms": {"isa": kernels.isa()}, "model": "default-e2e", "dtype": "float32",
              "new_tokens": NEW_TOKENS, "buckets": list(dispatch.BUCKETS), "head_plan": list(head.plan),
              "greedy_head_plan": list(measured),
              "greedy_head_seconds": dispatch.time_greedy_head(head.out_features, head.in_features, net.kernels),
              "timing": f"decode seconds over the {NEW_TOKENS - 1} steps after the first token, best of {ROUNDS} "
                        "interleaved rounds (order alternating) after a warm-up round; greedy_head_seconds: "
                        "dispatch.time_greedy_head again at the end of the run (per bucket, cold)",
              "command": "python benchmarks/greedy_head_plan_ab.py " + " ".join(sys.argv[1:]),
              "results": results, "skipped": skipped}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
