"""Next tokens from logits: greedy rows in one batched argmax, sampled rows
each from its own generator with its own temperature, top-k and top-p."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .request import SamplingParams


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Temperature-scaled logits ``(n, vocab)`` with everything outside top-k / top-p at -inf."""
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature  # the top logit is 0: no overflow
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest set reaching top_p
        drop[..., 0] = False  # and always the most likely token (a tiny top_p rounds to 0 in float32)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


def sample(logits: torch.Tensor, s: SamplingParams, gens: Sequence[torch.Generator] = (),
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Next token per row of ``(B, vocab)`` logits under one set of parameters;
    row ``b`` samples from ``gens[b]``. Greedy uses ``argmax`` when given."""
    if s.greedy:
        return argmax(logits) if argmax is not None else logits.argmax(dim=-1)
    probs = filter_logits(logits, s.temperature, s.top_k, s.top_p).softmax(dim=-1)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(gens)])


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], gens: Sequence[torch.Generator | None],
                argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[int]:
    """Next token per row, each row under its own parameters."""
    out = [0] * len(params)
    greedy = [r for r, p in enumerate(params) if p.greedy]
    if len(greedy) == len(params):
        return (argmax(logits) if argmax is not None else logits.argmax(-1)).tolist()
    if greedy:
        idx = torch.tensor(greedy)
        picks = (argmax if argmax is not None else (lambda x: x.argmax(-1)))(logits.index_select(0, idx).contiguous())
        for r, t in zip(greedy, picks.tolist()):
            out[r] = t
    for r, p in enumerate(params):
        if not p.greedy:
            out[r] = int(sample(logits[r:r + 1], p, [gens[r]]).item())
    return out
