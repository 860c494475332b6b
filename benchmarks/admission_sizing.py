"""Time to size a request's KV slots at admission (benchmarks/results/admission-sizing.json).

On admission the scheduler reserves, per layer, the prompt plus the decode steps that run the
layer (``SkipSchedule.steps_using_layer`` for every layer, up to ``max_new_tokens`` steps). This
times that for SmolLM2's 30 layers at full depth and on a 3x schedule, for 64 and 2048 new
tokens, best of 5. Run from the repository root:
    .venv/bin/python benchmarks/admission_sizing.py [OUT.json]
(with PYTHONPATH=<another checkout>/src it times that checkout's code).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import skipdecode
from skipdecode.bench.decode import machine_info
from skipdecode.schedule import SkipSchedule


def main() -> None:
    rows = []
    for name, s in (("full depth", SkipSchedule.full_depth(30)), ("3x", SkipSchedule(30, 16, 4, horizon=64))):
        for n in (64, 2048):
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                [s.steps_using_layer(layer, n) for layer in range(30)]
                best = min(best, time.perf_counter() - t)
            rows.append({"schedule": name, "max_new_tokens": n, "ms": round(best * 1e3, 3)})
            print(rows[-1], flush=True)
    out = {"layers": 30, "results": rows, "machine": machine_info(),
           "commit": subprocess.run(["git", "-C", str(Path(skipdecode.__file__).parent), "rev-parse", "--short",
                                     "HEAD"], capture_output=True, text=True).stdout.strip(),
           "command": "python benchmarks/admission_sizing.py " + " ".join(sys.argv[1:])}
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/admission-sizing.json")
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
