"""Render a quality-vs-speed study from ``skipdecode evaluate`` reports.

    python -m skipdecode.evaluation.report --title "E2E" --train-dir runs/default-e2e \\
        --eval fine-tuned=eval-tuned.json --eval "not fine-tuned"=eval-base.json \\
        --command "skipdecode train ..." --out benchmarks/results/train-e2e

Writes ``OUT.json`` (the inputs, the kept fractions and the commands) and
``OUT.md``. "Kept" is a score at a speedup divided by the same model's score
at full depth (1x) in the same report, or, with ``--reference NAME``, by the
1x score of that model for every row (the paper's comparison: a skip-trained
checkpoint against the full-depth fine-tuned one). ``--train NAME=DIR`` adds
the training summary of each run (``--train-dir`` names the first one); DIR
may also be a JSON file holding one run's summary, as a report's
``training`` entry does, so a report can be re-rendered without the run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .. import atomic
from .metrics import PAIRED_BOOTSTRAPS

METRICS = (("bleu", "BLEU"), ("rougeL", "ROUGE-L"), ("bertscore", "BERTScore (MiniLM-L6)"))


def _interval(metric: str, r: dict, base: dict) -> list[float] | None:
    """Paired-bootstrap 95% interval of ``r``'s score over ``base``'s (BLEU and ROUGE-L), when both
    reports carry their outputs for the same items; None otherwise (an old report, another split)."""
    a, b = r.get("outputs") or [], base.get("outputs") or []
    if (metric not in PAIRED_BOOTSTRAPS or not a or len(a) != len(b) or any("references" not in o for o in a)
            or [o.get("prompt") for o in a] != [o.get("prompt") for o in b]):
        return None
    boot = PAIRED_BOOTSTRAPS[metric]
    return boot([o["text"] for o in a], [o["text"] for o in b], [o["references"] for o in a])["ratio"]


def kept(results: list[dict], reference: list[dict] | None = None) -> list[dict]:
    """Each result with ``<metric>_kept`` = score / the 1x score of ``reference``
    (default: of the same report); with a reference, ``<metric>_kept_own`` is
    the fraction of the same model's own 1x score. BLEU and ROUGE-L fractions
    carry ``..._95ci`` (a paired bootstrap over the items) where the outputs allow."""
    own = next((r for r in results if r["speedup_target"] == 1.0), None)
    ref = next((r for r in reference if r["speedup_target"] == 1.0), None) if reference else own
    out = []
    for r in results:
        row = {k: v for k, v in r.items() if k != "outputs"}
        for m, _ in METRICS:
            if ref is not None and r.get(m) is not None and ref.get(m):
                row[f"{m}_kept"] = round(r[m] / ref[m], 4)
                if r is not ref and (ci := _interval(m, r, ref)) is not None:  # not a row against itself
                    row[f"{m}_kept_95ci"] = ci
            if reference and own is not None and r.get(m) is not None and own.get(m):
                row[f"{m}_kept_own"] = round(r[m] / own[m], 4)
                if r is not own and (ci := _interval(m, r, own)) is not None:
                    row[f"{m}_kept_own_95ci"] = ci
        out.append(row)
    return out


def _pct(row: dict, key: str) -> str:
    """A kept fraction as a percentage, with its interval when the row has one."""
    if row.get(key) is None:
        return ""
    ci = row.get(key + "_95ci")
    return f"{100 * row[key]:.1f}%" + ("" if ci is None else f" ({100 * ci[0]:.1f}-{100 * ci[1]:.1f})")


def train_summary(train_dir: Path) -> dict:
    """The summary of a run directory, or a summary saved before as JSON
    (so a report can be re-rendered where the run directory is gone)."""
    if train_dir.is_file():
        return json.loads(train_dir.read_text())
    meta = json.loads((train_dir / "skipdecode.json").read_text())
    log = [json.loads(x) for x in (train_dir / "train_log.jsonl").read_text().splitlines() if x.strip()]
    return {"config": meta.get("config"), "schedules": meta.get("schedules"), "expected_new_tokens":
            meta.get("expected_new_tokens"), "steps": len(log), "seconds": round(sum(r["seconds"] for r in log), 1),
            "validation_loss": meta.get("validation_loss"), "final_loss": log[-1]["loss"] if log else None}


def _describe(train: dict) -> str:
    c = train["config"] or {}
    method = f"LoRA r={c.get('lora_r')}" if c.get("lora") else "full fine-tuning"
    return (f"{train['steps']} steps of {c.get('batch_size')} examples, {method}, lr {c.get('lr')}, "
            f"schedules drawn per batch from {c.get('speedups')}x, {train['seconds'] / 60:.1f} min of training "
            f"steps on this machine (2 CPU cores). Validation loss per schedule: {train['validation_loss']}.")


def render(title: str, evals: dict[str, dict], trains: dict[str, dict], commands: list[str],
           reference: str | None = None, rows: dict[str, list[dict]] | None = None) -> str:
    """The Markdown report; ``rows`` are ``kept()`` of each eval when already computed."""
    lines = [f"# {title}: quality against decode-layer speedup", ""]
    first = next(iter(evals.values()))
    s = first["settings"]
    kept_def = (f"Kept = score / the 1x score of {reference}, the full-depth reference, for every row."
                if reference else "Kept = score / the same model's score at 1x.")
    lines += [f"Data: `{first['data']}` (split: {first['split']}, {first['results'][0]['n_examples']} items, "
              f"every reference of an item scored), greedy, max {s['max_new_tokens']} new tokens. "
              f"BLEU: sacrebleu corpus BLEU, multi-reference. ROUGE-L: rouge-score F1, stemmed, max over references. "
              f"BERTScore: {s['bertscore_model']}, max over references (not comparable to roberta-large figures). "
              f"{kept_def} Kept BLEU and ROUGE-L carry 95% intervals from a paired bootstrap over the items "
              f"(1000 resamples, both systems on the same resample) where the reports hold their outputs.", ""]
    if len(trains) == 1 and not reference:
        lines += ["Training: " + _describe(next(iter(trains.values()))), ""]
    elif trains:
        lines += ["Training runs:", ""] + [f"- {n}: {_describe(t)}" for n, t in trains.items()] + [""]
    own_metrics = ("bleu", "rougeL") if reference else ()  # with a reference, each model's own 1x too
    own = "".join(f" {dict(METRICS)[m]} kept (own 1x) |" for m in own_metrics)
    lines += ["| model | target | decode-layer speedup | BLEU | kept | ROUGE-L | kept | BERTScore | kept |"
              f"{own} new tokens | seconds |", "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(own_metrics)]
    ref = evals[reference]["results"] if reference else None
    rows = rows or {n: kept(ev["results"], ref) for n, ev in evals.items()}
    for name in evals:
        for r in rows[name]:
            f = lambda m: "" if r.get(m) is None else f"{r[m]:.2f}"  # noqa: E731
            k = lambda m: _pct(r, m + "_kept")  # noqa: E731
            o = "".join(f" {_pct(r, m + '_kept_own')} |" if m + "_kept_own" in r else " |" for m in own_metrics)
            lines.append(f"| {name} | {r['speedup_target']:g}x | {r['decode_layer_speedup']:.2f} | {f('bleu')} | "
                         f"{k('bleu')} | {f('rougeL')} | {k('rougeL')} | {f('bertscore')} | {k('bertscore')} |"
                         f"{o} {r['new_tokens']} | {r['seconds']:.0f} |")
    lines += ["", "Schedules (budget first -> floor over the horizon, warm-up layers):", ""]
    for name, ev in evals.items():
        for r in ev["results"]:
            d = r["schedule"]
            lines.append(f"- {name} {r['speedup_target']:g}x: {d['max_exit_layer']} -> {d['min_exit_layer']} "
                         f"over {d['horizon']}, warm-up {d['warmup_layers']}, mode {d['mode']}")
    lines += ["", "Sample outputs (first two items):", ""]
    for name, ev in evals.items():
        for r in ev["results"]:
            for o in r["outputs"][:2]:
                lines.append(f"- {name} {r['speedup_target']:g}x: {o['text']!r}")
    lines += ["", "Commands that produced this report:", "", "```"] + commands + ["```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m skipdecode.evaluation.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--title", required=True)
    p.add_argument("--eval", action="append", required=True, metavar="NAME=FILE.json")
    p.add_argument("--train-dir", default=None, help="the training run of the first --eval")
    p.add_argument("--train", action="append", default=[], metavar="NAME=DIR", help="a named training run")
    p.add_argument("--reference", default=None, metavar="NAME",
                   help="the --eval whose 1x score every row's kept fraction divides by")
    p.add_argument("--command", action="append", default=[])
    p.add_argument("--out", required=True, help="output path without extension")
    a = p.parse_args(argv)
    evals = {}
    for spec in a.eval:
        name, _, f = spec.rpartition("=")  # a name may hold "=" (r=16), a path seldom does
        evals[name] = json.loads(Path(f).read_text())
    if a.reference is not None and a.reference not in evals:
        p.error(f"--reference {a.reference!r} is not one of the --eval names {sorted(evals)}")
    trains = {n: train_summary(Path(d)) for n, _, d in (t.rpartition("=") for t in a.train)}
    if a.train_dir:
        trains = {next(iter(evals)): train_summary(Path(a.train_dir)), **trains}
    ref = evals[a.reference]["results"] if a.reference else None
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = {n: kept(ev["results"], ref) for n, ev in evals.items()}
    data = {"title": a.title, "commands": a.command, "training": trains, "reference": a.reference, "results": rows,
            "settings": {n: {k: ev[k] for k in ("data", "split", "model", "settings")} for n, ev in evals.items()}}
    atomic.write_text(out.with_suffix(".json"), json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    atomic.write_text(out.with_suffix(".md"), render(a.title, evals, trains, a.command, a.reference, rows))
    print(f"wrote {out}.json and {out}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
