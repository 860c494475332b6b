"""``skipdecode bench --engine``: the serving engine under Poisson arrivals.

E2E requests (the held-out meaning representations of ``../shared/data``,
chat template, greedy, up to ``max_new_tokens``, ending on EOS) arrive at
Poisson times at several rates, the last rate being "all at once"
(saturation). Every system serves the same arrivals, in one run:

- ``continuous``: the engine, per-row policy: a request joins the running
  batch at the next step, every request on its own schedule;
- ``shared``: the same engine with the paper's batch-shared policy (one layer
  set per step: the lowest next budget of the batch);
- ``static``: ``generate``-style static waves on the same engine: a wave is
  every request waiting when the previous wave finished (up to the batch
  limit), run to its end; finished rows leave, nobody joins.

Workloads: every request at 1x, 2x or 3x (the checkpoint's trained
schedules), and a mix drawn from {1x, 2x, 3x}. Per run: generated tokens/s
(first arrival to last finish), time to first token and time per output token
(p50/p99; TTFT counted from the scheduled arrival), and how far each request's
achieved decode-layer speedup is from what its own schedule gives for the
same number of tokens.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

from .. import atomic
from ..engine import EngineConfig, layer_needs
from ..llm import LLM
from .decode import machine_info

SYSTEMS = ("continuous", "shared", "static")
PREFILL_TOKENS = 256  # prompt tokens per step of the continuous engine (about 3 E2E prompts)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs) + 0.5) - 1))]


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def serve(llm: LLM, requests: list, arrivals: list[float], system: str, max_num_seqs: int) -> dict:
    """Serve ``requests`` (engine ``Request``s) arriving at ``arrivals`` seconds; wall-clock metrics."""
    # static waves prefill the whole wave in its first step, as ``generate`` does
    cfg = EngineConfig(max_num_seqs=max_num_seqs, kv_slots=8192, policy="shared" if system == "shared" else "per_row",
                       max_prefill_tokens=8192 if system == "static" else PREFILL_TOKENS, prefill_chunk=128)
    eng = llm.engine(cfg)
    order = sorted(range(len(requests)), key=lambda r: arrivals[r])
    done, states = {}, {}
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(order) or eng.has_unfinished():
        now = time.perf_counter() - t0
        admit = system != "static" or not eng.has_unfinished()  # static: a new wave only when idle
        while admit and nxt < len(order) and arrivals[order[nxt]] <= now and \
                (system != "static" or eng.num_waiting < max_num_seqs):
            r = order[nxt]
            st = eng.add(requests[r])
            st.arrival_time = t0 + arrivals[r]  # latency counts from the scheduled arrival
            states[r] = st
            nxt += 1
        if not eng.has_unfinished():
            time.sleep(max(0.0, min(0.05, arrivals[order[nxt]] - (time.perf_counter() - t0))))
            continue
        for o in eng.step():
            if o.finished:
                done[int(o.request_id)] = o
    end = time.perf_counter()
    c = eng.counters
    outs = [done[r] for r in range(len(requests))]
    tokens = sum(len(o.token_ids) for o in outs)
    ttft = [o.first_token_time - o.arrival_time for o in outs]
    tpot = [(o.finish_time - o.first_token_time) / (len(o.token_ids) - 1) for o in outs if len(o.token_ids) > 1]
    e2e = [o.finish_time - o.arrival_time for o in outs]
    L = llm.num_layers
    asked = [requests[r].schedule.decode_layer_speedup(len(o.token_ids)) for r, o in enumerate(outs)]
    got = [o.decode_layer_speedup for o in outs]
    dev = [abs(g / a - 1) for g, a in zip(got, asked)]
    needs = sum(sum(layer_needs(q.schedule, len(q.prompt_token_ids), q.max_new_tokens)) for q in requests)
    unaware = sum((len(q.prompt_token_ids) + q.max_new_tokens - 1) * L for q in requests)
    span = end - (t0 + min(arrivals))
    r3 = lambda x: round(x, 3)  # noqa: E731
    return {"requests": len(outs), "generated_tokens": tokens, "seconds": r3(span),
            "tokens_per_s": round(tokens / span, 2), "requests_per_s": r3(len(outs) / span),
            "ttft_p50_s": r3(_pct(ttft, 50)), "ttft_p99_s": r3(_pct(ttft, 99)),
            "tpot_p50_ms": round(1000 * _pct(tpot, 50), 2), "tpot_p99_ms": round(1000 * _pct(tpot, 99), 2),
            "e2e_p50_s": r3(_pct(e2e, 50)), "e2e_p99_s": r3(_pct(e2e, 99)),
            "mean_decode_layer_speedup": r3(statistics.fmean(got)),
            "mean_asked_speedup": r3(statistics.fmean(asked)),
            "speedup_deviation_mean": round(statistics.fmean(dev), 4), "speedup_deviation_max": round(max(dev), 4),
            "exact_schedule_fraction": r3(sum(d < 1e-9 for d in dev) / len(dev)),
            "mean_decode_rows": round(c["decode_rows"] / max(c["decode_steps"], 1), 2),
            "prefill_seconds": r3(c["prefill_seconds"]), "decode_seconds": r3(c["decode_seconds"]),
            "prompt_tokens_computed": c["prompt_tokens_computed"], "prompt_tokens_cached": c["prompt_tokens_cached"],
            "kv_reserved_vs_unaware": r3(needs / unaware)}


def run_engine_bench(model: str = "default-e2e", quick: bool = False, out_dir: str | os.PathLike = "benchmarks/results",
                     rates: list[float] | None = None, n_requests: int | None = None, max_new_tokens: int = 64,
                     max_num_seqs: int = 32, seed: int = 0, dtype: str = "float32") -> dict:
    from ..data import load_task

    llm = LLM.load(model, dtype=dtype)
    items = load_task("e2e").eval_items("validation")
    N = n_requests or (16 if quick else 48)
    rates = rates or ([4.0, float("inf")] if quick else [1.0, 2.0, 4.0, float("inf")])
    prompts = [items[i % len(items)].prompt for i in range(N)]
    rng = random.Random(seed)
    workloads = {"1x": [1.0] * N, "2x": [2.0] * N, "3x": [3.0] * N,
                 "mixed": [rng.choice([1.0, 2.0, 3.0]) for _ in range(N)]}
    plan = [("continuous", w) for w in workloads] + [("shared", "3x"), ("shared", "mixed")] + \
        [("static", w) for w in ("1x", "3x", "mixed")]
    log = lambda m: print(m, flush=True)  # noqa: E731
    warm = llm.engine()
    for sp in (1.0, 3.0):  # builds the kernels and warms the caches
        warm.add(llm.request(warm, prompts[0], speedup=sp, max_new_tokens=8))
    warm.run()
    runs = []
    probe = llm.engine(EngineConfig(kv_slots=1))  # only validates the requests; each run gets its own engine
    for rate in rates:
        arr = _arrivals(N, rate, seed)
        for system, w in plan:
            reqs = [llm.request(probe, p, speedup=sp, max_new_tokens=max_new_tokens, request_id=str(r))
                    for r, (p, sp) in enumerate(zip(prompts, workloads[w]))]
            m = serve(llm, reqs, arr, system, max_num_seqs)
            m.update(system=system, workload=w, rate=rate if rate != float("inf") else "saturation")
            runs.append(m)
            log(f"rate {m['rate']:>10} {system:<10} {w:<5} {m['tokens_per_s']:7.1f} tok/s  TTFT p50/p99 "
                f"{m['ttft_p50_s']:.2f}/{m['ttft_p99_s']:.2f} s  TPOT p50/p99 {m['tpot_p50_ms']:.0f}/"
                f"{m['tpot_p99_ms']:.0f} ms  rows {m['mean_decode_rows']:.1f}  "
                f"speedup {m['mean_decode_layer_speedup']:.2f}"
                f" (asked {m['mean_asked_speedup']:.2f}, exact {m['exact_schedule_fraction']:.0%})")
    settings = {"model": model, "dtype": dtype, "requests_per_run": N,
                "rates_per_s": [r if r != float("inf") else "saturation" for r in rates],
                "max_new_tokens": max_new_tokens, "max_num_seqs": max_num_seqs, "greedy": True, "eos": True,
                "prompts": "E2E held-out MRs (validation split by MR), chat template", "seed": seed, "quick": quick,
                "prompt_tokens_mean": round(statistics.fmean(len(llm.encode(p)) for p in prompts), 1),
                "engine": {"max_prefill_tokens": PREFILL_TOKENS, "prefill_chunk": 128,
                           "kv_slots_per_layer": 8192, "prefix_cache_blocks": EngineConfig.prefix_cache_blocks},
                "workloads": {w: sorted({f"{s:g}x" for s in v}) for w, v in workloads.items()},
                "schedules": {f"{sp:g}x": llm.make_schedule(speedup=sp).to_dict() for sp in (1.0, 2.0, 3.0)}}
    report = {"machine": machine_info(), "settings": settings, "runs": runs}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = ("engine-quick" if quick else "engine") + ("" if dtype == "float32" else f"-{dtype}")
    atomic.write_text(out / f"{name}.json", json.dumps(report, indent=2) + "\n")
    atomic.write_text(out / f"{name}.md", render_markdown(report, name))
    plot(report, out / f"{name}.png")
    log(f"wrote {out / name}.json, .md and .png")
    return report


def _find(runs, system, workload, rate):
    return next((r for r in runs if r["system"] == system and r["workload"] == workload and r["rate"] == rate), None)


def render_markdown(report: dict, name: str = "engine") -> str:
    m, s, runs = report["machine"], report["settings"], report["runs"]
    rates = s["rates_per_s"]
    sat = rates[-1]
    lines = [
        "# The serving engine under Poisson arrivals",
        "",
        f"Produced by `skipdecode bench --engine{' --quick' if s['quick'] else ''}` on {m['date']}.",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['platform']}",
        f"- Versions: python {m['python']}, torch {m['torch']}, skipdecode {m['skipdecode']}",
        f"- Model: `{s['model']}`, {s.get('dtype', 'float32')} weights, greedy, up to {s['max_new_tokens']} "
        "new tokens (ends on EOS); "
        f"{s['requests_per_run']} requests per run: {s['prompts']} ({s['prompt_tokens_mean']} prompt tokens on "
        f"average); at most {s['max_num_seqs']} running at once; prompt chunks of "
        f"{s['engine']['prefill_chunk']} tokens, {s['engine']['max_prefill_tokens']} per step.",
        "- Arrivals: Poisson at each rate (same seed, same times for every system); `saturation` = all at once.",
        "- Systems: `continuous` = the engine, per-row policy; `shared` = the same engine, one layer set per "
        "step (the paper's batch-shared rule); `static` = static waves (a wave runs to its end before the "
        "next one is admitted).",
        "- TTFT from the scheduled arrival; TPOT = (last token - first token) / (tokens - 1) per request.",
        "- Speedup: mean achieved decode-layer speedup; `asked` = what each request's own schedule gives for "
        "the tokens it generated; `exact` = share of requests that ran exactly their own schedule.",
        "",
        "| rate (req/s) | system | workload | tok/s | req/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | "
        "rows per step | speedup (asked) | exact | KV reserved vs schedule-unaware |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(f"| {r['rate']} | {r['system']} | {r['workload']} | {r['tokens_per_s']:.1f} | "
                     f"{r['requests_per_s']:.2f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | "
                     f"{r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} | {r['mean_decode_rows']:.1f} | "
                     f"{r['mean_decode_layer_speedup']:.2f} ({r['mean_asked_speedup']:.2f}) | "
                     f"{r['exact_schedule_fraction']:.0%} | {r['kv_reserved_vs_unaware']:.2f} |")
    lines += ["", "## The figures", "",
              "Continuous batching against static waves (same workload and arrivals):", "",
              "| rate | workload | continuous / static tok/s | TPOT p99 continuous vs static (ms) | "
              "TTFT p99 continuous vs static (s) |", "|---|---|---|---|---|"]
    for rate in rates:
        for w in ("1x", "3x", "mixed"):
            c, st = _find(runs, "continuous", w, rate), _find(runs, "static", w, rate)
            if c and st:
                lines.append(f"| {rate} | {w} | {c['tokens_per_s'] / st['tokens_per_s']:.2f}x | "
                             f"{c['tpot_p99_ms']:.0f} vs {st['tpot_p99_ms']:.0f} | "
                             f"{c['ttft_p99_s']:.2f} vs {st['ttft_p99_s']:.2f} |")
    c1, c2, c3 = (_find(runs, "continuous", w, sat) for w in ("1x", "2x", "3x"))
    if c1 and c3:
        pre = c1["prefill_seconds"] / (c1["prefill_seconds"] + c1["decode_seconds"])
        lines += ["", f"Skipping at saturation: 2x gives {c2['tokens_per_s'] / c1['tokens_per_s']:.2f}x and 3x "
                  f"{c3['tokens_per_s'] / c1['tokens_per_s']:.2f}x the engine's own full-depth throughput "
                  f"({c3['tokens_per_s']:.1f} vs {c1['tokens_per_s']:.1f} tok/s). At full depth the prompts "
                  f"(full depth by design) took {pre:.0%} of the engine's compute time; skipping only "
                  f"shortens the rest (decode time {c1['decode_seconds']:.1f} s at 1x, {c3['decode_seconds']:.1f} s "
                  f"at 3x: {c1['decode_seconds'] / c3['decode_seconds']:.2f}x)."]
    lines += ["", "Mixed speedups, per-row against batch-shared:", "",
              "| rate | per-row tok/s | shared tok/s | per-row / shared | exact schedules per-row vs shared | "
              "speedup per-row vs shared (asked) |", "|---|---|---|---|---|---|"]
    for rate in rates:
        p, sh = _find(runs, "continuous", "mixed", rate), _find(runs, "shared", "mixed", rate)
        if p and sh:
            lines.append(f"| {rate} | {p['tokens_per_s']:.1f} | {sh['tokens_per_s']:.1f} | "
                         f"{p['tokens_per_s'] / sh['tokens_per_s']:.2f}x | {p['exact_schedule_fraction']:.0%} vs "
                         f"{sh['exact_schedule_fraction']:.0%} | {p['mean_decode_layer_speedup']:.2f} vs "
                         f"{sh['mean_decode_layer_speedup']:.2f} ({p['mean_asked_speedup']:.2f}) |")
    lines += ["", f"Plot: `{name}.png` (throughput and p99 TPOT against the offered rate).", ""]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, rates = report["runs"], report["settings"]["rates_per_s"]
    xs = list(range(len(rates)))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    series = sorted({(r["system"], r["workload"]) for r in runs})
    for system, w in series:
        pts = [_find(runs, system, w, rate) for rate in rates]
        style = {"continuous": "-", "shared": "--", "static": ":"}[system]
        axes[0].plot(xs, [p["tokens_per_s"] for p in pts], style, marker="o", label=f"{system} {w}")
        axes[1].plot(xs, [p["tpot_p99_ms"] for p in pts], style, marker="o", label=f"{system} {w}")
    for ax, title in zip(axes, ("generated tokens/s", "p99 time per output token (ms)")):
        ax.set_xticks(xs, [str(r) for r in rates])
        ax.set_xlabel("offered load (requests/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(f"skipdecode engine, {report['settings']['model']}, {report['machine']['cpu']}")
    fig.tight_layout()
    atomic.write_file(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    plt.close(fig)
