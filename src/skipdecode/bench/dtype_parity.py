"""Quality in every weight dtype (``skipdecode bench --dtype-parity``): the shipped model on
e2e-heldout's report part (restaurant names never seen in training, never used to choose
anything), greedy, at 1x-3x, in fp32, bf16, int8, int4, w8a8, w4a8, w8a16 and w4a16. BLEU against fp32's, and greedy token
agreement: the share of fp32's generated tokens that the other dtype reproduces at the same
position before the two first diverge, and the share of outputs that are identical. With a KV cache
dtype (``--kv-dtype float16``), every dtype runs on that cache and is held against fp32 weights on a
float32 cache: the float32 rows then measure the cache's rounding alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import atomic
from ..checkpoint import resolve
from ..config import WEIGHT_DTYPES
from ..evaluation import evaluate
from ..llm import LLM
from .decode import machine_info

DATA = Path("../shared/data/e2e/devset.csv")


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Prefix agreement of ``b`` with the reference ``a``, over all tokens of ``a``; identical outputs."""
    same = sum(next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
               for ra, rb in zip(a, b))
    return {"token_agreement": round(same / max(1, sum(len(r) for r in a)), 4),
            "identical_outputs": round(sum(ra == rb for ra, rb in zip(a, b)) / max(1, len(a)), 4)}


def against_reference(runs: dict[str, dict[str, Any]], ref: dict[str, Any]) -> dict[str, dict[str, dict]]:
    """Per run and speedup (``"3x"``): its BLEU, BLEU minus ``ref``'s and greedy token agreement
    with ``ref``'s outputs; ``runs`` and ``ref`` are ``evaluate`` reports at the same speedups."""
    rows: dict[str, dict[str, dict]] = {}
    for name, rep in runs.items():
        rows[name] = {}
        for res, r0 in zip(rep["results"], ref["results"]):
            ag = agreement([o["token_ids"] for o in r0["outputs"]], [o["token_ids"] for o in res["outputs"]])
            rows[name][f"{res['speedup_target']:g}x"] = {
                "bleu": res["bleu"], "bleu_minus_fp32": round(res["bleu"] - r0["bleu"], 3), **ag}
    return rows


def reference_model(model: str) -> str:
    """The model whose fp32 outputs the dtypes are held against: ``model`` itself, or, for a
    checkpoint whose block linears hold int4 values (its fp32 then computes the int4 model:
    ``skipdecode awq --rounding gptq``'s output, or a ``skipdecode train --qat int4`` run), the
    model it was made from (for a run, its base model's own reference)."""
    meta = resolve(model) / "skipdecode.json"
    info = json.loads(meta.read_text()) if meta.is_file() else {}
    if "gptq" in info and "source" in info.get("awq", {}):
        return info["awq"]["source"]
    if info.get("config", {}).get("qat", "no") != "no" and info.get("base_model"):
        return reference_model(info["base_model"])
    return model


def run_dtype_parity(model: str = "default-e2e", out_dir: str | Path = "benchmarks/results",
                     speedups: tuple[float, ...] = (1.0, 2.0, 3.0), data: Path = DATA,
                     split: str = "report",
                     dtypes: tuple[str, ...] = WEIGHT_DTYPES, reference: str | None = None,
                     kv_dtype: str | None = None) -> dict[str, Any]:
    """Every weight dtype on the same prompts; the default split's restaurant names were held out
    from the shipped checkpoint's training. BLEU and agreement are against ``reference``'s fp32
    outputs on a float32 KV cache (default: ``reference_model(model)``); ``kv_dtype``: the cache
    every dtype runs on (default float32)."""
    reference = reference or reference_model(model)
    kv = kv_dtype or "float32"
    reports = {dt: evaluate("e2e", data, model, list(speedups), split=split, bertscore=False, dtype=dt,
                            llm=LLM.load(model, dtype=dt, kv_dtype=kv))
               for dt in dtypes}
    ref_report = reports["float32"] if reference == model and "float32" in reports and kv == "float32" else \
        evaluate("e2e", data, reference, list(speedups), split=split, bertscore=False, dtype="float32")
    rows = []
    for dt, rep in reports.items():
        for res, ref in zip(rep["results"], ref_report["results"]):
            a = [o["token_ids"] for o in ref["outputs"]]
            b = [o["token_ids"] for o in res["outputs"]]
            rows.append({"dtype": dt, "kv_dtype": kv, "speedup_target": res["speedup_target"], "bleu": res["bleu"],
                         "bleu_minus_fp32": round(res["bleu"] - ref["bleu"], 3), "rougeL": res["rougeL"],
                         **agreement(a, b), "n_examples": res["n_examples"]})
    command = "skipdecode bench --dtype-parity" + ("" if model == "default-e2e" else f" --model {model}") \
        + ("" if tuple(dtypes) == WEIGHT_DTYPES else "".join(f" --dtype {d}" for d in dtypes)) \
        + ("" if kv == "float32" else f" --kv-dtype {kv}") \
        + ("" if Path(out_dir) == Path("benchmarks/results") else f" --out-dir {out_dir}")
    report = {"model": model, "reference_model": reference, "kv_dtype": kv, "data": str(data), "split": split,
              "greedy": True,
              "machine": machine_info(), "command": command, "results": rows}
    out = Path(out_dir)
    atomic.write_text(out / "dtype-parity.json", json.dumps(report, indent=2) + "\n")
    lines = ["# Quality in every weight dtype", "",
             f"`{model}` on the E2E {split} split ({rows[0]['n_examples']} MRs"
             + (", restaurant names never seen in training" if split in ("report", "select") else "")
             + "), greedy, multi-reference "
             "BLEU (sacrebleu). Token agreement: share of fp32's generated tokens reproduced at the same "
             f"position before the first difference. Produced by `{command}` on "
             f"{report['machine']['cpu']}."
             + ("" if kv == "float32" else f" Every dtype here runs on a {kv} KV cache; fp32 is float32 weights "
                                           "on a float32 cache."), ""]
    if reference != model:
        ref_bleu = " / ".join(f"{r['bleu']:.2f}" for r in ref_report["results"])
        lines += [f"\"fp32\" below is `{reference}`'s fp32 ({ref_bleu} BLEU at "
                  + " / ".join(f"{sp:g}x" for sp in speedups) + f"), the model `{model}` was made from: "
                  "BLEU - fp32 and agreement are against it. `float32` rows are this model's int4 values "
                  "run in fp32.", ""]
    lines += ["| dtype | target | BLEU | BLEU - fp32 | token agreement | identical outputs |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['speedup_target']:g}x | {r['bleu']:.2f} | {r['bleu_minus_fp32']:+.2f} | "
                     f"{100 * r['token_agreement']:.1f}% | {100 * r['identical_outputs']:.1f}% |")
    atomic.write_text(out / "dtype-parity.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return report
