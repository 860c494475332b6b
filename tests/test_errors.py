"""User mistakes end with ``skipdecode: error: <what is wrong>`` and exit code
2, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CLI_MAX_POSITION
from skipdecode.cli import main
from skipdecode.generate import GenerationError, generate_tokens
from skipdecode.schedule import SkipSchedule


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(capsys, argv, *needles: str, usage: bool = False) -> str:
    """Exit 2, nothing on stdout, one clear message on stderr naming the problem
    (``usage``: a flag argparse refused, ``skipdecode VERB: error: ... (see ... --help)``)."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (code, out, err)
    assert "Traceback" not in err + out
    if usage:
        assert err.startswith(f"skipdecode {argv[0]}: error: ") and err.endswith("--help)\n"), err
    else:
        assert err.startswith("skipdecode: error: "), err
    assert err.count("\n") == 1, err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    assert out == ""
    return err


def _gen(model_dir, *extra):
    return ["generate", "--model", str(model_dir), "--max-new-tokens", "4", *extra]


# -- schedules ------------------------------------------------------------------

def test_invalid_schedule_file(tiny_cli_dir, tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"max_exit_layer": 3, "min_exit_layer": 5, "horizon": 4}))
    assert_user_error(capsys, _gen(tiny_cli_dir, "--schedule", str(f), "hello"),
                      "min_exit_layer (5) must be <= max_exit_layer (3)")


def test_non_json_schedule_file(tiny_cli_dir, tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text("max_exit_layer: 3\n")
    assert_user_error(capsys, _gen(tiny_cli_dir, "--schedule", str(f), "hello"), str(f), "is not valid JSON")


def test_missing_schedule_file(tiny_cli_dir, tmp_path, capsys):
    assert_user_error(capsys, _gen(tiny_cli_dir, "--schedule", str(tmp_path / "none.json"), "hello"),
                      "none.json does not exist")


def test_schedule_for_another_model(tiny_cli_dir, tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SkipSchedule(30, 20, 8, horizon=10).to_dict()))
    assert_user_error(capsys, _gen(tiny_cli_dir, "--schedule", str(f), "hello"),
                      "schedule is for 30 layers but the model has 6")


def test_impossible_speedup(tiny_cli_dir, capsys):
    assert_user_error(capsys, _gen(tiny_cli_dir, "--speedup", "7", "hello"), "impossible on 6 layers", "at most 3.00x")


def test_speedup_and_schedule_together(tiny_cli_dir, capsys):
    assert_user_error(capsys, _gen(tiny_cli_dir, "--speedup", "2", "--schedule", "x.json", "hi"),
                      "not allowed with argument", usage=True)


# -- prompts and sampling ---------------------------------------------------------

@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt(tiny_cli_dir, capsys, prompt):
    assert_user_error(capsys, _gen(tiny_cli_dir, "ok", prompt), "prompt is empty")


def test_prompt_longer_than_the_context(tiny_cli_dir, capsys):
    err = assert_user_error(capsys, _gen(tiny_cli_dir, "x" * (CLI_MAX_POSITION + 10)),
                            f"the model's context is {CLI_MAX_POSITION}", "shorten the prompt")
    assert f"has {CLI_MAX_POSITION + 10} tokens" in err


def test_prompt_plus_new_tokens_longer_than_the_context(tiny_packed):
    model = tiny_packed["gpt2"]  # 128 positions
    # the last new token is never fed back, so a prompt of P tokens needs P + N - 1 positions
    with pytest.raises(GenerationError, match="needs 129 positions but the model's context is 128"):
        generate_tokens(model, [[5] * 10, [5] * 120], SkipSchedule.full_depth(model.n_layers), 10)
    rows, _ = generate_tokens(model, [[5] * 119], SkipSchedule.full_depth(model.n_layers), 10)
    assert len(rows[0].token_ids) <= 10
    with pytest.raises(GenerationError, match="prompt 1: the prompt is empty"):
        generate_tokens(model, [[5], []], SkipSchedule.full_depth(model.n_layers), 4)
    with pytest.raises(GenerationError, match="no prompts"):
        generate_tokens(model, [], SkipSchedule.full_depth(model.n_layers), 4)
    with pytest.raises(GenerationError, match="schedule is for 30 layers, the model has 5"):
        generate_tokens(model, [[5]], SkipSchedule.full_depth(30), 4)


@pytest.mark.parametrize("flags, needle", [
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got 0"),
    (["--temperature", "-1"], "argument --temperature: must be a number >= 0, got -1"),
    (["--temperature", "nan"], "argument --temperature: must be a finite number >= 0, got nan"),
    (["--top-p", "1.5", "--temperature", "1"], "argument --top-p: must be a number in (0, 1], got 1.5"),
    (["--top-k", "0", "--temperature", "1"], "argument --top-k: must be an integer >= 1, got 0"),
    (["--seed", "-1"], "argument --seed: must be an integer in [0, 2**63 - 1], got -1"),
    (["--speedup", "inf"], "argument --speedup: must be a finite number >= 1, got inf"),
])
def test_bad_generation_flags(tiny_cli_dir, capsys, flags, needle):
    assert_user_error(capsys, ["generate", "--model", str(tiny_cli_dir), *flags, "hello"], needle, usage=True)


# -- models ----------------------------------------------------------------------

def test_unknown_model_path(tmp_path, capsys):
    assert_user_error(capsys, _gen(tmp_path / "no-such-model", "hello"), "no-such-model", "not found")


def test_directory_without_config(tmp_path, capsys):
    assert_user_error(capsys, _gen(tmp_path, "hello"), "no config.json")


def test_file_that_is_not_gguf(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "model.gguf"
    f.write_text("not a model")
    assert_user_error(capsys, _gen(f, "hello"), "is not a GGUF file")
    assert not (tmp_path / "cache").exists(), "nothing is converted or cached"


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_checkpoint_with_missing_tensors(tiny_cli_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    d = _copy_model(tiny_cli_dir, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.self_attn.q_proj.weight"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    assert_user_error(capsys, _gen(d, "hello"), "missing 1 tensor(s): layers.1.self_attn.q_proj.weight")


def test_checkpoint_with_a_wrong_shape(tiny_cli_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    d = _copy_model(tiny_cli_dir, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    sd["model.layers.0.mlp.down_proj.weight"] = sd["model.layers.0.mlp.down_proj.weight"][:, :-1].contiguous()
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    assert_user_error(capsys, _gen(d, "hello"), "tensor layers.0.w2.weight has shape")


def test_corrupt_safetensors_file(tiny_cli_dir, tmp_path, capsys):
    d = _copy_model(tiny_cli_dir, tmp_path / "m")
    (d / "model.safetensors").write_bytes(os.urandom(512))
    assert_user_error(capsys, _gen(d, "hello"), "cannot read", "model.safetensors")


def test_unreadable_config(tiny_cli_dir, tmp_path, capsys):
    d = _copy_model(tiny_cli_dir, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    assert_user_error(capsys, _gen(d, "hello"), "cannot read", "config.json")


def _adapter(base: Path, out: Path) -> Path:
    """A LoRA adapter directory for ``base``, as ``skipdecode train --lora`` writes it."""
    from skipdecode.checkpoint import load_model
    from skipdecode.lora import apply_lora, save_adapter

    net, path = load_model(base)
    return save_adapter(apply_lora(net, r=2, alpha=4, dropout=0.0, seed=0), path, out, {})


def test_adapter_with_truncated_weights(tiny_cli_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path / "cache"))
    a = _adapter(tiny_cli_dir, tmp_path / "adapter")
    assert run_cli(capsys, *_gen(a, "hello"))[0] == 0  # the intact adapter loads
    w = a / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    assert_user_error(capsys, _gen(a, "hello"), "cannot read", "adapter_model.safetensors", "truncated")


def test_adapter_without_weights_or_with_bad_config(tiny_cli_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path / "cache"))
    a = _adapter(tiny_cli_dir, tmp_path / "adapter")
    (a / "adapter_config.json").write_text("{not json")
    assert_user_error(capsys, _gen(a, "hello"), "adapter_config.json", "not valid JSON")
    (a / "adapter_model.safetensors").unlink()
    assert_user_error(capsys, _gen(a, "hello"), "no adapter_model.safetensors")


def test_adapter_for_another_base_model(tiny_cli_dir, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path / "cache"))
    a = _adapter(tiny_cli_dir, tmp_path / "adapter")
    sd = load_file(a / "adapter_model.safetensors")
    k = next(k for k in sd if "lora_A" in k)
    sd[k] = torch.zeros(sd[k].shape[0], sd[k].shape[1] + 8)  # trained on a wider model
    save_file(sd, a / "adapter_model.safetensors", metadata={"format": "pt"})
    assert_user_error(capsys, _gen(a, "hello"), "cannot apply the LoRA adapter", "another base model")
    assert not list((tmp_path / "cache").glob("*merged*/config.json")), "no half-merged model is cached"


def test_unsupported_architecture(tmp_path, capsys):
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert_user_error(capsys, _gen(d, "hello"), "model_type 'bert' is not supported")


@pytest.mark.parametrize("model_type, kw, needle", [
    ("mistral", dict(sliding_window=16, max_position_embeddings=128), "sliding-window attention (16 tokens)"),
    ("llama", dict(max_position_embeddings=128,
                   rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
     "RoPE scaling type 'yarn' is not supported"),
    ("llama", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True is not supported"),
])
def test_unsupported_model_features(tmp_path, capsys, model_type, kw, needle):
    """Features our decoder does not implement are refused by name, not run wrongly."""
    from transformers import AutoConfig

    d = tmp_path / model_type
    AutoConfig.for_model(model_type, **kw).save_pretrained(d)
    assert_user_error(capsys, _gen(d, "hello"), needle)


def test_model_without_tokenizer(tiny_dirs, capsys):
    assert_user_error(capsys, _gen(tiny_dirs["llama"], "hello"), "has no tokenizer")


def test_bin_checkpoint_with_python_objects_is_refused(tiny_dirs, tmp_path, capsys):
    """weights_only: a pickled object is refused, and its code never runs."""
    d = tmp_path / "evil"
    d.mkdir()
    shutil.copy(tiny_dirs["llama"] / "config.json", d)
    marker = tmp_path / "pwned"
    torch.save({"x": _Evil(str(marker))}, d / "pytorch_model.bin")
    assert_user_error(capsys, _gen(d, "hello"), "pytorch_model.bin holds Python objects")
    assert not marker.exists()


class _Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_console_script_exit_code_and_message(tmp_path):
    """The installed ``skipdecode`` command itself (not just ``main``)."""
    exe = Path(sys.executable).parent / "skipdecode"
    r = subprocess.run([str(exe), "generate", "--model", str(tmp_path / "missing"), "hi"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2
    assert r.stderr.startswith("skipdecode: error: model ") and "not found" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_fsdp_with_lora_is_refused(tiny_cli_dir, tmp_path, capsys):
    assert_user_error(capsys, ["train", "--model", str(tiny_cli_dir), "--lora", "--fsdp", "-o", str(tmp_path / "r")],
                      "--fsdp", "DDP")
    assert not (tmp_path / "r").exists()
