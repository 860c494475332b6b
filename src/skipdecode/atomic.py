"""Writes that are all or nothing, and temporaries that never outlive a crash.

Every file the project writes goes to a temporary sibling named
``.<name>.tmp-<pid>-<random>`` and is renamed into place; a directory is built
the same way. A process killed mid-write (SIGKILL, power loss) cannot clean
up, so the next write to the same directory removes temporaries whose
process is gone: a killed conversion's half-gigabyte never stays behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

_TMP = re.compile(r"^\.?(?P<name>.+)\.tmp-(?P<pid>\d+)-[^/]*$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_stale(directory: Path) -> list[Path]:
    """Remove temporaries in ``directory`` left by processes that no longer run."""
    removed = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _TMP.match(p.name)
        if m and not _alive(int(m["pid"])):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _prefix(parent: Path, name: str) -> str:
    """Make ``parent``, sweep its stale temporaries, and name a new one of this process for ``name``."""
    parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(parent)
    return f".{name}.tmp-{os.getpid()}-"


def write_file(path: Path | str, write: Callable[[str], None], mode: int = 0o644) -> Path:
    """Call ``write(tmp_name)`` on a temporary sibling of ``path``, then rename it into place."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=_prefix(path.parent, path.name), dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)  # mkstemp makes 0600; results and models are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: Path | str, text: str) -> Path:
    return write_file(path, lambda f: Path(f).write_text(text, encoding="utf-8"))


def build_dir(out: Path | str, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` in a temporary sibling directory, then rename it to ``out``:
    an interrupted build never leaves a half-written directory behind."""
    out = Path(out)
    tmp = Path(tempfile.mkdtemp(prefix=_prefix(out.parent, out.name), dir=out.parent))
    try:
        build(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@contextlib.contextmanager
def locked(path: Path | str, timeout: float = 1800) -> Iterator[None]:
    """Hold an inter-process lock on ``path`` (a ``filelock`` lock file beside it): caches
    that Ray replicas or torchrun ranks fill at once are read, checked and written by one
    process at a time, so the others reuse its work instead of redoing it."""
    from filelock import FileLock

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / f".{path.name}.lock"), timeout=timeout):
        yield


@contextlib.contextmanager
def temp_dir(parent: Path | str, name: str = "work") -> Iterator[Path]:
    """A temporary directory inside ``parent`` (same filesystem, so renames out of it are atomic),
    removed afterwards; a killed process's is swept by the next write there."""
    parent = Path(parent)
    tmp = Path(tempfile.mkdtemp(prefix=_prefix(parent, name), dir=parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_files_into(src: Path, out: Path, last: tuple[str, ...] = ()) -> None:
    """Rename every file of ``src`` into ``out`` (same filesystem), the names in ``last`` at the end:
    they mark the directory complete for readers."""
    names = sorted(p.name for p in src.iterdir())
    for name in [n for n in names if n not in last] + [n for n in last if n in names]:
        if (src / name).is_file():
            os.chmod(src / name, 0o644)  # some writers make 0600 files; a model directory is meant to be shared
        os.replace(src / name, out / name)
