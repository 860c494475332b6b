"""At full depth our decoder is transformers' decoder: same logits (1e-4),
same greedy tokens, alone and in a left-padded batch, for every supported
architecture, and on the real default model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import TINY_ARCHS, VOCAB
from skipdecode.generate import generate_tokens
from skipdecode.model import rope_inv_freq
from skipdecode.schedule import SkipSchedule

ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_models(tiny_dirs):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(d).eval() for name, d in tiny_dirs.items()}


def _random_tokens(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def _hf_greedy(hf, input_ids: torch.Tensor, n: int, attention_mask: torch.Tensor | None = None,
               eos: int | None = None) -> torch.Tensor:
    """transformers' greedy ``generate``. With ``eos=None`` it has no EOS at
    all, so ``min_new_tokens`` suppresses nothing and exactly ``n`` tokens come
    out, as from ``generate_tokens(..., eos_token_ids=())``."""
    with torch.no_grad():
        out = hf.generate(input_ids, attention_mask=attention_mask if attention_mask is not None
                          else torch.ones_like(input_ids), do_sample=False, max_new_tokens=n,
                          min_new_tokens=n if eos is None else None, eos_token_id=eos, pad_token_id=0)
    return out[:, input_ids.shape[1]:]


def test_llama3_rope_scaling_is_read_from_the_config(tiny_models):
    net = tiny_models["llama3_rope"]
    rs = net.cfg.rope_scaling
    assert rs is not None and rs["rope_type"] == "llama3"
    assert rs["factor"] == 8.0 and rs["original_max_position_embeddings"] == 32
    unscaled = rope_inv_freq(dataclasses.replace(net.cfg, rope_scaling=None))
    assert not torch.allclose(net.inv_freq, unscaled), "the scaling must change the frequencies"
    assert tiny_models["llama"].cfg.rope_scaling is None


@pytest.mark.parametrize("variant", ["unpacked", "packed", "onednn"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_full_depth_logits_match_transformers(arch, variant, tiny_models, tiny_packed, tiny_onednn, hf_models):
    net = {"unpacked": tiny_models, "packed": tiny_packed, "onednn": tiny_onednn}[variant][arch]
    hf = hf_models[arch]
    tokens = _random_tokens(2, 60, seed=1)  # 60 > 32: past llama3's original context
    positions = torch.arange(60)[None].expand(2, -1)
    with torch.no_grad():
        ref = hf(tokens).logits
        ours = net(tokens, positions)
    assert ours.shape == ref.shape == (2, 60, VOCAB)
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"{arch}: max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_full_depth_greedy_matches_transformers_generate(arch, tiny_packed, hf_models):
    net, hf = tiny_packed[arch], hf_models[arch]
    n = 12
    prompt = _random_tokens(1, 7, seed=2)
    expected = _hf_greedy(hf, prompt, n)[0].tolist()
    rows, _ = generate_tokens(net, [prompt[0].tolist()], SkipSchedule.full_depth(net.n_layers), n)
    assert rows[0].token_ids == expected
    assert rows[0].finish_reason == "length"


@pytest.mark.parametrize("variant", ["packed", "onednn"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_full_depth_left_padded_batch_matches_transformers(arch, variant, tiny_packed, tiny_onednn, hf_models):
    """A batch of mixed-length prompts, left-padded, against transformers'
    own left-padded batch with an attention mask (positions from the mask);
    with the compiled kernels and without them."""
    net, hf = {"packed": tiny_packed, "onednn": tiny_onednn}[variant][arch], hf_models[arch]
    n = 10
    lengths = [3, 11, 1, 7]
    prompts = [_random_tokens(1, k, seed=10 + k)[0].tolist() for k in lengths]
    P = max(lengths)
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, P - len(p):] = torch.tensor(p)
        mask[r, P - len(p):] = 1
    expected = _hf_greedy(hf, ids, n, attention_mask=mask).tolist()
    rows, _ = generate_tokens(net, prompts, SkipSchedule.full_depth(net.n_layers), n)
    assert [r.token_ids for r in rows] == expected
    # and transformers itself agrees with running each prompt alone (so the
    # comparison above is against a correct padded batch)
    for r, p in enumerate(prompts):
        assert _hf_greedy(hf, torch.tensor([p]), n)[0].tolist() == expected[r]


DEFAULT_PROMPTS = [  # answers longer than 16 tokens, prompts of different lengths
    "Write a short poem about the sea.",
    "Explain what a CPU does.",
    "Describe a cheap Italian restaurant in the city centre.",
]


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(default_llm, monkeypatch):
    """SmolLM2-135M-Instruct, chat prompts batched (each in its own KV slots), packed
    weights: the same 16 greedy tokens as transformers for every prompt, and
    the logits that chose each row's last token within 1e-4 (one Python step a call,
    whose sampling sees them); generate's native bursts give the same tokens."""
    from transformers import AutoModelForCausalLM

    import skipdecode.generate as gen

    llm = default_llm
    hf = AutoModelForCausalLM.from_pretrained(llm.path, dtype=torch.float32).eval()
    n = 16
    ids = [llm.encode(p, chat=True) for p in DEFAULT_PROMPTS]
    assert len({len(i) for i in ids}) > 1, "prompts should differ in length"

    # on_token is called for each request in the order of the rows the engine
    # sampled in that step: map those logits back to requests.
    import skipdecode.engine.engine as engine_mod

    state: dict = {"chose": {}}
    sample_rows = engine_mod.sample_rows

    def recording_sample_rows(logits, *a, **kw):
        state["logits"], state["b"] = logits.clone(), 0
        return sample_rows(logits, *a, **kw)

    def on_token(req: int, _tok: int) -> None:
        state["chose"][req] = state["logits"][state["b"]]
        state["b"] += 1

    bursts, _ = generate_tokens(llm.model, ids, SkipSchedule.full_depth(llm.num_layers), n,
                                eos_token_ids=llm.eos_token_ids)
    monkeypatch.setattr(gen, "DECODE_BURST", 1)
    engine_mod.sample_rows = recording_sample_rows
    try:
        rows, _ = generate_tokens(llm.model, ids, SkipSchedule.full_depth(llm.num_layers), n,
                                  eos_token_ids=llm.eos_token_ids, on_token=on_token)
    finally:
        engine_mod.sample_rows = sample_rows
    assert [r.token_ids for r in bursts] == [r.token_ids for r in rows]

    for r, (p, row) in enumerate(zip(ids, rows)):
        expected = _hf_greedy(hf, torch.tensor([p]), n, eos=llm.eos_token_ids[0])[0].tolist()
        assert row.token_ids == expected, f"prompt {r}: {row.token_ids} != {expected}"
        assert len(row.token_ids) >= 12, "pick prompts whose answers are long enough to compare"
        with torch.no_grad():
            ref = hf(torch.tensor([p + row.token_ids[:-1]])).logits[0, -1]
        diff = (state["chose"][r] - ref).abs().max().item()
        assert diff <= ATOL, f"prompt {r}: last-step max |logit diff| {diff:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "qwen2"])
def test_a_decode_steps_rope_lookup_equals_computing_it(arch, dtype, tiny_models):
    """Decode steps read RoPE from a table (``_rope_lookup``); every value equals what ``_rope``
    computes for the same positions, bit for bit, past the table's first size (it grows)."""
    net = tiny_models[arch]
    for positions in (torch.tensor([[0]]), torch.tensor([[5], [0], [1023], [17]]), torch.tensor([[1024], [3000]])):
        got = net._rope_lookup(positions, dtype)
        want = net._rope(positions, dtype)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert torch.equal(g, w)
    assert net._rope_tables[dtype][2].shape[0] == 4096
