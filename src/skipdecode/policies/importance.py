"""Nested layer sets by measured importance: which ``b`` layers a budget of ``b`` runs.

SkipDecode skips the *bottom* layers (SKIPDECODE.md). What its KV argument needs
is weaker: the layer sets must be nested, ``S(b) ⊂ S(b')`` for ``b < b'``. A
later token never has a larger budget than an earlier one, so every layer it
runs was run by every earlier position and its keys/values exist. Any order of
the layers defines such a family (budget ``b`` runs the first ``b`` layers of
the order, in depth order); "skip the bottom" is one order, early exit another.

This module measures an order: each layer's Block Influence (ShortGPT, Men et
al. 2024), ``1 - mean cos(x_in, x_out)`` over the positions that predict answer
tokens, at full depth, on training data. A layer that barely turns the residual
stream is the first to go. ``nested_order`` puts the most influential first.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..model import Transformer


@torch.no_grad()
def block_influence(model: Transformer, items: Sequence[tuple[Sequence[int], Sequence[int]]],
                    pad_id: int = 0, batch_size: int = 8) -> list[float]:
    """Per layer, ``1 - mean cosine(input, output)`` of its hidden states over the
    columns that predict a target token (``items`` are ``(prompt_ids, target_ids)``)."""
    from ..schedule import SkipSchedule
    from ..training.batch import IGNORE, make_batch

    if not items:
        raise ValueError("block_influence needs at least one (prompt, target) example")
    L = len(model.layers)
    sums = torch.zeros(L, dtype=torch.float64)
    count = 0
    seen: dict[int, torch.Tensor] = {}
    select: list[torch.Tensor] = []

    def hook(layer: int):
        def fn(module, args, out):
            x_in, x_out = args[0], out
            m = select[0]
            cos = torch.nn.functional.cosine_similarity(x_in[m].float(), x_out[m].float(), dim=-1)
            seen[layer] = cos.double().sum()
        return fn

    handles = [blk.register_forward_hook(hook(i)) for i, blk in enumerate(model.layers)]
    was = model.training
    model.eval()
    try:
        full = SkipSchedule.full_depth(L)
        for k in range(0, len(items), batch_size):
            b = make_batch(items[k:k + batch_size], full, pad_id)
            select[:] = [b.labels != IGNORE]
            model(b.tokens, b.positions, None, key_valid=b.key_valid, last_only=True)
            for i in range(L):
                sums[i] += seen[i]
            count += int(select[0].sum())
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    return [float(1 - s / count) for s in sums]


def nested_order(influence: Sequence[float]) -> tuple[int, ...]:
    """Layers by decreasing influence (ties: the deeper layer first): budget ``b`` runs the
    first ``b`` of them."""
    return tuple(sorted(range(len(influence)), key=lambda i: (-influence[i], -i)))
