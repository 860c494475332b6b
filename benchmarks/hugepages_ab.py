"""Decode steps with the packed weights on 2 MB pages (kernels.huge_page_arena) against the same
weights on 4 KB pages (SKIPDECODE_HUGEPAGES=0), in one run: the model is loaded once each way and
the two decode in interleaved rounds (best of each), on the same prompts; they must give the same
tokens (the bytes are the same). Writes benchmarks/results/hugepages-ab.json.
Run from the repository root: .venv/bin/python benchmarks/hugepages_ab.py [--case DTYPE:BATCH:SPEEDUP ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kernel_ab import case_rows, interleaved, parse_cases, write_report  # the same cases and timing
from skipdecode import LLM

CASES = [("float32", 1, 1.0), ("int8", 1, 1.0), ("w8a8", 1, 1.0), ("int4", 1, 1.0), ("w4a8", 1, 1.0),
         ("w8a16", 1, 1.0), ("w4a16", 1, 1.0), ("int8", 1, 3.0), ("float32", 8, 1.0), ("w4a8", 8, 1.0),
         ("float32", 32, 1.0)]
OUT = Path("benchmarks/results/hugepages-ab.json")


def anon_huge_kb() -> int | None:
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return None
    return int(text.split("AnonHugePages:")[1].split()[0])


def load(dtype: str, huge: bool) -> LLM:
    os.environ["SKIPDECODE_HUGEPAGES"] = "1" if huge else "0"
    try:
        return LLM.load("default-e2e", dtype=dtype)
    finally:
        del os.environ["SKIPDECODE_HUGEPAGES"]


def main() -> None:
    _, cases = parse_cases(sys.argv[1:])
    results = []
    for dtype, batch, speedup in cases or CASES:
        before = anon_huge_kb()
        llms = {"4k": load(dtype, False)}
        mid = anon_huge_kb()
        llms["2m"] = load(dtype, True)
        after = anon_huge_kb()
        ids, sched = case_rows(llms["4k"], batch, speedup)
        best, tokens = interleaved({name: (lambda m=llm.model: m) for name, llm in llms.items()}, ids, sched)
        if tokens["4k"] != tokens["2m"]:
            raise SystemExit(f"{dtype} batch {batch}: the two decode different tokens")
        r = {"dtype": dtype, "batch": batch, "speedup": speedup, "ms_per_step_4k_pages": round(best["4k"], 3),
             "ms_per_step_2m_pages": round(best["2m"], 3),
             "2m_over_4k_tokens_per_s": round(best["4k"] / best["2m"], 3),
             "anon_huge_pages_mb_added": None if after is None else
             {"4k load": round((mid - before) / 1024, 1), "2m load": round((after - mid) / 1024, 1)}}
        results.append(r)
        print(f"{dtype:8s} B={batch:<2} {speedup:g}x  4k {best['4k']:6.2f}  2m {best['2m']:6.2f} ms/step  "
              f"{r['2m_over_4k_tokens_per_s']:.3f}x  {r['anon_huge_pages_mb_added']}", flush=True)
        del llms
    write_report(OUT, "hugepages_ab.py", "loads", results)


if __name__ == "__main__":
    main()
