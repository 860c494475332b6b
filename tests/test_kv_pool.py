"""The KV pool holds exactly what the schedules write: each request its own
slots, per layer its prompt plus the decode steps that run that layer; no
slot is read before it is written, and nothing is written outside a request's
own slots."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import skipdecode.engine.engine as engine_mod
from conftest import VOCAB
from skipdecode.engine import Engine, EngineConfig, KVPool, layer_needs
from skipdecode.engine.kv_cache import Reservation, RequestKV, SlotAllocator
from skipdecode.generate import generate_tokens
from skipdecode.schedule import SkipSchedule

LENGTHS = [6, 2, 9]
NEW = 12


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in LENGTHS]


class _NaNPool(KVPool):
    """A pool whose every slot starts as NaN: reading a never-written slot poisons the logits."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        for t in self.k + self.v:
            t.fill_(float("nan"))


def test_layer_needs_are_prompt_plus_decode_steps_running_that_layer():
    L = 6
    for mode in ("skip", "early_exit"):
        sched = SkipSchedule(L, L, 2, horizon=8, warmup_layers=1, mode=mode)
        needs = layer_needs(sched, 7, NEW)
        for layer in range(L):
            runs = sum(layer in sched.layers(i) for i in range(NEW - 1))  # the last token is never fed
            assert needs[layer] == 7 + runs
        assert len(set(needs)) > 1, "the schedule should make layers differ"
    assert layer_needs(SkipSchedule.full_depth(L), 7, NEW) == [7 + NEW - 1] * L


@pytest.mark.parametrize("arch, mode", [("llama", "skip"), ("gpt2", "early_exit"), ("qwen2", "skip"),
                                        ("opt", "skip"), ("llama", "nested")])
def test_kv_never_read_before_written_and_never_written_outside_a_request(arch, mode, tiny_packed, monkeypatch):
    """Every slot starts as NaN. Requests with different prompts and schedules
    share the pool and finish at full length: their tokens equal a normal run
    (no NaN was ever read), every reserved slot was written (reservations are
    exact), and every slot outside a reservation is still NaN."""
    model = tiny_packed[arch]
    L = model.n_layers
    order = tuple(range(1, L, 2)) + tuple(range(0, L, 2)) if mode == "nested" else None  # odd layers first
    w = 0 if mode == "nested" else 1
    scheds = [SkipSchedule(L, L, 2 if mode == "skip" else 1, horizon=6, warmup_layers=w, mode=mode, layer_order=order),
              SkipSchedule.full_depth(L),
              SkipSchedule(L, L - 1, L - 2, horizon=3, warmup_layers=w, mode=mode, layer_order=order)]
    prompts = _prompts(seed=1)
    normal, _ = generate_tokens(model, prompts, scheds, NEW)

    # the detector works: attention over a NaN slot gives NaN logits
    probe = _NaNPool([8] * L, model.cfg.n_kv_heads, model.cfg.head_dim)
    with torch.inference_mode():
        out = model(torch.tensor([[5]]), torch.tensor([[1]]), cache=RequestKV(probe, Reservation([0] * L, [2] * L)),
                    start=1)
    assert torch.isnan(out).all()

    monkeypatch.setattr(engine_mod, "KVPool", _NaNPool)
    eng = Engine(model, EngineConfig(kv_slots=200))
    states = [eng.add_request(p, schedule=s, max_new_tokens=NEW, request_id=str(r))
              for r, (p, s) in enumerate(zip(prompts, scheds))]
    reservations = {}
    finished = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                finished[int(o.request_id)] = o
        for s in states:
            if s.reservation is not None:
                reservations[s.request_id] = s.reservation
    assert [finished[r].token_ids for r in range(3)] == [r.token_ids for r in normal]
    owned = [torch.zeros(200, dtype=torch.bool) for _ in range(L)]
    for res in reservations.values():
        for layer in range(L):
            s, n = res.starts[layer], res.needs[layer]
            owned[layer][s:s + n] = True
            for t in (eng.pool.k[layer], eng.pool.v[layer]):
                assert torch.isfinite(t[:, s:s + n]).all(), f"layer {layer}: a reserved slot was never written"
    for layer in range(L):
        for t in (eng.pool.k[layer], eng.pool.v[layer]):
            assert torch.isnan(t[:, ~owned[layer]]).all(), f"layer {layer}: a slot outside every request was written"
    assert eng.pool.used_slots == 0, "finished requests free their slots"


def test_kv_saved_bytes_positive_for_skip_and_zero_for_full_depth(tiny_packed):
    model = tiny_packed["llama"]
    L = model.n_layers
    prompts = _prompts()
    _, full = generate_tokens(model, prompts, SkipSchedule.full_depth(L), NEW)
    _, skip = generate_tokens(model, prompts, SkipSchedule(L, L - 1, 2, horizon=4), NEW)
    assert full["kv_cache_saved_bytes"] == 0
    assert full["kv_cache_bytes"] == full["kv_cache_full_bytes"]
    K, hd = model.cfg.n_kv_heads, model.cfg.head_dim
    assert full["kv_cache_full_bytes"] == 2 * L * K * hd * 4 * sum(n + NEW - 1 for n in LENGTHS)  # no padding
    assert skip["kv_cache_full_bytes"] == full["kv_cache_full_bytes"]
    assert skip["kv_cache_saved_bytes"] > 0
    assert skip["kv_cache_saved_bytes"] == skip["kv_cache_full_bytes"] - skip["kv_cache_bytes"]


def test_a_request_cannot_write_past_its_reservation():
    pool = KVPool([8, 8], 1, 2)
    kv = RequestKV(pool, Reservation([0, 4], [3, 1]))
    one = torch.zeros(1, 1, 1, 2)
    kv.update(1, 0, one, one)
    with pytest.raises(RuntimeError, match="layer 1: slot 1 written but the request reserved 1"):
        kv.update(1, 1, one, one)


def test_slot_allocator_first_fit_and_merging():
    a = SlotAllocator(10)
    assert [a.alloc(3), a.alloc(3), a.alloc(3)] == [0, 3, 6]
    assert a.alloc(2) is None and a.alloc(1) == 9
    a.release(3, 3)
    assert a.alloc(4) is None, "3 free slots in the middle, none contiguous to them"
    a.release(0, 3)
    assert a.largest_free == 6 and a.alloc(6) == 0
    a.release(9, 1)
    with pytest.raises(RuntimeError, match="released twice"):
        a.release(9, 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), min_size=1, max_size=60))
def test_slot_allocator_never_hands_out_a_slot_twice(ops):
    """Random allocations and frees: live ranges never overlap, the used count
    is their total, and once everything is freed one range spans the pool."""
    a = SlotAllocator(40)
    live: list[tuple[int, int]] = []
    for do_alloc, n in ops:
        if do_alloc or not live:
            s = a.alloc(n)
            if s is not None:
                assert all(s + n <= u or u + m <= s for u, m in live), "overlap"
                assert 0 <= s and s + n <= 40
                live.append((s, n))
        else:
            s, m = live.pop(n % len(live))
            a.release(s, m)
        assert a.used == sum(m for _, m in live)
    for s, m in live:
        a.release(s, m)
    assert a.used == 0 and a.largest_free == 40


def test_pool_reservation_is_all_or_nothing():
    pool = KVPool([10, 4], 1, 2)
    assert pool.reserve([5, 5]) is None
    assert pool.used_slots == 0, "a failed reservation takes nothing"
    r = pool.reserve([5, 4])
    assert r is not None and pool.usage() == [0.5, 1.0]
    pool.release(r)
    assert pool.used_slots == 0


def _staggered(model, prompts, scheds, fresh_table: bool) -> tuple[dict[int, list[int]], int, int]:
    """Request 0 alone, 1 joins at step 2 and finishes first, 2 joins at step 4; with
    ``fresh_table`` the runner rebuilds its slot table every step."""
    eng = Engine(model, EngineConfig(kv_slots=200))
    finished, keys, step = {}, [], 0
    eng.add_request(prompts[0], schedule=scheds[0], max_new_tokens=NEW, request_id="0")
    while eng.has_unfinished():
        if step == 2:
            eng.add_request(prompts[1], schedule=scheds[1], max_new_tokens=4, request_id="1")
        if step == 4:
            eng.add_request(prompts[2], schedule=scheds[2], max_new_tokens=7, request_id="2")
        if fresh_table:
            eng.runner._slot_key = ()
        for o in eng.step():
            if o.finished:
                finished[int(o.request_id)] = o.token_ids
        if eng.runner._slots is not None and not any(eng.runner._slots is k for k in keys):
            keys.append(eng.runner._slots)  # held, so no two tables share an id
        step += 1
    return finished, len(keys), step


def test_a_steps_slot_table_follows_its_rows_reservations(tiny_packed):
    """The runner keeps the step's slot table while its rows keep their reservations and writes
    only the lengths; a change of rows (a request joins or finishes) rebuilds it. Requests that
    join and leave a batch get the same tokens as with the table rebuilt every step."""
    model = tiny_packed["llama"]
    L = model.n_layers
    prompts = _prompts(seed=3)
    scheds = [SkipSchedule.full_depth(L), SkipSchedule(L, L, 2, horizon=6), SkipSchedule.full_depth(L)]
    kept, tables, steps = _staggered(model, prompts, scheds, fresh_table=False)
    fresh, fresh_tables, _ = _staggered(model, prompts, scheds, fresh_table=True)
    assert kept == fresh and sorted(kept) == [0, 1, 2]
    assert 4 <= tables < steps - 2, "rebuilt when the rows change, not every step"
    assert fresh_tables >= steps - 2
