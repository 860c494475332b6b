"""Lossless mode: the skip schedule drafts, a full-depth pass verifies, in the
same continuous batch. Greedy output is token-identical to full depth whatever
the arrivals, speedups, draft lengths and batch-mates; sampled output is
distributed exactly as full depth's; rejected drafts leave no trace in the KV
pool, and an abort mid-round frees every slot."""

from __future__ import annotations

import random

import pytest
import torch

import skipdecode.engine.engine as engine_mod
from conftest import _LLAMA, build_deep_llama, build_tiny, drive
from skipdecode.checkpoint import load_model
from skipdecode.engine import Engine, EngineConfig, EngineError, KVPool
from skipdecode.reference import naive_generate
from skipdecode.schedule import SkipSchedule

L = 10
VOCAB = 256


def _damp(model, factor: float):
    """Shrink the middle layers' residual branches so a skipped pass often
    agrees with full depth: rounds then both accept and reject drafts."""
    with torch.no_grad():
        for layer in model.layers[1:-1]:
            layer.wo.weight.mul_(factor)
            layer.w2.weight.mul_(factor)
    return model


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny 10-layer Llama whose skipped passes agree with full depth about half the time:
    (reference model, packed model whose drafts score the first 64 token ids and their prompt's)."""
    d = tmp_path_factory.mktemp("lossless") / "llama"
    build_deep_llama(d, seed=7, layers=L)
    return _damp(load_model(d)[0], 0.1), _damp(load_model(d)[0], 0.1).pack_for_inference(draft_vocab=64)


def _sched(speedup: float, new: int) -> SkipSchedule:
    return SkipSchedule.full_depth(L) if speedup == 1 else SkipSchedule.for_speedup(speedup, new, L)


def _alone(model, prompt, new, **kw):
    eng = Engine(model, EngineConfig(kv_slots=1024))
    eng.add_request(prompt, max_new_tokens=new, **kw)
    (out,) = eng.run()
    return out


def test_greedy_lossless_is_token_identical_to_full_depth_in_mixed_continuous_batches(deep):
    """Random arrivals and prompt lengths, speedups 2x-5x, K in 1..8, beside
    plain-skip and 1x batch-mates: every lossless request gets exactly the naive
    full-depth reference's tokens, every other request exactly its tokens alone."""
    ref, model = deep
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    arrivals: dict[int, list[dict]] = {}
    specs = {}
    for r in range(16):
        n = rng.choice([1, 5, 33, 130]) if r < 4 else rng.randint(1, 160)
        new = rng.randint(2, 14)
        kind = "lossless" if r % 3 != 2 else rng.choice(["skip", "full"])
        spec = dict(prompt_token_ids=torch.randint(3, VOCAB, (n,), generator=g).tolist(), max_new_tokens=new,
                    request_id=f"r{r}", ignore_eos=True)
        if kind == "lossless":
            spec.update(schedule=_sched(rng.choice([2, 3, 4, 5]), new), lossless=True, draft_tokens=rng.randint(1, 8))
        elif kind == "skip":
            spec.update(schedule=_sched(rng.choice([2, 3, 5]), new))
        specs[spec["request_id"]] = spec
        arrivals.setdefault(rng.randint(0, 25), []).append(spec)
    eng = Engine(model, EngineConfig(max_num_seqs=6, max_prefill_tokens=64, prefill_chunk=32, kv_slots=1200,
                                     draft_batch_limit=6))
    plans: list = []

    def carries_tokens(o) -> None:
        assert o.new_token_ids, "an output carries verified tokens only"

    done = drive(eng, arrivals, plans, check=carries_tokens)
    assert sorted(done) == sorted(specs)
    assert any(p.verify and p.decode and p.prefill for p in plans), "a verification shared a step with others"
    drafted = accepted = 0
    for rid, spec in specs.items():
        out, new = done[rid], spec["max_new_tokens"]
        assert len(out.token_ids) == new
        if spec.get("lossless"):
            full = naive_generate(ref, spec["prompt_token_ids"], SkipSchedule.full_depth(L), new)
            assert out.token_ids == full, rid
            assert out.active_layers == [list(range(L))] * (new - 1) + [[]], "every verified position ran all layers"
            assert out.decode_layer_speedup == 1.0
            drafted, accepted = drafted + out.draft.drafted, accepted + out.draft.accepted
            judged = out.draft.acceptance
            assert sum(ok for _, _, ok in judged) == out.draft.accepted and len(judged) <= out.draft.drafted
        else:
            alone = _alone(model, spec["prompt_token_ids"], new, schedule=spec.get("schedule"), ignore_eos=True)
            assert out.token_ids == alone.token_ids, rid
            assert out.draft is None
    assert 0 < accepted < drafted, "rounds both accepted and rejected drafts"
    assert eng.pool.used_slots == 0


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_each_draft_length_matches_full_depth_at_every_speedup(deep, k):
    ref, model = deep
    g = torch.Generator().manual_seed(k)
    for speedup in (2, 3, 4, 5):
        prompt = torch.randint(3, VOCAB, (11,), generator=g).tolist()
        out = _alone(model, prompt, 20, schedule=_sched(speedup, 20), lossless=True, draft_tokens=k, ignore_eos=True)
        assert out.token_ids == naive_generate(ref, prompt, SkipSchedule.full_depth(L), 20)
        spec = out.draft
        assert spec.drafted <= k * spec.rounds
        # drafts within a round ran non-increasing budgets, each the schedule's at its own position
        sched = _sched(speedup, 20)
        assert all(b == sched.budget(pos - 1) for pos, b, _ in spec.acceptance)


def test_nested_layer_set_drafts_are_verified_into_full_depths_tokens(deep):
    """Drafts on nested layer sets (a measured order, as `default-e2e` ships) are
    verified like any: the output is full depth's, each draft ran its schedule's
    budget, and the drafts differ from skipping the bottom."""
    ref, model = deep
    order = (0, 9, 4, 1, 8, 2, 7, 3, 6, 5)
    g = torch.Generator().manual_seed(11)
    verdicts = {}
    for speedup in (2, 3, 5):
        sched = _sched(speedup, 20).with_order(order)
        prompt = torch.randint(3, VOCAB, (9,), generator=g).tolist()
        out = _alone(model, prompt, 20, schedule=sched, lossless=True, draft_tokens=4, ignore_eos=True)
        assert out.token_ids == naive_generate(ref, prompt, SkipSchedule.full_depth(L), 20)
        assert all(b == sched.budget(pos - 1) for pos, b, _ in out.draft.acceptance)
        bottom = _alone(model, prompt, 20, schedule=_sched(speedup, 20), lossless=True, draft_tokens=4,
                        ignore_eos=True)
        verdicts[speedup] = ([ok for *_, ok in out.draft.acceptance], [ok for *_, ok in bottom.draft.acceptance])
    # the drafts ran other layers than skipping the bottom does: full depth judged them differently
    assert any(nested != bottom for nested, bottom in verdicts.values())


def test_a_draft_confidence_cutoff_ends_rounds_early_and_output_still_matches_full_depth(deep):
    """A round stops drafting after a draft its pass was less sure of than
    ``draft_confidence``: rounds get shorter as the cutoff rises (a cutoff no
    draft reaches leaves one draft per round), full depth's tokens stay."""
    ref, model = deep
    g = torch.Generator().manual_seed(21)
    for speedup in (2, 3, 5):
        prompt = torch.randint(3, VOCAB, (13,), generator=g).tolist()
        full = naive_generate(ref, prompt, SkipSchedule.full_depth(L), 24)
        per_round = []
        for conf in (0.0, 0.3, 0.9999):
            out = _alone(model, prompt, 24, schedule=_sched(speedup, 24), lossless=True, draft_tokens=8,
                         draft_confidence=conf, ignore_eos=True)
            assert out.token_ids == full, (speedup, conf)
            per_round.append(out.draft.drafted / out.draft.rounds)
        assert per_round[0] >= per_round[1] >= per_round[2] == 1.0, per_round
        assert per_round[0] > 1.0


def test_prompt_lookup_drafts_what_followed_the_last_tokens_before():
    """Longest suffix first (up to 4 tokens), its latest earlier occurrence, at least
    ``min_ngram`` tokens matched, at most ``k`` tokens proposed."""
    from skipdecode.policies.lookup import lookup_drafts

    name = [40, 41, 42, 43]  # a name in the prompt, then text, then its first token again
    ctx = [1, 2, *name, 7, 8, 40]
    assert lookup_drafts(ctx, 1, 3) == [41, 42, 43]
    assert lookup_drafts(ctx, 2, 3) == []  # "8 40" never occurred before
    assert lookup_drafts(ctx, 1, 8) == [41, 42, 43, 7, 8, 40]  # it runs on to the context's end
    # the longest match wins over a later shorter one: "5 6" -> 9, though "6" last preceded 7
    assert lookup_drafts([5, 6, 9, 4, 6, 7, 5, 6], 1, 1) == [9]
    assert lookup_drafts([3, 6, 7, 3, 6, 8, 3, 6], 2, 1) == [8]  # the latest occurrence
    assert lookup_drafts([1, 2, 3], 1, 4) == [] and lookup_drafts([4], 1, 4) == []
    assert lookup_drafts(ctx, 1, 0) == []


def test_prompt_lookup_drafts_are_verified_like_any_and_output_still_matches_full_depth(deep):
    """Lossless requests that also draft by prompt lookup, greedy, beside other
    requests: full depth's tokens exactly; lookups were drafted and some accepted."""
    ref, model = deep
    g = torch.Generator().manual_seed(5)
    eng = Engine(model, EngineConfig(max_num_seqs=6, kv_slots=2000, draft_batch_limit=6))
    prompts, new = [], 40
    for r in range(6):
        span = torch.randint(3, VOCAB, (6,), generator=g).tolist()
        prompts.append(torch.randint(3, VOCAB, (9,), generator=g).tolist() + span * 3)  # the output may copy
        kw = dict(lossless=True, prompt_lookup=1 + r % 2, draft_tokens=4) if r < 4 else {}
        eng.add_request(prompts[-1], max_new_tokens=new, schedule=_sched(2 + r % 3, new), ignore_eos=True,
                        request_id=str(r), **kw)
    outs = {o.request_id: o for o in eng.run()}
    looked = accepted = 0
    for r in range(4):
        out = outs[str(r)]
        assert out.token_ids == naive_generate(ref, prompts[r], SkipSchedule.full_depth(L), new), r
        looked, accepted = looked + out.draft.lookup_drafted, accepted + out.draft.lookup_accepted
        assert out.draft.lookup_accepted <= out.draft.accepted and out.draft.lookup_drafted <= out.draft.drafted
    assert looked > 0 and accepted > 0, (looked, accepted)
    assert eng.pool.used_slots == 0


def test_eos_drafted_or_verified_ends_the_request_as_full_depth_does(deep):
    """EOS stops a round's drafting; a lossless request ends where full depth ends."""
    ref, model = deep
    g = torch.Generator().manual_seed(11)
    for trial in range(12):
        prompt = torch.randint(3, VOCAB, (9,), generator=g).tolist()
        full = naive_generate(ref, prompt, SkipSchedule.full_depth(L), 24)
        eos = full[len(full) // 2]  # a token full depth emits mid-way: treat it as the end
        eng = Engine(model, EngineConfig(kv_slots=512), eos_token_ids=[eos])
        eng.add_request(prompt, schedule=_sched(3, 24), max_new_tokens=24, lossless=True, draft_tokens=6)
        (out,) = eng.run()
        want = full[:full.index(eos) + 1]
        assert out.token_ids == want and out.finish_reason == "eos"
        assert eng.pool.used_slots == 0


class _NaNPool(KVPool):
    """Every slot starts as NaN: reading a never-written slot poisons the logits."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        for t in self.k + self.v:
            t.fill_(float("nan"))


def test_no_slot_read_before_written_and_abort_mid_round_frees_every_slot(deep, monkeypatch):
    """NaN-poisoned pool: lossless requests (beside a plain skip one) produce the
    full-depth tokens, so no draft read a slot nobody wrote; aborting a request
    whose drafts wait for verification releases all its slots at once."""
    ref, model = deep
    monkeypatch.setattr(engine_mod, "KVPool", _NaNPool)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 30, 3)]
    eng = Engine(model, EngineConfig(kv_slots=300))
    eng.add_request(prompts[0], schedule=_sched(3, 16), max_new_tokens=16, lossless=True, draft_tokens=4,
                    request_id="a", ignore_eos=True)
    eng.add_request(prompts[1], schedule=_sched(5, 16), max_new_tokens=16, lossless=True, draft_tokens=3,
                    request_id="b", ignore_eos=True)
    eng.add_request(prompts[2], schedule=_sched(2, 16), max_new_tokens=16, request_id="c", ignore_eos=True)
    done = {}
    aborted = False
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        b = eng.requests.get("b")
        if not aborted and b is not None and b.verifying and len(b.token_ids) > 3:
            used = eng.pool.used_slots
            held = sum(b.reservation.needs)
            eng.abort("b")
            aborted = True
            assert eng.pool.used_slots == used - held
    assert aborted
    assert done["a"].token_ids == naive_generate(ref, prompts[0], SkipSchedule.full_depth(L), 16)
    assert done["c"].token_ids == _alone(model, prompts[2], 16, schedule=_sched(2, 16), ignore_eos=True).token_ids
    assert eng.pool.used_slots == 0


def test_lossless_reserves_full_depth_in_the_pool(deep):
    _, model = deep
    eng = Engine(model, EngineConfig(kv_slots=200))
    st = eng.add_request([5] * 10, schedule=_sched(3, 32), max_new_tokens=32, lossless=True)
    eng.step()
    assert st.reservation.needs == [10 + 31] * L


def test_draft_logits_are_the_full_heads_on_the_draft_vocabulary_and_the_prompts_tokens(deep):
    _, model = deep
    h = torch.randn(3, 1, model.cfg.dim)
    extra = [torch.tensor([100, 200]), torch.tensor([], dtype=torch.long), torch.tensor([64])]
    with torch.inference_mode():
        full = model.lm_head(h).float()[:, 0]
        got = model.draft_logits(h, extra)
    for r, ids in enumerate(extra):
        scored = torch.zeros(VOCAB, dtype=torch.bool)
        scored[:64] = True
        scored[ids] = True
        torch.testing.assert_close(got[r, scored], full[r, scored], rtol=1e-4, atol=1e-4)
        assert torch.isinf(got[r, ~scored]).all() and (got[r, ~scored] < 0).all()


def test_lossless_requests_stop_drafting_while_the_batch_is_large_and_still_match_full_depth(deep):
    """With more requests running than ``draft_batch_limit``, a lossless request
    decodes at full depth (no drafts); it drafts again once the batch is small."""
    ref, model = deep
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, VOCAB, (8,), generator=g).tolist() for _ in range(3)]
    eng = Engine(model, EngineConfig(kv_slots=600, draft_batch_limit=1))
    eng.add_request(prompts[0], schedule=_sched(3, 24), max_new_tokens=24, lossless=True, request_id="long",
                    ignore_eos=True)
    for r, p in enumerate(prompts[1:]):
        eng.add_request(p, max_new_tokens=6, request_id=f"short{r}", ignore_eos=True)
    rounds = []
    done = {}
    while eng.has_unfinished():
        running = len(eng.scheduler.running)
        st = eng.requests.get("long")
        drafting = st is not None and st.round_size > 0
        rounds.append((running, drafting))
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert not any(drafting for running, drafting in rounds if running > 1), "no drafts beside batch-mates"
    assert any(drafting for _, drafting in rounds), "it drafts once alone"
    out = done["long"]
    assert out.token_ids == naive_generate(ref, prompts[0], SkipSchedule.full_depth(L), 24)
    assert out.draft.verify_layers >= L * 5 and out.draft.drafted > 0


def test_bad_lossless_options_are_clear_errors(deep):
    _, model = deep
    eng = Engine(model, EngineConfig(kv_slots=200))
    with pytest.raises(EngineError, match="draft_tokens applies to lossless requests only"):
        eng.make_request([5, 6], schedule=_sched(2, 8), max_new_tokens=8, draft_tokens=3)
    for bad in (0, 17, True, 2.5):
        with pytest.raises(EngineError, match="draft_tokens must be an integer in"):
            eng.make_request([5, 6], max_new_tokens=8, lossless=True, draft_tokens=bad)
    with pytest.raises(EngineError, match="draft_confidence applies to lossless requests only"):
        eng.make_request([5, 6], max_new_tokens=8, draft_confidence=0.5)
    for bad in (1.0, -0.1, True, "0.5", float("nan")):
        with pytest.raises(EngineError, match=r"draft_confidence must be a number in \[0, 1\)"):
            eng.make_request([5, 6], max_new_tokens=8, lossless=True, draft_confidence=bad)
    with pytest.raises(EngineError, match="prompt_lookup applies to lossless requests only"):
        eng.make_request([5, 6], max_new_tokens=8, prompt_lookup=2)
    for bad in (-1, 5, True, 1.5):
        with pytest.raises(EngineError, match=r"prompt_lookup must be an integer in \[0, 4\]"):
            eng.make_request([5, 6], max_new_tokens=8, lossless=True, prompt_lookup=bad)
    with pytest.raises(EngineError, match="lossless must be true or false"):
        eng.make_request([5, 6], max_new_tokens=8, lossless="yes")
    shared = Engine(model, EngineConfig(kv_slots=200, policy="shared"))
    with pytest.raises(EngineError, match="draft_batch_limit must be an integer"):
        Engine(model, EngineConfig(kv_slots=200, draft_batch_limit=-1))
    with pytest.raises(EngineError, match="lossless requests need the per_row policy"):
        shared.add_request([5, 6], schedule=_sched(2, 8), max_new_tokens=8, lossless=True)


def _chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularized upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of observed counts to probabilities, cells with fewer than
    5 expected merged into one (the test's usual validity rule)."""
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    e = torch.cat([exp[big], exp[~big].sum()[None]]).double()
    keep = e > 0
    obs, e = obs[keep], e[keep]
    return _chi2_sf(float(((obs - e) ** 2 / e).sum()), int(keep.sum()) - 1)


FALSE_ALARM = 1e-3  # per marginal; with fixed seeds the test is deterministic


def test_sampled_lossless_tokens_are_distributed_as_full_depth_sampling(tmp_path):
    """A 16-token vocabulary: the exact full-depth marginals of the 2nd and 3rd
    generated tokens (enumerated), against 3000 seeded lossless requests
    (drafts at 3x, sampled at temperature 1): chi-square goodness of fit at a
    0.1% false-alarm rate per marginal. Plain 3x sampling, the drafts' own
    distribution, fails the same test, so the test can tell them apart."""
    V, N, NEW = 16, 3000, 3
    d = tmp_path / "small"
    build_tiny("llama", d, seed=3, **dict(_LLAMA, vocab_size=V, num_hidden_layers=6, tie_word_embeddings=False,
                                           bos_token_id=1, eos_token_id=2, pad_token_id=0))
    ref = load_model(d)[0]
    model = load_model(d)[0].pack_for_inference(draft_vocab=8)  # drafts never propose ids 13..15
    prompt = [5, 9, 3, 12]
    sched = SkipSchedule.for_speedup(3, NEW, 6)

    with torch.inference_mode():  # the exact full-depth distribution, by enumeration
        def nxt(seqs: torch.Tensor) -> torch.Tensor:
            T = seqs.shape[1]
            return ref(seqs, torch.arange(T).expand(seqs.shape[0], T))[:, -1].float().softmax(-1)

        p0 = nxt(torch.tensor([prompt]))[0]  # (V,)
        seq1 = torch.cat([torch.tensor(prompt).expand(V, -1), torch.arange(V)[:, None]], 1)
        p1 = nxt(seq1)  # (V, V): p(t1 | t0)
        m1 = p0 @ p1
        seq2 = torch.cat([seq1.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
        p2 = nxt(seq2).view(V, V, V)  # p(t2 | t0, t1)
        m2 = torch.einsum("a,ab,abc->c", p0, p1, p2)

    def run(**kw) -> torch.Tensor:
        eng = Engine(model, EngineConfig(max_num_seqs=N, max_prefill_tokens=N * len(prompt), kv_slots=N * 8,
                                         draft_batch_limit=N))
        for s in range(N):
            eng.add_request(prompt, max_new_tokens=NEW, ignore_eos=True, request_id=str(s),
                            sampling=engine_mod.SamplingParams(temperature=1.0, seed=s), **kw)
        outs = eng.run()
        return torch.tensor([o.token_ids for o in outs]), outs

    # drafting all K; stopping a round after a draft sampled with probability < 0.3; and such
    # an unsure draft giving way to prompt lookup (the prompt's tokens recur in the output)
    for conf, lookup in ((0.0, 0), (0.3, 0), (0.3, 1)):
        toks, outs = run(schedule=sched, lossless=True, draft_tokens=2, draft_confidence=conf, prompt_lookup=lookup)
        drafted = sum(o.draft.drafted for o in outs)
        accepted = sum(o.draft.accepted for o in outs)
        assert 0.1 * drafted < accepted < 0.9 * drafted, "both the acceptance and the residual paths ran often"
        if conf:
            assert drafted < 2 * sum(o.draft.rounds for o in outs), "some rounds stopped drafting early"
        looked, took = sum(o.draft.lookup_drafted for o in outs), sum(o.draft.lookup_accepted for o in outs)
        assert (0 < took < looked) if lookup else looked == 0, (looked, took)
        for j, m in ((1, m1), (2, m2)):
            counts = torch.bincount(toks[:, j], minlength=V)
            assert _chi2_p(counts, m) > FALSE_ALARM, \
                f"token {j} is not distributed as full depth's (c={conf}, lookup={lookup})"

    plain, _ = run(schedule=sched)
    assert min(_chi2_p(torch.bincount(plain[:, j], minlength=V), m) for j, m in ((1, m1), (2, m2))) < FALSE_ALARM
