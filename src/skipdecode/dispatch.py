"""Runtime dispatch: which implementation of a linear layer runs, per CPU and row count.

Users' CPUs differ (AVX2 only, AVX-512, AMX), and so does the fastest way to
multiply a few rows by a weight: the compiled kernels' panels win at one
row on some machines, oneDNN's blocked layout at 32 on others. Rather than
guess, each weight shape and dtype is timed once per machine in both forms at
every row-count bucket; the faster is recorded in
``$SKIPDECODE_CACHE/autotune.json`` (keyed by CPU, torch version, kernel source
and thread count) and used from then on. A form that wins no bucket is not
even kept in memory. The library form is oneDNN's blocked layout for fp32 and
bf16 weights (bf16 on AMX / AVX-512-BF16) and torch's int8 weight-only GEMM
for int8; the compiled kernels have panels in all three dtypes.

Whether a layer runs as the compiled kernels' one fused call (norms, RoPE,
attention and all four linears in one kernel, a whole step's layers in one
call) is chosen per bucket from its linears' times (``fused_plan``) and, where
those favour the library, from timing the model's whole layers both ways
(``layers_fused_plan``): what fusing saves besides the linears is then counted.

``SKIPDECODE_AUTOTUNE=0`` skips the timing and uses the compiled kernels up
to 8 rows, the library form above.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # a call with M rows uses the first bucket >= M (else the last)
LIBRARY = {"float32": "onednn", "bfloat16": "onednn", "int8": "int8mm",  # the form that is not ours, per dtype
           "int4": "dense",  # int4 has no library form: without the kernels, dequantized bf16 on torch
           "w8a8": "dense", "w4a8": "dense",  # integer activations: the panels only (model.PackedLinear)
           "w8a16": "dense", "w4a16": "dense"}
PANELS_ONLY = tuple(d for d, lib in LIBRARY.items() if lib == "dense")  # dtypes the compiled panels alone run
# More than the last-level cache of most 2-32 core CPU slices, so timed weights come from memory.
# Not all: some report more (an Intel Xeon in docs/results.md has a 300 MiB L3); there the timings
# are of weights still in L3, as a small or quantized model's weights may also be when it runs.
COLD_BYTES = 96e6
TIMING = 3  # how time_forms measures: part of the cache key, so plans timed another way are timed again
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16", "amx_int8")


_SINGLE_ROW_FORMS = threading.local()  # set while a call must compute each row as a one-row call would


@contextmanager
def single_row_forms():
    """Run every kernel in the form chosen for one row, whatever the row count.

    The autotuner picks forms (compiled panels, oneDNN, torch's int8 GEMM) per
    row-count bucket, and they compute at different precisions: torch's int8
    GEMM rounds activations to bf16, the panels keep fp32. A lossless
    verification (several positions of one request in one call) runs here, so
    each position is computed as a one-row decode step computes it, up to fp32
    summation order (about 1e-6 relative; tests/test_dispatch.py), which keeps
    greedy output equal to 1x's in int8 as in fp32 (benchmarks/results/lossless.md)."""
    prev = getattr(_SINGLE_ROW_FORMS, "on", False)
    _SINGLE_ROW_FORMS.on = True
    try:
        yield
    finally:
        _SINGLE_ROW_FORMS.on = prev


def bucket(rows: int) -> int:
    """Index of the bucket a call with ``rows`` rows belongs to."""
    if getattr(_SINGLE_ROW_FORMS, "on", False):
        return 0
    for i, b in enumerate(BUCKETS):
        if rows <= b:
            return i
    return len(BUCKETS) - 1


@lru_cache(maxsize=1)
def cpu_features() -> dict:
    """The CPU model and the ISA extensions that matter for the kernels here."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "isa": [f for f in ISA_FLAGS if f in flags],
            "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}


def forms(weights: str = "float32") -> tuple[str, str]:
    """The two forms a weight of this dtype can take: the compiled kernels' panels and the library's."""
    return ("hand", LIBRARY[weights])


def int8mm_takes(in_features: int) -> bool:
    """torch's int8 GEMM reads the reduction dimension in blocks of 32 and misreads any other size."""
    return in_features % 32 == 0


def default_plan(hand: bool, weights: str = "float32") -> tuple[str, ...]:
    """Without timing: the compiled kernels up to 8 rows (where they were written to win), the library above."""
    return tuple("hand" if hand and b <= 8 else LIBRARY[weights] for b in BUCKETS)


def choose(timings: dict[str, Sequence[float]]) -> tuple[str, ...]:
    """Per bucket, the form with the lowest time (``timings[form][bucket]``); ties keep the first form."""
    forms = list(timings)
    return tuple(min(forms, key=lambda f: (timings[f][i], forms.index(f))) for i in range(len(BUCKETS)))


def cache_bytes(cpu_dir: Path) -> int:
    """The largest data or unified cache of the highest level listed under a sysfs CPU directory's
    ``cache/index*`` (level, type, size such as ``491520K``); 0 where none is readable."""
    best = (0, 0)
    for d in (cpu_dir / "cache").glob("index*"):
        try:
            level, kind = int((d / "level").read_text()), (d / "type").read_text().strip()
            size = (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        digits, unit = size.rstrip("KMG"), {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        if kind != "Instruction" and digits.isdigit():
            best = max(best, (level, int(digits) * unit))
    return best[1]


@lru_cache(maxsize=1)
def llc_bytes() -> int:
    """The last-level cache's size as Linux reports it for CPU 0 (0 where it does not)."""
    return cache_bytes(Path("/sys/devices/system/cpu/cpu0"))


def _median_times(fns: Sequence[Callable[[], object]], reps: int,
                  before: Callable[[], object] | None = None) -> list[float]:
    """Median seconds per call of each function, their calls interleaved: on a shared machine a burst
    of other work then slows every form alike instead of the one being timed (one form timed after
    the other could pick the slower one: an LM head's int8 form was seen 2x slower that way).
    ``before`` (untimed) runs before every call, the first untimed ones too."""
    for fn in fns:
        for _ in range(2):
            if before is not None:
                before()
            fn()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, times in zip(fns, out):
            if before is not None:
                before()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return [statistics.median(t) for t in out]


def _cold_read(nbytes: int) -> Callable[[], object] | None:
    """For one copy of a weight of ``nbytes`` that fits the last-level cache, a read of 1.5x that
    cache to run before each timed call (the weight then comes from memory, as in a decode step);
    None for a larger weight, which no cache holds between calls."""
    if not 0 < nbytes <= llc_bytes():
        return None
    return torch.ones(int(1.5 * llc_bytes()) // 4).sum


def time_forms(out_features: int, in_features: int, kernel_module, reps: int = 5,
               weights: str = "float32") -> dict[str, list[float]]:
    """Seconds per call of each form at every bucket's row count, on a random weight of this shape:
    fp32 activations in and out, the weight in ``weights`` (float32, bfloat16 or int8). A form
    that cannot take this shape (torch's int8 GEMM, ``int8mm_takes``) or does not run on this CPU
    (oneDNN's bf16 without AVX-512) is timed as infinitely slow."""
    from . import kernels
    from .model import quantize_int8

    # A model's weights stream from memory at every step; one weight timed again and again would
    # sit in the caches and favour the wrong form. Each call takes the next of enough copies to fill
    # COLD_BYTES, at most 32 (a small weight's 32 copies fill less).
    # A weight of COLD_BYTES or more (an LM head) is timed alone, one copy; where it fits the
    # last-level cache, repeated calls would find it there, while a step reads it after every layer
    # has passed through: each of its calls follows a read of 1.5x the cache (cold_read). On an
    # Intel Xeon with a 480 MiB L3 the fp32 head of default-e2e timed warm had oneDNN win at one
    # row; timed cold the panels win there, and full-depth decode steps ran 1.03x faster at one row
    # and 1.08x at 8 with the head on the panels than on oneDNN
    # (benchmarks/results/xeon-amx/head-form-ab.json).
    w = torch.randn(out_features, in_features) * 0.02
    nbytes = w.numel() * {"float32": 4, "bfloat16": 2, "int8": 1}[weights]
    copies = max(1, min(32, int(COLD_BYTES // nbytes)))
    cold_read = _cold_read(nbytes) if copies == 1 else None
    hand, lib = forms(weights)
    if weights == "int8":
        q, sc = quantize_int8(w)
        packed = [(kernels.pack_weight(q), kernels.pack_scales(sc)) for _ in range(copies)]
        library = [(q.clone(), sc) for _ in range(copies)] if int8mm_takes(in_features) else None
        run_lib = lambda x, wl: torch._weight_int8pack_mm(x.bfloat16(), *wl).float()  # noqa: E731
    else:
        dt = torch.bfloat16 if weights == "bfloat16" else torch.float32
        w = w.to(dt)
        packed = [(kernels.pack_weight(w), None) for _ in range(copies)]
        # oneDNN's bf16 reorder raises on CPUs without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT
        has_lib = weights == "float32" or cpu_features()["onednn_bf16"]
        library = [torch.ops.mkldnn._reorder_linear_weight(w.clone(), 32) for _ in range(copies)] if has_lib else None
        run_lib = lambda x, wl: torch.ops.mkldnn._linear_pointwise(  # noqa: E731
            x.to(dt), wl, None, "none", [], "").float()
    # Every copy read once, the forms' copies in turn, before any call is timed: the copies written
    # last (the library's, packed after the panels) would otherwise start in the caches and win the
    # first bucket. On an Intel Xeon the fp32 gate/up weight's panels timed slower at one row than
    # at two that way, oneDNN took the bucket, and the layers of a batch-1 step ran unfused.
    x1 = torch.randn(1, in_features)
    for i in range(copies):
        kernel_module.linear(x1, packed[i][0], None, out_features, packed[i][1])
        if library is not None:
            run_lib(x1, library[i])
    res: dict[str, list[float]] = {hand: [], lib: []}
    from tqdm import tqdm

    for m in tqdm(BUCKETS, desc=f"skipdecode: timing kernels for {out_features}x{in_features} {weights} "
                                f"(once per machine)", unit="size", file=sys.stderr, disable=None, leave=False):
        x = torch.randn(m, in_features)
        n = max(2, min(reps, int(2e8 // max(1, m * in_features * out_features))))  # big shapes: fewer repeats
        nxt = iter(range(10 ** 9))
        def run_hand(panels=packed, x=x, nxt=nxt):
            wp, sp = panels[next(nxt) % copies]
            return kernel_module.linear(x, wp, None, out_features, sp)

        if library is None:
            res[hand].append(_median_times([run_hand], n, cold_read)[0])
            res[lib].append(float("inf"))
        else:
            def run_library(x=x, nxt=iter(range(10 ** 9))):  # its own turn through its copies
                return run_lib(x, library[next(nxt) % copies])
            t_hand, t_lib = _median_times([run_hand, run_library], n, cold_read)
            res[hand].append(t_hand)
            res[lib].append(t_lib)
    return res


def _machine_key(kernel_module) -> str:
    from . import kernels

    src = hashlib.sha1(kernels._SRC.read_bytes()).hexdigest()[:10]
    f = cpu_features()
    forms = (f"{kernels.isa()} a8 {kernels.a8_form()} amx-bf16 {int(kernels.amx_bf16())}"
             f" bf16-dot {int(kernels.bf16_dot())}")  # what the hand form runs
    return (f"{f['cpu']}|torch {torch.__version__}|kernels {src} {forms}|"
            f"threads {torch.get_num_threads()}|timing {TIMING}")


def autotune_file() -> Path:
    from .checkpoint import cache_dir

    return cache_dir() / "autotune.json"


_TUNED: dict[tuple[str, str], dict] = {}


def _measured_once(kernel_module, shape: str, ok: Callable[[object], bool], measure: Callable[[], dict]) -> dict:
    """The autotune cache's entry for ``shape`` on this machine: read when it is there and ``ok``,
    else ``measure()``d (under the cache's lock, so two processes do not both measure) and written."""
    key = _machine_key(kernel_module)
    if (key, shape) in _TUNED:
        return _TUNED[(key, shape)]
    path = autotune_file()

    def cached() -> tuple[dict, dict | None]:
        try:
            table = json.loads(path.read_text()) if path.is_file() else {}
        except (OSError, ValueError):
            table = {}  # a damaged cache is re-measured, never trusted
        entry = table.get(key, {}).get(shape) if isinstance(table.get(key), dict) else None
        return table, entry if ok(entry) else None

    table, entry = cached()
    if entry is None:
        from contextlib import ExitStack

        from . import atomic

        with ExitStack() as held:
            try:
                held.enter_context(atomic.locked(path))
            except OSError:
                pass  # a read-only cache: measure for this process alone
            table, entry = cached()  # another process may have measured it while we waited
            if entry is None:
                entry = measure()
                table.setdefault(key, {})[shape] = entry
                try:
                    atomic.write_text(path, json.dumps(table, indent=1) + "\n")
                except OSError:
                    pass  # a read-only cache: the plan still holds for this process
    _TUNED[(key, shape)] = entry
    return entry


def tune(out_features: int, in_features: int, kernel_module, weights: str = "float32") -> dict:
    """``{"plan": form per bucket, "seconds": {form: [seconds per bucket]}}`` for a weight of this
    shape and dtype on this machine: measured once, then read from the cache."""
    shape = f"{out_features}x{in_features}" + ("" if weights == "float32" else f" {weights}")
    fs = forms(weights)

    def ok(entry) -> bool:
        return isinstance(entry, dict) and len(entry.get("plan", ())) == len(BUCKETS) \
            and set(entry["plan"]) <= set(fs) and all(len(entry.get("seconds", {}).get(f, ())) == len(BUCKETS)
                                                      for f in fs)

    def measure() -> dict:
        timings = time_forms(out_features, in_features, kernel_module, weights=weights)
        return {"plan": list(choose(timings)), "buckets": list(BUCKETS),
                "seconds": {f: [round(t, 7) for t in v] for f, v in timings.items()}}

    return _measured_once(kernel_module, shape, ok, measure)


def plan_for(out_features: int, in_features: int, kernel_module, weights: str = "float32") -> tuple[str, ...]:
    """The form to run at each bucket for a weight of this shape and dtype, on this machine."""
    if kernel_module is None:
        return tuple(LIBRARY[weights] for _ in BUCKETS)
    if weights == "int8" and not int8mm_takes(in_features) or weights in PANELS_ONLY:
        return tuple("hand" for _ in BUCKETS)  # the panels are the only form
    if os.environ.get("SKIPDECODE_AUTOTUNE", "1") == "0":
        return default_plan(True, weights)
    return tuple(tune(out_features, in_features, kernel_module, weights)["plan"])


def time_greedy_head(out_features: int, in_features: int, kernel_module, reps: int = 5) -> dict[str, list[float]]:
    """Seconds per greedy pick of an fp32 LM head of this shape at every bucket's row count, each
    form with its argmax: ``greedy`` and ``greedy8`` (``kernels.greedy_head`` on the bf16 copy, on
    the int8 copy where ``in_features`` is a multiple of 32: the copy's pass and the exact logits it
    leaves in doubt) and ``onednn`` (the full fp32 product). Timed cold, as ``time_forms`` times a
    head: where the head fits the last-level cache, each call follows a read of 1.5x it."""
    from . import kernels
    from .model import fp32_head_copy

    w = torch.randn(out_features, in_features) * 0.02
    packed = kernels.pack_weight(w)
    approx, _, bound = fp32_head_copy(w, "bfloat16")
    library = torch.ops.mkldnn._reorder_linear_weight(w.clone(), 32)
    forms = {"greedy": lambda x: kernel_module.greedy_head(x, packed, out_features, approx, bound, w),
             "onednn": lambda x: torch.ops.mkldnn._linear_pointwise(x, library, None, "none", [], "").argmax(-1)}
    if kernels.whole_groups(in_features):
        approx8, scale8, bound8 = fp32_head_copy(w, "int8")
        forms["greedy8"] = lambda x: kernel_module.greedy_head(x, packed, out_features, approx8, bound8, w, scale8)
    return _head_picks_per_bucket(out_features, in_features, reps, _cold_read(w.numel() * 4), forms)


def _head_picks_per_bucket(out_features: int, in_features: int, reps: int, cold_read,
                           forms: dict[str, Callable[[torch.Tensor], object]]) -> dict[str, list[float]]:
    """Median seconds per call of each form (an LM head's picks from x) at every bucket's row count,
    the forms' calls interleaved, ``cold_read`` before each (``_median_times``)."""
    res: dict[str, list[float]] = {f: [] for f in forms}
    for m in BUCKETS:
        x = torch.randn(m, in_features)
        n = max(2, min(reps, int(2e8 // max(1, m * in_features * out_features))))
        for f, t in zip(forms, _median_times([lambda fn=fn: fn(x) for fn in forms.values()], n, cold_read)):
            res[f].append(t)
    return res


def _head_seconds_once(kernel_module, key: str, forms: Sequence[str],
                       timer: Callable[[], dict[str, list[float]]]) -> dict[str, list[float]]:
    """``timer()``'s seconds per form and bucket for a greedy head plan, measured once per machine
    and cached under ``key`` (``_measured_once``)."""
    def ok(entry) -> bool:
        return isinstance(entry, dict) and entry.get("buckets") == list(BUCKETS) \
            and all(len(entry.get("seconds", {}).get(f, ())) == len(BUCKETS) for f in forms)

    def measure() -> dict:
        return {"buckets": list(BUCKETS), "seconds": {f: [round(v, 7) for v in ts] for f, ts in timer().items()}}

    return _measured_once(kernel_module, key, ok, measure)["seconds"]


GREEDY_HEAD_FORMS = ("greedy", "greedy8", "onednn")


def _greedy_head_seconds(out_features: int, in_features: int, kernel_module) -> dict[str, list[float]]:
    from . import kernels

    forms = GREEDY_HEAD_FORMS if kernels.whole_groups(in_features) else ("greedy", "onednn")  # time_greedy_head's
    return _head_seconds_once(kernel_module, f"greedy head {out_features}x{in_features}", forms,
                              lambda: time_greedy_head(out_features, in_features, kernel_module))


def greedy_head_copy(out_features: int, in_features: int, kernel_module) -> str:
    """Which copy of an fp32 LM head greedy steps pick from (``kernels.greedy_head``): ``"int8"``
    (a quarter of the head's bytes, and more ids left in doubt) unless its picks, summed over the
    buckets, took longer than the ``"bfloat16"`` copy's (half the bytes) on this machine. Measured
    once per machine with ``greedy_head_plan``'s timings, then cached; ``SKIPDECODE_AUTOTUNE=0`` (or
    kernels without ``greedy_head``): int8. bf16 where ``in_features`` is not a multiple of 32 (int8
    activations are quantized in blocks of 32)."""
    from . import kernels

    if not kernels.whole_groups(in_features):
        return "bfloat16"
    if kernel_module is None or not hasattr(kernel_module, "greedy_head") \
            or os.environ.get("SKIPDECODE_AUTOTUNE", "1") == "0":
        return "int8"
    sec = _greedy_head_seconds(out_features, in_features, kernel_module)
    return "int8" if sum(sec["greedy8"]) <= sum(sec["greedy"]) else "bfloat16"


def greedy_head_plan(out_features: int, in_features: int, kernel_module, plan: Sequence[str],
                     copy: str = "bfloat16") -> tuple[bool, ...]:
    """Per bucket, whether greedy decode steps take an fp32 head's picks from ``kernels.greedy_head``
    on its ``copy`` (``greedy_head_copy``; in the native loop, ``Transformer.native_greedy``) where
    the head's ``plan`` puts its full product on oneDNN: where that pass and its few exact logits
    took no longer than oneDNN's product and argmax on this machine. Where ``plan`` has the panels,
    greedy steps take the pass anyway (it reads a half or a quarter of the bytes the panels do).
    Measured once per machine, then cached; ``SKIPDECODE_AUTOTUNE=0``, or kernels without
    ``greedy_head``, keep to ``plan``."""
    on_panels = tuple(f == "hand" for f in plan)
    if all(on_panels) or kernel_module is None or not hasattr(kernel_module, "greedy_head") \
            or os.environ.get("SKIPDECODE_AUTOTUNE", "1") == "0":
        return on_panels
    sec = _greedy_head_seconds(out_features, in_features, kernel_module)
    form = "greedy8" if copy == "int8" else "greedy"
    return tuple(p or g <= o for p, g, o in zip(on_panels, sec[form], sec["onednn"]))


def time_greedy_head_int8(out_features: int, in_features: int, kernel_module, reps: int = 5,
                          a8: int = 0) -> dict[str, list[float]]:
    """Seconds per greedy pick of an int8 LM head of this shape at every bucket's row count, each
    form with its argmax: ``greedy`` (``kernels.greedy_head_int8``: the int8-activation pass and
    the exact logits it leaves in doubt) and ``panels`` (the full product on the head's panels, on
    fp32 activations or, ``a8`` 2, two int8 limbs). Timed cold, as ``time_greedy_head`` times an
    fp32 head."""
    from . import kernels
    from .model import int8_head_bound, quantize_int8

    q, sc = quantize_int8(torch.randn(out_features, in_features) * 0.02)
    approx, scales, bound = kernels.pack_int8_vnni(q), kernels.pack_scales(sc), int8_head_bound(q, sc.float())
    packed = approx if a8 else kernels.pack_weight(q)
    return _head_picks_per_bucket(out_features, in_features, reps, _cold_read(q.numel()), {
        "greedy": lambda x: kernel_module.greedy_head_int8(x, packed, scales, out_features, approx, bound, a8),
        "panels": lambda x: kernel_module.argmax_rows(kernel_module.linear(x, packed, None, out_features, scales, a8))})


def int8_greedy_head_plan(out_features: int, in_features: int, kernel_module, plan: Sequence[str],
                          a8: int = 0) -> tuple[bool, ...]:
    """Per bucket, whether greedy decode steps take an int8 head's picks from
    ``kernels.greedy_head_int8`` (an int8-activation pass over the head packed for it, then the
    exact logits it leaves in doubt): at the buckets where the head runs on its panels and the pass
    took no longer than the full product there (on fp32 activations, or ``a8`` 2, two int8 limbs).
    Measured once per machine, then cached. Untimed (``SKIPDECODE_AUTOTUNE=0``): from 8 rows, where
    the fp32-activation product is bound by its FMAs and the pass took under half its time on an
    AMD EPYC."""
    on_panels = tuple(f == "hand" for f in plan)
    if kernel_module is None or not hasattr(kernel_module, "greedy_head_int8") or not any(on_panels):
        return tuple(False for _ in BUCKETS)
    if os.environ.get("SKIPDECODE_AUTOTUNE", "1") == "0":
        return tuple(p and b >= 8 for p, b in zip(on_panels, BUCKETS))

    key = f"int8 greedy head {out_features}x{in_features}" + (" two limbs" if a8 else "")
    sec = _head_seconds_once(kernel_module, key, ("greedy", "panels"),
                             lambda: time_greedy_head_int8(out_features, in_features, kernel_module, a8=a8))
    return tuple(p and g <= f for p, g, f in zip(on_panels, sec["greedy"], sec["panels"]))


def fused_plan(shapes: Sequence[tuple[int, int]], kernel_module, weights: str = "float32") -> tuple[bool, ...]:
    """Per bucket, whether a layer with these linears runs as the compiled kernels' one fused call:
    where their measured time on the panels is no more than on the library form (the fused call
    does the same GEMMs plus the norms, RoPE and attention without leaving the kernel)."""
    if kernel_module is None:
        return tuple(False for _ in BUCKETS)
    if weights in PANELS_ONLY or weights == "int8" and not all(int8mm_takes(i) for _, i in shapes):
        return tuple(True for _ in BUCKETS)  # the panels are the only int4 form, or the only int8 form of some
    if weights == "bfloat16" and not cpu_features()["onednn_bf16"]:
        return tuple(True for _ in BUCKETS)  # no oneDNN bf16 on this CPU (AVX2 only): the panels are the bf16 form
    if os.environ.get("SKIPDECODE_AUTOTUNE", "1") == "0":
        return tuple(f == "hand" for f in default_plan(True, weights))
    hand, lib = forms(weights)
    t = [tune(o, i, kernel_module, weights)["seconds"] for o, i in shapes]
    return tuple(sum(x[hand][b] for x in t) <= sum(x[lib][b] for x in t) for b in range(len(BUCKETS)))


def layers_fused_plan(signature: str, plan: Sequence[bool], kernel_module,
                      time_layers: Callable[[int], tuple[float, float]]) -> tuple[bool, ...]:
    """``plan`` (``fused_plan``'s, from the linears alone) with each bucket it leaves unfused timed
    again on a model's whole layers: ``time_layers(rows)`` gives the seconds of one decode position
    through them fused and unfused. The fused call also runs the norms, RoPE and attention without
    leaving the kernel (and, for a whole step, without Python between layers), which the linears'
    times leave out: an fp32 layer can lose on its linears by a few percent and still win as a
    layer. Measured once per machine and ``signature`` (the layers' shapes), then cached;
    ``SKIPDECODE_AUTOTUNE=0`` keeps ``plan``."""
    plan = tuple(bool(p) for p in plan)
    if all(plan) or os.environ.get("SKIPDECODE_AUTOTUNE", "1") == "0":
        return plan

    def ok(entry) -> bool:
        return isinstance(entry, dict) and entry.get("buckets") == list(BUCKETS) \
            and isinstance(entry.get("fused"), list) and len(entry["fused"]) == len(BUCKETS)

    def measure() -> dict:
        fused, unfused = [], []
        for b, p in zip(BUCKETS, plan):
            f, u = (None, None) if p else time_layers(b)  # a bucket the linears already fuse stays fused
            fused.append(None if f is None else round(f, 7))
            unfused.append(None if u is None else round(u, 7))
        return {"buckets": list(BUCKETS), "fused": [p or f <= u for p, f, u in zip(plan, fused, unfused)],
                "seconds": {"fused": fused, "unfused": unfused}}

    entry = _measured_once(kernel_module, f"layers {signature}", ok, measure)
    return tuple(p or bool(f) for p, f in zip(plan, entry["fused"]))
