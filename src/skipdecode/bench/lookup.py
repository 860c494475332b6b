"""``skipdecode bench --lossless-lookup``: lossless mode with and without prompt
lookup (``policies.lookup``), on an output that paraphrases its input (E2E)
and one that copies from it (SciTLDR summaries of abstracts), in one run.

Batch 1, greedy, the lossless defaults (5x drafts, K=4, confidence 0.6); rows
differ only in ``prompt_lookup`` (0 = off, else the shortest n-gram matched).
Each task's prompts come in two disjoint sets: the n-gram size is chosen on the
*tuning* prompts (the best tokens/s over both tasks together, each task's
tokens/s relative to its own 1x), and the figures shown are the *report*
prompts'. Decode time per prompt is the engine's time from the first token to
the last, the best of ``repeats`` runs; every lossless output is compared with
full depth's, token for token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import atomic
from ..llm import LLM
from .decode import machine_info
from .lossless import batch1

RESULTS = Path("benchmarks/results")
TASKS = {"e2e-names": "E2E, held-out restaurant names (paraphrases its input)",
         "scitldr": "SciTLDR, one-sentence summaries of abstracts (copies from its input)"}


def run_lookup_bench(model: str = "default-e2e", out_dir: str | os.PathLike = RESULTS,
                     dtypes: tuple[str, ...] = ("float32", "int8"), n_prompts: int = 12, max_new_tokens: int = 48,
                     ngrams: tuple[int, ...] = (0, 1, 2, 3), repeats: int = 2, quick: bool = False) -> dict:
    from ..data import load_task

    if quick:
        n_prompts, ngrams, repeats = 3, (0, 2), 1
    default_dtypes = tuple(dtypes) == ("float32", "int8")
    command = "skipdecode bench --lossless-lookup" + "".join(f" --dtype {d}" for d in dtypes if not default_dtypes) \
        + ("" if Path(out_dir) == Path(RESULTS) else f" --out-dir {out_dir}") + (" --quick" if quick else "")
    report: dict = {"machine": machine_info(), "command": command, "model": model, "max_new_tokens": max_new_tokens,
                    "prompts": n_prompts, "tuning_prompts": n_prompts, "repeats": repeats, "tasks": TASKS,
                    "setting": {"speedup": 5.0, "draft_tokens": "default", "draft_confidence": "default"},
                    "dtypes": {}}
    pools = {t: load_task(t).eval_items("validation") for t in TASKS}
    for dtype in dtypes:
        llm = LLM.load(model, dtype=dtype)
        llm.generate("Hello", max_new_tokens=4)  # warm-up (kernels, allocator)
        per_task = {}
        for task, pool in pools.items():
            sets = {"report": [llm.encode(it.prompt) for it in pool[:n_prompts]],
                    "tuning": [llm.encode(it.prompt) for it in pool[n_prompts:2 * n_prompts]]}
            rows: dict = {}
            full: dict = {}
            for part, ids in sets.items():
                base = batch1(llm, ids, max_new_tokens, repeats)
                full[part] = [o.token_ids for o in base.pop("outs")]
                rows.setdefault("1x", {})[part] = base
                for n in ngrams:
                    kw = dict(speedup=5.0, lossless=True, **({"prompt_lookup": n} if n else {}))
                    r = batch1(llm, ids, max_new_tokens, repeats, **kw)
                    outs = r.pop("outs")
                    drafted = sum(o.draft.drafted for o in outs)
                    accepted = sum(o.draft.accepted for o in outs)
                    r.update(vs_1x=round(r["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3),
                             acceptance=round(accepted / max(drafted, 1), 4),
                             lookup_drafted=sum(o.draft.lookup_drafted for o in outs),
                             lookup_accepted=sum(o.draft.lookup_accepted for o in outs),
                             identical_to_full_depth=sum(o.token_ids == f for o, f in zip(outs, full[part])))
                    rows.setdefault(f"lossless, lookup {n}" if n else "lossless", {})[part] = r
            per_task[task] = rows
        looked = [n for n in ngrams if n]
        score = {n: sum(per_task[t][f"lossless, lookup {n}"]["tuning"]["vs_1x"] for t in TASKS) for n in looked}
        best = max(looked, key=score.get) if looked else None
        report["dtypes"][dtype] = {"tasks": per_task, "chosen_ngram": best,
                                   "tuning_score": {str(n): round(v, 3) for n, v in score.items()}}
        del llm
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "lossless-lookup.json", json.dumps(report, indent=1) + "\n")
    atomic.write_text(out / "lossless-lookup.md", render_markdown(report))
    return report


def render_markdown(rep: dict) -> str:
    m = rep["machine"]
    lines = ["# Lossless mode with prompt lookup", "",
             f"- Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}; {m['date']}",
             f"- Versions: python {m['python']}, torch {m['torch']}, skipdecode {m['skipdecode']}",
             f"- Model `{rep['model']}`; batch 1; greedy; chat template; up to {rep['max_new_tokens']} new tokens "
             f"ending on EOS; best of {rep['repeats']} runs per prompt. Lossless rows: 5x drafts, the default K "
             "and draft confidence; `lookup n`: a draft below the confidence gives way to what followed the "
             "last n or more tokens where they occurred before (prompt or output).",
             f"- {rep['prompts']} report and {rep['tuning_prompts']} tuning prompts per task, disjoint; n is "
             "chosen on the tuning prompts (summed tokens/s vs 1x over both tasks); the tables show the report "
             "prompts.",
             f"- Command: `{rep['command']}`", ""]
    for dtype, d in rep["dtypes"].items():
        lines += [f"## {dtype}", "", f"n chosen on the tuning prompts: **{d['chosen_ngram']}** "
                  f"(tuning scores {d['tuning_score']})", ""]
        for task, rows in d["tasks"].items():
            lines += [f"### {rep['tasks'][task]}", "",
                      "| row | decode tok/s | vs 1x | vs 1x (tuning) | acceptance | lookup drafts accepted | "
                      "identical to 1x |", "|---|---|---|---|---|---|---|"]
            for name, parts in rows.items():
                r, t = parts["report"], parts["tuning"]
                look = f"{r['lookup_accepted']}/{r['lookup_drafted']}" if r.get("lookup_drafted") else ""
                ident = f"{r['identical_to_full_depth']}/{rep['prompts']}" if "identical_to_full_depth" in r else ""
                lines.append(f"| {name} | {r['decode_tokens_per_s']:.1f} | {r.get('vs_1x', 1.0):.2f}x | "
                             f"{t.get('vs_1x', 1.0):.2f}x | {r.get('acceptance', '')} | {look} | {ident} |")
            lines.append("")
    return "\n".join(lines) + "\n"
