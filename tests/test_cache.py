"""The KV cache holds exactly what the schedule writes: per layer, the prompt
plus the decode steps that run that layer; and no slot is ever read before
it was written."""

from __future__ import annotations

import pytest
import torch

import skipdecode.generate as generate_mod
from conftest import VOCAB
from skipdecode.cache import KVCache, layer_slots
from skipdecode.generate import generate_tokens
from skipdecode.schedule import SkipSchedule

LENGTHS = [6, 2, 9]
NEW = 12


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in LENGTHS]


class _RecordingCache(KVCache):
    """Remembers itself and the furthest slot written per layer."""

    made: list["_RecordingCache"] = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.written = [0] * len(self.slots)
        _RecordingCache.made.append(self)

    def update(self, layer, start, k, v):
        self.written[layer] = max(self.written[layer], start + k.shape[2])
        return super().update(layer, start, k, v)


@pytest.fixture
def recording_cache(monkeypatch):
    _RecordingCache.made = []
    monkeypatch.setattr(generate_mod, "KVCache", _RecordingCache)
    return _RecordingCache.made


@pytest.mark.parametrize("mode", ["skip", "early_exit"])
def test_layer_slots_are_prompt_plus_decode_steps_running_that_layer(mode, tiny_packed, recording_cache):
    model = tiny_packed["opt"]
    L = model.n_layers
    sched = SkipSchedule(L, L, 2, horizon=8, warmup_layers=1, mode=mode)
    prompts = _prompts()
    P = max(LENGTHS)
    rows, _ = generate_tokens(model, prompts, sched, NEW)
    assert all(len(r.token_ids) == NEW for r in rows)
    (cache,) = recording_cache
    for layer in range(L):
        runs = sum(layer in sched.layers(i) for i in range(NEW - 1))  # the last token is never fed
        assert cache.slots[layer] == P + runs, f"layer {layer}"
        assert cache.written[layer] == cache.slots[layer], f"layer {layer}: every slot is used"
    assert cache.slots == layer_slots(sched, P, NEW)
    assert len(set(cache.slots)) > 1, "the schedule should make layers differ"
    B, K, hd = len(prompts), model.cfg.n_kv_heads, model.cfg.head_dim
    assert cache.nbytes == sum(2 * B * K * s * hd * 4 for s in cache.slots)


def test_kv_saved_bytes_positive_for_skip_and_zero_for_full_depth(tiny_packed):
    model = tiny_packed["llama"]
    L = model.n_layers
    prompts = _prompts()
    _, full = generate_tokens(model, prompts, SkipSchedule.full_depth(L), NEW)
    _, skip = generate_tokens(model, prompts, SkipSchedule(L, L - 1, 2, horizon=4), NEW)
    assert full["kv_cache_saved_bytes"] == 0
    assert full["kv_cache_bytes"] == full["kv_cache_full_bytes"]
    B, K, hd, P = len(prompts), model.cfg.n_kv_heads, model.cfg.head_dim, max(LENGTHS)
    assert full["kv_cache_full_bytes"] == 2 * L * B * K * (P + NEW - 1) * hd * 4
    assert skip["kv_cache_full_bytes"] == full["kv_cache_full_bytes"]
    assert skip["kv_cache_saved_bytes"] > 0
    assert skip["kv_cache_saved_bytes"] == skip["kv_cache_full_bytes"] - skip["kv_cache_bytes"]


def test_cache_refuses_writes_past_its_slots():
    c = KVCache(1, 1, 2, [3, 1], full_slots=3, dtype=torch.float32)
    kv = torch.zeros(1, 1, 1, 2)
    c.update(1, 0, kv, kv)
    with pytest.raises(RuntimeError, match="layer 1 KV cache has 1 slots but slot 1 was written"):
        c.update(1, 1, kv, kv)


class _NaNCache(KVCache):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        for t in self.k + self.v:
            t.fill_(float("nan"))


@pytest.mark.parametrize("arch, mode", [("llama", "skip"), ("gpt2", "early_exit"), ("qwen2", "skip")])
def test_kv_never_read_before_written(arch, mode, tiny_packed, monkeypatch):
    """Fill every cache slot with NaN before generation: any read of a slot
    that was never written (even one masked out) would poison the logits."""
    model = tiny_packed[arch]
    L = model.n_layers
    sched = SkipSchedule(L, L, 2 if mode == "skip" else 1, horizon=6, warmup_layers=1, mode=mode)
    prompts = _prompts(seed=1)
    normal, _ = generate_tokens(model, prompts, sched, NEW)

    # the detector works: a decode step that skips a slot reads NaN
    probe = _NaNCache(1, model.cfg.n_kv_heads, model.cfg.head_dim, [4] * L, 4, torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([[5]]), torch.tensor([[1]]), cache=probe, start=1)
    assert torch.isnan(out).all()

    finite: list[bool] = []
    h = model.register_forward_hook(lambda m, a, out: finite.append(bool(torch.isfinite(out).all())))
    monkeypatch.setattr(generate_mod, "KVCache", _NaNCache)
    try:
        poisoned, _ = generate_tokens(model, prompts, sched, NEW)
    finally:
        h.remove()
    assert len(finite) == NEW and all(finite)
    assert [r.token_ids for r in poisoned] == [r.token_ids for r in normal]
