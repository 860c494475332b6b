"""Activation-aware channel scales for 4-bit weights (AWQ, Lin et al., 2024), fitted to the skip schedules.

Rounding a weight to 4 bits costs most where its input channel carries large activations. A
per-input-channel scale ``s`` moves magnitude from those activations into the weight before
rounding, ``W x = (W diag(s)) (x / s)``, and ``1 / s`` folds into whatever produces ``x``: the
norm before the attention and MLP, the value rows before the output projection (one scale per
key/value channel, shared by its query heads), the up rows before the down projection. The
fp32 model computes the same function (to rounding); only its int4 (``int4``, ``w4a8``,
``w4a16``) rounding changes. Per linear, ``s = mean|x| ** a``, ``a`` on a grid, is the one whose
4-bit product is closest to the fp32 one on calibration inputs, each token's error relative to
its output's size (so a few tokens with very large activations do not choose for all).

SkipDecode's upper layers see different inputs at 3x than at full depth (a skipped prefix passes
the embedding straight up), so the calibration inputs come from teacher-forced training examples
run with the checkpoint's own schedules at several speedups, not from full depth alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from . import kernels
from .checkpoint import save_hf_model
from .config import ModelError
from .data import encode_example, load_task
from .model import BLOCK_LINEARS, Transformer, dequantize_int4, quantize_int4

LINEARS = BLOCK_LINEARS  # the linears AWQ scales and GPTQ rounds


def _round_int4(w: torch.Tensor) -> torch.Tensor:
    return dequantize_int4(*quantize_int4(w))


def check_supported(net: Transformer) -> None:
    cfg = net.cfg
    if not cfg.pre_norm or cfg.mlp != "swiglu":
        raise ModelError("awq folds scales into pre-norm SwiGLU layers (the Llama family); "
                         f"this model has {'pre' if cfg.pre_norm else 'post'}-norm layers and a {cfg.mlp} MLP")
    for name, k in (("hidden size", cfg.dim), ("intermediate size", cfg.intermediate_size),
                    ("attention width", cfg.n_heads * cfg.head_dim)):
        if not kernels.whole_groups(k):
            raise ModelError(f"int4 rounds groups of 32 inputs; the {name} {k} is not a multiple of 32")


def each_linear_input(net: Transformer, items: Sequence[tuple[list[int], list[int]]], schedules: Sequence,
                      visit: Callable[[tuple[int, str], torch.Tensor], None], batch_size: int = 16) -> None:
    """Teacher-forced passes over ``items`` under each schedule, calling ``visit((layer, linear),
    rows)`` with the fp32 input rows each block linear receives (the positions a schedule skips at
    a layer never reach it; padding is left out)."""
    from .training.batch import make_batch

    valid: dict[str, torch.Tensor] = {}
    hooks = []
    for li, block in enumerate(net.layers):
        for name in LINEARS:
            def keep(_mod, inp, _out, key=(li, name)):
                x = inp[0].detach().float()
                visit(key, x[valid["mask"][:, : x.shape[1]]])
            hooks.append(getattr(block, name).register_forward_hook(keep))
    try:
        with torch.no_grad():
            for schedule in schedules:
                for i in range(0, len(items), batch_size):
                    b = make_batch(items[i:i + batch_size], schedule)
                    valid["mask"] = torch.ones_like(b.tokens, dtype=torch.bool) if b.key_valid is None else b.key_valid
                    net(b.tokens, b.positions, b.active_len, key_valid=b.key_valid, logits_from=b.tokens.shape[1] - 1)
    finally:
        for h in hooks:
            h.remove()


def linear_inputs(net: Transformer, items: Sequence[tuple[list[int], list[int]]], schedules: Sequence,
                  tokens_per_linear: int = 3072, batch_size: int = 16, seed: int = 0
                  ) -> dict[tuple[int, str], torch.Tensor]:
    """Per ``(layer, linear)``: up to ``tokens_per_linear`` input rows, drawn from teacher-forced
    passes over ``items`` under each schedule (``each_linear_input``)."""
    rows: dict[tuple[int, str], list[torch.Tensor]] = {}
    each_linear_input(net, items, schedules, lambda key, x: rows.setdefault(key, []).append(x), batch_size)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, parts in rows.items():
        x = torch.cat(parts)
        out[key] = x[torch.randperm(len(x), generator=g)[:tokens_per_linear]]
    return out


def best_scale(w: torch.Tensor, x: torch.Tensor, heads: tuple[int, int, int] | None = None, grid: int = 20
               ) -> tuple[torch.Tensor, float, float]:
    """The input-channel scale that minimises the int4 product's error on inputs ``x``; returns it,
    its exponent ``a`` and its error as a share of the unscaled weight's (1.0: no scale helps,
    ``a`` = 0). ``heads = (K, rep, hd)``: the inputs are ``K * rep`` query heads' outputs, each
    group of ``rep`` built from one value head, so channels share a scale per value channel
    (``[K * hd]``)."""
    ref = x @ w.T
    weight = 1 / ref.pow(2).mean(1, keepdim=True).clamp(min=1e-12)  # each token's error relative to its size
    unit = x / x.pow(2).mean(1, keepdim=True).sqrt().clamp(min=1e-6)
    imp = unit.abs().mean(0)
    if heads is not None:
        imp = imp.view(heads).mean(1).reshape(-1)
    base, best = None, (float("inf"), torch.ones_like(imp), 0.0)
    for i in range(grid):
        a = i / grid
        s = imp.clamp(min=1e-5) ** a
        s = s / (s.max() * s.min()).sqrt()
        sf = expand(s, heads)
        err = ((((x / sf) @ _round_int4(w * sf).T - ref).pow(2)) * weight).mean().item()
        base = err if base is None else base
        if err < best[0]:
            best = (err, s, a)
    return best[1], best[2], best[0] / base if base else 1.0


def expand(s: torch.Tensor, heads: tuple[int, int, int] | None) -> torch.Tensor:
    """A value-channel scale ``[K * hd]`` repeated for the ``rep`` query heads of each value head."""
    if heads is None:
        return s
    K, rep, hd = heads
    return s.view(K, 1, hd).expand(K, rep, hd).reshape(-1)


def apply_scales(net: Transformer, inputs: dict[tuple[int, str], torch.Tensor], grid: int = 20) -> list[dict]:
    """Fit and fold a scale for every block linear of ``net`` (in place); one record per linear."""
    check_supported(net)
    cfg = net.cfg
    H, K, hd, inter = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
    v0 = (H + K) * hd  # the value rows of the fused qkv weight
    records = []
    with torch.no_grad():
        for li, block in enumerate(net.layers):
            for name in LINEARS:
                lin = getattr(block, name)
                heads = (K, H // K, hd) if name == "wo" else None
                s, a, share = best_scale(lin.weight.float(), inputs[(li, name)], heads, grid)
                records.append({"layer": li, "linear": name, "exponent": a, "error_share": round(share, 4)})
                if a == 0:
                    continue
                if name == "wqkv":
                    _fold_into_norm(block.attn_norm, s)
                elif name == "w13":
                    _fold_into_norm(block.mlp_norm, s)
                elif name == "w2":  # silu(gate) * up is linear in up: its rows take 1 / s
                    block.w13.weight[inter:] /= s[:, None]
                    if block.w13.bias is not None:
                        block.w13.bias[inter:] /= s
                else:  # attention output is linear in the values: their rows take 1 / s
                    block.wqkv.weight[v0:] /= s[:, None]
                    if block.wqkv.bias is not None:
                        block.wqkv.bias[v0:] /= s
                lin.weight.mul_(expand(s, heads))
    return records


def _fold_into_norm(norm: torch.nn.Module, s: torch.Tensor) -> None:
    norm.weight.div_(s)
    if getattr(norm, "bias", None) is not None:
        norm.bias.div_(s)


def calibration_set(llm, task: str, examples: int, speedups: Sequence[float]) -> tuple[list, list]:
    """``examples`` training examples of ``task`` (token ids of prompt and target) and ``llm``'s
    schedules at ``speedups``: what the scales and GPTQ are fitted on."""
    rows = load_task(task).train[:examples]
    if not rows:
        raise ModelError(f"{task} has no training examples to calibrate on")
    items = [encode_example(llm.tokenizer, r.prompt, r.target) for r in rows]
    return items, [llm.make_schedule(speedup=float(sp)) for sp in speedups]


def fit(llm, task: str = "e2e-heldout", examples: int = 64, speedups: Sequence[float] = (1.0, 2.0, 3.0),
        tokens_per_linear: int = 3072, seed: int = 0) -> dict:
    """Fit the scales of an unpacked ``LLM`` (``LLM.load(..., pack=False)``) on ``examples`` training
    examples of ``task`` run under its schedules at ``speedups``, and fold them in (in place).
    Returns the fit's record: its settings and one entry per linear."""
    net = llm.model
    check_supported(net)  # before the expensive pass over the examples
    items, schedules = calibration_set(llm, task, examples, speedups)
    records = apply_scales(net, linear_inputs(net, items, schedules, tokens_per_linear, seed=seed))
    return {"task": task, "examples": len(items), "speedups": list(map(float, speedups)),
            "tokens_per_linear": tokens_per_linear, "seed": seed, "linears": records}


ROUNDINGS = ("nearest", "gptq")


def calibrate(model: str | os.PathLike, out: str | os.PathLike, task: str = "e2e-heldout", examples: int = 64,
              speedups: Sequence[float] = (1.0, 2.0, 3.0), tokens_per_linear: int = 3072, seed: int = 0,
              rounding: str = "gptq") -> Path:
    """``fit`` on ``model`` and write the scaled fp32 model to ``out`` (its ``skipdecode.json``
    kept, the fit recorded under ``awq``). ``rounding="gptq"`` (the default) then rounds the block
    linears to int4 codes by GPTQ on the same examples (``gptq.fit``; recorded under ``gptq``): the
    written weights are those codes' values, which ``--dtype int4`` / ``w4a8`` / ``w4a16`` run
    exactly (and fp32 runs as the int4 model). ``"nearest"`` writes the scaled model, which
    computes the source's fp32 function and rounds to nearest at load."""
    from .llm import LLM

    if rounding not in ROUNDINGS:
        raise ModelError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    llm = LLM.load(model, pack=False)
    record = fit(llm, task, examples, speedups, tokens_per_linear, seed)
    meta = dict(llm.training)
    meta["awq"] = {"source": str(model), **record}
    if rounding == "gptq":
        from . import gptq

        meta["gptq"] = gptq.fit(llm, task, examples, speedups)
    return save_hf_model(llm.model, llm.path, Path(out), meta)
