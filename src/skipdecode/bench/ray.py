"""``skipdecode bench --ray``: one replica against two on Ray Serve, same CPUs.

The same E2E chat load as ``bench --serve`` (streamed by the ``openai`` async
client; every run its own MRs) against ``skipdecode serve --ray`` with one
replica on both cores (2 torch threads) and with two replicas of one core
each. Same model, same total CPUs, same requests.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from .. import atomic
from .decode import machine_info
from .engine import _arrivals
from .serve import _free_port, _load, _start_skipdecode, _stop, _wait_healthy


def run_ray_bench(model: str = "default-e2e", out_dir: str | os.PathLike = "benchmarks/results",
                  rates: list[float] | None = None, n_requests: int = 48, max_tokens: int = 64, speedup: float = 1.0,
                  seed: int = 0) -> dict:
    from ..data import load_task

    task = load_task("e2e")
    mrs = [it.prompt for it in task.eval_items("validation") + task.eval_items("train")]
    rates = rates or [4.0, 8.0, float("inf")]
    layouts = [("1 replica x 2 CPUs", 1, 2.0), ("2 replicas x 1 CPU", 2, 1.0)]
    # each (layout, rate) run its own MRs: nothing comes from a prefix cache of an earlier run
    slices = iter(mrs[i * n_requests:(i + 1) * n_requests] for i in range(len(mrs) // n_requests))
    plan = {(name, rate): next(slices) for name, _, _ in layouts for rate in rates}
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    runs = []
    for name, replicas, cpus in layouts:
        port = _free_port()
        log = logs / "bench-ray.log"
        proc = _start_skipdecode(model, port, log, "--ray", "--num-replicas", str(replicas),
                                 "--replica-cpus", str(cpus))
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc, 600, log)
            asyncio.run(_load(url, "bench", ["Write one sentence describing this restaurant: name[Warm]."] * 4,
                              [0.0] * 4, 8, {"speedup": speedup}))  # warm-up, every replica
            for rate in rates:
                r = asyncio.run(_load(url, "bench", plan[(name, rate)], _arrivals(n_requests, rate, seed),
                                      max_tokens, {"speedup": speedup}))
                r.update(layout=name, replicas=replicas, replica_cpus=cpus,
                         rate=rate if rate != float("inf") else "saturation")
                runs.append(r)
                print(f"{name:<20} rate {r['rate']:>10}: {r['tokens_per_s']:7.1f} tok/s  TTFT p50/p99 "
                      f"{r['ttft_p50_s']:.2f}/{r['ttft_p99_s']:.2f} s  TPOT p50/p99 {r['tpot_p50_ms']:.0f}/"
                      f"{r['tpot_p99_ms']:.0f} ms", flush=True)
        finally:
            _stop(proc)
    settings = {"model": model, "requests_per_run": n_requests, "max_tokens": max_tokens, "speedup": speedup,
                "rates_per_s": [r if r != float("inf") else "saturation" for r in rates], "seed": seed,
                "layouts": [{"name": n, "replicas": k, "replica_cpus": c} for n, k, c in layouts]}
    report = {"machine": machine_info(), "settings": settings, "runs": runs}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic.write_text(out / "ray.json", json.dumps(report, indent=2) + "\n")
    atomic.write_text(out / "ray.md", render_markdown(report))
    print(f"wrote {out / 'ray.json'} and .md", flush=True)
    return report


def render_markdown(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    lines = ["# Ray Serve: one replica against two, same CPUs", "",
             f"Produced by `skipdecode bench --ray` on {m['date']}.", "",
             f"- Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; torch {m['torch']}, "
             f"skipdecode {m['skipdecode']}",
             f"- Model `{s['model']}` at {s['speedup']:g}x, greedy, up to {s['max_tokens']} new tokens; "
             f"{s['requests_per_run']} E2E chat requests per run (each run its own MRs), streamed by the openai "
             "async client through Ray Serve's HTTP proxy; Poisson arrivals, `saturation` = all at once.",
             "", "| layout | rate (req/s) | tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) |",
             "|---|---|---|---|---|"]
    for r in report["runs"]:
        lines.append(f"| {r['layout']} | {r['rate']} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p99_s']:.2f} | {r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} |")
    return "\n".join(lines) + "\n"
