"""LoRA adapters on our own module names, via peft: apply, save, merge.

Loading a model (``checkpoint.py``) merges a saved adapter through here, so
loading never imports the trainer; the trainer applies and saves adapters
through here too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import atomic
from .config import ModelError
from .model import BLOCK_LINEARS, Transformer

LORA_TARGETS = list(BLOCK_LINEARS)  # our fused Linear names in every Block
NORMS = ["attn_norm", "mlp_norm", "norm"]  # every Block's two norms and the final one


def apply_lora(net: Transformer, r: int, alpha: int, dropout: float, seed: int, norms: bool = False) -> nn.Module:
    """A peft model whose only trainable parameters are LoRA adapters on every block linear.

    ``norms``: the norms' weights (and biases) train too, whole (peft's
    ``modules_to_save``). A skipped token reaches an upper layer with a
    residual stream of another scale than at full depth; a norm's gain is the
    cheapest place to correct that.
    """
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # adapter initialization
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(LORA_TARGETS), bias="none",
                     modules_to_save=list(NORMS) if norms else None)
    return get_peft_model(net, cfg)


def save_adapter(model: nn.Module, base_path: Path | str, out: Path, meta: dict, tokenizer: Any = None) -> Path:
    """PEFT format (adapter_config.json + adapter_model.safetensors) over our module names."""
    out.mkdir(parents=True, exist_ok=True)
    for c in model.peft_config.values():
        c.base_model_name_or_path = str(base_path)

    with atomic.temp_dir(out, "adapter") as tmp:  # written aside, moved in with adapter_config.json last
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "skipdecode.json").write_text(json.dumps(meta, indent=2) + "\n")
        atomic.move_files_into(tmp, out, last=("skipdecode.json", "adapter_config.json"))
    return out


def merge_peft_model(model: nn.Module) -> Transformer:
    """Fold the LoRA deltas into the base weights (the peft model is consumed)."""
    merged = model.merge_and_unload()
    assert isinstance(merged, Transformer)
    return merged.eval().requires_grad_(False)


def _check_adapter_weights(path: Path) -> None:
    """A clear error for a missing, truncated or foreign weights file, before peft reads it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
    except (SafetensorError, OSError) as e:
        raise ModelError(f"cannot read {path}: {e} (truncated or not a safetensors file?); "
                         "copy or save the adapter again") from None
    if not any("lora_" in n for n in names):
        raise ModelError(f"{path} holds no LoRA weights (no tensor named lora_*): not a LoRA adapter")


def merge_lora(adapter_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
               base_model: str | None = None) -> Path:
    """Merge a saved LoRA adapter into its base model and write a full Hugging Face directory."""
    from peft import PeftModel

    from .checkpoint import load_model, save_hf_model

    adapter = Path(adapter_dir)
    cfg_file = adapter / "adapter_config.json"
    if not cfg_file.is_file():
        raise ModelError(f"{adapter} is not a LoRA adapter directory (no adapter_config.json)")
    try:
        adapter_cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"cannot read {cfg_file}: not valid JSON ({e}); save the adapter again") from None
    base = base_model or (adapter_cfg.get("base_model_name_or_path") if isinstance(adapter_cfg, dict) else None)
    if not base:
        raise ModelError(f"{cfg_file} names no base model: pass base_model")
    _check_adapter_weights(adapter / "adapter_model.safetensors")
    net, path = load_model(base)
    try:
        model = PeftModel.from_pretrained(net, str(adapter))
    except (RuntimeError, ValueError, KeyError, TypeError) as e:  # peft: wrong base, shapes, or config fields
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot apply the LoRA adapter {adapter} to {base}: {first[:300]} "
                         "(was it trained on another base model?)") from None
    meta_file = adapter / "skipdecode.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    return save_hf_model(merge_peft_model(model), path, Path(out_dir) if out_dir else adapter / "merged", meta)
