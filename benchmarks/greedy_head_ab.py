"""Greedy decode steps with the fp32 LM head's bf16 pass (kernels.greedy_head) against the full head.

A greedy step needs each row's argmax, not its logits. ``Transformer.greedy_steps`` picks it from
the head's bf16 copy (half the head's bytes) and the exact fp32 logits of the few token ids the
copy's error bound leaves in doubt (``model.head_bound``); ``greedy_approx = False`` reads every
logit from the fp32 head. The two must give the same tokens (the run stops if they do not). This
times both on ``default-e2e`` (fp32, 64 greedy tokens, the bench's E2E prompts, best of
interleaved rounds with the order alternating) at each row count and speedup, and counts how many
token ids each step's bf16 pass left in doubt (from the Python form of the same pick: the bf16
copy on x as it is, where the tiles take x's top bf16 half, so the count is close, not exact).
Run from the repository root:
    .venv/bin/python benchmarks/greedy_head_ab.py [OUT.json] [--rows 1,8,32] [--speedups 1,3]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kernel_ab import NEW_TOKENS, ROUNDS, ab_model, pop_option  # the same timing and options
from skipdecode import LLM, kernels
from skipdecode.bench.decode import PROMPTS, machine_info
from skipdecode.generate import generate_tokens


def ids_in_doubt(net, ids: list[list[int]], sched) -> list[int]:
    """Per decode step of one greedy run, how many token ids the bf16 pass left in doubt over all
    rows (greedy_head's candidates, recomputed here in float64 from the bf16 copy and head_bound)."""
    head, k = net.lm_head, net.kernels
    counts = []
    real = net.head

    def head_counting(x):
        h = net.final_hidden(x).reshape(-1, head.in_features)
        a = k.linear(h, head.approx, None, head.out_features, None, 0).double()
        b = h.double().norm(dim=1, keepdim=True) * head.approx_bound.double()
        counts.append(int(((a + b) >= (a - b).max(dim=1, keepdim=True).values).any(dim=0).sum()))
        return real(x)

    net.head = head_counting
    try:
        import skipdecode.generate as gen

        prev, gen.DECODE_BURST = gen.DECODE_BURST, 1  # Python steps, so each step's head is seen
        stack, net._stack = net._stack, None
        try:
            generate_tokens(net, ids, sched, NEW_TOKENS, eos_token_ids=())
        finally:
            gen.DECODE_BURST, net._stack = prev, stack
    finally:
        del net.head
    return counts[1:]  # the first call is the prefill's


def main() -> None:
    args = sys.argv[1:]
    rows = [int(r) for r in (pop_option(args, "--rows") or "1,8,32").split(",")]
    speedups = [float(s) for s in (pop_option(args, "--speedups") or "1,3").split(",")]
    out = Path(args[0]) if args else Path("benchmarks/results/greedy-head-ab.json")
    llm = LLM.load("default-e2e", dtype="float32")
    net = llm.model
    if net.lm_head.approx is None:
        raise SystemExit("the fp32 head has no bf16 copy here (no compiled kernels?)")
    results = []
    for b in rows:
        ids = [llm.encode(PROMPTS[i % len(PROMPTS)]) for i in range(b)]
        if not net.native_greedy(b):
            raise SystemExit(f"{b} rows do not run the native greedy loop here")
        for sp in speedups:
            sched = llm.make_schedule(speedup=sp, expected_new_tokens=NEW_TOKENS)
            # interleaved rounds after a warm-up, order alternating; stops if the two pick other tokens
            best, _ = ab_model(net, lambda m, on: setattr(m, "greedy_approx", on), {"full": False, "bf16": True},
                               ids, sched, f"{b} rows at {sp:g}x")
            net.greedy_approx = True
            doubt = ids_in_doubt(net, ids, sched)
            r = {"rows": b, "speedup": sp, "ms_per_step_full_head": round(best["full"], 3),
                 "ms_per_step_bf16_pass": round(best["bf16"], 3),
                 "full_over_bf16_pass": round(best["full"] / best["bf16"], 3), "same_tokens": True,
                 "ids_in_doubt_per_step": {"mean": round(sum(doubt) / len(doubt), 2), "max": max(doubt)}}
            results.append(r)
            print(json.dumps(r), flush=True)
    head = net.lm_head
    report = {"machine": machine_info(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "kernel_forms": {"isa": kernels.isa()}, "model": "default-e2e", "dtype": "float32",
              "new_tokens": NEW_TOKENS, "head_bytes": {"float32": head.packed.numel() * 4,
                                                       "bfloat16_copy": head.approx.numel() * 2},
              "timing": f"decode seconds over the {NEW_TOKENS - 1} steps after the first token, best of {ROUNDS} "
                        "interleaved rounds (order alternating) after a warm-up round",
              "command": "python benchmarks/greedy_head_ab.py " + " ".join(sys.argv[1:]), "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
