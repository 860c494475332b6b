"""Keep freed memory in the process for the next training step (glibc malloc).

A training step allocates and frees activations of a different shape every
step (each batch has its own lengths and schedule). glibc returns large freed
blocks to the kernel (``munmap`` and heap trimming), so the next step faults
the same memory back in page by page, zeroed. Raising the mmap threshold to its
maximum and never trimming keeps that memory in the heap for reuse; PyTorch's
CPU performance guide recommends jemalloc or tcmalloc for the same reason.
``benchmarks/train_step_time_bf16.sh`` measures the effect.

Nothing changes when the C library is not glibc, when the user already tuned
malloc (``MALLOC_*`` variables or a preloaded allocator), or when
``SKIPDECODE_MALLOC_TUNING=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest mmap threshold on 64-bit
TOP_PAD = 256 * 1024 * 1024  # grow the heap in large steps

_applied: bool | None = None


def _user_tuned() -> bool:
    preload = os.environ.get("LD_PRELOAD", "")
    return any(k.startswith("MALLOC_") for k in os.environ) or "jemalloc" in preload or "tcmalloc" in preload


def on_glibc() -> bool:
    """Whether this process runs on glibc, whose ``mallopt`` this module calls."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> bool:
    """Tune glibc malloc for repeated large allocations, once per process; True when applied."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("SKIPDECODE_MALLOC_TUNING", "1") == "0" or _user_tuned():
        return False
    if not on_glibc():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
              and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1
              and libc.mallopt(M_TOP_PAD, TOP_PAD) == 1)
    except (OSError, AttributeError):
        return False
    _applied = ok
    return ok
