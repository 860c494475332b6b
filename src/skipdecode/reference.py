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

Greedy only, and slow on purpose: it shares nothing with ``generate.py``;
from the model it uses only the embedding, the blocks and the head, never
the cache or the skipping forward pass.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .model import Transformer
from .schedule import SkipSchedule


@torch.inference_mode()
def naive_logits(model: Transformer, tokens: Sequence[int], n_prompt: int, schedule: SkipSchedule) -> torch.Tensor:
    """Logits ``(T, vocab)`` of one sequence whose first ``n_prompt`` tokens are the prompt."""
    T = len(tokens)
    L = model.cfg.n_layers
    ids = torch.tensor([list(tokens)])  # (1, T)
    positions = torch.arange(T)[None]  # (1, T)
    # active[l, t]: does position t run layer l?
    active = torch.ones(L, T, dtype=torch.bool)
    for t in range(n_prompt, T):
        run = set(schedule.layers(t - n_prompt))
        active[:, t] = torch.tensor([l in run for l in range(L)])
    is_prefix = active.int().diff(dim=1) <= 0  # never inactive then active again
    assert bool(is_prefix.all()), "active positions of some layer are not a prefix of the sequence"

    x, rope = model.embed(ids, positions)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]  # (1, 1, T, T)
    for l in range(L):
        y = model.layers[l](x, rope, causal, None, l, 0)
        x = torch.where(active[l][None, :, None], y, x)
    return model.head(x)[0]


def naive_generate(model: Transformer, prompt: Sequence[int], schedule: SkipSchedule, max_new_tokens: int,
                   eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Greedy generation for one prompt, recomputing everything for every token."""
    seq = list(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(naive_logits(model, seq, len(prompt), schedule)[-1].argmax())
        new.append(nxt)
        seq.append(nxt)
        if nxt in eos_token_ids:
            break
    return new
