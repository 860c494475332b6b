"""Training keeps freed memory in the heap (glibc), unless the user tuned malloc themselves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from skipdecode.allocator import on_glibc

glibc = pytest.mark.skipif(not on_glibc(), reason="mallopt is glibc's")


def _applied(**env: str) -> bool:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "SKIPDECODE_MALLOC_TUNING"}
    out = subprocess.run([sys.executable, "-c", "from skipdecode.allocator import keep_freed_memory as k; "
                          "print(k(), k())"], env={**base, **env}, capture_output=True, text=True, check=True)
    first, again = out.stdout.split()
    assert first == again  # once per process, the same answer
    return first == "True"


@glibc
def test_glibc_malloc_is_tuned_once_per_process():
    assert _applied()


@glibc
def test_user_malloc_settings_and_the_opt_out_are_respected():
    assert not _applied(SKIPDECODE_MALLOC_TUNING="0")
    assert not _applied(MALLOC_ARENA_MAX="2")
