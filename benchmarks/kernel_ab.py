"""Decode steps with this checkout's kernels against another version of them, in one run.

Machines like these move by more between runs than a kernel change does, so a change to
``csrc/decode_kernels.cpp`` is timed here against the source it replaces, in the same process
and on the same model: the other source is built under its own name, the model's layers run on
each in turn (interleaved rounds, best of each), and both must give the same tokens.

Each case reports this version's steps per second over the other's from the best round of each,
and paired: the median over the rounds of the two versions' ratio within a round (run back to
back, so a slow spell that spans a round slows both).

Run from the repository root, e.g. against the previous commit's kernels:
    git show HEAD~1:src/skipdecode/csrc/decode_kernels.cpp > /tmp/before.cpp
    .venv/bin/python benchmarks/kernel_ab.py /tmp/before.cpp benchmarks/results/kernel-ab.json
Other cases than CASES: --case DTYPE:BATCH:SPEEDUP (repeatable), e.g. --case w8a8:32:1.
--kv-dtype float16 (or bfloat16): both versions decode on a KV cache of that dtype (LLM.load's kv_dtype).
SKIPDECODE_ISA=avx2 times both versions in their AVX2 forms (recorded under "kernel_forms").
--rounds-differ: for a change that rounds differently (both versions within fp32 rounding of the
exact result), record how many rows decode the same tokens instead of stopping at a difference.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from skipdecode import LLM, kernels
from skipdecode.bench.decode import PROMPTS, machine_info, round_median
from skipdecode.generate import generate_tokens

CASES = [("int8", 1, 1.0), ("int4", 1, 1.0), ("w8a8", 1, 1.0), ("w4a8", 1, 1.0), ("float32", 1, 1.0),
         ("int8", 1, 3.0), ("int4", 1, 3.0), ("int8", 8, 1.0), ("w8a8", 8, 3.0)]
NEW_TOKENS, ROUNDS = 64, 8


def build_other(source: Path):
    from torch.utils.cpp_extension import load as build

    kernels._put_ninja_on_path()
    tag = hashlib.sha1(source.read_bytes() + torch.__version__.encode()).hexdigest()[:10]
    return kernels.configure(build(name=f"skipdecode_kernels_ab_{tag}", sources=[str(source)], **kernels.BUILD_FLAGS))


def parse_cases(args: list[str]) -> tuple[list[str], list[tuple[str, int, float]]]:
    """The ``--case DTYPE:BATCH:SPEEDUP`` options of ``args`` (repeatable) and the arguments left."""
    args, cases = list(args), []
    while "--case" in args:
        i = args.index("--case")
        dtype, batch, speedup = args[i + 1].split(":")
        cases.append((dtype, int(batch), float(speedup)))
        del args[i:i + 2]
    return args, cases


def pop_option(args: list[str], flag: str) -> str | None:
    """The value of ``flag VALUE`` in ``args`` (removed from them), or None if absent."""
    if flag not in args:
        return None
    i = args.index(flag)
    if i + 1 >= len(args):
        raise SystemExit(f"{flag} needs a value")
    value = args[i + 1]
    del args[i:i + 2]
    return value


def case_rows(llm, batch: int, speedup: float) -> tuple[list[list[int]], object]:
    """A case's prompts (row i gets the bench's E2E prompt i mod 8) and its schedule at ``speedup``."""
    enc = [llm.encode(p) for p in PROMPTS]
    return [enc[i % len(enc)] for i in range(batch)], llm.make_schedule(speedup=speedup, expected_new_tokens=NEW_TOKENS)


def write_report(out: Path, script: str, what: str, results: list, rounds: int = ROUNDS, **extra) -> None:
    """Write an A/B run's JSON: the machine, versions, timing, ``extra`` fields, the command and ``results``."""
    report = {"machine": machine_info(), **extra, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "new_tokens": NEW_TOKENS, "rounds": rounds, "model": "default-e2e",
              "timing": f"decode steps after the first token, best of the rounds, the two {what} interleaved "
                        "(order alternating)",
              "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]), "results": results}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def interleaved(runs: dict, ids: list, sched, rounds: int = ROUNDS, rounds_out: dict | None = None
                ) -> tuple[dict[str, float], dict[str, list]]:
    """Decode ``ids`` with ``sched`` on each of ``runs`` (name -> a callable that readies and returns
    the model) in turn, ``rounds`` times after a warm-up round, the order alternating between
    rounds: each run's best ms per decode step (after the first token) and its rows' tokens.
    ``rounds_out`` (if given) gets each run's ms per step in every round after the warm-up."""
    ms: dict[str, list[float]] = {name: [] for name in runs}
    tokens = {}
    for rnd in range(rounds + 1):
        for name in list(runs)[::1 if rnd % 2 else -1]:
            rows, st = generate_tokens(runs[name](), ids, sched, NEW_TOKENS, eos_token_ids=())
            ms[name].append(st["decode_seconds"] / (NEW_TOKENS - 1) * 1000)
            tokens[name] = [r.token_ids for r in rows]
    if rounds_out is not None:
        rounds_out.update({name: v[1:] for name, v in ms.items()})
    return {name: min(v[1:]) for name, v in ms.items()}, tokens


def ab_model(net, apply, settings: dict, ids: list, sched, label: str, rounds_differ: bool = False,
             rounds_out: dict | None = None) -> tuple[dict[str, float], int]:
    """``interleaved`` over one model under two ``settings`` (name -> a value ``apply(net, value)``
    puts on it; its layer stack is rebuilt after each): each setting's best ms per step and how many
    rows decode the same tokens under both. Stops where they differ, unless ``rounds_differ``.
    ``rounds_out``: as ``interleaved``'s."""
    def on(value):
        def ready():
            apply(net, value)
            net.build_layer_stack()  # the step's one stack call as this setting has it
            return net
        return ready

    best, tokens = interleaved({name: on(v) for name, v in settings.items()}, ids, sched, rounds_out=rounds_out)
    first, second = tokens.values()
    same_rows = sum(a == b for a, b in zip(first, second))
    if same_rows < len(first) and not rounds_differ:
        raise SystemExit(f"{label}: the two {' and '.join(settings)} decode different tokens")
    return best, same_rows


def use_kernels(net, module) -> None:
    """Every compiled call of ``net`` on these kernels: its layers, their linears, the norms and the
    LM head. The native decode loop (``Transformer.native_greedy``) runs only where the layers, the
    final norm and the head share one module, so a version given the layers alone decoded in Python
    steps while this checkout's ran native bursts."""
    for m in net.modules():
        if getattr(m, "kernels", None) is not None:
            m.kernels = module


def main() -> None:
    if not sys.argv[1:] or {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        raise SystemExit(0 if sys.argv[1:] else 2)
    rounds_differ = "--rounds-differ" in sys.argv[1:]
    try:
        args, cases = parse_cases([a for a in sys.argv[1:] if a != "--rounds-differ"])
    except (IndexError, ValueError):
        raise SystemExit("--case takes DTYPE:BATCH:SPEEDUP, e.g. --case int4:8:1") from None
    kv_dtype = pop_option(args, "--kv-dtype")
    if not args or not Path(args[0]).is_file():
        raise SystemExit(f"the first argument must be the other kernel source (a .cpp file); got {args[:1]}")
    other_src, out = Path(args[0]), Path(args[1]) if len(args) > 1 else None
    this, other = kernels.load(), build_other(other_src)
    results = []
    for dtype, batch, speedup in cases or CASES:
        llm = LLM.load("default-e2e", dtype=dtype, kv_dtype=kv_dtype)
        net = llm.model
        ids, sched = case_rows(llm, batch, speedup)
        rounds: dict[str, list[float]] = {}
        best, same_rows = ab_model(net, use_kernels, {"other": other, "this": this}, ids, sched,
                                   f"{dtype} batch {batch} {speedup:g}x", rounds_differ, rounds)
        paired = round_median(rounds["other"], rounds["this"])
        r = {"dtype": dtype, "batch": batch, "speedup": speedup, "ms_per_step_other": round(best["other"], 3),
             "ms_per_step_this": round(best["this"], 3), "this_over_other_tokens_per_s":
             round(best["other"] / best["this"], 3), "this_over_other_round_median": round(paired, 3),
             "rows_with_the_same_tokens": same_rows}
        results.append(r)
        print(f"{dtype:8s} B={batch:<2} {speedup:g}x  other {best['other']:6.2f}  this {best['this']:6.2f} ms/step  "
              f"{r['this_over_other_tokens_per_s']:.3f}x (paired, round median {paired:.3f}x)", flush=True)
    if out:
        write_report(out, "kernel_ab.py", "versions", results,
                     kernel_forms={"isa": kernels.isa(), "a8": kernels.a8_form()}, other_source=str(other_src),
                     kv_dtype=kv_dtype or "float32")


if __name__ == "__main__":
    main()
