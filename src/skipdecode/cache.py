"""Preallocated KV cache, written by slot, sized per layer from the schedule.

A generated token's budget never exceeds an earlier one's, so the decode
steps that run a given layer are a prefix of all decode steps. Layer ``l``
therefore needs only ``prompt_slots + steps_using_layer(l)`` slots; a layer no
decode step runs needs just the prompt. ``KVCache.saved_bytes`` reports the
saving against a full ``prompt + max_new_tokens`` cache for every layer.
"""

from __future__ import annotations

import torch

from .schedule import SkipSchedule


def layer_slots(schedule: SkipSchedule, prompt_slots: int, max_new_tokens: int) -> list[int]:
    """Slots each layer's cache needs for a generation of ``max_new_tokens``."""
    steps = max(max_new_tokens - 1, 0)  # the last token is never fed back
    return [prompt_slots + schedule.steps_using_layer(l, steps) for l in range(schedule.num_layers)]


class KVCache:
    """Per-layer keys/values ``[batch, kv_heads, slots, head_dim]``."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, slots: list[int],
                 full_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.slots = list(slots)
        self.full_slots = full_slots
        shape = lambda s: (batch, n_kv_heads, s, head_dim)  # noqa: E731
        self.k = [torch.zeros(shape(s), dtype=dtype, device=device) for s in slots]
        self.v = [torch.zeros(shape(s), dtype=dtype, device=device) for s in slots]

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` (``[B, kvh, T, hd]``) at slots ``start..start+T`` and
        return every key/value up to and including them."""
        end = start + k.shape[2]
        kc, vc = self.layer(layer, end)
        kc[:, :, start:end] = k
        vc[:, :, start:end] = v
        return kc[:, :, :end], vc[:, :, :end]

    def layer(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s whole key and value tensors, checked to hold slots ``0..end-1``."""
        if end > self.slots[layer]:
            raise RuntimeError(
                f"layer {layer} KV cache has {self.slots[layer]} slots but slot {end - 1} was written: "
                "the schedule and the cache disagree"
            )
        return self.k[layer], self.v[layer]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows so they leave the computation."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def full_nbytes(self) -> int:
        """Bytes a schedule-unaware cache (every layer, every slot) would take."""
        if not self.k:
            return 0
        t = self.k[0]
        per_slot = t.shape[0] * t.shape[1] * t.shape[3] * t.element_size() * 2
        return per_slot * self.full_slots * len(self.k)

    @property
    def saved_bytes(self) -> int:
        return self.full_nbytes - self.nbytes
