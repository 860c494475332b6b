"""A half-width KV pool (``kv_dtype`` float16 / bfloat16): keys and values are rounded when
stored and every attention reads the stored values, so the engine gives exactly the tokens of
the naive recompute-everything reference whose attention reads keys and values rounded the same
way, on the compiled kernels (fused layers, native bursts) and on plain torch alike; the pool
takes half the bytes; a dtype it cannot hold is a clear error."""

from __future__ import annotations

import pytest
import torch

from conftest import build_deep_llama
from skipdecode import kernels
from skipdecode.checkpoint import load_model
from skipdecode.config import ModelError
from skipdecode.engine import Engine, EngineConfig, EngineError
from skipdecode.reference import naive_generate, naive_logits
from skipdecode.schedule import SkipSchedule

L = 10
VOCAB = 256
NEW = 10
HALF = [torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """(reference, plain torch model, packed model on the compiled kernels where they build)."""
    d = tmp_path_factory.mktemp("deep") / "llama"
    build_deep_llama(d, seed=11, layers=L)
    return load_model(d)[0], load_model(d)[0], load_model(d)[0].pack_for_inference()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 37, 90)]


def _sched(speedup: float) -> SkipSchedule:
    return SkipSchedule.full_depth(L) if speedup == 1 else SkipSchedule.for_speedup(speedup, NEW, L)


def _run(model, dtype: torch.dtype, burst: int = 1) -> dict[str, list[int]]:
    eng = Engine(model, EngineConfig(kv_slots=512, decode_burst=burst, kv_dtype=str(dtype).removeprefix("torch.")))
    assert eng.pool.dtype == dtype and all(k.dtype == dtype for k in eng.pool.k + eng.pool.v)
    for i, (p, sp) in enumerate(zip(_prompts(), (1, 2, 3))):
        eng.add_request(p, schedule=_sched(sp), max_new_tokens=NEW, request_id=str(i))
    return {o.request_id: o.token_ids for o in eng.run()}


def test_the_reference_with_rounded_keys_and_values_differs_from_the_unrounded_one(deep):
    """The rounding the reference applies is real: its logits move, by about the dtype's epsilon."""
    ref = deep[0]
    toks = _prompts()[1]
    full = naive_logits(ref, toks, len(toks), _sched(1))
    for dt, eps in ((torch.float16, 2 ** -10), (torch.bfloat16, 2 ** -7)):
        diff = (naive_logits(ref, toks, len(toks), _sched(1), kv_dtype=dt) - full).abs().max().item()
        assert 0 < diff < 200 * eps * full.abs().max().item(), (dt, diff)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_half_width_pool_gives_the_tokens_of_the_reference_reading_rounded_keys_and_values(deep, dtype):
    ref, plain, packed = deep
    want = {str(i): naive_generate(ref, p, _sched(sp), NEW, kv_dtype=dtype)
            for i, (p, sp) in enumerate(zip(_prompts(), (1, 2, 3)))}
    assert _run(plain, dtype) == want
    assert _run(packed, dtype) == want
    assert _run(packed, dtype, burst=8) == want  # the native greedy loop


@pytest.mark.skipif(kernels.load() is None, reason="no compiled kernels on this machine")
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_decode_attention_on_a_half_width_pool_is_attention_on_its_values_widened(dtype):
    k = kernels.load()
    g = torch.Generator().manual_seed(0)
    B, H, KVH, hd, slots = 3, 9, 3, 64, 61
    q = torch.randn(B, H, hd, generator=g)
    kp, vp = (torch.randn(KVH, slots, hd, generator=g).to(dtype) for _ in range(2))
    rows = torch.tensor([[0, 7], [10, 13], [30, 31]])
    got = k.decode_attention(q, kp, vp, None, hd ** -0.5, rows)
    assert torch.equal(got, k.decode_attention(q, kp.float(), vp.float(), None, hd ** -0.5, rows))
    kd, vd = (torch.randn(B, KVH, 21, hd, generator=g).to(dtype) for _ in range(2))  # a dense cache, masked
    mask = torch.rand(B, 21, generator=g) > 0.3
    mask[:, -1] = True
    got = k.decode_attention(q, kd, vd, mask, hd ** -0.5)
    assert torch.equal(got, k.decode_attention(q, kd.float(), vd.float(), mask, hd ** -0.5))
    with pytest.raises(RuntimeError, match="one dtype"):
        k.decode_attention(q, kp, vp.float(), None, hd ** -0.5, rows)


@pytest.mark.skipif(kernels.load() is None, reason="no compiled kernels on this machine")
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_decode_step_stores_keys_and_values_rounded_as_torch_rounds_them(dtype):
    """The native step's store (8 values at a time) rounds to nearest-even as ``.to(dtype)`` does:
    ties either way, values past the largest finite, subnormals, zeros, infinities, NaN."""
    k = kernels.load()
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(4096, generator=g) * 10.0 ** torch.randint(-8, 6, (4096,), generator=g),
                   torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11, -(1 + 2 ** -8),
                                 65520.0, 65519.0, 1e38, 3.4e38, -3.4e38, 2 ** -25, 2 ** -24 * 1.5, 1e-40, -0.0,
                                 0.0, float("inf"), float("-inf"), float("nan")])])
    x = torch.cat([x, torch.zeros(-len(x) % 8)])
    got, want = k.kv_round(x, torch.empty(0, dtype=dtype)), x.to(dtype)
    assert got.dtype == dtype
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    assert torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_half_width_pool_is_half_the_bytes_and_stores_each_key_rounded(deep, dtype):
    _, _, packed = deep
    prompt = _prompts()[1]
    pools = {}
    for dt in (torch.float32, dtype):
        eng = Engine(packed, EngineConfig(kv_slots=128, kv_dtype=str(dt).removeprefix("torch.")))
        eng.add_request(prompt, schedule=_sched(1), max_new_tokens=3)
        eng.run()
        pools[dt] = eng.pool
    assert pools[dtype].nbytes * 2 == pools[torch.float32].nbytes
    n = len(prompt)  # layer 0's prompt keys come from the embeddings alone: the same values, rounded
    torch.testing.assert_close(pools[dtype].k[0][:, :n], pools[torch.float32].k[0][:, :n].to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(pools[dtype].v[0][:, :n], pools[torch.float32].v[0][:, :n].to(dtype), rtol=0, atol=0)


def test_a_kv_dtype_the_pool_cannot_hold_is_a_clear_error(deep):
    with pytest.raises(EngineError, match="kv_dtype must be one of float32, float16, bfloat16"):
        Engine(deep[2], EngineConfig(kv_slots=8, kv_dtype="int8"))
    from skipdecode import LLM

    with pytest.raises(ModelError, match="kv_dtype must be one of"):
        LLM.load("default-e2e", kv_dtype="fp8")
