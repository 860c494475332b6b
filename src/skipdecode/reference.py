"""A naive, obviously-correct SkipDecode generator, for checking the real one.

For every new token it recomputes the whole sequence from scratch: one row at
a time, no KV cache, no padding, a plain causal mask. At layer ``l`` each
position either runs the block or keeps its hidden state::

    h = where(active[l], block_l(h), h)

where prompt positions are always active and generated token ``i`` (the i-th
sampled token, fed back as input) is active iff ``l in schedule.layers(i)``.

Running the block on every position and keeping only the active outputs is
exact because the active positions at any layer are a prefix of the sequence
(budgets never increase), and a causal query only reads keys at or before it,
so no active position ever reads an inactive position's keys. ``naive_logits``
asserts that prefix property rather than assuming it.

With ``kv_dtype`` (a half-width KV cache) every attention reads keys and
values rounded to that dtype, as a cache of it stores them.

Greedy only, and slow on purpose: it shares nothing with ``generate.py``;
from the model it uses only the embedding, the blocks and the head, never
the cache or the skipping forward pass.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .model import Transformer
from .schedule import SkipSchedule, layers_for_budget


class _Rounded:
    """A block's keys/values rounded to ``dtype`` and back, as a KV cache of that dtype holds them
    (the ``cache.update`` interface of ``Block.forward``, over the whole sequence at once)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k.to(self.dtype).to(k.dtype), v.to(self.dtype).to(v.dtype)


@torch.inference_mode()
def naive_logits(model: Transformer, tokens: Sequence[int], n_prompt: int, schedule: SkipSchedule,
                 budgets: Sequence[int] | None = None, kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits ``(T, vocab)`` of one sequence whose first ``n_prompt`` tokens are the prompt;
    ``budgets[i]``: the budget generated token ``i`` ran at (default: the schedule's);
    ``kv_dtype``: attention reads keys and values rounded to it (default: unrounded)."""
    T = len(tokens)
    L = model.cfg.n_layers
    ids = torch.tensor([list(tokens)])  # (1, T)
    positions = torch.arange(T)[None]  # (1, T)
    # active[l, t]: does position t run layer l?
    active = torch.ones(L, T, dtype=torch.bool)
    for t in range(n_prompt, T):
        i = t - n_prompt
        run = set(schedule.layers(i) if budgets is None else
                  layers_for_budget(L, budgets[i], schedule.warmup_layers, schedule.mode, schedule.layer_order))
        active[:, t] = torch.tensor([l in run for l in range(L)])
    is_prefix = active.int().diff(dim=1) <= 0  # never inactive then active again
    assert bool(is_prefix.all()), "active positions of some layer are not a prefix of the sequence"

    x, rope = model.embed(ids, positions)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]  # (1, 1, T, T)
    for l in range(L):
        y = model.layers[l](x, rope, causal, _Rounded(kv_dtype) if kv_dtype is not None else None, l, 0)
        x = torch.where(active[l][None, :, None], y, x)
    return model.head(x)[0]


def naive_generate(model: Transformer, prompt: Sequence[int], schedule: SkipSchedule, max_new_tokens: int,
                   eos_token_ids: Sequence[int] = (), kv_dtype: torch.dtype | None = None) -> list[int]:
    """Greedy generation for one prompt, recomputing everything for every token."""
    seq = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(naive_logits(model, seq, len(prompt), schedule, kv_dtype=kv_dtype)[-1].argmax())
        new.append(nxt)
        seq.append(nxt)
        if nxt in eos_token_ids:
            break
    return new


def naive_adaptive_generate(model: Transformer, prompt: Sequence[int], schedule: SkipSchedule, threshold: float,
                            max_new_tokens: int, eos_token_ids: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """Greedy adaptive generation recomputing everything: token ``i`` is fed at
    ``schedule.budget(c - 1)`` (``b(0)`` while ``c`` is 0), ``c`` the number of tokens
    0..i chosen with top-1 probability >= ``threshold``. Returns (tokens, budgets fed)."""
    seq = list(prompt)
    new: list[int] = []
    budgets: list[int] = []
    confident = 0
    for _ in range(max_new_tokens):
        row = naive_logits(model, seq, len(prompt), schedule, budgets)[-1]
        nxt = int(row.argmax())
        confident += int(torch.softmax(row.float(), -1).max().item() >= threshold)
        new.append(nxt)
        seq.append(nxt)
        if nxt in eos_token_ids or len(new) == max_new_tokens:
            break
        budgets.append(schedule.budget(max(confident - 1, 0)))
    return new, budgets
