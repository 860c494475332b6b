"""Shared fixtures: tiny random Hugging Face checkpoints of every supported
architecture (built offline, seeded), a tiny Llama with a byte-level tokenizer
for the CLI, and the real default model (slow tests only)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The default model is converted once into the user's cache and reused across
# runs; never point this at a temporary directory (that would reconvert, ~25 s).
from skipdecode.checkpoint import cache_dir  # noqa: E402

os.environ.setdefault("SKIPDECODE_CACHE", str(cache_dir()))
# The fp32 forms are chosen by timing on the user's machine; tests take the fixed rule
# (compiled kernels up to 8 rows) so what runs does not depend on a busy CPU's timings.
# tests/test_dispatch.py times and checks the autotuner itself.
os.environ.setdefault("SKIPDECODE_AUTOTUNE", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


def _kernels_buildable() -> bool:
    import shutil

    from skipdecode import kernels

    return kernels._cpu_has_avx2_fma() and shutil.which("c++") is not None


# Whether the compiled kernels can build here (an AVX2/FMA CPU and a C++ compiler), and the mark
# for tests that need them.
BUILDABLE = _kernels_buildable()
needs_kernels = pytest.mark.skipif(not BUILDABLE, reason="no AVX2/FMA CPU or no C++ compiler")


def pytest_sessionstart(session):
    """Build the compiled kernels once, before any test runs: otherwise the first CLI
    subprocess to load them builds them and prints a one-time notice that tests of the
    CLI's exact output would see (order dependent)."""
    from skipdecode import kernels

    kernels.load()


# Tiny models gain nothing from intra-op threads, and on a shared 2-core
# machine OpenMP spin-waiting made the suite ~2.5x slower with 2 threads.
torch.set_num_threads(1)

VOCAB = 256
_LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2)

# name -> (model_type, config kwargs). initializer_range 0.2 (not 0.02) spreads
# the logits so greedy argmax is never decided by a 1e-6 rounding difference.
TINY_SPECS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(_LLAMA, tie_word_embeddings=False)),  # GQA, untied head
    "llama3_rope": ("llama", dict(_LLAMA, num_hidden_layers=5, tie_word_embeddings=True, max_position_embeddings=256,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2": ("qwen2", dict(_LLAMA, num_hidden_layers=5, tie_word_embeddings=False)),  # q/k/v biases
    "mistral": ("mistral", dict(_LLAMA, sliding_window=None, tie_word_embeddings=False)),
    "opt": ("opt", dict(vocab_size=VOCAB, hidden_size=64, word_embed_proj_dim=32, ffn_dim=128, num_hidden_layers=6,
                        num_attention_heads=4, max_position_embeddings=128, init_std=0.2,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "opt_postnorm": ("opt", dict(vocab_size=VOCAB, hidden_size=64, word_embed_proj_dim=64, ffn_dim=128,
                                 num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=128,
                                 do_layer_norm_before=False, init_std=0.2,
                                 bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "gpt2": ("gpt2", dict(vocab_size=VOCAB, n_embd=64, n_layer=5, n_head=4, n_positions=128, initializer_range=0.2,
                          bos_token_id=1, eos_token_id=2)),
}
TINY_ARCHS = list(TINY_SPECS)


def build_tiny(model_type: str, out: Path, seed: int = 0, **kw):
    """A seeded random transformers model saved with ``save_pretrained``.

    Biases and norm weights are initialised to 0/1 by transformers; perturb
    every 1-D parameter so a mis-mapped bias or norm cannot go unnoticed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return model


def build_deep_llama(out: Path, seed: int, layers: int = 10) -> Path:
    """A tiny Llama with ``layers`` layers (1x-5x reachable with one warm-up layer), a 512-token
    context and an untied head: the engine tests' model."""
    build_tiny("llama", out, seed=seed, **dict(_LLAMA, num_hidden_layers=layers, max_position_embeddings=512,
                                              tie_word_embeddings=False))
    return out


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """name -> directory of a saved tiny random checkpoint (all of TINY_SPECS)."""
    root = tmp_path_factory.mktemp("tiny")
    dirs = {}
    for i, (name, (mt, kw)) in enumerate(TINY_SPECS.items()):
        build_tiny(mt, root / name, seed=i, **kw)
        dirs[name] = root / name
    return dirs


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    """name -> our unpacked ``Transformer`` (session-shared: do not mutate)."""
    from skipdecode.checkpoint import load_model

    return {name: load_model(d)[0] for name, d in tiny_dirs.items()}


@pytest.fixture(scope="session")
def tiny_packed(tiny_dirs):
    """name -> our ``Transformer`` packed for decoding, on the compiled kernels
    where they build (as ``LLM.load`` builds it)."""
    from skipdecode.checkpoint import load_model

    return {name: load_model(d)[0].pack_for_inference() for name, d in tiny_dirs.items()}


@pytest.fixture(scope="session")
def tiny_onednn(tiny_dirs):
    """name -> our ``Transformer`` packed with the kernels off (oneDNN linears)."""
    from skipdecode.checkpoint import load_model

    return {name: load_model(d)[0].pack_for_inference(use_kernels=False) for name, d in tiny_dirs.items()}


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + ``<|endoftext|>`` (id 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    vocab["<|endoftext|>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


CLI_EOS = 256
CLI_MAX_POSITION = 64


@pytest.fixture(scope="session")
def tiny_cli_dir(tmp_path_factory) -> Path:
    """A 6-layer tiny Llama with a byte-level tokenizer and a 64-token context,
    so the CLI and ``LLM`` run end to end in a fraction of a second."""
    d = tmp_path_factory.mktemp("tiny_cli") / "llama"
    model = build_tiny("llama", d, seed=42, **dict(_LLAMA, vocab_size=264, num_hidden_layers=6,
                                                   max_position_embeddings=CLI_MAX_POSITION,
                                                   tie_word_embeddings=False, eos_token_id=CLI_EOS))
    with torch.no_grad():
        # EOS logit is then exactly 0, far below the greedy winner among 263
        # random logits: greedy runs always go to length (tests assert it).
        model.lm_head.weight[CLI_EOS].zero_()
    model.save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def default_llm():
    """The real SmolLM2-135M-Instruct (30 layers), packed, converted once into the user's cache."""
    from skipdecode import LLM

    return LLM.load("default")


def pick_eos(token_ids: list[list[int]], min_step: int = 1) -> tuple[int, int, int]:
    """From a run without EOS, choose ``(row, step, token)`` such that using
    ``token`` as EOS ends exactly ``row`` at ``step`` and no other row early."""
    for r, ids in enumerate(token_ids):
        for s in range(min_step, len(ids) - 1):
            tok = ids[s]
            if tok not in ids[:s] and all(tok not in o for i, o in enumerate(token_ids) if i != r):
                return r, s, tok
    raise AssertionError("no token ends exactly one row early; change the prompts")


def drive(eng, arrivals: dict[int, list[dict]], plans: list | None = None, check=None) -> dict[str, object]:
    """Add each request (``Engine.add_request`` keywords) at its engine step, step
    until all finish; final outputs by id. ``plans`` collects every step's plan;
    ``check(output)`` sees every output of every step."""
    done = {}
    if plans is not None:
        schedule = eng.scheduler.schedule
        eng.scheduler.schedule = lambda step: plans.append(schedule(step)) or plans[-1]
    while any(s >= eng.step_count for s in arrivals) or eng.has_unfinished():
        for spec in arrivals.get(eng.step_count, []):
            eng.add_request(**spec)
        for o in eng.step():
            if check is not None:
                check(o)
            if o.finished:
                done[o.request_id] = o
        assert eng.pool.used_slots <= sum(eng.pool.capacities)
        assert eng.num_running <= eng.config.max_num_seqs
    return done


def write_tiny_gguf(hf, path: Path, arch: str = "llama") -> Path:
    """Write a transformers Llama or Qwen2 as an fp32 GGUF the way llama.cpp's converter
    does (Llama's q/k rows permuted for its RoPE layout; Qwen2's q/k/v biases), with a
    byte-level vocabulary."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = hf.config

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or getattr(c, "rope_theta", None)
    w.add_rope_freq_base(float(theta or 10000.0))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    b2u = bytes_to_unicode()
    w.add_tokenizer_model("gpt2")
    w.add_token_list([b2u[i] for i in range(256)])
    w.add_token_types([1] * 256)
    w.add_token_scores([0.0] * 256)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for theirs, g in names.items():
            t = sd[f"model.layers.{i}.{theirs}.weight"]
            if arch == "llama" and theirs == "self_attn.q_proj":
                t = permute(t, c.num_attention_heads)
            elif arch == "llama" and theirs == "self_attn.k_proj":
                t = permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{g}.weight", np.ascontiguousarray(t))
            bias = sd.get(f"model.layers.{i}.{theirs}.bias")
            if bias is not None:
                w.add_tensor(f"blk.{i}.{g}.bias", np.ascontiguousarray(bias))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def build_chat_model(d: Path, seed: int, layers: int, chat_template: str) -> Path:
    """A tiny Llama a server can run: 512 positions, the byte-level tokenizer with
    ``chat_template``, and EOS (id 256) never winning greedy, so requests run to max_tokens."""
    m = build_tiny("llama", d, seed=seed, **dict(_LLAMA, vocab_size=264, num_hidden_layers=layers,
                                                   max_position_embeddings=512, tie_word_embeddings=False,
                                                   eos_token_id=256))
    with torch.no_grad():
        m.lm_head.weight[256].zero_()
    m.save_pretrained(d)
    tok = byte_tokenizer()
    tok.chat_template = chat_template
    tok.save_pretrained(d)
    return d
