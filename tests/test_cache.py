"""``skipdecode cache`` lists what the cache holds and clears it: named entries,
or every merged adapter (each a full-size model), never anything else."""

from __future__ import annotations

import pytest

from skipdecode.cli import main


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SKIPDECODE_CACHE", str(root))
    for name, size in (("smollm2-135m-instruct", 3000), ("default-e2e-merged-aaaaaaaaaaaa", 2000),
                       ("default-e2e-merged-bbbbbbbbbbbb", 2000), ("qwen2.5-coder-0.5b", 5000)):
        (root / name).mkdir(parents=True)
        (root / name / "model.safetensors").write_bytes(b"x" * size)
        (root / f".{name}.lock").touch()
    (root / "autotune.json").write_text("{}")
    return root


def test_cache_lists_every_entry_with_its_size_and_kind(cache, capsys):
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    lines = {ln.split()[4]: ln for ln in out.splitlines()[1:-1]}
    assert set(lines) == {"smollm2-135m-instruct", "default-e2e-merged-aaaaaaaaaaaa",
                          "default-e2e-merged-bbbbbbbbbbbb", "qwen2.5-coder-0.5b", "autotune.json"}
    assert "LoRA adapter merged" in lines["default-e2e-merged-aaaaaaaaaaaa"]
    assert "pulled model" in lines["qwen2.5-coder-0.5b"] and "embedded default" in lines["smollm2-135m-instruct"]
    assert "in 5 entries" in out and ".lock" not in out


def test_clear_merged_removes_only_merged_adapters_and_their_locks(cache, capsys):
    assert main(["cache", "--clear-merged"]) == 0
    out = capsys.readouterr().out
    assert out.count("removed default-e2e-merged-") == 2
    left = sorted(p.name for p in cache.iterdir())
    assert left == [".qwen2.5-coder-0.5b.lock", ".smollm2-135m-instruct.lock", "autotune.json",
                    "qwen2.5-coder-0.5b", "smollm2-135m-instruct"]
    assert main(["cache", "--clear-merged"]) == 0 and "nothing to remove" in capsys.readouterr().out


def test_clear_by_name_and_an_unknown_name_is_a_clear_error(cache, capsys):
    assert main(["cache", "--clear", "qwen2.5-coder-0.5b", "autotune.json"]) == 0
    assert not (cache / "qwen2.5-coder-0.5b").exists() and not (cache / "autotune.json").exists()
    assert (cache / "smollm2-135m-instruct" / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(["cache", "--clear", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "not in the cache" in err and "no-such-model" in err and "smollm2-135m-instruct" in err
    assert "Traceback" not in err
