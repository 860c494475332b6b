"""Model configuration: one dataclass with named switches for the architecture
differences our single decoder implementation supports (Llama family, OPT,
GPT-2), built from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import SkipDecodeError


# The linears' weight dtypes (model.PackedLinear): fp32, bf16, weight-only int8 / int4, and int8 / int4
# weights with int8 activations (w8a8, w4a8) or 15-bit integer activations (w8a16, w4a16). Here, beside the other switches, so that the CLI's
# choices come from the same tuple without importing torch.
WEIGHT_DTYPES = ("float32", "bfloat16", "int8", "int4", "w8a8", "w4a8", "w8a16", "w4a16")
DTYPE_HELP = ("weights: float32, bfloat16, int8 (per channel) or int4 (groups of 32) weight-only, or w8a8 / w4a8 "
              "(int8 / int4 weights with int8 activations), or w8a16 / w4a16 (with 15-bit integer activations)")
# The KV cache's dtypes (engine.kv_cache.KV_DTYPES): keys and values rounded to it when stored.
KV_DTYPE_NAMES = ("float32", "float16", "bfloat16")
KV_DTYPE_HELP = ("the KV cache's dtype (default: the model's, float32): float16 or bfloat16 halve the cache and "
                 "the keys/values each decode step reads, rounding them when stored (llama.cpp's default is float16)")


class ModelError(SkipDecodeError):
    """A model or checkpoint we cannot load, with what to do about it."""


@dataclass
class ModelConfig:
    arch: str  # "llama" (Llama/Mistral/Qwen2/SmolLM2), "opt", "gpt2"
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-5
    pos: str = "rope"  # "rope" | "learned"
    pos_offset: int = 0  # OPT's learned positions start at index 2
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    mlp: str = "swiglu"  # "swiglu" | "relu" | "gelu" | "gelu_tanh"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    pre_norm: bool = True  # OPT-350m is post-norm (do_layer_norm_before=False)
    final_norm: bool = True
    embed_proj_dim: int | None = None  # OPT word_embed_proj_dim != hidden_size
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hf_model_type: str = ""


_LLAMA_LIKE = {"llama", "mistral", "qwen2", "smollm2"}
_ACT = {"silu": "swiglu", "relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def _eos_list(eos: Any) -> list[int]:
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def config_from_hf(hf: Any) -> ModelConfig:
    """Translate a transformers ``PretrainedConfig`` into our ``ModelConfig``."""
    mt = getattr(hf, "model_type", "")
    if mt in _LLAMA_LIKE:
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ModelError(f"{mt} checkpoint with hidden_act={act!r} is not supported (expected silu)")
        sw = getattr(hf, "sliding_window", None)
        if getattr(hf, "use_sliding_window", mt == "mistral") and sw is not None and sw < hf.max_position_embeddings:
            raise ModelError(
                f"{mt} checkpoint uses sliding-window attention ({sw} tokens) which skipdecode does not implement"
            )
        rope = getattr(hf, "rope_scaling", None) or getattr(hf, "rope_parameters", None)
        theta = getattr(hf, "rope_theta", None)
        if theta is None and isinstance(rope, dict):
            theta = rope.get("rope_theta")
        if isinstance(rope, dict):
            rtype = rope.get("rope_type", rope.get("type", "default"))
            if rtype == "default":
                rope = None
            elif rtype != "llama3":
                raise ModelError(f"RoPE scaling type {rtype!r} is not supported (default and llama3 are)")
        n_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
        return ModelConfig(
            arch="llama", vocab_size=hf.vocab_size, dim=hf.hidden_size, n_layers=hf.num_hidden_layers,
            n_heads=n_heads, n_kv_heads=getattr(hf, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim, intermediate_size=hf.intermediate_size,
            max_position=hf.max_position_embeddings, norm="rms", norm_eps=hf.rms_norm_eps,
            pos="rope", rope_theta=float(theta or 10000.0), rope_scaling=rope, mlp="swiglu",
            qkv_bias=bool(getattr(hf, "attention_bias", False)) or mt == "qwen2",
            o_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            bos_token_id=hf.bos_token_id, eos_token_ids=_eos_list(hf.eos_token_id), hf_model_type=mt,
        )
    if mt == "opt":
        act = hf.activation_function
        if act not in _ACT:
            raise ModelError(f"OPT activation {act!r} is not supported")
        return ModelConfig(
            arch="opt", vocab_size=hf.vocab_size, dim=hf.hidden_size, n_layers=hf.num_hidden_layers,
            n_heads=hf.num_attention_heads, n_kv_heads=hf.num_attention_heads,
            head_dim=hf.hidden_size // hf.num_attention_heads, intermediate_size=hf.ffn_dim,
            max_position=hf.max_position_embeddings, norm="layer", norm_eps=1e-5, pos="learned",
            pos_offset=2, mlp=_ACT[act], qkv_bias=hf.enable_bias, o_bias=hf.enable_bias,
            mlp_bias=hf.enable_bias, pre_norm=hf.do_layer_norm_before,
            final_norm=hf.do_layer_norm_before and not getattr(hf, "_remove_final_layer_norm", False),
            embed_proj_dim=hf.word_embed_proj_dim if hf.word_embed_proj_dim != hf.hidden_size else None,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
            bos_token_id=hf.bos_token_id, eos_token_ids=_eos_list(hf.eos_token_id), hf_model_type=mt,
        )
    if mt == "gpt2":
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if getattr(hf, flag, False):
                raise ModelError(f"GPT-2 option {flag}=True is not supported")
        if not getattr(hf, "scale_attn_weights", True):
            raise ModelError("GPT-2 option scale_attn_weights=False is not supported")
        act = hf.activation_function
        if act not in _ACT:
            raise ModelError(f"GPT-2 activation {act!r} is not supported")
        return ModelConfig(
            arch="gpt2", vocab_size=hf.vocab_size, dim=hf.n_embd, n_layers=hf.n_layer,
            n_heads=hf.n_head, n_kv_heads=hf.n_head, head_dim=hf.n_embd // hf.n_head,
            intermediate_size=hf.n_inner or 4 * hf.n_embd, max_position=hf.n_positions,
            norm="layer", norm_eps=hf.layer_norm_epsilon, pos="learned", mlp=_ACT[act],
            qkv_bias=True, o_bias=True, mlp_bias=True,
            tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
            bos_token_id=hf.bos_token_id, eos_token_ids=_eos_list(hf.eos_token_id), hf_model_type=mt,
        )
    raise ModelError(
        f"model_type {mt!r} is not supported; skipdecode runs Llama-family (llama, mistral, qwen2), "
        "OPT and GPT-2 checkpoints"
    )
