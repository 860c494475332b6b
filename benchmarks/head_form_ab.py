"""Decode steps with the LM head on each of its two fp32 forms, and what the autotuner picks for it.

Why: the autotuner times each weight shape alone (dispatch.time_forms). An LM head is too big for
several copies, so it is timed as one weight called again and again; on a CPU whose last-level
cache holds it (an Intel Xeon here reports 480 MiB of L3) those calls found it cached, while a
decode step reads it after every layer, from memory. This times full-depth decode steps of
``default-e2e`` (fp32, 64 greedy tokens, best of interleaved rounds) with the head's plan set to
the compiled panels and to oneDNN at every row count, and records the plan and timings the
autotuner gives the head now (each timed call after a read of 1.5x the last-level cache). The two
forms sum in different orders (both fp32), so a row's greedy tokens can part where two logits
nearly tie: the rows whose tokens agree are counted.
Run from the repository root:
    .venv/bin/python benchmarks/head_form_ab.py [OUT.json] [--rows 1,8,32]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from skipdecode import LLM, dispatch, kernels
from skipdecode.bench.decode import PROMPTS, machine_info
from skipdecode.generate import generate_tokens

NEW_TOKENS, ROUNDS = 64, 6


def main() -> None:
    args = sys.argv[1:]
    rows = (1, 8, 32)
    if "--rows" in args:
        i = args.index("--rows")
        rows = tuple(int(r) for r in args[i + 1].split(","))
        del args[i:i + 2]
    out = Path(args[0]) if args else Path("benchmarks/results/head-form-ab.json")
    llm = LLM.load("default-e2e", dtype="float32")
    net, head = llm.model, llm.model.lm_head
    if head.kernels is None:
        raise SystemExit("the compiled kernels are not available here: the head has one form")
    auto = dispatch.tune(head.out_features, head.in_features, head.kernels)
    w = net.tok_emb.weight.detach().float()
    if head.packed is None:
        head.packed = kernels.pack_weight(w)
    if head.onednn is None:
        head.onednn = torch.ops.mkldnn._reorder_linear_weight(w, head.PACK_BATCH_HINT)
    plans = {"hand": ("hand",) * len(dispatch.BUCKETS), "onednn": ("onednn",) * len(dispatch.BUCKETS)}
    sched = llm.make_schedule(speedup=1.0, expected_new_tokens=NEW_TOKENS)
    results = []
    for b in rows:
        ids = [llm.encode(PROMPTS[i % len(PROMPTS)]) for i in range(b)]
        best = {f: float("inf") for f in plans}
        tokens = {}
        for rnd in range(ROUNDS):
            for form in (list(plans) if rnd % 2 else list(plans)[::-1]):
                head.plan = plans[form]
                toks, st = generate_tokens(net, ids, sched, NEW_TOKENS, eos_token_ids=())
                best[form] = min(best[form], st["decode_seconds"] / (NEW_TOKENS - 1) * 1e3)
                tokens[form] = toks
        r = {"rows": b, "step_ms": {f: round(t, 3) for f, t in best.items()},
             "onednn_over_hand": round(best["onednn"] / best["hand"], 3),
             "autotuner_picks": auto["plan"][dispatch.bucket(b)],
             "rows_with_the_same_tokens": sum(a.token_ids == c.token_ids
                                              for a, c in zip(tokens["hand"], tokens["onednn"]))}
        results.append(r)
        print(json.dumps(r), flush=True)
    report = {"machine": machine_info(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "model": "default-e2e", "dtype": "float32", "new_tokens": NEW_TOKENS,
              "last_level_cache_mib": dispatch.llc_bytes() / 2 ** 20,
              "timing": f"decode seconds over the {NEW_TOKENS - 1} steps after the first token, best of {ROUNDS} "
                        "interleaved rounds per form",
              "autotuned_head": auto, "command": "python benchmarks/head_form_ab.py " + " ".join(sys.argv[1:]),
              "results": results}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
