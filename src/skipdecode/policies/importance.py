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
``removal_order`` measures what removing layers does instead: it takes layers
away one at a time, each time the one whose absence (with those already gone)
raises the answer tokens' loss least (SLEB, Song et al. 2024, by perplexity),
so the family it defines is the one greedy search finds, budget by budget.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from ..data import IGNORE, left_pad
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


class _PrefixKV:
    """The prompt's keys/values per layer, computed once at full depth; an answer chunk
    attends to them and to its own (nothing it computes is stored)."""

    def __init__(self) -> None:
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.recording = True

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recording:
            self.kv[layer] = (k, v)
            return k, v
        pk, pv = self.kv[layer]
        return torch.cat([pk, k], 2), torch.cat([pv, v], 2)


def _answer_loss_fn(net: Transformer, items: Sequence[tuple[Sequence[int], Sequence[int]]],
                    batch_size: int) -> Callable[[frozenset[int]], float]:
    """``loss(removed)``: mean cross-entropy of the answer tokens after the first when the
    layers in ``removed`` do not run at answer positions (the prompt, and the last prompt
    position that predicts the first answer token, stay at full depth, as in decoding)."""
    L = len(net.layers)
    batches = []
    for i in range(0, len(items), batch_size):
        chunk = [(list(p), list(t)) for p, t in items[i:i + batch_size] if p and len(t) > 1]
        if not chunk:
            continue
        # training's layout (data.left_pad): prompts end at column t0 - 1, answers are fed from t0 on
        lay = left_pad(chunk)
        t0, kv = lay.t0, lay.key_valid
        cache = _PrefixKV()
        net(lay.tokens[:, :t0], lay.positions[:, :t0], cache=cache, key_valid=kv[:, :t0], last_only=True)
        cache.recording = False
        # labels from t0 on: the answer tokens after the first (the first is the prompt's, at full depth)
        batches.append((lay.tokens[:, t0:], lay.positions[:, t0:], kv, t0, cache, lay.labels[:, t0:]))
    if not batches:
        raise SkipDecodeError("no answer of two or more tokens to measure layer removal on")
    n = sum(int((lab != IGNORE).sum()) for *_, lab in batches)

    def loss(removed: frozenset[int]) -> float:
        total = 0.0
        for tok, pos, kv, t0, cache, labels in batches:
            T = tok.shape[1]
            logits = net(tok, pos, [0 if l in removed else T for l in range(L)], cache=cache, start=t0,
                         key_valid=kv)
            total += float(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                             ignore_index=IGNORE, reduction="sum"))
        return total / n

    return loss


@torch.no_grad()
def removal_order(net: Transformer, items: Sequence[tuple[Sequence[int], Sequence[int]]],
                  batch_size: int = 16, keep: int = 1) -> tuple[tuple[int, ...], list[float]]:
    """Layers, most important first, by greedy removal on ``(prompt_ids, target_ids)`` pairs:
    repeatedly drop the layer whose removal at answer positions raises the answer loss least,
    until ``keep`` layers remain (those come first, in depth order). Returns the order and
    the answer loss at each budget from ``L - 1`` down to ``keep`` (entry ``i``: budget ``L - 1 - i``).
    About ``L**2 / 2`` passes over the answers alone (the prompts' keys/values are computed once)."""
    L = len(net.layers)
    if not 1 <= keep <= L:
        raise SkipDecodeError(f"keep must be an integer in [1, {L}], got {keep!r}")
    was = net.training
    net.eval()
    try:
        loss = _answer_loss_fn(net, items, batch_size)
        removed: list[int] = []
        at: list[float] = []
        while L - len(removed) > keep:
            gone = frozenset(removed)
            best, l = min((loss(gone | {l}), l) for l in range(L) if l not in gone)  # ties: the deeper stays
            removed.append(l)
            at.append(best)
    finally:
        net.train(was)
    kept = [l for l in range(L) if l not in removed]
    order = tuple(kept) + tuple(reversed(removed))
    return order, at
