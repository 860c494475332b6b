"""Batching changes speed, never results: a row's tokens do not depend on its
batch-mates, finished rows leave the batch, sampling is seeded, and the text
API streams and stops on strings."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, pick_eos
from skipdecode.generate import GenerationError, Sampling, generate_tokens
from skipdecode.schedule import SkipSchedule

LENGTHS = [4, 13, 1, 9, 6]
NEW = 10


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in LENGTHS]


def _skip(L: int) -> SkipSchedule:
    return SkipSchedule(L, L - 1, 2, horizon=5, warmup_layers=1)


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2"])
def test_batch_gives_same_tokens_as_each_row_alone(arch, tiny_packed):
    model = tiny_packed[arch]
    sched = _skip(model.n_layers)
    prompts = _prompts()
    batch, stats = generate_tokens(model, prompts, sched, NEW)
    # every decode step after the one that prefills is timed, and they fit inside the decode time
    assert len(stats["step_seconds"]) == stats["engine_steps"] - 1 == NEW - 1
    assert 0 < sum(stats["step_seconds"]) <= stats["decode_seconds"]
    for r, p in enumerate(prompts):
        alone, _ = generate_tokens(model, [p], sched, NEW)
        assert batch[r].token_ids == alone[0].token_ids, f"{arch}: row {r} (prompt length {len(p)})"
        assert batch[r].active_layers == alone[0].active_layers
    assert len({tuple(r.token_ids) for r in batch}) > 1, "rows should differ"


def test_finished_rows_leave_the_batch(tiny_packed, monkeypatch):
    """A row that hits EOS stops there; the others go on exactly as before,
    and every later forward pass runs without it (it is dropped, not masked).
    One Python step a call, so each step's outputs stream in turn (native bursts:
    test_generate_runs_steady_greedy_steps_natively_with_the_tokens_of_python_steps)."""
    import skipdecode.generate as gen

    monkeypatch.setattr(gen, "DECODE_BURST", 1)
    model = tiny_packed["llama"]
    sched = _skip(model.n_layers)
    prompts = _prompts(seed=1)
    plain, _ = generate_tokens(model, prompts, sched, NEW)
    row, step, eos = pick_eos([r.token_ids for r in plain], min_step=2)

    batch_sizes: list[int] = []
    order: list[int] = []
    decode = model.decode

    def counting_decode(tokens, *a, **kw):
        batch_sizes.append(tokens.shape[0])
        return decode(tokens, *a, **kw)

    model.decode = counting_decode
    try:
        rows, stats = generate_tokens(model, prompts, sched, NEW, eos_token_ids=[eos],
                                      on_token=lambda req, tok: order.append(req))
    finally:
        del model.decode

    B = len(prompts)
    assert rows[row].token_ids == plain[row].token_ids[: step + 1]
    assert rows[row].finish_reason == "eos"
    for r in range(B):
        if r != row:
            assert rows[r].token_ids == plain[r].token_ids and rows[r].finish_reason == "length"
    # decode steps feed tokens 0..NEW-2; token `step` of the finished row is
    # its last, so every decode step after it runs one row fewer
    assert batch_sizes == [B] * step + [B - 1] * (NEW - 1 - step)
    assert stats["decode_steps"] == NEW - 1
    # streaming order: each step reports the live rows; the finished row never again
    assert order.count(row) == step + 1
    assert row not in order[(step + 1) * B:]
    assert len(order) == B * NEW - (NEW - 1 - step)


def test_all_rows_finishing_ends_generation(tiny_packed):
    model = tiny_packed["gpt2"]
    prompts = _prompts(seed=2)[:1]
    plain, _ = generate_tokens(model, prompts, SkipSchedule.full_depth(model.n_layers), NEW)
    _, step, eos = pick_eos([plain[0].token_ids], min_step=1)
    rows, stats = generate_tokens(model, prompts, SkipSchedule.full_depth(model.n_layers), NEW,
                                  eos_token_ids=[eos])
    assert rows[0].token_ids == plain[0].token_ids[: step + 1] and rows[0].finish_reason == "eos"
    assert stats["decode_steps"] == step


def test_sampling_with_seed_is_reproducible(tiny_packed):
    model = tiny_packed["llama"]
    sched = _skip(model.n_layers)
    prompts = _prompts(seed=3)

    def run(seed):
        s = Sampling(temperature=1.0, top_k=50, top_p=0.95, seed=seed)
        return [r.token_ids for r in generate_tokens(model, prompts, sched, NEW, sampling=s)[0]]

    first = run(1234)
    assert run(1234) == first
    assert run(99) != first, "a different seed should sample differently"
    greedy = [r.token_ids for r in generate_tokens(model, prompts, sched, NEW)[0]]
    assert first != greedy, "temperature 1 should not be greedy"


def test_a_sampled_request_does_not_depend_on_its_batch_mates(tiny_packed):
    """Request r samples from seed + r: alone with that seed it gives the same
    tokens as in the batch, also after other rows have left the batch."""
    model = tiny_packed["llama"]
    sched = _skip(model.n_layers)
    prompts = _prompts(seed=5)
    s = lambda seed: Sampling(temperature=1.0, top_k=50, seed=seed)  # noqa: E731
    plain = [r.token_ids for r in generate_tokens(model, prompts, sched, NEW, sampling=s(7))[0]]
    row, step, eos = pick_eos(plain, min_step=1)
    batch = [r.token_ids for r in generate_tokens(model, prompts, sched, NEW, sampling=s(7), eos_token_ids=[eos])[0]]
    for r, p in enumerate(prompts):
        alone = generate_tokens(model, [p], sched, NEW, sampling=s(7 + r), eos_token_ids=[eos])[0][0].token_ids
        assert batch[r] == alone, f"row {r}"
    assert batch[row] == plain[row][: step + 1]


def test_top_k_1_equals_greedy(tiny_packed):
    model = tiny_packed["opt"]
    sched = _skip(model.n_layers)
    prompts = _prompts(seed=4)
    greedy = [r.token_ids for r in generate_tokens(model, prompts, sched, NEW)[0]]
    for seed in (0, 1):
        top1 = generate_tokens(model, prompts, sched, NEW, sampling=Sampling(temperature=1.5, top_k=1, seed=seed))[0]
        assert [r.token_ids for r in top1] == greedy


def test_top_p_keeps_the_smallest_set_reaching_p():
    from skipdecode.generate import sample

    # probabilities 0.5, 0.3, 0.2 (logits are their logs): top_p=0.6 keeps {0, 1}
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(4000, -1)
    g = torch.Generator().manual_seed(0)
    got = sample(logits, Sampling(temperature=1.0, top_p=0.6), [g] * len(logits))
    counts = torch.bincount(got, minlength=3).tolist()
    assert counts[2] == 0 and counts[0] > 0 and counts[1] > 0
    assert abs(counts[0] / 4000 - 0.625) < 0.05  # renormalised 0.5 / 0.8
    assert sample(logits[:1], Sampling(temperature=1.0, top_p=0.4), [g]).item() == 0


@pytest.mark.parametrize("kw, msg", [
    (dict(temperature=-1.0), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_parameters_are_rejected(kw, msg):
    with pytest.raises(GenerationError, match=msg):
        Sampling(**kw)


# -- text API, on the real model (slow) --------------------------------------

@pytest.mark.slow
def test_stop_string_ends_row(default_llm):
    prompts = ["Write a short poem about the sea.", "Explain what a CPU does."]
    free = default_llm.generate(prompts, speedup=1.5, max_new_tokens=12)
    words = free[0].text.split()
    assert len(words) >= 4 and free[0].finish_reason == "length"
    stop = " " + words[2]  # a string that first appears mid-generation
    first = free[0].text.find(stop)
    assert first > 0
    pieces: dict[int, list[str]] = {0: [], 1: []}
    out = default_llm.generate(prompts, speedup=1.5, max_new_tokens=12, stop=[stop],
                               on_text=lambda row, delta: pieces[row].append(delta))
    assert out[0].finish_reason == "stop"
    assert out[0].text == free[0].text[:first]
    assert "".join(pieces[0]) == out[0].text, "the stream must not show the stop string"
    assert out[0].new_tokens < free[0].new_tokens
    assert out[0].token_ids == free[0].token_ids[: out[0].new_tokens]
    if stop not in free[1].text:  # the other row is unaffected
        assert out[1].text == free[1].text and out[1].finish_reason == free[1].finish_reason


@pytest.mark.slow
def test_streaming_callback_reassembles_text(default_llm):
    prompts = ["Describe a cheap Italian restaurant in the city centre.", "Name a colour."]
    pieces: dict[int, list[str]] = {0: [], 1: []}
    out = default_llm.generate(prompts, speedup=2, max_new_tokens=12,
                               on_text=lambda row, delta: pieces[row].append(delta))
    for r, o in enumerate(out):
        assert "".join(pieces[r]) == o.text
        assert o.text.strip()
    assert len(pieces[0]) > 1, "text arrives token by token, not at the end"


@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "qwen2", "mistral", "opt", "gpt2"])
def test_generate_runs_steady_greedy_steps_natively_with_the_tokens_of_python_steps(arch, tiny_packed, monkeypatch):
    """generate_tokens bursts a static greedy batch's steady steps through the native loop
    (Llama-family models on the compiled kernels; OPT and GPT-2 step in Python): the same tokens,
    layer sets, finish reasons and decode steps as one Python step at a time, one step time per
    decode step, with an EOS ending a row mid-burst."""
    import skipdecode.generate as gen

    model = tiny_packed[arch]
    sched = _skip(model.n_layers)
    prompts = _prompts(4)
    monkeypatch.setattr(gen, "DECODE_BURST", 1)
    plain, _ = generate_tokens(model, prompts, sched, 24)
    r, step, eos = pick_eos([row.token_ids for row in plain], min_step=4)
    runs = {}
    for burst in (1, 16):
        monkeypatch.setattr(gen, "DECODE_BURST", burst)
        runs[burst] = generate_tokens(model, prompts, sched, 24, eos_token_ids=[eos])
    (want, want_stats), (got, stats) = runs[1], runs[16]
    for a, b in zip(want, got):
        assert (b.token_ids, b.active_layers, b.finish_reason) == (a.token_ids, a.active_layers, a.finish_reason)
    assert got[r].finish_reason == "eos" and len(got[r].token_ids) == step + 1
    assert stats["decode_steps"] == want_stats["decode_steps"]
    assert len(stats["step_seconds"]) == stats["engine_steps"] - 1 == want_stats["engine_steps"] - 1
    assert model.native_greedy(len(prompts)) == (arch not in ("opt", "gpt2"))
