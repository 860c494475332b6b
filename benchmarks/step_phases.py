"""Where a native decode step's time goes inside the kernels, phase by phase, per weight dtype.

``benchmarks/step_breakdown.py`` splits a step at the Python calls (engine, layer stack, head);
this splits the native step (``LayerStack.greedy``) with the kernels' own clock
(``set_phase_timing``): each layer's norms, its four GEMMs (fused q/k/v, o, fused gate/up,
down), RoPE, attention (the new key/value stored and attended over) and SwiGLU, then the final
norm with the LM head and its argmax ("head"), and what is left of the step ("other": the
embedding row, the RoPE rows, the loop). Each GEMM's weight bytes over its time give the rate it
streams its weights at, against the machine's read bandwidth measured as ``skipdecode bench``
measures it (the fastest reader of a 1 GiB probe, best of a measurement before every run).

A 64-token greedy decode of one E2E prompt (``--rows R``: R prompts, row i gets the benchmark
prompt i mod 8, as ``skipdecode bench`` does) on ``default-e2e`` at full depth (``--speedup S``
for a skip schedule; ``--kv-dtype float16`` for the KV cache ``skipdecode bench --llamacpp
--kv-dtype float16`` compares with), the run with the best step of ``RUNS``. Runs without the clock are
interleaved with the timed ones and their best step is reported too (``untimed_step_ms``): the
clock's own cost is the difference.

Run from the repository root:
    .venv/bin/python benchmarks/step_phases.py OUT.json [--rows R] [--speedup S] [--kv-dtype K] [--dtype D ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from skipdecode import LLM
from skipdecode.bench.decode import PROMPTS, machine_info
from skipdecode.bench.llamacpp import linear_bytes, read_bandwidth_gbs, read_probe, step_bytes
from skipdecode.generate import generate_tokens

sys.path.insert(0, str(Path(__file__).parent))
from kernel_ab import pop_option  # noqa: E402

DTYPES = ("float32", "int8", "int4")
N, RUNS = 64, 6
GEMMS = {"qkv": "wqkv", "o": "wo", "gate_up": "w13", "down": "w2"}  # phase -> the Block linear it runs
LAYER_PHASES = ("norm1", "qkv", "rope", "attention", "o", "norm2", "gate_up", "silu", "down")


def phases(dtype: str, rows: int, speedup: float, probe: torch.Tensor, kv_dtype: str | None = None) -> dict:
    llm = LLM.load("default-e2e", dtype=dtype, kv_dtype=kv_dtype)
    net = llm.model
    k = net._stack_kernels
    if not net.native_greedy(rows) or not hasattr(k, "set_phase_timing"):
        raise SystemExit(f"{dtype}: no native greedy steps at {rows} rows here")
    ids = [llm.encode(PROMPTS[i % len(PROMPTS)]) for i in range(rows)]
    sched = llm.make_schedule(speedup=speedup, expected_new_tokens=N)
    generate_tokens(net, ids, sched, 8, eos_token_ids=())
    best, untimed, bandwidth = None, float("inf"), 0.0
    try:
        for _ in range(RUNS):
            # the read bandwidth of this host moves between runs: measured in every round, the best kept,
            # as skipdecode bench does
            bandwidth = max(bandwidth, read_bandwidth_gbs(repeats=1, probe=probe, module=k))
            k.set_phase_timing(False)
            st = generate_tokens(net, ids, sched, N, eos_token_ids=())[1]
            untimed = min(untimed, st["decode_seconds"] / (N - 1))
            k.set_phase_timing(True)
            k.phase_times(True)
            generate_tokens(net, ids, sched, N, eos_token_ids=())
            t = k.phase_times(True)
            if best is None or t["step"][0] / t["step"][1] < best["step"][0] / best["step"][1]:
                best = t
    finally:
        k.set_phase_timing(False)
    steps = best["step"][1]
    per_step = {p: best[p][0] / steps for p in best}
    layer_calls = best["qkv"][1] / steps  # layers run per step (every row on the same layers)
    block = net.layers[0]  # every block's linears have the same shapes and dtypes
    out = {"dtype": dtype, "rows": rows, "speedup": speedup, "kv_dtype": kv_dtype or "float32",
           "layers_per_step": round(layer_calls, 2),
           "step_ms": round(per_step["step"] * 1e3, 3), "untimed_step_ms": round(untimed * 1e3, 3),
           "read_bandwidth_gb_per_s": round(bandwidth, 1), "phases": {}}
    for p in LAYER_PHASES + ("head",):
        row = {"us_per_step": round(per_step[p] * 1e6, 1), "share": round(per_step[p] / per_step["step"], 4)}
        nbytes = None
        if p in GEMMS:
            nbytes = linear_bytes(getattr(block, GEMMS[p])) * layer_calls
        elif p == "head":
            nbytes = linear_bytes(net.lm_head, net.greedy_approx)
        if nbytes is not None and rows == 1:  # a batch-1 GEMM reads each weight once
            gbs = nbytes / per_step[p] / 1e9
            row.update({"weight_mb_per_step": round(nbytes / 1e6, 2), "gb_per_s": round(gbs, 1),
                        "of_bandwidth": round(gbs / bandwidth, 3)})
        out["phases"][p] = row
    rest = per_step["step"] - sum(per_step[p] for p in LAYER_PHASES + ("head",))
    out["phases"]["other"] = {"us_per_step": round(rest * 1e6, 1), "share": round(rest / per_step["step"], 4)}
    if rows == 1:
        gemm_s = sum(per_step[p] for p in GEMMS)
        gemm_b = sum(out["phases"][p]["weight_mb_per_step"] for p in GEMMS) * 1e6
        out["layer_gemms_gb_per_s"] = round(gemm_b / gemm_s / 1e9, 1)
        out["layer_gemms_of_bandwidth"] = round(gemm_b / gemm_s / 1e9 / bandwidth, 3)
        if speedup == 1.0:  # the whole step's weight bytes over its time, as skipdecode bench gives them
            step_b = step_bytes(llm)
            out["step_weight_mb"] = round(step_b / 1e6, 1)
            out["step_of_bandwidth"] = round(step_b / per_step["step"] / 1e9 / bandwidth, 3)
    return out


def main() -> None:
    args = sys.argv[1:]
    if {"-h", "--help"} & set(args):
        print(__doc__)
        return
    kv_dtype = pop_option(args, "--kv-dtype")
    rows = int(pop_option(args, "--rows") or 1)
    speedup = float(pop_option(args, "--speedup") or 1.0)
    dtypes = []
    while (d := pop_option(args, "--dtype")) is not None:
        dtypes.append(d)
    probe = read_probe()
    results = []
    for dt in dtypes or DTYPES:
        r = phases(dt, rows, speedup, probe, kv_dtype)
        results.append(r)
        print(json.dumps(r), flush=True)
    out = {"model": "default-e2e", "rows": rows, "speedup": speedup, "kv_dtype": kv_dtype or "float32",
           "new_tokens": N, "runs": RUNS,
           "threads": torch.get_num_threads(),
           "machine": machine_info(), "results": results,
           "command": "python benchmarks/step_phases.py " + " ".join(sys.argv[1:])}
    path = Path(args[0] if args else "benchmarks/results/step-phases.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
