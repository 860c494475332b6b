"""``skipdecode bench``: decode speed against HF transformers, in one run.

Both engines get the same model, prompts (chat template) and a
fixed number of new tokens (EOS ignored). Decode time is isolated the same way
for both: ``t(N new tokens) - t(1 new token)`` over ``N - 1`` decode steps,
each time the best of several interleaved repeats (timings on shared CPUs are
noisy; the minimum is the least disturbed run of either engine). Speedups are ratios measured in
this run, never against figures from another day.

The cost model the skip measurements are checked against: a decode step costs
``fixed + b * per_layer`` where ``fixed`` (embedding, final norm, LM head) is
measured directly by a step that runs no layer, and ``per_layer`` follows
from the full-depth step. Predicted speedup of a schedule =
``full / (fixed + mean_b * per_layer)``.
"""

from __future__ import annotations

import json
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import atomic
from .. import __version__
from ..generate import generate_tokens
from ..llm import LLM
from ..schedule import SkipSchedule

ATTRS = [
    "name[The Eagle], eatType[coffee shop], food[Japanese], priceRange[less than £20], area[riverside]",
    "name[Alimentum], food[Italian], priceRange[cheap], customer rating[5 out of 5], area[city centre]",
    "name[The Punter], eatType[pub], food[English], familyFriendly[yes], near[Café Sicilia]",
    "name[Zizzi], eatType[restaurant], food[French], priceRange[high], area[riverside], near[The Sorrento]",
    "name[Green Man], food[Chinese], customer rating[average], familyFriendly[no]",
    "name[Fitzbillies], eatType[coffee shop], priceRange[moderate], area[city centre], near[Express by Holiday Inn]",
    "name[The Wrestlers], food[Indian], priceRange[£20-25], customer rating[high], familyFriendly[yes]",
    "name[Browns Cambridge], eatType[restaurant], food[Fast food], area[riverside], near[The Rice Boat]",
]
PROMPTS = [f"Write one sentence describing this restaurant: {a}." for a in ATTRS]


def _best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def machine_info() -> dict:
    import transformers

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "skipdecode": __version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


class _Ours:
    def __init__(self, llm: LLM, ids: list[list[int]]):
        self.llm, self.ids = llm, ids

    def run(self, schedule: SkipSchedule, new_tokens: int) -> None:
        generate_tokens(self.llm.model, self.ids, schedule, new_tokens, eos_token_ids=())

    def fixed_step_seconds(self, repeats: int) -> float:
        """One decode step that runs no layer: embedding + final norm + LM head."""
        net, B = self.llm.model, len(self.ids)
        tok, pos = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)
        with torch.inference_mode():
            f = lambda: net.decode(tok, pos, [None] * net.n_layers, [])  # noqa: E731
            f()
            return _best_time(f, repeats * 5)

    def matmul_step_seconds(self, repeats: int) -> float:
        """Only the matrix multiplications of one full-depth decode step (every
        layer's linears and the LM head, same kernels and shapes, no attention,
        norms or activations): the floor under a full-depth step."""
        net, B = self.llm.model, len(self.ids)
        linears = [m for blk in net.layers for m in (blk.wqkv, blk.wo, blk.w13, blk.w2)] + [net.lm_head]
        xs = [torch.randn(B, 1, m.in_features) for m in linears]
        with torch.inference_mode():
            f = lambda: [m(x) for m, x in zip(linears, xs)]  # noqa: E731
            f()
            return _best_time(f, repeats * 2)


class _HF:
    def __init__(self, path: Path, tokenizer, ids: list[list[int]]):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        P = max(len(x) for x in ids)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.input_ids = torch.tensor([[pad] * (P - len(x)) + x for x in ids])
        self.mask = torch.tensor([[0] * (P - len(x)) + [1] * len(x) for x in ids])
        self.pad = pad

    def run(self, new_tokens: int) -> None:
        with torch.inference_mode():
            self.model.generate(input_ids=self.input_ids, attention_mask=self.mask, do_sample=False,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                pad_token_id=self.pad, eos_token_id=None)


def run_bench(model: str = "default", quick: bool = False, out_dir: str | os.PathLike = "benchmarks/results",
              batch_sizes: list[int] | None = None, speedups: list[float] | None = None,
              new_tokens: int | None = None, with_transformers: bool = True, repeats: int | None = None) -> dict:
    batch_sizes = batch_sizes or [1, 8, 32]
    speedups = speedups or [1.0, 2.0, 3.0, 5.0]
    if 1.0 not in speedups:
        speedups = [1.0] + speedups
    N = new_tokens or (16 if quick else 64)
    R = repeats or (1 if quick else 5)
    llm = LLM.load(model)
    L = llm.num_layers
    # the same engine on oneDNN's linears and torch's norm/attention: what the kernels contribute
    on_kernels = llm.model.kernels is not None
    llm_onednn = LLM.load(model, use_kernels=False) if on_kernels else None
    schedules = {sp: llm.make_schedule(speedup=sp, expected_new_tokens=N) for sp in speedups}
    encoded = [llm.encode(p) for p in PROMPTS]
    settings = {"model": model, "model_path": str(llm.path), "num_layers": L, "new_tokens": N, "repeats": R,
                "quick": quick, "dtype": "float32", "greedy": True, "eos_ignored": True,
                "prompt_tokens": [len(x) for x in encoded],
                "decode_kernels": ("skipdecode CPU kernels (AVX2/FMA)"
                                   + (", one fused call per layer" if llm.model.layers[0].fused_decode else "")
                                   if on_kernels else "oneDNN + torch"),
                "schedules": {str(k): v.to_dict() for k, v in schedules.items()}}
    results = []
    log = lambda m: print(m, flush=True)  # noqa: E731
    for B in batch_sizes:
        ids = [encoded[i % len(encoded)] for i in range(B)]
        ours = _Ours(llm, ids)
        onednn = _Ours(llm_onednn, ids) if llm_onednn else None
        hf = _HF(llm.path, llm.tokenizer, ids) if with_transformers else None
        for sched in schedules.values():  # warm-up
            ours.run(sched, 4)
        if onednn:
            onednn.run(schedules[1.0], 4)
        if hf:
            hf.run(4)
        t_n: dict[str, list[float]] = {}
        t_1: dict[str, list[float]] = {}

        def time_both(key: str, run) -> None:
            """One timing of ``run(N)`` and one of ``run(1)`` under ``key``."""
            for n, store in ((N, t_n), (1, t_1)):
                t = time.perf_counter()
                run(n)
                store.setdefault(key, []).append(time.perf_counter() - t)

        for _ in range(R):  # interleaved rounds so drift hits every system alike
            for sp, sched in schedules.items():
                time_both(f"skipdecode:{sp}", lambda n, s=sched: ours.run(s, n))
            if onednn:
                time_both("skipdecode-onednn:1.0", lambda n: onednn.run(schedules[1.0], n))
            if hf:
                time_both("transformers:1.0", hf.run)
        fixed = ours.fixed_step_seconds(R)
        matmul_ms = ours.matmul_step_seconds(R) * 1000
        rows = {}
        for key in t_n:
            engine, sp = key.split(":")
            dec = min(t_n[key]) - min(t_1[key])  # best of the repeats: the least disturbed run
            ms = dec / (N - 1) * 1000
            sched = schedules[float(sp)] if engine.startswith("skipdecode") else SkipSchedule.full_depth(L)
            rows[key] = {"engine": engine, "batch_size": B, "speedup_target": float(sp),
                         "decode_layer_speedup": round(sched.decode_layer_speedup(N), 4),
                         "decode_tokens_per_s": round(B * (N - 1) / dec, 2), "ms_per_step": round(ms, 2),
                         "prefill_seconds": round(min(t_1[key]), 4)}
        full = rows["skipdecode:1.0"]["ms_per_step"]
        fixed_ms = fixed * 1000
        per_layer = (full - fixed_ms) / L
        for key, r in rows.items():
            if r["engine"] == "skipdecode":
                mean_b = L / r["decode_layer_speedup"]
                predicted = full / (fixed_ms + mean_b * per_layer)
                measured = full / r["ms_per_step"]
                if r["speedup_target"] == 1.0:
                    r["matmul_ms_per_step"] = round(matmul_ms, 2)
                r.update(fixed_ms_per_step=round(fixed_ms, 2), predicted_speedup=round(predicted, 3),
                         measured_speedup=round(measured, 3),
                         measured_over_predicted=round(measured / predicted, 3))
            if "transformers:1.0" in rows:
                r["tokens_per_s_vs_transformers"] = round(
                    r["decode_tokens_per_s"] / rows["transformers:1.0"]["decode_tokens_per_s"], 3)
            results.append(r)
            log(f"B={B:<3} {r['engine']:<17} target {r['speedup_target']:g}x: {r['ms_per_step']:7.2f} ms/step "
                f"{r['decode_tokens_per_s']:8.1f} tok/s  layer-speedup {r['decode_layer_speedup']:.2f}"
                + (f"  measured {r['measured_speedup']:.2f} / predicted {r['predicted_speedup']:.2f}"
                   if "measured_speedup" in r else ""))
        del hf
    report = {"machine": machine_info(), "settings": settings, "results": results}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "bench-quick" if quick else "bench"
    atomic.write_text(out / f"{name}.json", json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    atomic.write_text(out / f"{name}.md", render_markdown(report))
    log(f"wrote {out / name}.json and .md")
    return report


def render_markdown(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    lines = [
        "# Decode speed: skipdecode vs HF transformers",
        "",
        f"Produced by `skipdecode bench{' --quick' if s['quick'] else ''}` on {m['date']}.",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), {m['platform']}",
        f"- Versions: python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"skipdecode {m['skipdecode']}",
        f"- Model: `{s['model']}` ({s['num_layers']} layers), fp32, greedy, {s['new_tokens']} new tokens "
        f"(EOS ignored), row i of a batch gets E2E-style prompt i mod {len(s['prompt_tokens'])} "
        f"({s['prompt_tokens']} tokens with the chat template; left padded for transformers, "
        "each in its own KV slots for skipdecode), "
        f"best of {s['repeats']} interleaved repeats",
        f"- skipdecode decodes on: {s.get('decode_kernels', 'oneDNN + torch')}."
        + (" `skipdecode-onednn` is the same engine with them off (oneDNN linears, torch's norm and "
           "attention), at full depth." if s.get("decode_kernels", "").startswith("skipdecode") else ""),
        "- Decode time = t(N new tokens) - t(1 new token), over N-1 steps, for every engine.",
        "- Predicted speedup: cost model `fixed + b * per_layer`, `fixed` = a measured step that runs "
        "no layer (embedding, final norm, LM head).",
        "",
        "| batch | engine | target | decode-layer speedup | ms/step | decode tok/s | vs transformers | "
        "measured speedup | predicted | measured/predicted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        g = lambda k: (f"{r[k]:.2f}" if isinstance(r.get(k), float) else "")  # noqa: E731
        lines.append(
            f"| {r['batch_size']} | {r['engine']} | {r['speedup_target']:g}x | {r['decode_layer_speedup']:.2f} | "
            f"{r['ms_per_step']:.1f} | {r['decode_tokens_per_s']:.1f} | {g('tokens_per_s_vs_transformers')} | "
            f"{g('measured_speedup')} | {g('predicted_speedup')} | {g('measured_over_predicted')} |")
    bound = [(r, t) for r in report["results"] for t in report["results"]
             if "matmul_ms_per_step" in r and t["engine"] == "transformers" and t["batch_size"] == r["batch_size"]]
    if bound:
        lines += ["", "Full depth against its floor: the matrix multiplications of one step alone (every linear "
                  "and the LM head, same kernels, no attention/norms/activations), measured in this run. "
                  "No engine on these kernels can beat transformers by more than transformers' step over that floor.",
                  "", "| batch | skipdecode ms/step | matmuls alone ms/step | transformers ms/step | "
                  "ratio reached | ratio bound (transformers / matmuls) |", "|---|---|---|---|---|---|"]
        for r, t in bound:
            lines.append(f"| {r['batch_size']} | {r['ms_per_step']:.1f} | {r['matmul_ms_per_step']:.1f} | "
                         f"{t['ms_per_step']:.1f} | {t['ms_per_step'] / r['ms_per_step']:.2f} | "
                         f"{t['ms_per_step'] / r['matmul_ms_per_step']:.2f} |")
    lines += ["", "Schedules (solved for the new-token count above):", ""]
    for sp, d in s["schedules"].items():
        lines.append(f"- {float(sp):g}x: budget {d['max_exit_layer']} -> {d['min_exit_layer']} over "
                     f"{d['horizon']} positions, {d['warmup_layers']} warm-up layer(s), mode {d['mode']}")
    return "\n".join(lines) + "\n"
