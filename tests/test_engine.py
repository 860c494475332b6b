"""The serving engine: continuous batching where every request keeps its own
monotone schedule. Requests arriving at any step, with any prompt length and
any speedup, get exactly the tokens and layers they get alone, and exactly
what the naive recompute-everything reference gives; KV is admitted against
capacity, freed at once, and a request that can never fit is refused."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from conftest import build_deep_llama, drive as _drive, pick_eos
from skipdecode.checkpoint import load_model
from skipdecode.engine import AsyncEngine, Engine, EngineConfig, EngineError, SamplingParams, layer_needs
from skipdecode.reference import naive_generate
from skipdecode.schedule import SkipSchedule

L = 10  # 10 layers, one warm-up: 1x..5x are all reachable
VOCAB = 256


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny 10-layer Llama with a 512-token context: (reference model, packed model)."""
    d = tmp_path_factory.mktemp("deep") / "llama"
    build_deep_llama(d, seed=7, layers=L)
    return load_model(d)[0], load_model(d)[0].pack_for_inference()


def _sched(speedup: float, new: int) -> SkipSchedule:
    return SkipSchedule.full_depth(L) if speedup == 1 else SkipSchedule.for_speedup(speedup, new, L)


def _alone(model, prompt, sched, new, sampling=None) -> tuple[list[int], list[list[int]]]:
    eng = Engine(model, EngineConfig(kv_slots=1024))
    eng.add_request(prompt, schedule=sched, max_new_tokens=new, sampling=sampling)
    (out,) = eng.run()
    return out.token_ids, out.active_layers


def test_random_arrivals_match_each_request_alone_and_the_naive_reference(deep):
    ref, model = deep
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    arrivals: dict[int, list[dict]] = {}
    specs = {}
    for r in range(12):
        n = rng.choice([1, 2, 17, 64, 129, 200, 300]) if r < 7 else rng.randint(1, 300)
        new = rng.randint(3, 9)
        sp = rng.choice([1, 2, 3, 4, 5])
        spec = dict(prompt_token_ids=torch.randint(3, VOCAB, (n,), generator=g).tolist(), schedule=_sched(sp, new),
                    max_new_tokens=new, request_id=f"r{r}")
        specs[f"r{r}"] = spec
        arrivals.setdefault(rng.randint(0, 20), []).append(spec)
    # a small pool and a small prefill budget: requests queue for KV, prompts run in chunks
    eng = Engine(model, EngineConfig(max_num_seqs=5, max_prefill_tokens=64, prefill_chunk=32, kv_slots=900))
    plans: list = []
    done = _drive(eng, arrivals, plans)

    assert sorted(done) == sorted(specs)
    assert any(len(set(p.budgets)) > 1 for p in plans), "rows at different budgets shared a step"
    assert any(p.prefill and p.decode for p in plans), "prompt chunks ran beside decode steps"
    assert max(len(p.decode) for p in plans) > 1
    for rid, spec in specs.items():
        out, sched, new = done[rid], spec["schedule"], spec["max_new_tokens"]
        alone_tokens, alone_layers = _alone(model, spec["prompt_token_ids"], sched, new)
        assert out.token_ids == alone_tokens, rid
        assert out.active_layers == alone_layers, rid
        assert out.token_ids == naive_generate(ref, spec["prompt_token_ids"], sched, new), rid
        n = len(out.token_ids)
        assert out.active_layers == [sched.layers(i) for i in range(n - 1)] + [[]]
        for a, b in zip(out.active_layers, out.active_layers[1:-1]):
            assert set(b) <= set(a), "a request's layer sets are nested: its budget never grows"
        assert out.finished_step > out.arrived_step
    assert eng.pool.used_slots == 0


def test_packed_prefill_equals_each_chunk_run_alone(deep):
    """Chunks of several requests in one packed pass (one a request's second
    chunk, after its first in the same pass) write the same keys/values and give
    the same last-token logits as each chunk through ``forward`` on its own."""
    from skipdecode.engine.kv_cache import KVPool, RequestKV
    from skipdecode.model import PrefillChunk

    _, model = deep
    cfg = model.cfg
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 40, 1, 23)]
    cuts = [(0, 0, 7), (1, 0, 16), (1, 16, 40), (2, 0, 1), (3, 5, 23)]  # (prompt, start, end); 3's 0..5 ran before
    pools = [KVPool([256] * L, cfg.n_kv_heads, cfg.head_dim) for _ in range(2)]
    res = [[p.reserve([64] * L) for _ in prompts] for p in pools]
    with torch.inference_mode():
        for pool, rs in zip(pools, res):  # prompt 3's first 5 tokens, already in its slots
            model(torch.tensor([prompts[3][:5]]), torch.arange(5)[None], cache=RequestKV(pool, rs[3]), start=0)
        alone = [model(torch.tensor([prompts[i][a:b]]), torch.arange(a, b)[None], cache=RequestKV(pools[0], res[0][i]),
                       start=a, last_only=True)[0, -1] for i, a, b in cuts]
        packed = model.prefill([PrefillChunk(prompts[i][a:b], a, RequestKV(pools[1], res[1][i])) for i, a, b in cuts])
    assert packed.shape == (len(cuts), cfg.vocab_size)
    for i, (x, y) in enumerate(zip(alone, packed)):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4, msg=f"chunk {cuts[i]}")
    for l in range(L):
        torch.testing.assert_close(pools[1].k[l], pools[0].k[l], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pools[1].v[l], pools[0].v[l], rtol=1e-4, atol=1e-4)


def test_prompt_chunks_stay_within_the_token_budget_and_running_requests_keep_decoding(deep):
    _, model = deep
    eng = Engine(model, EngineConfig(max_prefill_tokens=48, prefill_chunk=16, kv_slots=1024))
    eng.add_request([5, 6, 7], max_new_tokens=30, request_id="short")
    eng.step()  # its prompt
    eng.add_request(list(range(3, 253)), max_new_tokens=4, request_id="long")  # 250 prompt tokens
    plans: list = []
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda step: plans.append(schedule(step)) or plans[-1]
    got_token = []
    while eng.has_unfinished():
        got_token.append(any(o.request_id == "short" for o in eng.step()))
    chunks = [sum(e - s for _, s, e in p.prefill) for p in plans]
    assert max(chunks) <= 48 and sum(chunks) == 250
    assert sum(c > 0 for c in chunks) >= 250 // 48, "the long prompt is spread over several steps"
    assert all(s % 16 == 0 for p in plans for _, s, _ in p.prefill), "chunk boundaries are fixed"
    prefill_steps = [i for i, c in enumerate(chunks) if c]
    assert all(got_token[i] for i in prefill_steps), "the running request got a token in every prefill step"


def test_each_layer_runs_on_exactly_the_rows_whose_layer_set_holds_it(deep):
    """Per-row policy: a step's layer work is the sum of the rows' budgets, not
    the maximum; each layer sees exactly the rows that run it."""
    _, model = deep
    ran: list[int] = []
    for l, blk in enumerate(model.layers):
        blk.decode = (lambda f: lambda x, *a, **k: ran.append(x.shape[0]) or f(x, *a, **k))(blk.decode)
    stack = model._stack

    class Spy:  # a step as one layer-stack call: each layer's row count is in `counts`
        def run(self, x, ids, counts, *a):
            ran.extend(counts)
            return stack.run(x, ids, counts, *a)

    if stack is not None:
        model._stack = Spy()
    try:
        eng = Engine(model, EngineConfig(kv_slots=512))
        for r, sp in enumerate([1, 2, 3, 5]):
            eng.add_request([9 + r] * 5, schedule=_sched(sp, 8), max_new_tokens=8, request_id=str(r))
        plans: list = []
        schedule = eng.scheduler.schedule
        eng.scheduler.schedule = lambda step: plans.append(schedule(step)) or plans[-1]
        per_step = []
        while eng.has_unfinished():
            ran.clear()
            eng.step()
            per_step.append(sum(ran))
    finally:
        model._stack = stack
        for blk in model.layers:
            del blk.decode
    for p, work in zip(plans, per_step):
        if p.decode:
            assert work == sum(p.budgets)
    assert any(p.decode and sum(p.budgets) < len(p.budgets) * max(p.budgets) for p in plans)


def test_shared_policy_runs_one_layer_set_per_step_and_never_raises_a_budget(deep):
    _, model = deep
    eng = Engine(model, EngineConfig(kv_slots=512, policy="shared"))
    arrivals = {0: [dict(prompt_token_ids=[4, 5, 6], schedule=_sched(1, 10), max_new_tokens=10, request_id="a")],
                3: [dict(prompt_token_ids=[7, 8], schedule=_sched(4, 10), max_new_tokens=4, request_id="b")]}
    plans: list = []
    done = _drive(eng, arrivals, plans)
    assert all(len(set(p.budgets)) <= 1 for p in plans)
    for o in done.values():
        sizes = [len(a) for a in o.active_layers[:-1]]
        assert sizes == sorted(sizes, reverse=True), "a request's budget never increases"
    a_sizes = [len(x) for x in done["a"].active_layers[:-1]]
    assert min(a_sizes) < L, "the full-depth request was pulled down by its shallower batch-mate"
    eng.add_request([1], schedule=SkipSchedule(L, L, 2, horizon=4, mode="early_exit"), max_new_tokens=4)
    with pytest.raises(EngineError, match="same mode and warm-up"):
        eng.add_request([1], schedule=SkipSchedule(L, L, 3, horizon=4, warmup_layers=2), max_new_tokens=4)


def test_a_seeded_sampled_request_does_not_depend_on_batch_mates_or_arrival(deep):
    _, model = deep
    s = SamplingParams(temperature=1.0, top_k=40, seed=7)
    sched = _sched(3, 12)
    prompt = list(range(20, 60))
    alone, _ = _alone(model, prompt, sched, 12, s)
    eng = Engine(model, EngineConfig(kv_slots=1024, max_prefill_tokens=32, prefill_chunk=16))
    arrivals = {0: [dict(prompt_token_ids=[3] * 50, max_new_tokens=20, request_id="g"),
                    dict(prompt_token_ids=[4] * 9, schedule=_sched(2, 12), max_new_tokens=15, request_id="s",
                         sampling=SamplingParams(temperature=0.8, seed=1))],
                5: [dict(prompt_token_ids=prompt, schedule=sched, max_new_tokens=12, sampling=s, request_id="x")]}
    done = _drive(eng, arrivals)
    assert done["x"].token_ids == alone
    assert alone != _alone(model, prompt, sched, 12, SamplingParams(temperature=1.0, top_k=40, seed=8))[0]


def test_abort_frees_kv_at_once_and_the_others_go_on(deep):
    _, model = deep
    eng = Engine(model, EngineConfig(kv_slots=512))
    specs = [dict(prompt_token_ids=[3 + r] * (4 + r), schedule=_sched(1 + r, 10), max_new_tokens=10,
                  request_id=str(r)) for r in range(3)]
    for s in specs:
        eng.add_request(**s)
    for _ in range(3):
        eng.step()
    used = eng.pool.used_slots
    out = eng.abort("1")
    assert out.finished and out.finish_reason == "abort"
    assert eng.pool.used_slots == used - sum(layer_needs(specs[1]["schedule"], 5, 10))
    assert eng.abort("1") is None
    done = eng.run()
    assert sorted(o.request_id for o in done) == ["0", "2"]
    for o in done:
        s = specs[int(o.request_id)]
        assert o.token_ids == _alone(model, s["prompt_token_ids"], s["schedule"], 10)[0]
    assert eng.pool.used_slots == 0


def test_admission_waits_for_kv_and_a_request_that_never_fits_is_refused(deep):
    _, model = deep
    need = layer_needs(SkipSchedule.full_depth(L), 20, 10)[0]  # 29 slots at every layer
    eng = Engine(model, EngineConfig(kv_slots=need + 5))  # room for one such request at a time
    eng.add_request([5] * 20, max_new_tokens=10, request_id="a")
    eng.add_request([6] * 20, max_new_tokens=10, request_id="b")
    eng.step()
    assert eng.num_running == 1 and eng.num_waiting == 1
    done = eng.run()
    assert [o.request_id for o in done] == ["a", "b"]
    assert done[1].arrived_step == 0 and done[1].finished_step > done[0].finished_step
    with pytest.raises(EngineError, match=r"needs 35 KV slots at layer \d+ .* the pool holds 34"):
        eng.add_request([5] * 26, max_new_tokens=10)
    with pytest.raises(EngineError, match="the model's context is 512"):
        eng.add_request([5] * 510, max_new_tokens=10)
    for bad, msg in [(dict(max_new_tokens=0), "max_new_tokens"), (dict(prompt_token_ids=[]), "empty"),
                     (dict(prompt_token_ids=[VOCAB + 5]), "token ids"), (dict(stop=["x"]), "tokenizer"),
                     (dict(schedule=SkipSchedule.full_depth(3)), "3 layers")]:
        kw = dict(prompt_token_ids=[5], max_new_tokens=4) | bad
        with pytest.raises(EngineError, match=msg):
            eng.add_request(**kw)
    assert not eng.has_unfinished()


def test_async_engine_streams_and_a_consumer_that_leaves_aborts_its_request(deep):
    _, model = deep
    eng = Engine(model, EngineConfig(kv_slots=512))
    want, _ = _alone(model, [5, 6, 7], _sched(2, 12), 12)

    async def main():
        aeng = AsyncEngine(eng)
        try:
            async def full():
                toks = []
                async for o in aeng.generate(eng.make_request([5, 6, 7], schedule=_sched(2, 12), max_new_tokens=12)):
                    toks += o.new_token_ids
                return toks

            async def leaves_early():
                n = 0
                async for _ in aeng.generate(eng.make_request([9] * 30, max_new_tokens=200)):
                    n += 1
                    if n == 3:
                        break
                return n

            got, n = await asyncio.gather(full(), leaves_early())
            for _ in range(200):  # the abort reaches the loop thread
                if not eng.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            return got, n
        finally:
            aeng.shutdown()

    got, n = asyncio.run(main())
    assert got == want and n == 3
    assert not eng.has_unfinished() and eng.pool.used_slots == 0


def test_a_cached_prompt_prefix_is_copied_not_recomputed_and_changes_nothing(deep):
    """Requests sharing a 40-token preamble: later ones copy its keys/values
    (two blocks of 16) instead of computing them, and still produce exactly the
    tokens they produce alone (no cache) and the naive reference's."""
    ref, model = deep
    g = torch.Generator().manual_seed(3)
    pre = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    prompts = [pre + torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (5, 1, 30)]
    scheds = [_sched(1, 8), _sched(3, 8), _sched(2, 8)]
    eng = Engine(model, EngineConfig(kv_slots=1024))
    arrivals = {2 * r: [dict(prompt_token_ids=p, schedule=s, max_new_tokens=8, request_id=str(r))]
                for r, (p, s) in enumerate(zip(prompts, scheds))}
    done = _drive(eng, arrivals)
    assert eng.counters["prompt_tokens_cached"] == 2 * 32
    assert eng.counters["prompt_tokens_computed"] == sum(map(len, prompts)) - 2 * 32
    for r, (p, s) in enumerate(zip(prompts, scheds)):
        assert done[str(r)].token_ids == _alone(model, p, s, 8)[0] == naive_generate(ref, p, s, 8)
    # a prompt that is all cached still computes its last token (it gives the first new token)
    eng.add_request(pre[:32] + [7], max_new_tokens=3, request_id="x")
    eng.add_request(pre[:32], max_new_tokens=3, request_id="y")
    out = {o.request_id: o for o in eng.run()}
    assert out["y"].token_ids == _alone(model, pre[:32], _sched(1, 3), 3)[0]
    small = Engine(model, EngineConfig(kv_slots=1024, prefix_cache_blocks=1))
    small.add_request(pre, max_new_tokens=2)
    small.run()
    assert len(small.prefix_cache) == 1, "the cache never holds more blocks than it may"


@pytest.mark.parametrize("kw", [dict(temperature=5e-324), dict(temperature=1e-300), dict(temperature=1e-6),
                                dict(temperature=1.0, top_p=5e-324), dict(temperature=1.0, top_p=1e-9)])
def test_vanishing_temperature_or_top_p_is_greedy_not_a_crash(deep, kw):
    _, model = deep
    greedy, _ = _alone(model, [5, 6], _sched(2, 6), 6)
    got, _ = _alone(model, [5, 6], _sched(2, 6), 6, SamplingParams(seed=0, **kw))
    assert got == greedy


def test_sampling_is_finite_for_huge_logits():
    from skipdecode.engine.sampler import sample

    logits = torch.tensor([[3e38, -3e38, 3e38, 0.0]])
    g = torch.Generator().manual_seed(0)
    picks = {int(sample(logits, SamplingParams(temperature=0.5, seed=0), [g])) for _ in range(50)}
    assert picks <= {0, 2} and picks


def test_a_burst_of_prompts_sharing_a_preamble_computes_it_once_per_step(deep):
    """All arriving at once, with room for one prompt (and a bit) per step: only the first
    computes the shared preamble; every later one copies it, since its prefix
    is looked up when its own first chunk runs."""
    _, model = deep
    g = torch.Generator().manual_seed(5)
    pre = torch.randint(3, VOCAB, (32,), generator=g).tolist()
    prompts = [pre + torch.randint(3, VOCAB, (8,), generator=g).tolist() for _ in range(6)]
    eng = Engine(model, EngineConfig(kv_slots=1024, max_prefill_tokens=50))  # 10 tokens left: not a prompt
    for r, p in enumerate(prompts):
        eng.add_request(p, max_new_tokens=3, request_id=str(r))
    done = {o.request_id: o for o in eng.run()}
    assert eng.counters["prompt_tokens_cached"] == 5 * 32
    for r, p in enumerate(prompts):
        assert done[str(r)].token_ids == _alone(model, p, _sched(1, 3), 3)[0]


def _steady_run(model, specs: list[dict], burst: int, eos=(), **cfg) -> tuple[dict, dict, int, list]:
    """Run ``specs`` (add_request keywords) admitted together: final outputs by id, the engine's
    counters, its step() calls and every output streamed."""
    eng = Engine(model, EngineConfig(kv_slots=2048, decode_burst=burst, **cfg), eos_token_ids=eos)
    for spec in specs:
        eng.add_request(**spec)
    done, calls, streamed = {}, 0, []
    while eng.has_unfinished():
        calls += 1
        for o in eng.step():
            streamed.append(o)
            if o.finished:
                done[o.request_id] = o
    assert eng.pool.used_slots == 0
    return done, dict(eng.counters), calls, streamed


@pytest.mark.parametrize("speedup", [1, 2, 3, 5])
def test_a_steady_greedy_batch_decodes_in_native_bursts_exactly_as_step_by_step(deep, speedup):
    """With decode_burst, the steady stretches of a greedy batch on one schedule run in the model's
    native loop (Transformer.greedy_steps): the same tokens, layer sets, finish reasons, budgets
    and counters as one step a call, every token streamed once, in fewer calls. An EOS ending one
    row mid-burst ends the burst there; rows of other prompt lengths share it."""
    _, model = deep
    if not model.native_greedy(3):
        pytest.skip("the compiled kernels are not in use here")
    g = torch.Generator().manual_seed(speedup)
    new = 30
    specs = [dict(prompt_token_ids=torch.randint(3, VOCAB, (n,), generator=g).tolist(),
                  schedule=_sched(speedup, new), max_new_tokens=m, request_id=f"r{i}")
             for i, (n, m) in enumerate([(5, new), (40, new), (17, 23)])]
    ref, ref_counts, ref_calls, _ = _steady_run(model, specs, 1)
    r, step, eos = pick_eos([ref[f"r{i}"].token_ids for i in range(3)], min_step=3)
    for eos_ids in ((), (eos,)):
        want, want_counts, _, _ = _steady_run(model, specs, 1, eos_ids)
        got, counts, calls, streamed = _steady_run(model, specs, 8, eos_ids)
        assert calls < ref_calls / 3, "the steady steps ran in bursts"
        for rid, o in want.items():
            assert got[rid].token_ids == o.token_ids, rid
            assert got[rid].active_layers == o.active_layers, rid
            assert got[rid].finish_reason == o.finish_reason, rid
            assert got[rid].decode_layer_speedup == o.decode_layer_speedup, rid
            assert [t for s in streamed if s.request_id == rid for t in s.new_token_ids] == o.token_ids
        for key in ("decode_steps", "decode_rows", "decode_layers_run", "decode_layers_full", "generated_tokens"):
            assert counts[key] == want_counts[key], key
    assert want[f"r{r}"].finish_reason == "eos" and len(want[f"r{r}"].token_ids) == step + 1


def test_bursts_keep_every_step_count_and_leave_other_requests_step_by_step(deep):
    """Requests queued for a seat are admitted at the step they would be without bursts (a burst
    ends where a request finishes), and every output keeps its step numbers; sampled requests run
    one step a call, and rows on different schedules burst only while they run the same layers:
    all with the tokens a run without bursts gives."""
    _, model = deep
    if not model.native_greedy(1):
        pytest.skip("the compiled kernels are not in use here")
    g = torch.Generator().manual_seed(3)
    prompt = lambda n: torch.randint(3, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    sampled = SamplingParams(temperature=0.8, seed=5)
    cases = {
        "queued": ([dict(prompt_token_ids=prompt(9), schedule=_sched(2, 12), max_new_tokens=12, request_id=f"q{i}")
                    for i in range(3)], dict(max_num_seqs=1)),
        "sampled": ([dict(prompt_token_ids=prompt(9), schedule=_sched(3, 12), max_new_tokens=12, request_id="s",
                          sampling=sampled)], {}),
        "mixed": ([dict(prompt_token_ids=prompt(9), schedule=_sched(sp, 16), max_new_tokens=16, request_id=f"m{sp}")
                   for sp in (1, 3)], {}),
    }
    calls = {}
    for name, (specs, cfg) in cases.items():
        want, _, want_calls, _ = _steady_run(model, specs, 1, **cfg)
        got, _, calls[name], _ = _steady_run(model, specs, 8, **cfg)
        for rid, o in want.items():
            assert got[rid].token_ids == o.token_ids, rid
            assert (got[rid].arrived_step, got[rid].finished_step) == (o.arrived_step, o.finished_step), rid
        if name == "sampled":
            assert calls[name] == want_calls
        else:  # the queued requests burst alone; the 1x and 3x rows only while both run every layer
            assert calls[name] < want_calls if name == "queued" else calls[name] <= want_calls, name


def test_decode_burst_must_be_a_positive_integer(deep):
    _, model = deep
    for bad in (0, -1, 2.5, True):
        with pytest.raises(EngineError, match="decode_burst must be an integer >= 1"):
            Engine(model, EngineConfig(decode_burst=bad))
