"""``skipdecode bench --lossless``: lossless mode (the skip path drafts, full
depth verifies) against full depth, plain skipping and transformers' assisted
generation with ``assistant_early_exit``, in one run.

Prompts: E2E meaning representations of held-out restaurant names (the
``e2e-names`` validation split, never trained on), chat template, greedy,
ending on EOS or ``max_new_tokens``. Lossless greedy output equals full
depth's, so both generate the same tokens and tokens/s compare directly.

- **batch 1**: per prompt, decode time = the engine's time from the first
  token to the last (the prompt excluded), the best of ``repeats`` runs;
  decode tokens/s = tokens after the first / decode time, over all prompts.
  Rows: full depth, plain skipping at each target, lossless at each target,
  draft length K and draft confidence (a round stops drafting after a draft
  its pass gave less than that probability; 0 = never early). Every row runs
  on two disjoint prompt sets of the split: *tuning* prompts, where the
  setting with the best tokens/s is chosen, and *report* prompts, whose
  figures are the ones shown (so the chosen row's figure carries no
  best-of-many selection).
- **batches of 4 and 8**: whole-generation tokens/s (prefill included),
  full depth against the chosen lossless setting.
- **serving**: the engine under Poisson arrivals (``bench.engine.serve``),
  full depth against the chosen lossless setting; sustainable throughput is
  the best tokens/s among rates whose p99 time per output token is <= 100 ms.
- **acceptance** (where skipping loses): every draft full depth judged (each
  accepted one and the first rejected one of a round) in the batch-1 runs, with
  its generated position, the budget of the pass that drafted it, and whether
  full depth's token there is *copied* (its id occurs in the prompt's meaning
  representation, e.g. a name) or not.
- **transformers**: ``generate`` at batch 1, plain and with
  ``assistant_early_exit`` at several exit layers, on the same weights (fp32),
  one run per prompt.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .. import atomic
from ..engine import EngineConfig
from ..llm import LLM
from .decode import machine_info
from .engine import _arrivals, serve

RESULTS = Path("benchmarks/results")
POS_BUCKETS = [(0, 4), (4, 8), (8, 16), (16, 32), (32, 10**9)]
TPOT_LIMIT_MS = 100.0


def _best(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        r = fn()
        dt = time.perf_counter() - t
        if dt < best:
            best, out = dt, r
    return best, out


def batch1(llm: LLM, ids: list[list[int]], max_new_tokens: int, repeats: int, **kw) -> dict:
    """Each prompt alone on the engine, the best of ``repeats`` runs: decode
    tokens/s over all prompts (first token to last, the prompt excluded), and the outputs."""
    decode_s, tokens, outs = 0.0, 0, []
    for x in ids:
        best = None
        for _ in range(repeats):
            eng = llm.engine()
            eng.add(llm.request(eng, x, max_new_tokens=max_new_tokens, **kw))
            (o,) = eng.run()
            t = o.finish_time - o.first_token_time
            if best is None or t < best[0]:
                best = (t, o)
        decode_s += best[0]
        tokens += len(best[1].token_ids) - 1
        outs.append(best[1])
    return {"decode_tokens": tokens, "decode_seconds": round(decode_s, 3),
            "decode_tokens_per_s": round(tokens / decode_s, 2), "outs": outs}


def _label(bucket: tuple[int, int]) -> str:
    lo, hi = bucket
    return f"{lo}-{hi - 1}" if hi < 10**9 else f"{lo}+"


def acceptance_tables(records: list[tuple[float, int, int, bool, bool]]) -> dict:
    """``records``: (target, position, budget, accepted, copied) per draft ->
    acceptance rate and count by position bucket, by budget and by token kind, per target."""
    out: dict = {}
    for target in sorted({r[0] for r in records}):
        rs = [r for r in records if r[0] == target]

        def table(key, label=str) -> dict:
            groups: dict = {}
            for r in rs:
                groups.setdefault(key(r), []).append(r[3])
            return {label(k): {"drafts": len(v), "acceptance": round(sum(v) / len(v), 4)}
                    for k, v in sorted(groups.items())}

        out[f"{target:g}x"] = {
            "drafts": len(rs), "acceptance": round(sum(r[3] for r in rs) / len(rs), 4) if rs else None,
            "by_position": table(lambda r: next(b for b in POS_BUCKETS if b[0] <= r[1] < b[1]), _label),
            "by_budget": table(lambda r: r[2]),
            "by_kind": table(lambda r: "copied" if r[4] else "other"),
        }
    return out


def _hf_peer(path: Path, tokenizer, ids: list[list[int]], new_tokens: int, exits: list[int], repeats: int) -> dict:
    """transformers ``generate`` at batch 1, plain and with ``assistant_early_exit``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = {}
    for exit_layer in [None] + exits:
        kw = {} if exit_layer is None else {"assistant_early_exit": exit_layer}
        decode_s, tokens, texts = 0.0, 0, []
        for x in ids:
            inp = torch.tensor([x])

            def gen(n: int):
                with torch.inference_mode():
                    return model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                          max_new_tokens=n, pad_token_id=pad, **kw)

            t1, _ = _best(lambda: gen(1), repeats)
            tn, out = _best(lambda: gen(new_tokens), repeats)
            n = out.shape[1] - len(x)
            decode_s += max(tn - t1, 0.0)
            tokens += n - 1
            texts.append(out[0, len(x):].tolist())
        rows["transformers" if exit_layer is None else f"transformers-early-exit-{exit_layer}"] = {
            "engine": "transformers", "assistant_early_exit": exit_layer, "decode_tokens": tokens,
            "decode_seconds": round(decode_s, 3), "decode_tokens_per_s": round(tokens / decode_s, 2),
            "token_ids": texts}
    return rows


def serving_sweep(llm: LLM, pool: list, rows: dict[str, dict], rates: list[float], n_req: int,
                  max_new_tokens: int, max_num_seqs: int = 32) -> dict:
    """Per row (``LLM.request`` keyword arguments): the serving engine under Poisson arrivals
    (seed 0) at each rate, ``n_req`` requests drawn in turn from ``pool``; sustainable
    throughput is the best tokens/s at a rate whose p99 TPOT is <= ``TPOT_LIMIT_MS``."""
    out = {}
    for name, kw in rows.items():
        runs = []
        for rate in rates:
            eng = llm.engine()
            reqs = [llm.request(eng, pool[r % len(pool)].prompt, max_new_tokens=max_new_tokens, request_id=str(r),
                                **kw) for r in range(n_req)]
            res = serve(llm, reqs, _arrivals(n_req, rate, seed=0), "continuous", max_num_seqs)
            runs.append({"rate": "inf" if rate == float("inf") else rate,
                         **{k: res[k] for k in ("tokens_per_s", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_s",
                                                "generated_tokens")}})
        ok = [r for r in runs if r["tpot_p99_ms"] <= TPOT_LIMIT_MS]
        top = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
        out[name] = {"runs": runs, "sustainable_tokens_per_s": top["tokens_per_s"] if top else None,
                     "sustainable_rate": top["rate"] if top else None}
    return out


def serving_table(serving: dict) -> list[str]:
    """Markdown rows of a ``serving_sweep``: one per row and rate."""
    lines = ["| row | rate (req/s) | tok/s | TPOT p50 ms | TPOT p99 ms |", "|---|---|---|---|---|"]
    for name, s in serving.items():
        if isinstance(s, dict):  # a ratio stored beside the rows is no row
            lines += [f"| {name} | {r['rate']} | {r['tokens_per_s']:.1f} | {r['tpot_p50_ms']:.1f} | "
                      f"{r['tpot_p99_ms']:.1f} |" for r in s["runs"]]
    return lines


def run_lossless_bench(model: str = "default-e2e", quick: bool = False, out_dir: str | os.PathLike = RESULTS,
                       dtypes: tuple[str, ...] = ("float32", "int8"), n_prompts: int | None = None,
                       max_new_tokens: int = 48, speedups: tuple[float, ...] = (2.0, 3.0, 5.0),
                       draft_tokens: tuple[int, ...] = (2, 4, 6, 8),
                       draft_confidences: tuple[float, ...] = (0.0, 0.6), repeats: int | None = None,
                       hf_exits: tuple[int, ...] = (8, 15), with_transformers: bool = True) -> dict:
    from ..data import load_task, parse_mr

    n_prompts = n_prompts or (4 if quick else 12)
    repeats = repeats or (1 if quick else 2)
    if quick:
        speedups, draft_tokens, hf_exits = speedups[:2], draft_tokens[:2], hf_exits[:1]
    pool = load_task("e2e-names").eval_items("validation")  # the serving runs draw from all of it
    items = pool[:max(n_prompts, 8)]  # report prompts (and the batches of 4 and 8)
    tune_items = pool[n_prompts:2 * n_prompts]  # tuning prompts: the setting is chosen here
    default_dtypes = tuple(dtypes) == ("float32", "int8")
    command = "skipdecode bench --lossless" + "".join(f" --dtype {d}" for d in dtypes if not default_dtypes) \
        + ("" if Path(out_dir) == Path(RESULTS) else f" --out-dir {out_dir}") + (" --quick" if quick else "")
    report: dict = {"machine": machine_info(), "command": command, "model": model, "max_new_tokens": max_new_tokens,
                    "prompts": n_prompts, "split": "e2e-names validation (held-out restaurant names)",
                    "tuning_prompts": len(tune_items),
                    "repeats": repeats, "tpot_limit_ms": TPOT_LIMIT_MS,
                    "draft_batch_limit": EngineConfig().draft_batch_limit, "dtypes": {}}
    for dtype in dtypes:
        llm = LLM.load(model, dtype=dtype)
        L = llm.num_layers
        ids = [llm.encode(it.prompt) for it in items]
        tune_ids = [llm.encode(it.prompt) for it in tune_items]
        mr_ids = [set(llm.tokenizer.encode(", ".join(v for _, v in parse_mr(it.group)), add_special_tokens=False))
                  for it in items]
        llm.generate(items[0].prompt, max_new_tokens=4)  # warm-up (kernels, allocator)

        def measure(**kw) -> dict:
            """A row on the report prompts, with its tokens/s on the tuning prompts."""
            tune = batch1(llm, tune_ids, max_new_tokens, repeats, **kw)
            return dict(batch1(llm, ids[:n_prompts], max_new_tokens, repeats, **kw),
                        tuning_decode_tokens_per_s=tune["decode_tokens_per_s"])

        rows: dict = {"1x": dict(measure(), kind="full depth", target=1.0, draft_tokens=None)}
        full_ids = [o.token_ids for o in rows["1x"]["outs"]]
        drafts = lambda outs, key: sum(getattr(o.draft, key) for o in outs)  # noqa: E731
        records = []
        for sp in speedups:
            rows[f"skip {sp:g}x"] = dict(measure(speedup=sp), kind="skip", target=sp, draft_tokens=None)
            for k in draft_tokens:
                for c in draft_confidences:
                    r = measure(speedup=sp, lossless=True, draft_tokens=k, draft_confidence=c)
                    outs = r["outs"]
                    drafted, accepted = drafts(outs, "drafted"), drafts(outs, "accepted")
                    work = drafts(outs, "draft_layers") + drafts(outs, "verify_layers")
                    rows[f"lossless {sp:g}x K={k}" + (f" c={c:g}" if c else "")] = dict(
                        r, kind="lossless", target=sp, draft_tokens=k, draft_confidence=c, drafted=drafted,
                        accepted=accepted, acceptance=round(accepted / max(drafted, 1), 4),
                        layer_work_vs_full_depth=round(work / max(L * sum(len(o.token_ids) - 1 for o in outs), 1), 3),
                        identical_to_full_depth=sum(o.token_ids == f for o, f in zip(outs, full_ids)))
                    if k == max(draft_tokens) and c == 0:  # the acceptance study: drafts reach furthest here
                        for i, o in enumerate(outs):
                            records += [(sp, pos, budget, ok, o.token_ids[pos] in mr_ids[i])
                                        for pos, budget, ok in o.draft.acceptance if pos < len(o.token_ids)]
        base, tune_base = rows["1x"]["decode_tokens_per_s"], rows["1x"]["tuning_decode_tokens_per_s"]
        for r in rows.values():
            r["vs_1x"] = round(r["decode_tokens_per_s"] / base, 3)
            r["tuning_vs_1x"] = round(r["tuning_decode_tokens_per_s"] / tune_base, 3)
            r.pop("outs")
        best = max((k for k in rows if rows[k]["kind"] == "lossless"),
                   key=lambda k: rows[k]["tuning_decode_tokens_per_s"])
        choice = {"row": best, "target": rows[best]["target"], "draft_tokens": rows[best]["draft_tokens"],
                  "draft_confidence": rows[best]["draft_confidence"]}

        # batches of 4 and 8: whole-generation tokens/s, full depth vs the chosen lossless setting
        # (lossless requests draft only while at most EngineConfig.draft_batch_limit requests run)
        batches = {}
        lossless_kw = dict(speedup=choice["target"], lossless=True, draft_tokens=choice["draft_tokens"],
                           draft_confidence=choice["draft_confidence"])
        for bs in (4, 8):
            prompts = [it.prompt for it in items[:bs]]
            res = {}
            for name, kw in (("1x", {}), (best, lossless_kw)):
                t, outs = _best(lambda: llm.generate(prompts, max_new_tokens=max_new_tokens, **kw), repeats)
                n = sum(o.new_tokens for o in outs)
                res[name] = {"tokens": n, "seconds": round(t, 3), "tokens_per_s": round(n / t, 2),
                             "token_ids": [o.token_ids for o in outs]}
            same = sum(a == b for a, b in zip(res["1x"].pop("token_ids"), res[best].pop("token_ids")))
            res[best]["vs_1x"] = round(res[best]["tokens_per_s"] / res["1x"]["tokens_per_s"], 3)
            res[best]["identical_to_full_depth"] = same
            batches[str(bs)] = res

        # serving: Poisson arrivals, full depth vs lossless
        serving = {}
        if dtype == "float32":
            n_req = 8 if quick else 32
            rates = [2.0, float("inf")] if quick else [2.0, 4.0, 8.0, float("inf")]
            serving = serving_sweep(llm, pool, {"1x": {}, best: lossless_kw}, rates, n_req, max_new_tokens)
            a, b = serving["1x"]["sustainable_tokens_per_s"], serving[best]["sustainable_tokens_per_s"]
            serving["lossless_vs_1x"] = round(b / a, 3) if a and b else None

        peer = {}
        if dtype == "float32" and with_transformers:
            # one run per prompt: its early-exit rows take minutes each, and they are far behind
            peer = _hf_peer(llm.path, llm.tokenizer, ids[:n_prompts], max_new_tokens, list(hf_exits), 1)
            for r in peer.values():
                r["identical_to_full_depth"] = sum(a == b for a, b in zip(r.pop("token_ids"), full_ids))
            best_hf = max(peer.values(), key=lambda r: r["decode_tokens_per_s"])
            choice["vs_best_transformers"] = round(rows[best]["decode_tokens_per_s"] / best_hf["decode_tokens_per_s"],
                                                   3)
        report["dtypes"][dtype] = {"batch1": rows, "choice": choice, "batches": batches, "serving": serving,
                                   "transformers": peer, "acceptance": acceptance_tables(records)}
        del llm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "lossless.json", json.dumps(report, indent=1) + "\n")
    atomic.write_text(out / "lossless.md", render_markdown(report))
    plot(report, out / "lossless.png")
    return report


def render_markdown(rep: dict) -> str:
    m = rep["machine"]
    lines = [
        "# Lossless mode: the skip path drafts, full depth verifies",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, torch threads {m['torch_threads']}; {m['date']}",
        f"- Versions: python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"skipdecode {m['skipdecode']}",
        f"- Model `{rep['model']}`; {rep['prompts']} prompts of the {rep['split']}; chat template; greedy; up to "
        f"{rep['max_new_tokens']} new tokens, ending on EOS; best of {rep['repeats']} runs per prompt.",
        f"- Every batch-1 row also runs on {rep.get('tuning_prompts', 0)} other prompts of the split (*tuning*); "
        "the lossless setting is chosen there, and the figures shown are the report prompts'. "
        "`K`: drafts per round; `c`: a round stops drafting after a draft its pass gave less than this probability.",
        f"- Command: `{rep.get('command', 'skipdecode bench --lossless')}`"
        + (" (`make bench-lossless`)." if rep.get("command", "skipdecode bench --lossless") == "skipdecode bench --lossless"
           else "."),
        "",
    ]
    for dtype, d in rep["dtypes"].items():
        lines += [f"## {dtype}", "", "### Batch 1: decode tokens/s", "",
                  "| row | decode tok/s | vs 1x | vs 1x (tuning) | acceptance | layer work vs full depth | "
                  "identical to 1x |", "|---|---|---|---|---|---|---|"]
        for name, r in d["batch1"].items():
            ident = f"{r['identical_to_full_depth']}/{rep['prompts']}" if "identical_to_full_depth" in r else ""
            tune = f"{r['tuning_vs_1x']:.2f}x" if "tuning_vs_1x" in r else ""
            lines.append(f"| {name} | {r['decode_tokens_per_s']:.1f} | {r['vs_1x']:.2f}x | {tune} | "
                         f"{r.get('acceptance', '')} | {r.get('layer_work_vs_full_depth', '')} | {ident} |")
        c = d["choice"]
        lines += ["", f"Lossless setting chosen on the tuning prompts: **{c['row']}** "
                  f"({d['batch1'][c['row']]['vs_1x']:.2f}x full depth on the report prompts"
                  + (f", {c['vs_best_transformers']:.2f}x the best transformers row" if "vs_best_transformers" in c
                     else "") + ").", "", "### Batches of 4 and 8: tokens/s (whole generation, prefill included)", "",
                  f"Lossless requests draft only while at most {rep['draft_batch_limit']} requests run "
                  "(`EngineConfig.draft_batch_limit`); beyond that they decode at full depth.", "",
                  "| batch | row | tok/s | vs 1x | identical to 1x |", "|---|---|---|---|---|"]
        for bs, res in d["batches"].items():
            for name, r in res.items():
                ident = f"{r['identical_to_full_depth']}/{bs}" if "identical_to_full_depth" in r else ""
                lines.append(f"| {bs} | {name} | {r['tokens_per_s']:.1f} | {r.get('vs_1x', 1.0):.2f}x | {ident} |")
        if d["serving"]:
            lines += ["", f"### Serving engine, Poisson arrivals (sustainable: p99 TPOT <= {rep['tpot_limit_ms']:g} ms)",
                      ""] + serving_table(d["serving"])
            lines += ["", "Sustainable tokens/s: " + ", ".join(
                f"{n} {s['sustainable_tokens_per_s']}" for n, s in d["serving"].items() if n != "lossless_vs_1x")
                + f"; lossless / 1x = {d['serving']['lossless_vs_1x']}."]
        if d["transformers"]:
            lines += ["", "### transformers at batch 1 (fp32, same weights, one run per prompt)", "",
                      "| row | decode tok/s | identical to 1x |", "|---|---|---|"]
            for name, r in d["transformers"].items():
                lines.append(f"| {name} | {r['decode_tokens_per_s']:.1f} | {r['identical_to_full_depth']}/"
                             f"{rep['prompts']} |")
        lines += ["", "### Where skipping loses: draft acceptance", ""]
        for target, a in d["acceptance"].items():
            lines += [f"**{target}** ({a['drafts']} drafts, acceptance {a['acceptance']})", "",
                      "| by | group | drafts | acceptance |", "|---|---|---|---|"]
            for by in ("by_position", "by_budget", "by_kind"):
                for g, v in a[by].items():
                    lines.append(f"| {by[3:]} | {g} | {v['drafts']} | {v['acceptance']:.3f} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = rep["dtypes"].get("float32") or next(iter(rep["dtypes"].values()))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, max(4.0, 0.22 * len(d["batch1"]))))
    for target, a in d["acceptance"].items():
        xs = list(a["by_position"])
        ax1.plot(xs, [a["by_position"][x]["acceptance"] for x in xs], marker="o", label=f"drafts at {target}")
    ax1.set_xlabel("generated position")
    ax1.set_ylabel("share of drafts full depth accepts")
    ax1.set_ylim(0, 1)
    ax1.legend()
    ax1.set_title("Acceptance by position")
    names = list(d["batch1"])
    ax2.barh(names, [d["batch1"][n]["vs_1x"] for n in names],
             color=["#888" if d["batch1"][n]["kind"] != "lossless" else "#2a7" for n in names])
    ax2.axvline(1.0, color="k", lw=0.8)
    ax2.set_xlabel("decode tokens/s vs full depth (batch 1)")
    ax2.set_title("Speed (green: lossless)")
    fig.suptitle(f"Lossless mode on {rep['model']}, {rep['machine']['cpu']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
