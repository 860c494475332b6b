"""Keys/values of prompt prefixes, reused across requests.

Prompt positions run at full depth and each request's positions start at 0,
so the keys/values of a prompt's first ``n`` tokens depend on those tokens
alone. Requests that share a prefix (a chat template's system prompt, a
few-shot preamble) need not recompute it: the cache keeps full-depth
keys/values per block of ``block`` tokens, keyed by the whole prefix up to the
block's end (as vLLM's automatic prefix caching does), and a new request's
longest cached block-aligned prefix is copied into its own KV slots at
admission. A copy costs a few microseconds per token; recomputing it costs a
full forward pass. Least recently used blocks are evicted past ``max_blocks``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch


class PrefixCache:
    def __init__(self, max_blocks: int, block: int = 16):
        self.max_blocks, self.block = max_blocks, block
        self._blocks: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()  # prefix -> (L, 2, K, block, hd)
        self.hits = self.lookups = self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, tokens: Sequence[int]) -> int:
        """Length of the longest cached block-aligned prefix, leaving at least
        the last prompt token to compute (its logits give the first new token)."""
        n, B = 0, self.block
        self.lookups += 1
        while n + B <= len(tokens) - 1 and tuple(tokens[:n + B]) in self._blocks:
            n += B
        if n:
            self.hits += 1
        return n

    def load(self, tokens: Sequence[int], n: int, kpools: list[torch.Tensor], vpools: list[torch.Tensor],
             starts: list[int]) -> None:
        """Copy the cached keys/values of ``tokens[:n]`` into a request's slots."""
        B = self.block
        for i in range(0, n, B):
            kv = self._blocks[tuple(tokens[:i + B])]
            self._blocks.move_to_end(tuple(tokens[:i + B]))
            for l, (kp, vp, s) in enumerate(zip(kpools, vpools, starts)):
                kp[:, s + i:s + i + B] = kv[l, 0]
                vp[:, s + i:s + i + B] = kv[l, 1]
        self.tokens_reused += n

    def store(self, tokens: Sequence[int], kpools: list[torch.Tensor], vpools: list[torch.Tensor],
              starts: list[int]) -> None:
        """Keep every full block of a prefilled prompt that is not cached yet."""
        B = self.block
        for i in range(0, len(tokens) - B + 1, B):
            key = tuple(tokens[:i + B])
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self._blocks[key] = torch.stack([torch.stack([kp[:, s + i:s + i + B], vp[:, s + i:s + i + B]])
                                             for kp, vp, s in zip(kpools, vpools, starts)])
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
