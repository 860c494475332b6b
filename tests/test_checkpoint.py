"""Checkpoints load as weights only, from safetensors (sharded too), ``.bin``
and GGUF; a GGUF is converted once and the conversion is reused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import skipdecode.checkpoint as ckpt
from conftest import VOCAB, write_tiny_gguf
from skipdecode.checkpoint import load_model, resolve


def _logits(net, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return net(tokens, torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1))


TOKENS = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf_llama(tiny_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()


def test_bin_checkpoint_loads_with_weights_only(tiny_dirs, hf_llama, tmp_path, monkeypatch):
    d = tmp_path / "bin"
    d.mkdir()
    hf_llama.config.save_pretrained(d)
    torch.save(hf_llama.state_dict(), d / "pytorch_model.bin")
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or real_load(*a, **kw))
    net, path = load_model(d)
    assert path == d
    assert calls and all(kw.get("weights_only") is True for kw in calls)
    ref, _ = load_model(tiny_dirs["llama"])
    assert torch.equal(_logits(net, TOKENS), _logits(ref, TOKENS))
    with torch.no_grad():
        assert (_logits(net, TOKENS) - hf_llama(TOKENS).logits).abs().max() <= 1e-4


def test_sharded_safetensors_load(hf_llama, tiny_dirs, tmp_path):
    d = tmp_path / "sharded"
    hf_llama.save_pretrained(d, max_shard_size="40KB")
    assert len(list(d.glob("*.safetensors"))) > 1
    net, _ = load_model(d)
    ref, _ = load_model(tiny_dirs["llama"])
    assert torch.equal(_logits(net, TOKENS), _logits(ref, TOKENS))


def test_tied_head_shares_the_embedding(tiny_models):
    for name in ("opt", "gpt2", "llama3_rope"):
        net = tiny_models[name]
        assert net.cfg.tie_embeddings and net.lm_head.weight is net.tok_emb.weight
    assert not tiny_models["llama"].cfg.tie_embeddings
    assert not torch.equal(tiny_models["llama"].lm_head.weight, tiny_models["llama"].tok_emb.weight)


def test_bfloat16_load(tiny_dirs, tiny_models):
    from skipdecode import LLM

    from skipdecode.model import PackedLinear

    llm = LLM.load(tiny_dirs["gpt2"], dtype="bfloat16")  # the linears' weights in bf16, the rest fp32
    linears = [m for m in llm.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.weights == "bfloat16" for m in linears)
    assert all(p.dtype == torch.float32 for p in llm.model.parameters())  # embeddings, norms
    diff = (_logits(llm.model, TOKENS).float() - _logits(tiny_models["gpt2"], TOKENS)).abs().max().item()
    assert diff < 0.5  # bf16 rounding only


# -- GGUF -----------------------------------------------------------------------

def _no_conversion(monkeypatch):
    import transformers.modeling_gguf_pytorch_utils as g

    def fail(*a, **kw):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(g, "load_gguf_checkpoint", fail)
    monkeypatch.setattr(ckpt.atomic, "build_dir", fail)


def test_gguf_file_loads_and_converts_once(hf_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path / "cache"))
    gguf_path = write_tiny_gguf(hf_llama, tmp_path / "tiny.gguf")

    net, path = load_model(gguf_path)
    assert path.parent == tmp_path / "cache" and path.name.startswith("tiny-")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    # a Hugging Face directory as transformers writes it: converters (llama.cpp's) read the class name
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name], "no half-written conversion left"
    with torch.no_grad():
        assert (_logits(net, TOKENS) - hf_llama(TOKENS).logits).abs().max().item() <= 1e-4

    mtime = (path / "model.safetensors").stat().st_mtime_ns
    with monkeypatch.context() as m:
        _no_conversion(m)
        again, path2 = load_model(gguf_path)
    assert path2 == path and (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert torch.equal(_logits(again, TOKENS), _logits(net, TOKENS))

    # the tokenizer came along: the whole LLM runs from the .gguf path
    from skipdecode import LLM

    llm = LLM.load(gguf_path)
    assert llm.encode("hi", chat=False) == [104, 105]
    (out,) = llm.generate("hi", max_new_tokens=3, chat=False, ignore_eos=True)
    assert out.new_tokens == 3

    # the special tokens are the ones the GGUF records (ids 1 and 2), whatever transformers made of them
    assert (llm.tokenizer.bos_token_id, llm.tokenizer.eos_token_id) == (1, 2) and 2 in llm.eos_token_ids

    # a changed file is a different model: converted anew, not served stale
    st = gguf_path.stat()
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert resolve(gguf_path) != path


def test_special_tokens_are_pinned_to_the_ids_the_gguf_records(hf_llama, tmp_path):
    """A tokenizer whose EOS a transformers version got wrong is set back to the GGUF's ids."""
    from transformers import AutoTokenizer

    gguf_path = write_tiny_gguf(hf_llama, tmp_path / "tiny.gguf")
    ids = ckpt.gguf_special_token_ids(gguf_path)
    assert ids == {"bos_token": 1, "eos_token": 2}
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    tok.eos_token = tok.convert_ids_to_tokens(1)  # the wrong one
    ckpt.pin_special_tokens(tok, ids)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


@pytest.mark.slow
def test_default_model_conversion_is_cached(default_llm, monkeypatch):
    """``default`` is converted once into the cache; later loads only read it."""
    path = default_llm.path
    assert path.parent == ckpt.cache_dir()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    _no_conversion(monkeypatch)
    assert resolve("default") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert default_llm.num_layers == 30 and default_llm.model.cfg.n_kv_heads == 3


def test_exported_config_names_its_architecture_even_when_the_source_did_not(tiny_dirs, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_dirs["qwen2"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("architectures", None)
    (src / "config.json").write_text(json.dumps(cfg))
    net, path = load_model(src)
    out = ckpt.save_hf_model(net, path, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert ckpt.hf_architecture({"model_type": "gpt2"}) == "GPT2LMHeadModel"
    assert ckpt.hf_architecture({"architectures": ["OPTForCausalLM"], "model_type": "opt"}) == "OPTForCausalLM"
    with pytest.raises(ckpt.ModelError, match="unknown model_type 'nonesuch'"):
        ckpt.hf_architecture({"model_type": "nonesuch"})


def test_an_adapter_reused_from_another_place_or_reinstall_merges_once(tiny_cli_dir, tmp_path, monkeypatch):
    """The merged model is keyed by the adapter's bytes, not its path or mtime: a
    fresh clone or a reinstall of the same adapter must not write another full copy."""
    import shutil

    from safetensors.torch import load_file, save_file

    from skipdecode.checkpoint import load_model
    from skipdecode.lora import apply_lora, save_adapter

    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path / "cache"))
    net, base = load_model(tiny_cli_dir)
    a = save_adapter(apply_lora(net, r=2, alpha=4, dropout=0.0, seed=0), base, tmp_path / "adapter", {})
    merged = resolve(a)
    copy = tmp_path / "elsewhere" / "adapter"
    shutil.copytree(a, copy)
    for f in copy.iterdir():  # a new checkout: same bytes, new times
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    with monkeypatch.context() as m:
        m.setattr("skipdecode.lora.merge_lora", lambda *a, **k: pytest.fail("merged a second time"))
        assert resolve(copy) == merged
    assert len(list((tmp_path / "cache").glob("adapter-merged-*"))) == 1
    # changed weights are a different model: merged anew, not served stale
    sd = load_file(copy / "adapter_model.safetensors")
    k = next(k for k in sd if "lora_B" in k)
    sd[k] = sd[k] + 1.0
    save_file(sd, copy / "adapter_model.safetensors", metadata={"format": "pt"})
    assert resolve(copy) != merged
