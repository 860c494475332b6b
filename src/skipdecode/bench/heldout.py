"""Quality where nobody tuned, against measured wall-clock speedup (``skipdecode bench --quality``).

Every row is trained on e2e-heldout's train part and scored on both of its other
parts, disjoint by restaurant name: ``select`` (every choice of schedule, recipe,
checkpoint and threshold was made there) and ``report`` (scored once per shipped
candidate, never chosen on). The table's headline figures are the report
column's; the select column shows how much choosing on a split flatters it.

Speed is measured here, in one run: the report prompts in batches, a fixed number
of new tokens (EOS ignored), prompt to last token, divided into the time of the
same base model at full depth, each the best of interleaved rounds (every
schedule once per round, so a slow spell of a shared machine cannot fall on one
schedule alone). A static schedule's speed depends on which layers run, not on
their weights, so it is timed once on the base model (static drop: the base with
as many layers removed); an adaptive row's budgets depend on the model's
confidence, so it is timed on its own model with its threshold.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import atomic
from ..llm import LLM
from ..schedule import SkipSchedule
from .decode import machine_info
from .quality import _kept, _percent, _result, best_of_interleaved, generation_timer, paired_interval, timing_model

RESULTS = Path("benchmarks/results")
SPLITS = ("select", "report")
# the shipped recipe trained at full depth only (--speedups 1): what the shipped model's 1x is held to
REFERENCE = "full-depth fine-tuning (shipped recipe, 1x only)"
# the skip-the-bottom recipe at full depth only, trained at three seeds: the noise floor between two runs
SEED_REFERENCE = "full-depth fine-tuning (skip-the-bottom recipe, 1x only)"
SHIPPED = "default-e2e (shipped)"
SHIPPED_SEED0 = "the shipped recipe at seed 0 (default-e2e before)"
NESTED = "nested layer sets, no renaming (default-e2e before)"
SKIP = "skipping the bottom layers (default-e2e before that)"
STATIC_DROP = "static layer drop (ShortGPT)"
EARLY_EXIT = "early exit"
SHIPPED_05B = "qwen2.5-coder-0.5b-e2e"
HEADLINE = (SHIPPED, SHIPPED_05B, STATIC_DROP, EARLY_EXIT, REFERENCE)  # at most 5 series


SHIPPED_RECIPE = "the shipped recipe (recipes/default-e2e-names-aug-1800.yaml)"
SKIP_RECIPE = "the skip-the-bottom recipe (recipes/default-e2e.yaml)"
# Recipes trained at several seeds (data order, schedule draws, LoRA init; benchmarks/quality_heldout_gpu.sh
# and benchmarks/screen_seeds_gpu.sh, one GPU): how far runs of one recipe land apart is the noise floor of
# any comparison between two runs.
SEED_GROUPS: dict[str, tuple[str, ...]] = {
    SEED_REFERENCE: ("full-only", "full-only-seed1", "full-only-seed2"),
    SKIP_RECIPE: ("default-e2e-cuda", "default-e2e-cuda-seed1", "default-e2e-cuda-seed2"),
    REFERENCE: ("screen-names-aug-1800-ref",),
    # seed 0 on the CPU and again on the GPU, seeds 1-3 on the GPU; seed 2 is the shipped default-e2e
    SHIPPED_RECIPE: ("default-e2e-names-aug-1800", "screen-names-aug-1800-gpu", "screen-names-aug-1800-seed1",
                     "default-e2e", "screen-names-aug-1800-seed3"),
}
# each recipe's 1x against the same recipe trained at full depth only
SEED_REFERENCES = {SKIP_RECIPE: SEED_REFERENCE, SHIPPED_RECIPE: REFERENCE}


@dataclass(frozen=True)
class HeldoutRow:
    name: str
    stem: str  # benchmarks/results/eval-{split}-{stem}.json (a static row: {stem}-{x}x)
    model: str
    base: str = "default"  # whose full depth its speedups are measured against
    targets: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0)
    static: bool = False  # one pruned model per target, evaluated at its own full depth
    adaptive: bool = False  # budgets depend on confidence: timed on its own model
    own: str | None = None  # the row whose 1x it keeps a share of (an inference-time variant's model)
    notes: dict = field(default_factory=dict)

    def eval_path(self, split: str, target: float, results: Path = RESULTS) -> Path:
        stem = f"{self.stem}-{target:g}x" if self.static else self.stem
        return results / f"eval-{split}-{stem}.json"


def heldout_rows() -> list[HeldoutRow]:
    return [
        HeldoutRow("untrained", "untrained", "default"),
        # benchmarks/screen_weights_gpu.sh (one GPU, adapter rounded to bf16)
        HeldoutRow(REFERENCE, "screen-names-aug-1800-ref", "runs/gpu-names-aug-1800-ref", targets=(1.0,)),
        HeldoutRow(SEED_REFERENCE, "full-only", "runs/heldout-full-only", targets=(1.0,)),
        # the shipped default-e2e: nested layer sets by measured influence, trained with name augmentation
        # (recipes/default-e2e-names-aug-1800.yaml at seed 2, chosen on select among seeds 0-3)
        HeldoutRow(SHIPPED, "default-e2e", "default-e2e"),
        HeldoutRow("default-e2e, adaptive budgets", "default-e2e-adaptive", "default-e2e",
                   targets=(2.0, 3.0, 4.0), adaptive=True, own=SHIPPED),
        # the same recipe at seed 0, shipped before
        HeldoutRow(SHIPPED_SEED0, "default-e2e-names-aug-1800", "runs/default-e2e-names-aug-1800"),
        # the same without name augmentation (recipes/default-e2e-nested.yaml), shipped before it
        HeldoutRow(NESTED, "default-e2e-nested", "runs/default-e2e-nested"),
        HeldoutRow("nested, no renaming, adaptive budgets", "default-e2e-nested-adaptive", "runs/default-e2e-nested",
                   targets=(2.0, 3.0, 4.0), adaptive=True, own=NESTED),
        # SkipDecode's skip-the-bottom recipe (recipes/default-e2e.yaml), shipped before nested replaced it
        HeldoutRow(SKIP, "default-e2e-skip", "runs/default-e2e-skip"),
        HeldoutRow("skipping the bottom, adaptive budgets", "default-e2e-skip-adaptive", "runs/default-e2e-skip",
                   targets=(2.0, 3.0, 4.0), adaptive=True, own=SKIP),
        HeldoutRow("nested layer sets by greedy removal", "default-e2e-nested-removal",
                   "runs/default-e2e-nested-removal"),
        HeldoutRow(EARLY_EXIT, "early-exit", "runs/heldout-early-exit"),
        HeldoutRow(STATIC_DROP, "drop", "runs/heldout-drop", targets=(2.0, 3.0, 5.0), static=True),
        HeldoutRow(SHIPPED_05B, "qwen2.5-coder-0.5b-e2e", "qwen2.5-coder-0.5b-e2e", base="qwen2.5-coder-0.5b"),
        HeldoutRow("qwen2.5-coder-0.5b untrained", "qwen2.5-coder-0.5b-untrained", "qwen2.5-coder-0.5b",
                   base="qwen2.5-coder-0.5b", targets=(1.0,)),
        HeldoutRow("qwen2.5-coder-0.5b, gentler recipe", "qwen2.5-coder-0.5b-e2e-gentle",
                   "runs/qwen2.5-coder-0.5b-e2e-gentle", base="qwen2.5-coder-0.5b"),
    ]


def _local_run_missing(model: str) -> bool:
    """A model named by a local path (``runs/NAME``) that is not on this machine."""
    return ("/" in model or model.startswith(".")) and not Path(model).exists()


def seed_spread(results: Path = RESULTS, groups: dict[str, tuple[str, ...]] | None = None,
                references: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Per recipe, split and target: each seed's BLEU, kept fraction of its own 1x and names right,
    with their mean and range (seeds whose evaluation is missing are left out), and the group its
    1x is held to (``references``: recipe -> its full-depth-only group)."""
    out = []
    references = SEED_REFERENCES if references is None else references
    for recipe, stems in (SEED_GROUPS if groups is None else groups).items():
        for split in SPLITS:
            by_seed = {}
            for stem in stems:
                p = results / f"eval-{split}-{stem}.json"
                if p.is_file():
                    by_seed[stem] = {r["speedup_target"]: r for r in json.loads(p.read_text())["results"]}
            targets = sorted({t for res in by_seed.values() for t in res})
            for t in targets:
                have = [(stem, res) for stem, res in by_seed.items() if t in res]
                bleu = [res[t]["bleu"] for _, res in have]
                kept = [res[t]["bleu"] / res[1.0]["bleu"] for _, res in have if 1.0 in res and res[1.0]["bleu"]]
                names = [res[t].get("names_copied") for _, res in have]
                out.append({"recipe": recipe, "reference": references.get(recipe), "split": split,
                            "speedup_target": t, "seeds": [s for s, _ in have],
                            "bleu": [round(x, 2) for x in bleu], "bleu_stats": _stats(bleu),
                            "kept_own": [round(x, 4) for x in kept], "kept_own_stats": _stats(kept),
                            "names_copied": names})
    return out


def _stats(xs: list[float]) -> dict[str, float] | None:
    return {"mean": round(sum(xs) / len(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)} if xs else None


def run_heldout_quality(out_dir: str | Path = RESULTS, results: str | Path = RESULTS, quick: bool = False,
                        new_tokens: int = 32, batch: int = 16, repeats: int = 3,
                        rows: list[HeldoutRow] | None = None,
                        seed_groups: dict[str, tuple[str, ...]] | None = None,
                        seed_references: dict[str, str] | None = None) -> dict[str, Any]:
    """Every row's scores from its select and report evaluations; its speed measured here."""
    out_dir, results = Path(out_dir), Path(results)
    rows = rows or heldout_rows()
    loaded: dict[str, dict[float, dict[str, dict]]] = {}  # row -> target -> split -> result
    for row in rows:
        for target in row.targets:
            for split in SPLITS:
                p = row.eval_path(split, target, results)
                if not p.is_file():
                    continue
                res = _result(json.loads(p.read_text()), target, row.static)
                if res is not None:
                    loaded.setdefault(row.name, {}).setdefault(target, {})[split] = {**res, "_path": str(p)}
    have = [(row, t) for row in rows for t in row.targets if "report" in loaded.get(row.name, {}).get(t, {})]
    missing = [f"{row.name} {t:g}x" for row in rows for t in row.targets if (row, t) not in have]
    # an adaptive row's budgets follow its own model's confidence, so it is timed on that model; a
    # local run that is not on this machine (runs/ is not committed) cannot be timed in this run
    absent = {row.name for row, _ in have if row.adaptive and _local_run_missing(row.model)}
    untimed = [f"{row.name} {t:g}x ({row.model} not present)" for row, t in have if row.name in absent]
    have = [(row, t) for row, t in have if row.name not in absent]
    if not have:
        raise RuntimeError(f"no report evaluations under {results}: run benchmarks/ship_default_e2e.sh first")
    first = loaded[have[0][0].name][have[0][1]]["report"]
    prompts = [o["prompt"] for o in first["outputs"]]
    refs = [o["references"] for o in first["outputs"]]
    timed_prompts = prompts[:batch] if quick else prompts
    repeats = 1 if quick else repeats

    # every distinct timing, gathered first and then measured in interleaved rounds, one base model
    # (and the copies it is timed as) in memory at a time: speedups are ratios within one base
    jobs: dict[tuple, tuple[str, HeldoutRow, dict, float | None]] = {}  # key -> base, row, schedule, threshold

    def job_key(row: HeldoutRow, sched: dict, threshold: float | None) -> tuple:
        if row.adaptive:  # its budgets follow its own model's confidence
            return row.base, row.model, json.dumps(sched, sort_keys=True), threshold
        return row.base, "", json.dumps(sched, sort_keys=True), None

    for row, target in have:
        rep = loaded[row.name][target]["report"]
        jobs.setdefault(job_key(row, rep["schedule"], rep.get("adaptive_threshold")),
                        (row.base, row, rep["schedule"], rep.get("adaptive_threshold")))
    timed: dict[tuple, float] = {}
    full_key: dict[str, tuple] = {}  # base -> the key of its full-depth timing
    num_layers: dict[str, int] = {}
    for base in dict.fromkeys(b for b, *_ in jobs.values()):
        base_llm = LLM.load(base)
        num_layers[base] = L = base_llm.num_layers
        full = HeldoutRow("full", "", base, base=base)
        sched = SkipSchedule.full_depth(L).to_dict()
        full_key[base] = job_key(full, sched, None)
        jobs.setdefault(full_key[base], (base, full, sched, None))
        models: dict[Any, LLM] = {}

        def model_for(row: HeldoutRow, n: int) -> LLM:
            key = row.model if row.adaptive else n
            if key not in models:
                models[key] = (LLM.load(row.model) if row.adaptive else
                               base_llm if n == base_llm.num_layers else timing_model(base, n))
            return models[key]

        runs = {}
        for key, (b, row, sched, threshold) in jobs.items():
            if b != base:
                continue
            n = sched["num_layers"]
            runs[key] = generation_timer(model_for(row, n), timed_prompts,
                                         SkipSchedule.from_dict(sched, None if row.adaptive else n),
                                         new_tokens, batch, adaptive=threshold)
        print(f"timing {len(runs)} schedules on {base}: best of {repeats} interleaved rounds", flush=True)
        timed.update(best_of_interleaved(runs, repeats))
        del base_llm, models, runs

    own_of = {row.name: row.own for row in rows if row.own}
    full_seconds = {base: timed[k] for base, k in full_key.items()}
    table = []
    texts: dict[tuple[str, float], tuple[list[str], list[str]]] = {}
    for row, target in have:
        by_split = loaded[row.name][target]
        rep = by_split["report"]
        sec = timed[job_key(row, rep["schedule"], rep.get("adaptive_threshold"))]
        n = rep["schedule"]["num_layers"]
        L = num_layers[row.base]
        entry = {"method": row.name, "speedup_target": target, "model": row.model, "base": row.base,
                 "num_layers": n, "schedule": rep["schedule"],
                 "decode_layer_speedup": round(rep["decode_layer_speedup"] * (L / n if row.static else 1), 3),
                 "seconds": round(sec, 4), "wall_clock_speedup": round(full_seconds[row.base] / sec, 3),
                 "report": {k: rep.get(k) for k in ("bleu", "rougeL", "bertscore", "names_copied",
                                                      "bleu_many_attributes", "n_many_attributes", "n_examples")},
                 "eval_reports": {s: r["_path"] for s, r in by_split.items()}}
        if rep.get("adaptive_threshold") is not None:
            entry["adaptive_threshold"] = rep["adaptive_threshold"]
        if "select" in by_split:
            sel = by_split["select"]
            entry["select"] = {k: sel.get(k) for k in ("bleu", "names_copied", "decode_layer_speedup", "n_examples")}
        texts[row.name, target] = [o["prompt"] for o in rep["outputs"]], [o["text"] for o in rep["outputs"]]
        table.append(entry)
        print(f"{row.name:40s} {target:g}x  report BLEU {rep['bleu']:.2f}  {sec:.2f} s", flush=True)

    own_1x = {r["method"]: r for r in table if r["speedup_target"] == 1.0}
    ref = own_1x.get(REFERENCE)
    for r in table:
        # an inference-time variant (adaptive budgets) is kept against its model's 1x
        own_name = own_of.get(r["method"], r["method"])
        own = own_1x.get(own_name)
        if own is not None:
            r["report"]["bleu_kept_own"] = round(r["report"]["bleu"] / own["report"]["bleu"], 4)
            r["report"]["bleu_kept_own_95ci"] = paired_interval(texts, (r["method"], r["speedup_target"]),
                                                                (own_name, 1.0), refs)["ratio"]
            if own["report"].get("names_copied") and r["report"].get("names_copied") is not None:
                r["report"]["names_kept_own"] = round(r["report"]["names_copied"] / own["report"]["names_copied"], 4)
            if "select" in r and "select" in own:
                r["select"]["bleu_kept_own"] = round(r["select"]["bleu"] / own["select"]["bleu"], 4)
        if ref is not None and r["base"] == ref["base"]:
            r["report"]["bleu_vs_reference"] = round(r["report"]["bleu"] / ref["report"]["bleu"], 4)
    report = {
        "title": "Quality on held-out restaurant names (e2e-heldout report part) vs measured wall-clock speedup",
        "data": first.get("data", "../shared/data/e2e/devset.csv"), "n_examples": len(prompts),
        "splits": {"select": "3 restaurant names, 73 MRs: every choice was made here",
                   "report": "5 restaurant names, 76 MRs: scored once per shipped candidate, never chosen on"},
        "settings": {"new_tokens": new_tokens, "batch": batch, "repeats": repeats, "ignore_eos": True,
                     "timing": "best_of_interleaved", "threads": torch.get_num_threads(), "torch": torch.__version__,
                     "python": platform.python_version(), "quick": quick},
        "full_depth_seconds": {k: round(v, 4) for k, v in full_seconds.items()},
        "machine": machine_info(),
        "commands": ["benchmarks/quality_heldout.sh", "skipdecode bench --quality"],
        "not_yet_measured": missing,
        "not_timed": untimed,
        "results": table,
        "seed_spread": seed_spread(results, seed_groups, seed_references),
    }
    atomic.write_text(out_dir / "quality.json", json.dumps(report, indent=2) + "\n")
    atomic.write_text(out_dir / "quality.md", render_markdown(report))
    plot(report, out_dir / "quality.png", headline=True)
    plot(report, out_dir / "quality-appendix.png", headline=False)
    return report


def _timing(s: dict) -> str:
    """How each time was taken (older reports took the median of sequential repeats)."""
    if s.get("timing") == "best_of_interleaved":
        return f"best of {s['repeats']} interleaved rounds (every schedule once per round)"
    return f"median of {s['repeats']}"


def render_markdown(rep: dict) -> str:
    m, s = rep["machine"], rep["settings"]
    lines = [f"# {rep['title']}", "",
             f"E2E devset split by restaurant name (`e2e-heldout`): {rep['splits']['report']} (the headline "
             f"columns); {rep['splits']['select']}. Every trained row learns from the train part only (no MR of "
             "either part). Greedy, multi-reference BLEU (sacrebleu). Speed: the report prompts in batches of "
             f"{s['batch']}, {s['new_tokens']} new tokens each (EOS ignored), {_timing(s)}, prompt to "
             "last token, relative to the same base model at full depth. "
             f"CPU: {m.get('cpu')}, {s['threads']} threads, torch {s['torch']}.", "",
             "Kept figures carry 95% intervals from a paired bootstrap over the MRs. \"names right\" is the share "
             "of outputs that spell the restaurant's name as the input does; \">=6 attr.\" is BLEU on the MRs "
             "with 6 or more attributes.", "",
             "| method | target | layers fewer | wall-clock speedup | report BLEU | kept of own 1x "
             "| vs reference 1x | >=6 attr. BLEU | names right | names kept | select BLEU | select kept |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rep["results"]:
        rp, sel = r["report"], r.get("select", {})
        lines.append(
            f"| {r['method']} | {r['speedup_target']:g}x"
            + (f" (threshold {r['adaptive_threshold']:.3f})" if "adaptive_threshold" in r else "")
            + f" | {r['decode_layer_speedup']:.2f}x | {r['wall_clock_speedup']:.2f}x | {rp['bleu']:.2f} | "
            f"{_kept(rp.get('bleu_kept_own'), rp.get('bleu_kept_own_95ci'), r['speedup_target'] == 1.0)} | "
            f"{_kept(rp.get('bleu_vs_reference'), None, True)} | "
            f"{'-' if rp.get('bleu_many_attributes') is None else format(rp['bleu_many_attributes'], '.2f')} | "
            f"{_percent(rp.get('names_copied'))} | {_kept(rp.get('names_kept_own'), None, True)} | "
            f"{'-' if sel.get('bleu') is None else format(sel['bleu'], '.2f')} | "
            f"{_kept(sel.get('bleu_kept_own'), None, True)} |")
    spread = rep.get("seed_spread") or []
    if spread:
        lines += ["", "## Recipes and their full-depth-only references, by seed", "",
                  "Trained on one GPU (`skipdecode train --device cuda`: `benchmarks/quality_heldout_gpu.sh`, "
                  "`benchmarks/screen_weights_gpu.sh`, `benchmarks/screen_seeds_gpu.sh`) at seed 0, or N for a run "
                  "named -seedN (`--seed`: data order, schedule draws, LoRA init; the split stays fixed); "
                  "`default-e2e-names-aug-1800` is the shipped recipe's seed-0 run trained on the CPU, `default-e2e` "
                  "its seed-2 run (shipped). Each scored as above; of the shipped recipe's runs, those not shipped are "
                  "scored on select only. With several seeds the range between them is the noise floor of comparing two single "
                  "runs.", "",
                  "| recipe | split | target | runs (eval-SPLIT-RUN.json) | BLEU per run | mean (min-max) "
                  "| kept of own 1x per run | mean kept | names right per run |",
                  "|---|---|---:|---|---|---|---|---:|---|"]
        for g in spread:
            b, k = g["bleu_stats"], g["kept_own_stats"]
            lines.append(
                f"| {g['recipe']} | {g['split']} | {g['speedup_target']:g}x | {' / '.join(g['seeds'])} | "
                + " / ".join(f"{x:.2f}" for x in g["bleu"])
                + (f" | {b['mean']:.2f} ({b['min']:.2f}-{b['max']:.2f}) | " if len(g["bleu"]) > 1 else " | - | ")
                + (" / ".join(f"{100 * x:.1f}%" for x in g["kept_own"]) if g["speedup_target"] != 1.0 else "-")
                + f" | {'-' if k is None or g['speedup_target'] == 1.0 else format(100 * k['mean'], '.1f') + '%'} | "
                + " / ".join(_percent(x) for x in g["names_copied"]) + " |")
        one = {(g["recipe"], g["split"]): g["bleu_stats"] for g in spread if g["speedup_target"] == 1.0}
        held_to = {g["recipe"]: g.get("reference") for g in spread}
        for split in SPLITS:
            for (recipe, sp), st in one.items():
                ref = one.get((held_to[recipe], split))
                if sp == split and ref:
                    single = st["min"] == st["max"] and ref["min"] == ref["max"]
                    lines += ["", f"{split}, 1x: {recipe} {st['mean']:.2f} {'' if single else 'mean '}BLEU against "
                                  f"the full-depth-only reference's {ref['mean']:.2f} (difference "
                                  f"{st['mean'] - ref['mean']:+.2f}" + ("" if single else
                                  f"; seed ranges {st['min']:.2f}-{st['max']:.2f} and {ref['min']:.2f}-{ref['max']:.2f}")
                                  + ")."]
    if rep.get("not_timed"):
        lines += ["", "Scored but not timed in this run (an adaptive row is timed on its own model, a local run "
                      "not on this machine): " + ", ".join(rep["not_timed"]) + "."]
    if rep["not_yet_measured"]:
        lines += ["", "Not yet measured (no report evaluation committed): " + ", ".join(rep["not_yet_measured"])
                  + "."]
    lines += ["", "Commands:", "", "```"] + rep["commands"] + ["```", ""]
    return "\n".join(lines)


def plot(rep: dict, path: Path, headline: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5 if headline else 10.5, 5))
    methods = list(dict.fromkeys(r["method"] for r in rep["results"]))
    if headline:
        methods = [m for m in methods if m in HEADLINE][:5]
    colors = plt.get_cmap("tab10").colors
    for i, name in enumerate(methods):
        rows = sorted((r for r in rep["results"] if r["method"] == name), key=lambda r: r["wall_clock_speedup"])
        pts = [(r["wall_clock_speedup"], r["report"]["bleu"]) for r in rows]
        if name in (REFERENCE, SEED_REFERENCE):  # 1x only: a level to compare with
            ax.axhline(pts[0][1], color="grey" if name == REFERENCE else colors[i % 10], ls="--", lw=1, label=name)
            continue
        shipped = name in (SHIPPED, SHIPPED_05B)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="*" if shipped else "o",
                lw=2.2 if shipped else 1.2, ms=10 if shipped else 5, color=colors[i % 10], label=name)
        for r, (x, y) in zip(rows, pts):
            if r["speedup_target"] in (2.0, 3.0, 5.0):
                ax.annotate(f"{r['speedup_target']:g}x", (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7, color=colors[i % 10])
    ax.set_xlabel("measured wall-clock speedup (vs the same base model at full depth)")
    ax.set_ylabel("BLEU, report split (names never chosen on)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.set_title(("" if headline else "appendix: every row, ") + f"E2E e2e-heldout report, {rep['machine'].get('cpu')}",
                 fontsize=9)
    fig.tight_layout()
    atomic.write_file(path, lambda f: fig.savefig(f, dpi=110, format="png", bbox_inches="tight"))
    plt.close(fig)
