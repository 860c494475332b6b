"""Where serving saturates: the rate grid of ``skipdecode bench --lossless`` at finer steps.

``bench --lossless`` offers 2, 4, 8 and unbounded requests per second; full
depth and the lossless setting both hold p99 TPOT <= 100 ms at 8 and both fail
unbounded, so both report the offered load at 8 req/s as their sustainable
throughput, and the knee between 8 and unbounded is not measured. This script
offers 8, 10, 12, 14, 16, 20 req/s and unbounded (64 requests each, Poisson,
seed 0, the same e2e-names prompts, 48 new tokens) to full depth, the lossless
setting that ``bench --lossless`` chose on its tuning prompts (read from
``benchmarks/results/lossless.json``) and plain skipping at that setting's
target, and writes ``benchmarks/results/lossless-serving-knee.{json,md}``.
Run from the repository root on a quiet machine:

    .venv/bin/python benchmarks/lossless_serving_knee.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from skipdecode.bench.decode import machine_info  # noqa: E402
from skipdecode.bench.lossless import TPOT_LIMIT_MS, serving_sweep, serving_table  # noqa: E402
from skipdecode.data import load_task  # noqa: E402
from skipdecode.llm import LLM  # noqa: E402

RESULTS = Path("benchmarks/results")
RATES = [8.0, 10.0, 12.0, 14.0, 16.0, 20.0, float("inf")]
N_REQUESTS, MAX_NEW_TOKENS, MAX_NUM_SEQS = 64, 48, 32


def main() -> None:
    choice = json.loads((RESULTS / "lossless.json").read_text())["dtypes"]["float32"]["choice"]
    llm = LLM.load("default-e2e")
    pool = load_task("e2e-names").eval_items("validation")
    llm.generate(pool[0].prompt, max_new_tokens=4)  # warm-up (kernels, allocator)
    rows = {"1x": {}, choice["row"]: dict(speedup=choice["target"], lossless=True,
                                          draft_tokens=choice["draft_tokens"],
                                          draft_confidence=choice["draft_confidence"]),
            f"skip {choice['target']:g}x": dict(speedup=choice["target"])}
    out: dict = {"machine": machine_info(), "command": ".venv/bin/python benchmarks/lossless_serving_knee.py",
                 "model": "default-e2e", "dtype": "float32", "requests": N_REQUESTS,
                 "max_new_tokens": MAX_NEW_TOKENS, "max_num_seqs": MAX_NUM_SEQS, "tpot_limit_ms": TPOT_LIMIT_MS,
                 "split": "e2e-names validation",
                 "rows": serving_sweep(llm, pool, rows, RATES, N_REQUESTS, MAX_NEW_TOKENS, MAX_NUM_SEQS)}
    full = out["rows"]["1x"]["sustainable_tokens_per_s"]
    for r in out["rows"].values():
        r["vs_1x"] = round(r["sustainable_tokens_per_s"] / full, 3) if full and r["sustainable_tokens_per_s"] else None
    (RESULTS / "lossless-serving-knee.json").write_text(json.dumps(out, indent=2) + "\n")
    m = out["machine"]
    lines = ["# Lossless serving: where each row saturates", "",
             f"`{out['command']}`; {m.get('cpu')}, {m.get('torch_threads')} threads, {m.get('date')}. "
             f"`default-e2e` fp32, {N_REQUESTS} requests per rate (Poisson, seed 0), {MAX_NEW_TOKENS} new tokens, "
             f"at most {MAX_NUM_SEQS} running; sustainable = the best tokens/s at a rate whose p99 TPOT is "
             f"<= {TPOT_LIMIT_MS:g} ms.", ""] + serving_table(out["rows"])
    lines += [""] + [f"- {name}: sustainable {r['sustainable_tokens_per_s']} tok/s at {r['sustainable_rate']} req/s "
                     f"({r['vs_1x']}x full depth)" for name, r in out["rows"].items()] + [""]
    (RESULTS / "lossless-serving-knee.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
