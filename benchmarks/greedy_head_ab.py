"""Greedy decode steps with the LM head's approximate pass against the full head.

A greedy step needs each row's argmax, not its logits. ``Transformer.greedy_steps`` picks it from
an approximate pass and the exact logits of the few token ids the pass's error bound leaves in
doubt; ``greedy_approx = False`` reads every logit from the full head. An fp32 head's pass is its
bf16 copy (half the head's bytes, ``kernels.greedy_head``, ``model.head_bound``); an int8 head's
(the int8 and int4 dtypes, and the two-limb heads of w8a16 and w4a16) is the same int8 weights
packed for int8 activations (``kernels.greedy_head_int8``, ``model.int8_head_bound``), run at the
row counts where ``dispatch.int8_greedy_head_plan`` measured it no slower (``pass_in_plan``; where
not, both settings run the full head: a control for the host's spread). The two must give the same tokens (the
run stops if they do not). This times both on ``default-e2e`` (64 greedy tokens, the bench's E2E
prompts, best of interleaved rounds with the order alternating) at each row count and speedup, and
counts how many token ids each step's pass left in doubt (from the Python form of the same pick:
for the bf16 copy on x as it is, where the tiles take x's top bf16 half, so the count is close,
not exact).

``--copies`` (float32): an fp32 head's two copies against each other instead, both picking from
their pass (``model.fp32_head_copy``): the bf16 copy (half the head's bytes) and the int8 copy (a
quarter, ``kernels.greedy_head`` with its scales and two-term bound), with the ids each left in
doubt. Run from the repository root:
    .venv/bin/python benchmarks/greedy_head_ab.py [OUT.json] [--dtype float32|int8|int4|w8a16|w4a16] [--rows 1,8,32]
        [--speedups 1,3] [--copies]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kernel_ab import NEW_TOKENS, ROUNDS, ab_model, pop_option  # the same timing and options
from skipdecode import LLM, dispatch, kernels
from skipdecode.bench.decode import PROMPTS, machine_info
from skipdecode.generate import generate_tokens
from skipdecode.model import fp32_head_copy, int8_head_row_factor


def ids_in_doubt(net, ids: list[list[int]], sched) -> list[int]:
    """Per decode step of one greedy run, how many token ids the bf16 pass left in doubt over all
    rows (greedy_head's candidates, recomputed here in float64 from the bf16 copy and head_bound)."""
    head, k = net.lm_head, net.kernels
    counts = []
    real = net.head
    int8 = head.approx.dtype == torch.int8
    copy8 = int8 and head.approx_scale is not None  # an fp32 head's int8 copy

    def head_counting(x):
        h = net.final_hidden(x).reshape(-1, head.in_features)
        if copy8:  # the copy's int8-activation pass: B_n = nx_r c_n + mx_r d_n
            a = k.linear(h, head.approx, None, head.out_features, head.approx_scale, 1).double()
            c, d = head.approx_bound.double()
            b = int8_head_row_factor(h)[:, None] * c + 1.05 * h.double().norm(dim=1, keepdim=True) * d
        elif int8:  # the int8-activation pass and its rows' own factors
            a = k.linear(h, head.approx, None, head.out_features, head.panel_scales, 1).double()
            b = int8_head_row_factor(h, two_limbs=head.a8 == 2)[:, None] * head.approx_bound.double()
        else:
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


def write_report(out: Path, dtype: str, results: list[dict], **fields) -> None:
    """``out``: the machine, the kernels' forms, the timing and the command with ``results``."""
    report = {"machine": machine_info(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "kernel_forms": {"isa": kernels.isa(), "a8": kernels.a8_form()}, "model": "default-e2e",
              "dtype": dtype, "new_tokens": NEW_TOKENS, **fields,
              "timing": f"decode seconds over the {NEW_TOKENS - 1} steps after the first token, best of {ROUNDS} "
                        "interleaved rounds (order alternating) after a warm-up round",
              "command": "python benchmarks/greedy_head_ab.py " + " ".join(sys.argv[1:]), "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def compare_copies(llm, rows: list[int], speedups: list[float], out: Path) -> None:
    """Greedy steps picking from the fp32 head's bf16 copy against its int8 copy (both through their
    pass and the exact logits they leave in doubt), interleaved; writes ``out``."""
    net = llm.model
    head = net.lm_head
    made = {form: fp32_head_copy(net._head_rows, form) for form in ("bfloat16", "int8")}

    def use(m, form):
        head.approx, head.approx_scale, head.approx_bound = made[form]

    results = []
    for b in rows:
        ids = [llm.encode(PROMPTS[i % len(PROMPTS)]) for i in range(b)]
        if not net.native_greedy(b) or not head.greedy_plan[dispatch.bucket(b)]:
            raise SystemExit(f"{b} rows do not pick from the head's copy in the native loop here")
        for sp in speedups:
            sched = llm.make_schedule(speedup=sp, expected_new_tokens=NEW_TOKENS)
            best, _ = ab_model(net, use, {"bf16": "bfloat16", "int8": "int8"}, ids, sched, f"{b} rows at {sp:g}x")
            doubt = {}
            for form in ("bfloat16", "int8"):
                use(net, form)
                d = ids_in_doubt(net, ids, sched)
                doubt[form] = {"mean": round(sum(d) / len(d), 2), "max": max(d)}
            r = {"rows": b, "speedup": sp, "ms_per_step_bf16_copy": round(best["bf16"], 3),
                 "ms_per_step_int8_copy": round(best["int8"], 3),
                 "bf16_over_int8_copy": round(best["bf16"] / best["int8"], 3), "same_tokens": True,
                 "ids_in_doubt_per_step": doubt}
            results.append(r)
            print(json.dumps(r), flush=True)
    write_report(out, "float32", results, head_bytes={
        "float32": head.packed.nbytes, "bfloat16_copy": made["bfloat16"][0].nbytes,
        "int8_copy": made["int8"][0].nbytes + made["int8"][1].nbytes})


def main() -> None:
    args = sys.argv[1:]
    rows = [int(r) for r in (pop_option(args, "--rows") or "1,8,32").split(",")]
    speedups = [float(s) for s in (pop_option(args, "--speedups") or "1,3").split(",")]
    dtype = pop_option(args, "--dtype") or "float32"
    copies = "--copies" in args
    args = [a for a in args if a != "--copies"]
    out = Path(args[0]) if args else Path("benchmarks/results/greedy-head-ab.json")
    llm = LLM.load("default-e2e", dtype=dtype)
    net = llm.model
    if net.lm_head.approx is None:
        raise SystemExit(f"the {dtype} head has no approximate pass here (no compiled kernels, or an int8 head "
                         "whose pass was measured slower at every row count)")
    if copies:
        if dtype != "float32":
            raise SystemExit("--copies compares an fp32 head's bf16 and int8 copies: --dtype float32")
        return compare_copies(llm, rows, speedups, out)
    pass_name = "int8" if net.lm_head.approx.dtype == torch.int8 else "bf16"
    results = []
    for b in rows:
        ids = [llm.encode(PROMPTS[i % len(PROMPTS)]) for i in range(b)]
        if not net.native_greedy(b):
            raise SystemExit(f"{b} rows do not run the native greedy loop here")
        for sp in speedups:
            sched = llm.make_schedule(speedup=sp, expected_new_tokens=NEW_TOKENS)
            # interleaved rounds after a warm-up, order alternating; stops if the two pick other tokens
            best, _ = ab_model(net, lambda m, on: setattr(m, "greedy_approx", on), {"full": False, "pass": True},
                               ids, sched, f"{b} rows at {sp:g}x")
            net.greedy_approx = True
            used = bool(net.lm_head.greedy_plan[dispatch.bucket(b)])
            doubt = ids_in_doubt(net, ids, sched)
            r = {"rows": b, "speedup": sp, "ms_per_step_full_head": round(best["full"], 3),
                 f"ms_per_step_{pass_name}_pass": round(best["pass"], 3),
                 f"full_over_{pass_name}_pass": round(best["full"] / best["pass"], 3), "same_tokens": True,
                 "pass_in_plan": used,
                 "ids_in_doubt_per_step": {"mean": round(sum(doubt) / len(doubt), 2), "max": max(doubt)}}
            results.append(r)
            print(json.dumps(r), flush=True)
    head = net.lm_head
    write_report(out, dtype, results, head_bytes={str(head.packed.dtype).removeprefix("torch."): head.packed.nbytes,
                 **({"pass": "the head's own panels (two int8 limbs: packed for the pass already)"}
                    if head.approx is head.packed else
                    {f"{str(head.approx.dtype).removeprefix('torch.')}_copy": head.approx.nbytes})},
                 pass_in_plan_note="pass_in_plan: whether greedy steps of that many rows take the pass (the "
                                   "head's greedy_plan); where not, both settings run the full head")


if __name__ == "__main__":
    main()
