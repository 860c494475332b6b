"""The KV pool: preallocated keys/values per layer, each request its own slots.

Layer ``l`` holds ``(kv_heads, capacity[l], head_dim)`` keys and values. A
request reserves, at every layer, one contiguous range of slots sized from its
own schedule: its prompt plus the decode steps that run that layer. Budgets
never increase, so those steps are a prefix of its steps and the range is
filled front to back; a layer the schedule drops early needs few slots. There
is no shared left padding: row ``r`` of a step reads exactly its own slots.

Reservation is all-or-nothing and made at admission, so a running request can
never run out of KV; finishing or aborting releases every range at once.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..config import KV_DTYPE_NAMES
from ..schedule import SkipSchedule

# the dtypes a KV pool may hold. Keys and values are rounded to the pool's dtype when stored
# (round to nearest even, torch's ``.to``) and attention reads the stored values in the model's
# dtype: float16 and bfloat16 halve the bytes of a float32 pool and of what each decode step
# reads from it, at the cost of that rounding (float16 keeps 11 significant bits, bfloat16 8).
KV_DTYPES = {name: getattr(torch, name) for name in KV_DTYPE_NAMES}


def layer_needs(schedule: SkipSchedule, prompt_len: int, max_new_tokens: int) -> list[int]:
    """Slots each layer needs for one request: its prompt, plus the decode
    steps (the last new token is never fed back) that run the layer."""
    steps = max(max_new_tokens - 1, 0)
    return [prompt_len + schedule.steps_using_layer(l, steps) for l in range(schedule.num_layers)]


class SlotAllocator:
    """Contiguous ranges of one layer's slots: first fit, freed ranges merge."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity > 0 else []  # (start, length), by start
        self.used = 0

    def alloc(self, n: int) -> int | None:
        """Start of a free range of ``n`` slots, or None if no range is that long."""
        if n == 0:
            return 0
        for i, (s, ln) in enumerate(self._free):
            if ln >= n:
                self._free[i:i + 1] = [(s + n, ln - n)] if ln > n else []
                self.used += n
                return s
        return None

    def release(self, start: int, n: int) -> None:
        if n == 0:
            return
        i = bisect.bisect_left(self._free, (start, 0))
        if (i > 0 and self._free[i - 1][0] + self._free[i - 1][1] > start) or \
                (i < len(self._free) and start + n > self._free[i][0]):
            raise RuntimeError(f"KV slots {start}..{start + n - 1} released twice")
        self._free.insert(i, (start, n))
        if i + 1 < len(self._free) and start + n == self._free[i + 1][0]:  # merge with the next range
            self._free[i:i + 2] = [(start, n + self._free[i + 1][1])]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:  # and with the previous one
            ps, pn = self._free[i - 1]
            self._free[i - 1:i + 1] = [(ps, pn + self._free[i][1])]
        self.used -= n

    @property
    def largest_free(self) -> int:
        return max((ln for _, ln in self._free), default=0)


@dataclass
class Reservation:
    """One request's slots: layer ``l`` owns ``starts[l] .. starts[l] + needs[l] - 1``."""

    starts: list[int]
    needs: list[int]


class KVPool:
    """Per-layer keys/values and the allocators that share them out."""

    def __init__(self, capacities: list[int], n_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32):
        self.capacities = list(capacities)
        self.n_kv_heads, self.head_dim, self.dtype = n_kv_heads, head_dim, dtype
        self.k = [torch.zeros(n_kv_heads, c, head_dim, dtype=dtype) for c in capacities]
        self.v = [torch.zeros(n_kv_heads, c, head_dim, dtype=dtype) for c in capacities]
        self.alloc = [SlotAllocator(c) for c in capacities]

    @property
    def num_layers(self) -> int:
        return len(self.capacities)

    def fits_empty(self, needs: list[int]) -> bool:
        """Whether a request with these needs fits the pool at all (when nothing else runs)."""
        return all(n <= c for n, c in zip(needs, self.capacities))

    def reserve(self, needs: list[int]) -> Reservation | None:
        """Slots at every layer, or None (and nothing taken) if some layer has no room."""
        starts: list[int] = []
        for l, n in enumerate(needs):
            s = self.alloc[l].alloc(n)
            if s is None:
                for j, sj in enumerate(starts):
                    self.alloc[j].release(sj, needs[j])
                return None
            starts.append(s)
        return Reservation(starts, list(needs))

    def release(self, r: Reservation) -> None:
        for l, (s, n) in enumerate(zip(r.starts, r.needs)):
            self.alloc[l].release(s, n)

    def pools(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return list(zip(self.k, self.v))

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot of one layer (keys and values)."""
        return 2 * self.n_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def nbytes(self) -> int:
        return sum(self.capacities) * self.slot_bytes

    @property
    def used_slots(self) -> int:
        return sum(a.used for a in self.alloc)

    def usage(self) -> list[float]:
        """Fraction of each layer's slots reserved."""
        return [a.used / a.capacity if a.capacity else 0.0 for a in self.alloc]


class RequestKV:
    """One request's slots of the pool seen as a dense cache ``(1, K, slots, hd)``,
    the interface of ``Transformer.forward`` (prefill chunks write through it)."""

    def __init__(self, pool: KVPool, reservation: Reservation):
        self.pool, self.res = pool, reservation

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + k.shape[2]
        if end > self.res.needs[layer]:
            raise RuntimeError(f"layer {layer}: slot {end - 1} written but the request reserved "
                               f"{self.res.needs[layer]}: the schedule and the reservation disagree")
        s0 = self.res.starts[layer]
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        kp[:, s0 + start:s0 + end] = k[0]
        vp[:, s0 + start:s0 + end] = v[0]
        # attention reads what the pool holds (rounded to its dtype), in the model's dtype
        return kp[None, :, s0:s0 + end].to(k.dtype), vp[None, :, s0:s0 + end].to(v.dtype)
