"""A lever tried on e2e-heldout's select part before building it: hold the schedule while copying.

Names copied from the input break once a request's budget has dropped
(``docs/results.md``). The idea: an adaptive request's clock (``policies.adaptive``,
threshold 0, so every other token ticks) does not tick while its last N generated
tokens continue a span of its prompt, so a name keeps the depth it started at.
This script patches the engine's clock for the experiment only and scores
``default-e2e`` on select (where choices are made) at the 3x and 5x schedules,
for N = 0 (the static schedule, as a check), 1 and 2. It writes
``benchmarks/results/copy-hold-select.json``. Compare each row's BLEU with the
static schedules' at the same achieved decode-layer speedup
(``eval-select-default-e2e.json``). Run from the repository root:

    .venv/bin/python benchmarks/copy_hold_select.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from skipdecode.engine.engine import Engine  # noqa: E402
from skipdecode.evaluation.evaluate import evaluate  # noqa: E402
from skipdecode.evaluation.metrics import names_copied  # noqa: E402
from skipdecode.llm import LLM  # noqa: E402

HOLD = {"n": 0}


def continues_prompt(prompt: list[int], generated: list[int], n: int) -> bool:
    """The last ``n`` generated tokens occur in the prompt with at least one prompt token after them."""
    if n <= 0 or len(generated) < n:
        return False
    p = np.asarray(prompt, dtype=np.int64)
    tail = generated[-n:]
    c = np.flatnonzero(p[: len(p) - 1] == tail[-1])
    for j in range(1, n):
        c = c[c - j >= 0]
        c = c[p[c - j] == tail[-1 - j]]
    return len(c) > 0


_append = Engine._append


def _held_append(self, st, tok, now, merge=None, row=None):
    before = st.confident
    out = _append(self, st, tok, now, merge=merge, row=row)
    if st.confident > before and continues_prompt(st.request.prompt_token_ids, st.token_ids, HOLD["n"]):
        st.confident = before  # inside a copied span: the clock waits
    return out


def main() -> None:
    Engine._append = _held_append
    llm = LLM.load("default-e2e")
    rows = []
    for n in (0, 1, 2):
        HOLD["n"] = n
        rep = evaluate("e2e", "../shared/data/e2e/devset.csv", "default-e2e", speedups=[3.0, 5.0], split="select",
                       adaptive=0.0, bertscore=False, llm=llm)
        for r in rep["results"]:
            rows.append({"hold_ngram": n, "schedule": f"{r['speedup_target']:g}x",
                         "decode_layer_speedup": r["decode_layer_speedup"], "bleu": r["bleu"],
                         "names_copied": names_copied(r)})
            print(rows[-1], flush=True)
    out = Path("benchmarks/results/copy-hold-select.json")
    out.write_text(json.dumps({"model": "default-e2e", "split": "e2e-heldout select", "threshold": 0.0,
                               "command": ".venv/bin/python benchmarks/copy_hold_select.py", "rows": rows},
                              indent=2) + "\n")


if __name__ == "__main__":
    main()
