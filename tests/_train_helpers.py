"""Tiny random checkpoints and data files for the training tests (no network, no big model)."""

from __future__ import annotations

import contextlib
import csv
import json
from pathlib import Path

import torch

E2E_ROWS = [
    ("name[The Eagle], eatType[coffee shop], food[Japanese], area[riverside]",
     ["The Eagle is a Japanese coffee shop by the riverside.", "By the river, The Eagle serves Japanese food."]),
    ("name[Alimentum], food[Italian], priceRange[cheap]",
     ["Alimentum serves cheap Italian food.", "For cheap Italian food, try Alimentum."]),
    ("name[The Punter], eatType[pub], familyFriendly[yes]",
     ["The Punter is a family friendly pub.", "The Punter pub welcomes families."]),
    ("name[Aromi], eatType[coffee shop], area[city centre]",
     ["Aromi is a coffee shop in the city centre.", "In the city centre you will find Aromi, a coffee shop."]),
    ("name[Zizzi], food[French], customer rating[5 out of 5]",
     ["Zizzi serves French food and is rated 5 out of 5.", "Rated 5 out of 5, Zizzi offers French food."]),
    ("name[Cotto], eatType[restaurant], near[Burger King]",
     ["Cotto is a restaurant near Burger King.", "Near Burger King there is a restaurant called Cotto."]),
]


@contextlib.contextmanager
def one_thread():
    """Tiny models run fastest on one thread, and a busy 2-core machine makes a second
    OpenMP thread wait for a core at every op (10x slower steps)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def write_e2e_csv(path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["mr", "ref"])
        for mr, refs in E2E_ROWS:
            for r in refs:
                w.writerow([mr, r])
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def smollm2_tokenizer_dir() -> Path:
    """The converted default model's directory: its tokenizer serves the tiny text models."""
    from skipdecode.checkpoint import resolve

    return resolve("default")


# SmolLM2-Instruct's chat template: the tiny tokenizer behaves like the default model's.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TINY_VOCAB = 384


def make_tokenizer(path: Path, vocab: int = TINY_VOCAB) -> Path:
    """A byte-level BPE tokenizer trained on the test sentences, with SmolLM2's special tokens
    (ids 0, 1, 2) and chat template: a 49k vocabulary would make the tiny models' logits dominate."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [mr + " " + r for mr, refs in E2E_ROWS for r in refs] + [CHAT_TEMPLATE]
    tok.train_from_iterator(corpus * 3, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path


def make_tiny(path: Path, arch: str = "llama", layers: int = 8, vocab: int | None = None,
              tokenizer: bool = True, seed: int = 0) -> Path:
    """A random transformers checkpoint (config.json + safetensors [+ a tiny chat tokenizer])."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, OPTConfig

    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=vocab or TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                          rope_theta=10000.0)
    elif arch == "llama_untied":
        cfg = LlamaConfig(vocab_size=vocab or 256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    elif arch == "opt":
        cfg = OPTConfig(vocab_size=vocab or 256, hidden_size=32, ffn_dim=64, num_hidden_layers=layers,
                        num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=16)
    elif arch == "gpt2":
        cfg = GPT2Config(vocab_size=vocab or 256, n_embd=32, n_layer=layers, n_head=4, n_positions=512)
    else:
        raise ValueError(arch)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger random weights: predictions depend visibly on the layers run
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    if tokenizer:
        make_tokenizer(path, cfg.vocab_size)
    return path


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))
