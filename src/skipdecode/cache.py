"""What ``$SKIPDECODE_CACHE`` holds, and removing it (``skipdecode cache``).

Everything there is rebuilt on demand: converted GGUFs and merged adapters on
the next load, pulled models by ``skipdecode pull`` again, autotuning on the
next start. Merged adapters are the ones that pile up (one full-size model per
adapter version), so they can be cleared as a group.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from . import atomic
from .checkpoint import DEFAULT_CONVERTED, MERGED, cache_dir
from .errors import SkipDecodeError


class CacheError(SkipDecodeError):
    """A cache entry that does not exist was named."""


@dataclass(frozen=True)
class CacheEntry:
    name: str
    path: Path
    kind: str
    size: int  # bytes
    modified: float  # seconds since the epoch

    @property
    def merged(self) -> bool:
        return MERGED in self.name


def kind_of(name: str) -> str:
    """What an entry of the cache is, from the name its writer gave it."""
    from .bench.llamacpp import GGUF_CACHE
    from .dispatch import autotune_file
    from .pull import PULLABLE, pulled_dir

    if name == autotune_file().name:
        return "kernel autotuning"
    if name == pulled_dir().name:
        return "downloaded parts of pulled models"
    if name == GGUF_CACHE:
        return "llama.cpp GGUFs (bench --llamacpp)"
    if name in PULLABLE:
        return "pulled model, converted"
    if name == DEFAULT_CONVERTED:
        return "the embedded default, converted"
    if MERGED in name:
        return "LoRA adapter merged into its base"
    return "converted GGUF"


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())


def entries(root: Path | None = None) -> list[CacheEntry]:
    """Every entry of the cache, largest first (lock files and half-written work left out)."""
    root = root or cache_dir()
    if not root.is_dir():
        return []
    out = [CacheEntry(p.name, p, kind_of(p.name), _size(p), p.stat().st_mtime)
           for p in root.iterdir() if not p.name.startswith(".")]
    return sorted(out, key=lambda e: -e.size)


def remove(entry: CacheEntry) -> None:
    """Delete one entry, holding its lock, so no process is writing it meanwhile."""
    with atomic.locked(entry.path):
        if entry.path.is_dir():
            shutil.rmtree(entry.path)
        elif entry.path.exists():
            entry.path.unlink()
    (entry.path.parent / f".{entry.name}.lock").unlink(missing_ok=True)


def clear(names: list[str], merged: bool = False, root: Path | None = None) -> list[CacheEntry]:
    """Remove the named entries (and every merged adapter with ``merged``); returns what went.
    Raises ``CacheError`` naming what is there when a name is not."""
    have = {e.name: e for e in entries(root)}
    unknown = [n for n in names if n not in have]
    if unknown:
        raise CacheError(f"not in the cache ({root or cache_dir()}): {', '.join(unknown)}; "
                         f"it holds: {', '.join(sorted(have)) or 'nothing'}")
    gone = [have[n] for n in names] + [e for e in have.values() if merged and e.merged and e.name not in names]
    for e in gone:
        remove(e)
    return gone
