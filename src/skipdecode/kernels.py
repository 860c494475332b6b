"""CPU decode kernels (``csrc/decode_kernels.cpp``), compiled on first use.

The C++ source is built once per machine and torch version with
``torch.utils.cpp_extension`` (about 30 s with g++) and cached under
``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``). Where it
cannot be used (no AVX2/FMA, no compiler, ``SKIPDECODE_KERNELS=0``) the
engine keeps its oneDNN path and says so once; nothing else changes.

Every kernel is checked against plain torch in ``tests/test_kernels.py``.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import sys
import warnings
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from . import atomic

_SRC = Path(__file__).parent / "csrc" / "decode_kernels.cpp"
PANEL = 16  # output columns per packed panel (two AVX registers)


def _cpu_has_avx2_fma() -> bool:
    """AVX2 and FMA (and F16C, which every CPU with AVX2 has: float16 KV pools)."""
    from .dispatch import cpu_features

    return {"avx2", "fma", "f16c"} <= set(cpu_features()["isa"])


def _put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip package's binary may not
    be there when the venv is not activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


# how the kernel source is compiled (AVX2 + FMA + F16C baseline; the AVX-512, VNNI and AMX forms carry their own
# targets). No implicit FMA contraction: every fused multiply-add is written out, so an expression
# rounds the same in each form it is inlined into and the forms stay bitwise equal.
BUILD_FLAGS = {"extra_cflags": ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"],
               "extra_ldflags": ["-fopenmp"]}


def configure(module):
    """Point a freshly built kernel module at this CPU's forms (``isa``, ``a8_form``); returns it."""
    module.set_isa(isa() == "avx512")
    form = a8_form()
    try:
        module.set_a8(form)
    except RuntimeError as e:  # AMX present but not granted by the OS: the VNNI form computes the same
        if form != "amx":
            raise
        warnings.warn(f"skipdecode: {e}; the int8-activation kernels use AVX512-VNNI", stacklevel=2)
        module.set_a8("vnni")
    if hasattr(module, "set_bf16_dot"):
        module.set_bf16_dot(bf16_dot())
    if amx_bf16() and hasattr(module, "set_amx_bf16"):  # (a module built from an older source has no tiles)
        try:
            module.set_amx_bf16(True)
        except RuntimeError as e:  # not granted by the OS: the FMA forms run instead
            warnings.warn(f"skipdecode: {e}; fp32-activation linears use the FMA forms", stacklevel=2)
    return module


@lru_cache(maxsize=1)
def load():
    """The compiled kernel module, or None (with one warning saying why)."""
    if os.environ.get("SKIPDECODE_KERNELS", "1") == "0":
        return None
    if not _cpu_has_avx2_fma():
        warnings.warn("skipdecode: this CPU has no AVX2/FMA/F16C; using oneDNN for the decode step", stacklevel=2)
        return None
    from torch.utils.cpp_extension import load as build

    _put_ninja_on_path()
    tag = hashlib.sha1(_SRC.read_bytes() + torch.__version__.encode() + repr(BUILD_FLAGS).encode()).hexdigest()[:10]
    name = f"skipdecode_kernels_{tag}"
    try:
        from torch.utils.cpp_extension import _get_build_directory

        if not (Path(_get_build_directory(name, False)) / f"{name}.so").is_file():
            print("skipdecode: building the CPU decode kernels (once per machine, about 30 s)", file=sys.stderr)
    except Exception:  # only a courtesy message
        pass
    try:
        from torch.utils.cpp_extension import _get_build_directory

        build_dir = Path(_get_build_directory(name, False))
        # torch marks a build in progress with a plain ``lock`` file that a killed build (Ctrl-C on
        # the first run) leaves behind, and every later load then waits for it forever. Builds here
        # hold an OS lock too, released when its process dies: a ``lock`` found under it is stale.
        with atomic.locked(build_dir):
            (build_dir / "lock").unlink(missing_ok=True)
            module = build(name=name, sources=[str(_SRC)], verbose=False, **BUILD_FLAGS)
        return configure(module)
    except Exception as e:  # no compiler, no headers: the oneDNN path still works
        warnings.warn(f"skipdecode: could not build the CPU decode kernels ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}); using oneDNN. "
                      "They need g++ and ninja (a dependency); SKIPDECODE_KERNELS=0 silences this.", stacklevel=2)
        return None


AVX512_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def isa() -> str:
    """The form of the panel micro-kernels this CPU runs: ``avx512`` where it has AVX-512
    F/BW/VL/DQ, else ``avx2``. ``SKIPDECODE_ISA=avx2`` forces the AVX2 form (to run, test or time
    what an AVX2-only CPU runs, on any CPU)."""
    from .dispatch import cpu_features

    forced = os.environ.get("SKIPDECODE_ISA", "").lower()
    if forced not in ("", "avx2", "avx512"):
        raise ValueError(f"SKIPDECODE_ISA must be avx2 or avx512, got {forced!r}")
    has = AVX512_FLAGS <= set(cpu_features()["isa"])
    if forced == "avx512" and not has:
        raise ValueError("SKIPDECODE_ISA=avx512 but this CPU lacks AVX-512 F/BW/VL/DQ")
    return "avx2" if forced == "avx2" or not has else "avx512"


def a8_form() -> str:
    """The form of the int8-activation kernels (``w8a8``, ``w4a8``, ``w8a16``, ``w4a16``) here:
    ``amx`` where the CPU has AMX-INT8 (tiles for calls of 12 or more rows, VNNI below),
    ``vnni`` where it has AVX512-VNNI, else ``avx2`` (vpmaddubsw/vpmaddwd, as llama.cpp's Q8_0 on
    AVX2 CPUs). ``SKIPDECODE_ISA=avx2`` forces ``avx2``; ``SKIPDECODE_AMX=0`` leaves AMX out. All
    give the same integer sums and outputs, bit for bit, as the plain C++ form the tests hold them to."""
    from .dispatch import cpu_features

    have = set(cpu_features()["isa"])
    if isa() != "avx512" or "avx512_vnni" not in have:
        return "avx2"
    amx = os.environ.get("SKIPDECODE_AMX", "1")
    if amx not in ("0", "1"):
        raise ValueError(f"SKIPDECODE_AMX must be 0 or 1, got {amx!r}")
    return "amx" if amx == "1" and {"amx_tile", "amx_int8"} <= have else "vnni"


def amx_bf16() -> bool:
    """Whether linears with fp32 activations run calls of several rows on the AMX-BF16 tiles
    (``bfloat16``, ``int8`` and ``int4`` weights from 8 rows, ``int4`` at 4-5 rows too, ``float32``
    from 32): where the CPU has them and the AVX-512 form runs, unless ``SKIPDECODE_AMX=0``. The
    tiles sum each output in their own order, in bf16 limbs that lose nothing, so outputs agree
    with the FMA forms to fp32 rounding, not bit for bit."""
    from .dispatch import cpu_features

    amx = os.environ.get("SKIPDECODE_AMX", "1")
    if amx not in ("0", "1"):
        raise ValueError(f"SKIPDECODE_AMX must be 0 or 1, got {amx!r}")
    return isa() == "avx512" and amx == "1" and {"amx_tile", "amx_bf16"} <= set(cpu_features()["isa"])


def bf16_dot() -> bool:
    """Whether the bf16 pass of greedy picks from an fp32 LM head (``greedy_head``) runs on
    AVX512-BF16's pair dot products below the tiles' row count: where the CPU has them and the
    AVX-512 form runs. Two exact products a lane against an FMA form's widening and one product:
    the pass takes x's top bf16 half, as on the tiles, which ``model.head_bound`` counts."""
    from .dispatch import cpu_features

    return isa() == "avx512" and "avx512_bf16" in cpu_features()["isa"]


def fma_peak_gflops(module, repeats: int = 5, seconds: float = 0.05) -> float:
    """This machine's fp32 multiply-add rate (GFLOP/s) on torch's threads, in the form the kernels
    run (AVX-512 or AVX2): register-only FMA chains, best of ``repeats`` runs of about ``seconds``.
    It is the roof of the fp32-activation forms when a step has many rows, as the read bandwidth
    is at one row."""
    import time

    t = time.perf_counter()
    module.fma_flops(100_000)
    iters = max(1, int(100_000 * seconds / max(time.perf_counter() - t, 1e-6)))
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        flops = module.fma_flops(iters)
        best = max(best, flops / (time.perf_counter() - t) / 1e9)
    return best


def panel_bytes(linear) -> int:
    """Bytes of a packed ``linear``'s panels and their scales: what a call reads of its weights."""
    return sum(t.nbytes for t in (linear.packed, linear.panel_scales) if t is not None)


def resident_gbs(linear, rows: int = 1, repeats: int = 5, seconds: float = 0.05) -> float:
    """GB/s of weights a packed ``linear`` (``model.PackedLinear``) runs at ``rows`` rows with its
    weights in the caches: its GEMM called again and again natively (``linear_repeat``), best of
    ``repeats`` runs of about ``seconds``. Why: at one row a step streams every weight from memory
    once, and a call cannot read faster than its arithmetic runs; this is that rate, to set beside
    the read bandwidth (a linear of a few MB stays in the last-level cache, under 1 MB a thread in L2)."""
    import time

    m = linear.kernels
    x = torch.randn(rows, linear.in_features)
    args = (x, linear.packed, linear.out_features, linear.panel_scales, linear.a8)
    nbytes = panel_bytes(linear)
    t = time.perf_counter()
    m.linear_repeat(*args, repeats=8)
    n = max(8, int(8 * seconds / max(time.perf_counter() - t, 1e-6)))
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        m.linear_repeat(*args, repeats=n)
        best = max(best, nbytes * n / (time.perf_counter() - t) / 1e9)
    return best


READ_PREFETCH_BYTES = (0, 512, 1024, 2048, 4096)  # prefetch distances the read probe tries


def stream_read_gbs(module, probe: torch.Tensor, repeats: int = 3) -> dict[int, float]:
    """This machine's read bandwidth (GB/s) on torch's threads, as the kernels stream weights: each
    thread sums its contiguous share of ``probe`` (float32, far larger than the caches) with vector
    loads, asking for lines each of READ_PREFETCH_BYTES ahead (0: the hardware prefetcher alone);
    best of ``repeats`` per distance. Which distance reads fastest differs between CPUs, so all are
    tried and reported; the best is the bandwidth a batch-1 step's weight stream is measured against."""
    import time

    best: dict[int, float] = {}
    for _ in range(repeats):
        for pf in READ_PREFETCH_BYTES:
            t = time.perf_counter()
            module.read_stream(probe, pf)
            best[pf] = max(best.get(pf, 0.0), probe.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


HUGE_PAGE = 2 << 20  # x86-64's large page: one TLB entry maps 512 small ones
ARENA_ALIGN = 64  # each tensor in the arena starts on a cache line


def huge_page_arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` laid end to end in one buffer that Linux is asked to back with
    2 MB pages (``MADV_HUGEPAGE``; transparent huge pages are commonly in ``madvise`` mode).

    Why: a decode step streams every packed weight once. On 4 KB pages that is a TLB miss
    every 4 KB (a 135 MB int8 model: 33,000 per step) and the hardware prefetchers stop at
    every page boundary; 2 MB pages make both 512 times rarer. One arena rather than a mapping
    per tensor: a layer's small weights (0.3-2 MB) would each round up to whole 2 MB pages.
    The bytes are the same, so every output is the same. Where the OS has no such advice
    (not Linux), or ``SKIPDECODE_HUGEPAGES=0``, the tensors are returned as they are."""
    if (not tensors or os.environ.get("SKIPDECODE_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE")
            or not hasattr(mmap, "MAP_PRIVATE")):
        return list(tensors)
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // ARENA_ALIGN) * ARENA_ALIGN
    size = -(-total // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a 2 MB boundary
    try:
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: pages are faulted in 2 MB at a time
    except OSError:
        return list(tensors)
    base = torch.frombuffer(buf, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = (-base.data_ptr()) % HUGE_PAGE
    out = []
    for t, off in zip(tensors, offsets):
        view = base[start + off: start + off + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` weight (fp32, bf16 or int8) -> ``[ceil(N/16), K, 16]`` panels, zero
    padded: the layout ``linear`` streams, one contiguous panel per 16 outputs."""
    n, k = w.shape
    pad = (-n) % PANEL
    if pad:
        w = F.pad(w, (0, 0, 0, pad))
    return w.reshape(-1, PANEL, k).transpose(1, 2).contiguous()


def pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """Per-output-channel scales of an int8 weight -> fp32, zero padded to whole panels like ``pack_weight``."""
    return F.pad(scales.float(), (0, (-scales.numel()) % PANEL)).contiguous()


INT4_GROUP = 32  # int4 weights: one scale per output channel and 32 consecutive inputs (llama.cpp's Q4_0 block)


def whole_groups(in_features: int) -> bool:
    """Whether a reduction of this length splits into whole ``INT4_GROUP`` blocks: int4 weights
    keep one scale per block and int8 activations are quantized per block, so both need it."""
    return in_features % INT4_GROUP == 0


def pack_int4(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` int4 codes (uint8, 0..15, the weight ``(q - 8) * scale``) and ``[N, K/32]`` bf16
    group scales -> the panels ``linear`` streams: per panel of 16 outputs and 8 consecutive
    inputs, 16 little-endian 32-bit words, word c holding column c's 8 codes, nibble j for input
    j; nibbles 0-6 hold ``q``, nibble 7 holds ``q - 8`` in two's complement (the kernels convert
    whole masked words to float, so the top nibble carries the word's sign). Stored as
    ``[ceil(N/16), K/2, 16]`` bytes; the scales as ``[ceil(N/16), K/32, 16]``, zero padded."""
    n, k = q.shape
    v = pack_weight(q.to(torch.int64))  # [NP, K, 16] codes (padded columns: 0, with scale 0)
    v = v.reshape(v.shape[0], k // 8, 8, PANEL)
    v[:, :, 7] = (v[:, :, 7] - 8) & 0xF
    words = (v << (4 * torch.arange(8))[None, None, :, None]).sum(2)  # [NP, K/8, 16], 0 .. 2^32 - 1
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the same 32 bits
    packed = words.contiguous().view(torch.uint8).reshape(-1, k // 2, PANEL)
    return packed, pack_int4_scales(scales, divide=1)


def pack_int4_scales(scales: torch.Tensor, divide: int = 16) -> torch.Tensor:
    """``[N, K/32]`` bf16 group scales -> ``[ceil(N/16), K/32, 16]``, divided by ``divide`` (exact, a
    power of two: the ``w4a8`` kernels read each high nibble as 16 times its code), zero padded."""
    n, g = scales.shape
    sc = (scales.float() / divide).bfloat16()
    return F.pad(sc, (0, 0, 0, (-n) % PANEL)).reshape(-1, PANEL, g).transpose(1, 2).contiguous()


def pack_int8_vnni(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int8 weights (K a multiple of 4) -> the panels of ``w8a8`` (int8 activations):
    ``[ceil(N/16), K, 16]`` int8 holding, per panel and 4 consecutive inputs, each column's 4
    weights as one 32-bit group (AVX512-VNNI's ``vpdpbusd`` operand, 64 bytes), offset to unsigned
    (the byte ``q + 128``). Scales as ``pack_scales``."""
    n, k = q.shape
    if q.numel() and int(q.min()) < -127:
        # the AVX2 form gives each weight its activation's sign: -128 has no positive
        raise ValueError("w8a8 weights must lie in [-127, 127] (symmetric int8); got -128")
    v = pack_weight(q)  # [NP, K, 16]
    v = v.reshape(v.shape[0], k // 4, 4, PANEL).transpose(2, 3)  # [NP, K/4, 16 columns, 4 k]
    u = (v.to(torch.int16) + 128).to(torch.uint8)
    return u.contiguous().view(torch.int8).reshape(-1, k, PANEL)


def pack_int4_vnni(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` int4 codes (0..15) and ``[N, K/32]`` bf16 group scales -> the panels of ``w4a8``:
    per panel and 4 consecutive inputs, the 64 codes in ``vpdpbusd`` order (each column's 4 as one
    32-bit group) stored in 32 bytes, codes 0-31 in the low nibbles and 32-63 in the high ones:
    ``[ceil(N/16), K/2, 16]`` uint8. Scales as ``pack_int4_scales``."""
    n, k = q.shape
    v = pack_weight(q)  # [NP, K, 16] codes
    v = v.reshape(v.shape[0], k // 4, 4, PANEL).transpose(2, 3).reshape(v.shape[0], k // 4, 64)
    packed = (v[..., :32] | (v[..., 32:] << 4)).contiguous().reshape(-1, k // 2, PANEL)
    return packed, pack_int4_scales(scales)
