"""Layer importance, measured: Block Influence, and the nested layer sets built on it.

A layer's Block Influence (ShortGPT, Men et al. 2024) is ``1 - cos(x_in, x_out)``
of its hidden states, averaged over tokens: a layer that barely turns the
residual stream matters little. Static layer drop (``static_drop.py``) removes the
least influential layers for every token; nested layer sets skip them first
during decoding only.

SkipDecode skips the *bottom* layers (SKIPDECODE.md). What its KV argument needs
is weaker: the layer sets must be nested, ``S(b) ⊂ S(b')`` for ``b < b'``. A
later token never has a larger budget than an earlier one, so every layer it
runs was run by every earlier position and its keys/values exist. Any order of
the layers defines such a family (budget ``b`` runs the first ``b`` layers of
the order, in depth order); "skip the bottom" is one order, early exit another.
``nested_order`` puts the most influential layers first, measured on the
positions that skipping affects: those that predict answer tokens.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..errors import SkipDecodeError
from ..model import Transformer


@torch.no_grad()
def block_influence(net: Transformer, sequences: Iterable[Sequence[int]],
                    starts: Sequence[int] | None = None) -> list[float]:
    """Per layer, ``1 - cos(input, output)`` of its hidden states, averaged over the tokens of
    ``sequences`` from ``starts[k]`` on (default: every token); each sequence runs alone, so no
    padding enters the mean."""
    L = len(net.layers)
    total = torch.zeros(L, dtype=torch.float64)
    count = 0
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [b.register_forward_hook(lambda _m, args, out: captured.append((args[0], out)))
             for b in net.layers]
    was = net.training
    net.eval()
    try:
        for k, seq in enumerate(sequences):
            ids = torch.as_tensor(list(seq), dtype=torch.long)[None]
            s = starts[k] if starts is not None else 0
            if ids.shape[1] <= s:
                continue
            captured.clear()
            net(ids, torch.arange(ids.shape[1])[None])
            for layer, (x_in, x_out) in enumerate(captured):
                cos = torch.nn.functional.cosine_similarity(x_in[0, s:].double(), x_out[0, s:].double(), dim=-1)
                total[layer] += (1 - cos).sum()
            count += ids.shape[1] - s
    finally:
        for h in hooks:
            h.remove()
        net.train(was)
    if count == 0:
        raise SkipDecodeError("no tokens to measure layer influence on: give at least one non-empty sequence")
    return (total / count).tolist()


def answer_influence(net: Transformer, items: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[float]:
    """Block Influence over the positions that predict target tokens (the last prompt token and
    every fed-back target token but the last) of ``(prompt_ids, target_ids)`` pairs: the positions
    a decode-time skip schedule affects."""
    seqs = [list(p) + list(t[:-1]) for p, t in items if p and t]
    return block_influence(net, seqs, [len(p) - 1 for p, t in items if p and t])


def nested_order(influence: Sequence[float]) -> tuple[int, ...]:
    """Layers by decreasing influence (ties: the deeper layer first): budget ``b`` runs the
    first ``b`` of them."""
    return tuple(sorted(range(len(influence)), key=lambda i: (-influence[i], -i)))
