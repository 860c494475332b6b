"""Nested layer sets by measured importance: budget b runs the b most influential
layers (in depth order); the sets are nested, so every key/value a later token
reads exists; the engine runs them beside skip and full-depth requests token for
token as the recompute-everything reference; training measures the order and
records it, and generation then uses it by default."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import build_deep_llama, drive
from skipdecode.checkpoint import load_model
from skipdecode.engine import Engine, EngineConfig
from skipdecode.policies.importance import answer_influence, block_influence, nested_order, removal_order
from skipdecode.policies.select import schedule_for_speedup
from skipdecode.reference import naive_generate
from skipdecode.schedule import ScheduleError, SkipSchedule, layers_for_budget

L = 10
VOCAB = 256
ORDER = (0, 9, 4, 7, 1, 8, 2, 6, 3, 5)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    d = tmp_path_factory.mktemp("nested") / "llama"
    build_deep_llama(d, seed=5, layers=L)
    return load_model(d)[0], load_model(d)[0].pack_for_inference()


def test_nested_budget_runs_the_first_b_layers_of_the_order_in_depth_order():
    s = SkipSchedule(L, 8, 3, horizon=5, warmup_layers=0, mode="nested", layer_order=ORDER)
    for b in range(1, L + 1):
        got = layers_for_budget(L, b, 0, "nested", ORDER)
        assert got == sorted(ORDER[:b])
        if b > 1:
            assert set(layers_for_budget(L, b - 1, 0, "nested", ORDER)) < set(got), "the family is nested"
    assert s.layers(0) == sorted(ORDER[:8]) and s.layers(10) == [0, 4, 9]
    assert SkipSchedule.from_dict(json.loads(json.dumps(s.to_dict())), L) == s


def test_skip_and_early_exit_ranks_give_their_documented_layer_sets():
    for n in (1, 5, 12):
        for w in range(0, 3):
            for b in range(w + 1, n + 1):
                assert layers_for_budget(n, b, w, "skip") == list(range(w)) + list(range(n - (b - w), n))
        for b in range(1, n + 1):
            assert layers_for_budget(n, b, 1, "early_exit") == list(range(b))


@pytest.mark.parametrize("order, match", [(None, "needs a layer_order"), ((0, 1, 2), "each of the 10 layers"),
                                          ((0,) * 10, "each of the 10 layers")])
def test_a_nested_schedule_needs_a_permutation_of_the_layers(order, match):
    with pytest.raises(ScheduleError, match=match):
        SkipSchedule(L, 8, 3, horizon=5, warmup_layers=0, mode="nested", layer_order=order)
    with pytest.raises(ScheduleError, match="only for mode 'nested'"):
        SkipSchedule(L, 8, 3, horizon=5, layer_order=ORDER)


def test_nested_requests_beside_skip_and_full_depth_ones_match_the_reference(deep):
    ref, model = deep
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    arrivals: dict[int, list[dict]] = {}
    specs = {}
    for r in range(9):
        new = rng.randint(4, 10)
        kind = r % 3
        if kind == 0:
            sched = SkipSchedule.for_speedup(rng.choice([2, 3, 4]), new, L, horizon=rng.randint(1, 4),
                                             mode="nested", layer_order=ORDER)
        elif kind == 1:
            sched = SkipSchedule.for_speedup(rng.choice([2, 3]), new, L)
        else:
            sched = SkipSchedule.full_depth(L)
        spec = dict(prompt_token_ids=torch.randint(3, VOCAB, (rng.randint(1, 80),), generator=g).tolist(),
                    schedule=sched, max_new_tokens=new, request_id=f"r{r}", ignore_eos=True)
        specs[spec["request_id"]] = spec
        arrivals.setdefault(rng.randint(0, 6), []).append(spec)
    eng = Engine(model, EngineConfig(kv_slots=4096, max_prefill_tokens=48, prefill_chunk=16))
    done = drive(eng, arrivals)
    for rid, spec in specs.items():
        want = naive_generate(ref, spec["prompt_token_ids"], spec["schedule"], spec["max_new_tokens"])
        assert done[rid].token_ids == want, rid
        s = spec["schedule"]
        assert done[rid].active_layers[:-1] == [s.layers(i) for i in range(len(want) - 1)]


def test_block_influence_ranks_a_layer_that_changes_nothing_last(deep):
    ref, _ = deep
    import copy

    net = copy.deepcopy(ref)
    with torch.no_grad():  # layer 6 adds nothing to the residual stream: its output is its input
        for lin in (net.layers[6].wo, net.layers[6].w2):
            lin.weight.zero_()
            if lin.bias is not None:
                lin.bias.zero_()
    g = torch.Generator().manual_seed(0)
    items = [(torch.randint(3, VOCAB, (n,), generator=g).tolist(), torch.randint(3, VOCAB, (5,), generator=g).tolist())
             for n in (4, 9, 6)]
    bi = answer_influence(net, items)
    assert len(bi) == L and abs(bi[6]) < 1e-6 and min(b for i, b in enumerate(bi) if i != 6) > 1e-4
    order = nested_order(bi)
    assert order[-1] == 6 and sorted(order) == list(range(L))
    # the answer positions of (prompt, target) are the tail of prompt + target[:-1]
    tails = block_influence(net, [p + t[:-1] for p, t in items], [len(p) - 1 for p, _ in items])
    assert tails == bi and block_influence(net, [p + t[:-1] for p, t in items]) != bi


def _answer_loss_by_full_recompute(net, items, removed):
    """The slow reference: every item alone, prompt + answer in one forward pass, the removed
    layers skipped from the first answer input on; mean cross-entropy of answer tokens 1..n-1."""
    total, n = 0.0, 0
    with torch.no_grad():
        for p, t in items:
            tok = torch.tensor([p + t[:-1]])
            T, P = tok.shape[1], len(p)
            logits = net(tok, torch.arange(T)[None], [P if l in removed else T for l in range(L)])[0]
            total += float(torch.nn.functional.cross_entropy(logits[P:].float(), torch.tensor(t[1:]),
                                                             reduction="sum"))
            n += len(t) - 1
    return total / n


def _items(seed, lens=(4, 9, 6, 7), answer=(5, 3, 8, 2)):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, VOCAB, (n,), generator=g).tolist(), torch.randint(3, VOCAB, (m,), generator=g).tolist())
            for n, m in zip(lens, answer)]


def test_removal_order_is_greedy_removal_by_answer_loss_against_a_full_recompute(deep):
    from skipdecode.policies.importance import _answer_loss_fn

    net, _ = deep
    items = _items(1)
    loss = _answer_loss_fn(net, items, batch_size=3)  # padded batches, prompts' keys/values computed once
    for removed in (frozenset(), frozenset({3}), frozenset({0, 5, 9})):
        assert loss(removed) == pytest.approx(_answer_loss_by_full_recompute(net, items, removed), rel=1e-4)
    order, at = removal_order(net, items, batch_size=3, keep=4)
    assert sorted(order) == list(range(L)) and len(at) == L - 4
    kept, removed = order[:4], list(reversed(order[4:]))
    assert list(kept) == sorted(kept)  # the layers that stay lead, in depth order
    gone: set[int] = set()
    for i, l in enumerate(removed):  # each step removes the layer that raises the loss least, given the ones gone
        cand = {c: _answer_loss_by_full_recompute(net, items, gone | {c}) for c in range(L) if c not in gone}
        assert cand[l] == pytest.approx(min(cand.values()), rel=1e-4)
        assert at[i] == pytest.approx(cand[l], rel=1e-4)
        gone.add(l)
    with pytest.raises(Exception, match="keep must be"):
        removal_order(net, items, keep=0)


def test_a_nested_checkpoint_uses_its_measured_order_unless_told_otherwise():
    trained = {"1x": SkipSchedule.full_depth(L).to_dict(),
               "3x": SkipSchedule.for_speedup(3, 12, L, mode="nested", layer_order=ORDER).to_dict()}
    assert schedule_for_speedup(3, L, 12, trained=trained).layer_order == ORDER
    solved = schedule_for_speedup(2, L, 12, trained=trained)
    assert solved.mode == "nested" and solved.layer_order == ORDER
    assert schedule_for_speedup(3, L, 12, trained=trained, mode="skip").mode == "skip"
    with pytest.raises(ScheduleError, match="train it with mode nested"):
        schedule_for_speedup(3, L, 12, mode="nested")
