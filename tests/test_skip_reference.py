"""The real generator (KV cache, left-padded batch, packed linears, rows
leaving) produces exactly what the naive recompute-everything reference
produces, and runs exactly the schedule's layers."""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, pick_eos
from skipdecode.generate import generate_tokens
from skipdecode.reference import naive_generate, naive_logits
from skipdecode.schedule import SkipSchedule

LENGTHS = [5, 12, 1, 8]  # mixed, one single-token prompt
NEW = 10


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in LENGTHS]


def _schedule(L: int, mode: str) -> SkipSchedule:
    # decays from full depth to the floor within the generation, then stays there
    return SkipSchedule(L, max_exit_layer=L, min_exit_layer=2 if mode == "skip" else 1, horizon=6,
                        warmup_layers=1, mode=mode)


def _check_against_reference(arch, mode, tiny_models, tiny_packed):
    ref_model, model = tiny_models[arch], tiny_packed[arch]
    sched = _schedule(model.n_layers, mode)
    assert sched.budget(0) == model.n_layers and sched.budget(NEW - 1) < model.n_layers
    prompts = _prompts()
    rows, _ = generate_tokens(model, prompts, sched, NEW)
    full, _ = generate_tokens(model, prompts, SkipSchedule.full_depth(model.n_layers), NEW)
    for r, (p, row) in enumerate(zip(prompts, rows)):
        expected = naive_generate(ref_model, p, sched, NEW)
        assert row.token_ids == expected, f"{arch}/{mode}: row {r} (prompt length {len(p)})"
    # the schedule really changed something (else the test would prove little)
    assert [r.token_ids for r in rows] != [r.token_ids for r in full]


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2", "qwen2"])
def test_skip_generation_matches_naive_recompute_reference(arch, tiny_models, tiny_packed):
    _check_against_reference(arch, "skip", tiny_models, tiny_packed)


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2"])
def test_early_exit_generation_matches_naive_recompute_reference(arch, tiny_models, tiny_packed):
    _check_against_reference(arch, "early_exit", tiny_models, tiny_packed)


def test_reference_at_full_depth_is_a_plain_forward(tiny_models):
    """The reference with a full-depth schedule is the model's own forward."""
    net = tiny_models["llama"]
    seq = _prompts()[1]
    with torch.no_grad():
        plain = net(torch.tensor([seq]), torch.arange(len(seq))[None])[0]
    ref = naive_logits(net, seq, 3, SkipSchedule.full_depth(net.n_layers))
    assert (plain - ref).abs().max().item() < 1e-4


def test_reference_keeps_skipped_hidden_states():
    """At layer l a skipped position keeps its hidden state: with every block
    replaced by ``h + 1``, a generated position's final state counts its layers."""
    from skipdecode.config import ModelConfig
    from skipdecode.model import Transformer

    cfg = ModelConfig(arch="gpt2", vocab_size=4, dim=4, n_layers=6, n_heads=1, n_kv_heads=1, head_dim=4,
                      intermediate_size=4, max_position=16, norm="layer", pos="learned", mlp="gelu",
                      final_norm=False, tie_embeddings=False)
    net = Transformer(cfg)
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
        net.lm_head.weight.copy_(torch.eye(4))  # logits = hidden state
    for b in net.layers:
        b.forward = lambda x, *a: x + 1  # noqa: E731
    sched = SkipSchedule(6, 6, 2, horizon=4, warmup_layers=1)
    out = naive_logits(net, [0, 1, 2, 3, 0, 1, 2], 2, sched)[:, 0]
    assert out.tolist() == [6, 6] + [float(sched.budget(i)) for i in range(5)]


@pytest.mark.parametrize("mode", ["skip", "early_exit"])
def test_trace_active_layers_are_exactly_the_schedule_layer_sets(mode, tiny_packed):
    """Both what ``RowResult.active_layers`` reports and what really ran: the
    prefill runs every layer, decode step i runs exactly ``schedule.layers(i)``.
    A row finishing early gets ``[]`` for its final (never fed) token."""
    model = tiny_packed["opt"]
    L = model.n_layers
    sched = _schedule(L, mode)
    prompts = _prompts(seed=3)

    plain, _ = generate_tokens(model, prompts, sched, NEW)
    eos_row, eos_step, eos = pick_eos([r.token_ids for r in plain], min_step=2)  # one row ends early

    prefill: list[list[int]] = []  # per packed prefill pass: the layers it ran
    prefilled: list[tuple[int, ...]] = []  # every prompt chunk prefilled: its positions
    decode: list[list[int]] = []  # per decode step: the layers it ran
    model_decode, model_prefill = model.decode, model.prefill

    def recording_decode(*a, **kw):
        decode.append([])
        return model_decode(*a, **kw)

    def recording_prefill(chunks):
        prefill.append([])
        prefilled.extend(tuple(range(c.start, c.start + len(c.tokens))) for c in chunks)
        return model_prefill(chunks)

    def recording(log, l, f):
        def run(*a, **kw):
            log[-1].append(l)
            return f(*a, **kw)
        return run

    model.decode, model.prefill = recording_decode, recording_prefill
    for l, blk in enumerate(model.layers):
        blk.decode = recording(decode, l, blk.decode)
        blk.attention_chunks = recording(prefill, l, blk.attention_chunks)
    try:
        rows, stats = generate_tokens(model, prompts, sched, NEW, eos_token_ids=[eos])
    finally:
        del model.decode, model.prefill
        for blk in model.layers:
            del blk.decode, blk.attention_chunks

    assert prefill and all(ran == list(range(L)) for ran in prefill), "every prompt runs at full depth"
    assert sorted(prefilled) == sorted(tuple(range(len(p))) for p in prompts), "each prompt prefilled once, whole"
    assert len(decode) == stats["decode_steps"] == NEW - 1
    for i, ran in enumerate(decode):
        assert ran == sched.layers(i), f"decode step {i}"
    assert rows[eos_row].finish_reason == "eos"
    for r, row in enumerate(rows):
        n = len(row.token_ids)
        assert n == (eos_step + 1 if r == eos_row else NEW)
        assert len(row.active_layers) == n
        assert row.active_layers[:-1] == [sched.layers(i) for i in range(n - 1)]
        assert row.active_layers[-1] == []
        expected = L * (n - 1) / sum(sched.budget(i) for i in range(n - 1))
        assert row.decode_layer_speedup == pytest.approx(expected)
