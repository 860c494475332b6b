"""The compiled CPU decode kernels equal plain torch: the small-M linear
(any row count, ragged panels, K past one cache block, bias), RMSNorm, RoPE
in place, silu(gate) * up, one-position attention (GQA and MHA, padding
masks, strided cache views), and the fused decode layer of the Llama family
against the same layer op by op.
Where the kernels are on, the engine uses them; with them off it still
matches transformers (tests/test_parity_transformers.py runs both)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import BUILDABLE, needs_kernels
from skipdecode import dispatch, kernels
from skipdecode.engine.kv_cache import KVPool, Reservation, RequestKV
from skipdecode.model import LayerRows, PackedLinear, RMSNorm


@pytest.fixture(scope="module")
def k():
    mod = kernels.load()
    assert mod is not None, "the kernels must build on a machine with AVX2/FMA and g++"
    return mod


HAS_AVX512 = BUILDABLE and kernels.AVX512_FLAGS <= set(__import__("skipdecode.dispatch").dispatch.cpu_features()["isa"])


@pytest.fixture(params=["avx2", "avx512"])
def isa(request, k):
    """Run the test on each form of the panel micro-kernels: AVX2 runs on every CPU the kernels
    build on (so an AVX-512 machine checks what an AVX2-only one runs), AVX-512 where present."""
    if request.param == "avx512" and not HAS_AVX512:
        pytest.skip("this CPU has no AVX-512 F/BW/VL/DQ")
    prev = k.set_isa(request.param == "avx512")
    yield request.param
    k.set_isa(prev)


@needs_kernels
def test_the_fma_rate_counts_each_forms_lanes_on_every_thread_and_is_a_plausible_speed(k, isa):
    lanes = 16 if isa == "avx512" else 8
    assert k.fma_flops(1000) == 2 * 12 * lanes * 1000 * torch.get_num_threads()
    rate = kernels.fma_peak_gflops(k, repeats=2, seconds=0.01)
    assert 1 < rate < 100_000, rate  # GFLOP/s: a CPU's multiply-add rate, not a unit slip
    with pytest.raises(RuntimeError, match="iters must be >= 1"):
        k.fma_flops(0)


@needs_kernels
@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 4096 + 17])
def test_the_read_probe_reads_every_float_once_in_each_form_and_thread_count(k, isa, threads, n):
    x = (torch.arange(n) % 7).float()  # integer sums below 2^24: exact in any order
    for t in (1, 2, 3):
        threads(t)
        for pf in (0, 512, 4096):
            assert k.read_stream(x, pf) == float(x.sum()), (t, pf)


@needs_kernels
def test_the_read_probe_refuses_what_it_cannot_stream_and_times_every_prefetch_distance(k):
    with pytest.raises(RuntimeError, match="contiguous float32"):
        k.read_stream(torch.ones(64, dtype=torch.float64), 0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        k.read_stream(torch.ones(64, 2).t(), 0)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        k.read_stream(torch.ones(64), 100)
    rates = kernels.stream_read_gbs(k, torch.ones(2**20), repeats=1)
    assert list(rates) == list(kernels.READ_PREFETCH_BYTES)
    assert all(0.5 < v < 5000 for v in rates.values()), rates  # GB/s, not a unit slip


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_the_resident_rate_times_the_linear_itself_called_again_and_again(k, dtype):
    """kernels.resident_gbs is the roof a streamed call is set against: its native loop must run
    the very GEMM linear runs (the same outputs), and its rate must be in GB/s."""
    from types import SimpleNamespace

    n, kdim = 40, 64
    g = _gen(11)
    w, s = torch.randn(n, kdim, generator=g), None
    if dtype == "int8":
        w = torch.randint(-127, 128, (n, kdim), generator=g, dtype=torch.int8)
        s = kernels.pack_scales(torch.rand(n, generator=g) * 0.01)
    p, x = kernels.pack_weight(w), torch.randn(3, kdim, generator=g)
    assert torch.equal(k.linear_repeat(x, p, n, s, 0, repeats=3), k.linear(x, p, None, n, s))
    with pytest.raises(RuntimeError, match="repeats must be >= 1"):
        k.linear_repeat(x, p, n, s, 0, repeats=0)
    lin = SimpleNamespace(kernels=k, packed=p, panel_scales=s, a8=0, in_features=kdim, out_features=n)
    assert 0.01 < kernels.resident_gbs(lin, rows=1, repeats=1, seconds=0.001) < 5000  # GB/s, not a unit slip


HAS_AMX_BF16 = HAS_AVX512 and {"amx_tile", "amx_bf16"} <= set(
    __import__("skipdecode.dispatch").dispatch.cpu_features()["isa"])


@pytest.fixture
def fma_forms(k):
    """The FMA forms alone: calls of several rows with bf16, int8 or int4 weights stay off the
    AMX-BF16 tiles (which sum in their own order) for the test."""
    prev = k.set_amx_bf16(False)
    yield
    k.set_amx_bf16(prev)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _skip_unless_tiles(k) -> None:
    """Skip the test unless the AMX-BF16 tiles are on in this process (SKIPDECODE_AMX=0, or the OS
    refusing the tile registers, leaves them off)."""
    on = k.set_amx_bf16(False)
    k.set_amx_bf16(on)
    if not on:
        pytest.skip("the tiles are off here (SKIPDECODE_AMX=0, or the OS refused them)")


@needs_kernels
@pytest.mark.parametrize("n,kdim", [(16, 8), (40, 300), (100, 600), (3, 520)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 32, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear_for_any_row_count_and_shape(k, rows, n, kdim, bias, isa):
    g = _gen(rows * 1000 + n)
    w = torch.randn(n, kdim, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(2, rows, kdim, generator=g)[:, :, :]  # 3-D input, as the model passes it
    got = k.linear(x, kernels.pack_weight(w), b, n)
    ref = F.linear(x, w, b)
    assert got.shape == ref.shape == (2, rows, n)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("n,kdim", [(16, 8), (40, 300), (3, 520)])
@pytest.mark.parametrize("rows", [1, 3, 7, 32])
def test_bf16_panels_equal_the_fp32_product_with_the_bf16_weight(k, rows, n, kdim, isa):
    g = _gen(rows * 1000 + n + 1)
    w = torch.randn(n, kdim, generator=g).bfloat16()
    x = torch.randn(rows, kdim, generator=g)
    got = k.linear(x, kernels.pack_weight(w), None, n)
    torch.testing.assert_close(got, F.linear(x, w.float()), rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("n,kdim", [(16, 8), (40, 300), (3, 520)])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 32])
def test_int8_panels_scale_each_output_of_the_fp32_product(k, rows, n, kdim, isa):
    g = _gen(rows * 1000 + n)
    q = torch.randint(-127, 128, (n, kdim), generator=g, dtype=torch.int8)
    s, b = torch.rand(n, generator=g) * 0.01, torch.randn(n, generator=g)
    x = torch.randn(rows, kdim, generator=g)
    got = k.linear(x, kernels.pack_weight(q), b, n, kernels.pack_scales(s))
    torch.testing.assert_close(got, F.linear(x, q.float() * s[:, None], b), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="int8 and int4 panels take their scales"):
        k.linear(x, kernels.pack_weight(q), b, n)
    with pytest.raises(RuntimeError, match="int8 and int4 panels take their scales"):
        k.linear(x, kernels.pack_weight(q.float()), b, n, kernels.pack_scales(s))
    with pytest.raises(RuntimeError, match="one per padded output column"):
        k.linear(x, kernels.pack_weight(q), b, n, s.float().contiguous()[:1])


@needs_kernels
def test_linear_takes_a_non_contiguous_input(k):
    w = torch.randn(24, 64, generator=_gen(1))
    x = torch.randn(64, 5, generator=_gen(2)).t()  # (5, 64), transposed storage
    torch.testing.assert_close(k.linear(x, kernels.pack_weight(w), None, 24), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.fixture
def threads():
    """Sets torch's thread count for a test and puts the previous one back."""
    prev = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(prev)


@needs_kernels
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 100, 20000])
@pytest.mark.parametrize("chunk", [0, 1, 2, 5])
def test_shared_panels_go_to_exactly_one_thread_however_many_threads_run(k, threads, n, chunk):
    for t in (1, 2, 4):  # 4 on a 2-core machine: threads stall, and others take from their shares
        threads(t)
        for _ in range(5):
            got = k.steal_counts(n, chunk)
            assert got[:n] == [1] * n
            if min(n, t) <= 1:  # one thread: every index in one range
                assert got[n] == min(n, 1)
            elif chunk == 0:  # fixed shares: one range per thread
                assert got[n] == min(n, t)
            else:  # no range longer than chunk
                assert got[n] >= -(-n // chunk)


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [1, 3])
def test_panel_outputs_do_not_depend_on_how_threads_share_the_panels(k, threads, dtype, rows, isa):
    n, kdim = 16 * 97 + 5, 320
    g = _gen(rows + 7)
    w = torch.randn(n, kdim, generator=g)
    s = None
    if dtype == "int8":
        w = torch.randint(-127, 128, (n, kdim), generator=g, dtype=torch.int8)
        s = kernels.pack_scales(torch.rand(n, generator=g) * 0.01)
    elif dtype == "bfloat16":
        w = w.bfloat16()
    p, x = kernels.pack_weight(w), torch.randn(rows, kdim, generator=g)
    threads(1)
    ref = k.linear(x, p, None, n, s)
    for t in (2, 4):
        threads(t)
        for _ in range(10):
            assert torch.equal(k.linear(x, p, None, n, s), ref)


def test_packed_weight_holds_every_weight_once_in_16_column_panels():
    w = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    p = kernels.pack_weight(w)
    assert p.shape == (3, 3, 16)
    assert torch.equal(p[1, 2, 5], w[16 + 5, 2])
    assert torch.equal(p[2, :, 8:], torch.zeros(3, 8))  # rows 40..47 are padding
    assert torch.equal(p.transpose(1, 2).reshape(48, 3)[:40], w)


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 576), (3, 7, 64), (70, 40)])
def test_rms_norm_equals_torch(k, shape):
    x = torch.randn(*shape, generator=_gen(3)) * 3
    w = torch.randn(shape[-1], generator=_gen(4))
    torch.testing.assert_close(k.rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("T", [1, 9])
def test_rope_in_place_equals_apply_rope_on_a_strided_view(k, T):
    from skipdecode.model import apply_rope

    B, NH, hd = 2, 5, 64
    fused = torch.randn(B, T, NH * hd + 3 * hd, generator=_gen(8))  # q/k part of a fused qkv output
    x = fused[..., : NH * hd].view(B, T, NH, hd)
    ang = torch.randn(B, T, 1, hd // 2, generator=_gen(9)) * 10
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    ref = apply_rope(x.clone(), cos, sin)
    tail = fused[..., NH * hd:].clone()
    k.rope_(x, cos, sin)
    torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused[..., NH * hd:], tail), "only the rotated heads may change"


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1, 2 * 1536), (32, 2 * 20), (3, 4, 2 * 13)])
def test_silu_mul_equals_torch(k, shape):
    h = torch.randn(*shape, generator=_gen(10)) * 6
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(k.silu_mul(h), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def _sdpa_reference(q, kc, vc, mask):
    """Plain torch: repeat the KV heads for every query head, boolean mask."""
    B, H, hd = q.shape
    rep = H // kc.shape[1]
    m = None if mask is None else mask[:, None, None, :]
    y = F.scaled_dot_product_attention(q[:, :, None], kc.repeat_interleave(rep, 1), vc.repeat_interleave(rep, 1),
                                       attn_mask=m)
    return y.reshape(B, 1, H * hd)


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (14, 2)])
@pytest.mark.parametrize("length", [1, 5, 37, 134])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("hd", [64, 40, 80, 128])
def test_decode_attention_equals_sdpa(k, isa, heads, kv_heads, length, padded, hd):
    """On either form of the kernels: the AVX-512 one takes heads of 16 to 128 dimensions in steps
    of 16 (here 64, 80, 128: one, two and two passes over the values), the AVX2 one the rest (40)."""
    B, slots = 3, 150
    g = _gen(length + heads)
    kc, vc = torch.randn(B, kv_heads, slots, hd, generator=g), torch.randn(B, kv_heads, slots, hd, generator=g)
    q = torch.randn(B, heads, hd, generator=g)
    kv, vv = kc[:, :, :length], vc[:, :, :length]  # a strided view of the cache, as the engine passes it
    mask = None
    if padded:
        mask = torch.ones(B, length, dtype=torch.bool)
        mask[1, : length // 2] = False  # row 1 is left padded; the newest key is always visible
    got = k.decode_attention(q, kv, vv, mask, hd ** -0.5)
    torch.testing.assert_close(got, _sdpa_reference(q, kv, vv, mask), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_decode_attention_skips_scattered_masked_keys(k, isa):
    B, H, KVH, hd, S = 2, 6, 2, 64, 23
    g = _gen(11)
    kc, vc = torch.randn(B, KVH, S, hd, generator=g), torch.randn(B, KVH, S, hd, generator=g)
    q = torch.randn(B, H, hd, generator=g)
    mask = torch.rand(B, S, generator=g) > 0.5
    mask[:, :8] = False  # whole blocks of four masked, then scattered holes
    mask[:, -1] = True
    got = k.decode_attention(q, kc, vc, mask, hd ** -0.5)
    torch.testing.assert_close(got, _sdpa_reference(q, kc, vc, mask), rtol=1e-5, atol=1e-5)


@needs_kernels
def test_decode_attention_ignores_huge_scores_of_masked_keys(k, isa):
    B, H, hd, S = 1, 2, 16, 9
    kc = torch.randn(B, 1, S, hd, generator=_gen(5))
    vc = torch.randn(B, 1, S, hd, generator=_gen(6))
    kc[:, :, :4] *= 1e4  # masked keys with scores far above the rest must still weigh exactly 0
    q = torch.randn(B, H, hd, generator=_gen(7))
    mask = torch.arange(S)[None] >= 4
    got = k.decode_attention(q, kc, vc, mask, hd ** -0.5)
    torch.testing.assert_close(got, _sdpa_reference(q, kc[:, :, 4:], vc[:, :, 4:], None), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("vocab", [1, 7, 8, 33, 40, 49152, 50257])
def test_argmax_rows_equals_torch_argmax_with_ties_infinities_and_nans(k, vocab):
    x = torch.randn(6, vocab, generator=_gen(vocab))
    x[1] = 0.0  # all tied: the first index
    x[2, -1] = float("inf")
    x[3] = float("-inf")
    x[4, vocab // 2:] = float("nan")  # the first NaN wins, as in torch
    x[5, vocab // 3] = x[5].max() + 1
    x[5, -1] = x[5, vocab // 3]  # a tie between a vector block and the tail
    assert torch.equal(k.argmax_rows(x), x.argmax(-1))
    assert torch.equal(k.argmax_rows(x[:, :]), torch.argmax(x, dim=-1))


@pytest.fixture(params=["fma", "bf16-dot"])
def head_pass(request, k):
    """Run the test on each form of greedy_head's bf16 pass below the tiles' row count: the panels'
    own form, and AVX512-BF16 pair dot products where the CPU has them (the AVX-512 form only)."""
    if request.param == "bf16-dot" and "avx512_bf16" not in dispatch.cpu_features()["isa"]:
        pytest.skip("this CPU has no AVX512-BF16")
    prev = k.set_bf16_dot(request.param == "bf16-dot")
    yield request.param
    k.set_bf16_dot(prev)


def _head_with_near_ties(V: int, K: int, seed: int) -> torch.Tensor:
    """A random fp32 head whose rows include exact ties (a copy: the first id must win), a
    permutation of a row (the same true product for a constant x, other rounding) and copies one
    ulp apart in one weight: outputs that only the exact logits tell apart."""
    w = torch.randn(V, K, generator=_gen(seed)) * 0.05
    w[7] = w[3]
    w[11] = w[3][torch.randperm(K, generator=_gen(seed + 1))]
    w[12] = w[3]
    w[12, 5] = torch.nextafter(w[3, 5], torch.tensor(1.0))
    w[V - 1] = w[3]  # a tie with the last id: the tail of the vector loops
    return w


def _near_tied_top(w: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` rows of x and a copy of ``w`` whose rows 3, 7, 11, 12 and V - 1 are nearly or exactly
    tied at the top of x's logits: copies, a permutation, one ulp up in the weight x is largest at."""
    V, K = w.shape
    x = torch.full((rows, K), 0.25)
    x[:, 5] = 1.0
    w2 = w.clone()
    w2[3] = w2[3].abs() + 1.0
    for i in (7, 12, V - 1):
        w2[i] = w2[3]
    w2[11] = w2[3][torch.randperm(K, generator=_gen(3))]
    w2[12, 5] = torch.nextafter(w2[3, 5], torch.tensor(2.0))
    return x, w2


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 31, 32, 33, 40])
def test_greedy_head_picks_the_full_heads_argmax_in_every_form_and_row_count(k, isa, head_pass, rows):
    """kernels.greedy_head (a bf16 pass, then the exact logits of the ids it leaves in doubt) picks
    what argmax_rows picks from the full fp32 head's logits, ties and near-ties included, in the
    AVX2 and AVX-512 forms, with the pass on the panels' form or on AVX512-BF16 dot products, and at
    every row count (where the tiles are present, the bf16 pass runs on them from 8 rows and the
    fp32 head from 32)."""
    from skipdecode.model import head_bound

    V, K = 1000, 96
    w = _head_with_near_ties(V, K, rows)
    P, A, c = kernels.pack_weight(w), kernels.pack_weight(w.bfloat16()), head_bound(w, w.bfloat16())
    for x in (torch.randn(rows, K, generator=_gen(rows + 7)) * 3, torch.full((rows, K), 0.25)):
        full = k.argmax_rows(k.linear(x, P, None, V, None, 0))
        assert torch.equal(k.greedy_head(x, P, V, A, c, w), full)
    x, w2 = _near_tied_top(w, rows)
    P2, A2, c2 = kernels.pack_weight(w2), kernels.pack_weight(w2.bfloat16()), head_bound(w2, w2.bfloat16())
    full = k.argmax_rows(k.linear(x, P2, None, V, None, 0))
    assert torch.equal(k.greedy_head(x, P2, V, A2, c2, w2), full)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_head_bound_holds_for_inputs_along_the_rounding_itself(k, head_pass, rows):
    """head_bound's c_n bounds |bf16 pass - fp32 head| / ||x|| for every output, x random or x
    along one row's rounding error (where Cauchy-Schwarz is tight), in the forms a call of
    ``rows`` rows runs, with x as it is or cut to its top bf16 half (what the pass takes on the
    tiles and on AVX512-BF16 dot products), and for the pass greedy_head itself runs."""
    from skipdecode.model import head_bound

    V, K = 600, 576
    w = torch.randn(V, K, generator=_gen(rows)) * 0.05
    A, c = w.bfloat16(), head_bound(w, w.bfloat16())
    x = torch.randn(rows, K, generator=_gen(rows + 1))
    x[0] = (w[5] - A[5].float()) * 1e4
    cut = (x.view(torch.int32) & -65536).view(torch.float32)  # the top bf16 half of each x
    z = k.linear(x, kernels.pack_weight(w), None, V, None, 0).double()
    for xa in (x, cut):
        a = k.linear(xa, kernels.pack_weight(A), None, V, None, 0).double()
        gap = (a - z).abs() / x.double().norm(dim=1, keepdim=True)
        assert (gap <= c.double()).all()
    a = k.greedy_head_pass(x, kernels.pack_weight(A), V).double()
    assert ((a - z).abs() / x.double().norm(dim=1, keepdim=True) <= c.double()).all()
    if head_pass == "bf16-dot" and rows < 8:  # (from 8 rows the tiles take the pass where present)
        assert not torch.equal(a, k.linear(cut, kernels.pack_weight(A), None, V, None, 0).double())  # another form ran
        assert torch.allclose(a, k.linear(cut, kernels.pack_weight(A), None, V, None, 0).double(), rtol=1e-5,
                              atol=1e-4)  # x's top half, summed in pairs
    gap = (k.linear(x, kernels.pack_weight(A), None, V, None, 0).double() - z).abs()[0, 5] / x[0].double().norm()
    assert gap > 0.5 * (w[5].double() - A[5].double()).norm()  # along row 5's rounding its share is nearly reached


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 31, 32, 40])
def test_greedy_head_on_an_int8_copy_picks_the_full_fp32_heads_argmax_in_every_form_and_row_count(
        k, isa, a8_form, rows):
    """kernels.greedy_head on an fp32 head's int8 copy (model.fp32_head_copy: the copy's
    int8-activation pass, then the exact fp32 logits of the ids its two-term bound leaves in doubt)
    picks what argmax_rows picks from the full fp32 head's logits, ties and near-ties included (rows
    one ulp apart, which the copy rounds to the same int8 row), with every form of the integer pass
    and at every row count."""
    from skipdecode.model import fp32_head_copy

    V, K = 1000, 96
    w = _head_with_near_ties(V, K, rows)
    P = kernels.pack_weight(w)
    A, S, c = fp32_head_copy(w, "int8")
    x1 = torch.randn(rows, K, generator=_gen(rows + 7)) * 3
    x1[0, :32] *= 1e-3  # blocks of very different scale
    for x in (x1, torch.full((rows, K), 0.25)):
        full = k.argmax_rows(k.linear(x, P, None, V, None, 0))
        assert torch.equal(k.greedy_head(x, P, V, A, c, w, S), full)
    x, w2 = _near_tied_top(w, rows)
    P2 = kernels.pack_weight(w2)
    A2, S2, c2 = fp32_head_copy(w2, "int8")
    full = k.argmax_rows(k.linear(x, P2, None, V, None, 0))
    assert torch.equal(k.greedy_head(x, P2, V, A2, c2, w2, S2), full)
    assert int(full[0]) in (3, 11, 12)  # the near-tied top: row 3 (its copies after it), 12 or the permutation


@needs_kernels
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_the_int8_copys_pass_stays_within_the_two_term_bound(k, a8_form, rows):
    """An fp32 head's int8 copy's pass differs from the full fp32 head by at most nx_r c_n + mx_r d_n
    (model.fp32_head_int8_bound's c_n = ||w~_n||_2 and d_n, the copy's rounding with the exact
    side's summation; nx_r the row's activation factor, int8_head_row_factor; mx_r = 1.05 ||x_r||_2),
    with x random, with blocks of very different scale and along one row's rounding error (where
    the d_n term is nearly reached). And the bound is of use: random rows leave under 2% of the ids
    in doubt on average."""
    from skipdecode.model import fp32_head_copy, int8_head_row_factor, quantize_int8

    V, K = 600, 576
    w = torch.randn(V, K, generator=_gen(rows)) * 0.05
    A, S, bound = fp32_head_copy(w, "int8")
    c, d = bound.double()
    q, sc = quantize_int8(w)
    err = w[5].double() - q[5].double() * sc[5].double()  # row 5's copy is off by this
    x = torch.randn(rows, K, generator=_gen(rows + 1))
    x[-1, 64:96] *= 1e3
    x[0] = (err / err.norm() * 30).float()  # along row 5's rounding
    P = kernels.pack_weight(w)

    def pass_and_bound(x):
        b = int8_head_row_factor(x)[:, None] * c + 1.05 * x.double().norm(dim=1, keepdim=True) * d
        return k.linear(x, A, None, V, S, 1).double(), b

    a, b = pass_and_bound(x)
    assert ((a - k.linear(x, P, None, V, None, 0).double()).abs() <= b).all()
    gap = (a - k.linear(x, P, None, V, None, 0).double()).abs()[0, 5]
    assert gap > 0.5 * x[0].double().norm() * err.norm()  # along it, the d_n term is nearly reached
    a, b = pass_and_bound(torch.randn(rows, K, generator=_gen(rows + 2)))
    doubt = ((a + b) >= (a - b).max(dim=1, keepdim=True).values).sum(dim=1)
    assert doubt.float().mean() <= V / 50, doubt


def _rows_out_of_the_bounds_range(K: int, huge: float) -> torch.Tensor:
    """Four rows of K: a plain one, one with a NaN, an all-zero one and one scaled by ``huge``
    (its logits past 1e30): a greedy pass's bound holds for the first alone."""
    x = torch.randn(4, K, generator=_gen(10))
    x[1, 3] = float("nan")
    x[2] = 0.0
    x[3] *= huge
    return x


@needs_kernels
def test_greedy_head_takes_the_full_head_where_the_bound_does_not_hold(k):
    """Rows with a NaN, an all-zero row and logits past 1e30 take the full head, from either copy:
    the same picks as argmax_rows there (the first NaN, the first of equal logits)."""
    from skipdecode.model import fp32_head_copy, head_bound

    V, K = 100, 32
    w = torch.randn(V, K, generator=_gen(9))
    P, A, c = kernels.pack_weight(w), kernels.pack_weight(w.bfloat16()), head_bound(w, w.bfloat16())
    x = _rows_out_of_the_bounds_range(K, 1e30)
    assert torch.equal(k.greedy_head(x, P, V, A, c, w), k.argmax_rows(k.linear(x, P, None, V, None, 0)))
    with pytest.raises(RuntimeError, match="bound must be"):
        k.greedy_head(x, P, V, A, c[:-1], w)
    with pytest.raises(RuntimeError, match="bfloat16 copy"):
        k.greedy_head(x, P, V, P, c, w)
    A8, S8, c8 = fp32_head_copy(w, "int8")  # the int8 copy: the same fallback, its own argument checks
    assert torch.equal(k.greedy_head(x, P, V, A8, c8, w, S8), k.argmax_rows(k.linear(x, P, None, V, None, 0)))
    with pytest.raises(RuntimeError, match=r"bound must be \[2, vocab\]"):
        k.greedy_head(x, P, V, A8, c8[0].contiguous(), w, S8)
    with pytest.raises(RuntimeError, match="int8 copy"):
        k.greedy_head(x, P, V, A8, c8, w)  # no scales
    with pytest.raises(ValueError, match="'bfloat16' or 'int8'"):
        fp32_head_copy(w, "int4")


def _int8_head_with_near_ties(V: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random int8 head (q, scales) whose rows include exact ties (a copy: the first id must
    win), a permutation of a row (the same true product for a constant x, other rounding), a copy
    one step apart in one weight, and a tie with the last id."""
    from skipdecode.model import quantize_int8

    q, sc = quantize_int8(torch.randn(V, K, generator=_gen(seed)) * 0.05)
    sc[7] = sc[11] = sc[12] = sc[V - 1] = sc[3]
    q[7] = q[3]
    q[11] = q[3][torch.randperm(K, generator=_gen(seed + 1))]
    q[12] = q[3]
    q[12, 5] = q[3, 5] + (1 if q[3, 5] < 127 else -1)
    q[V - 1] = q[3]
    return q, sc


@needs_kernels
@pytest.mark.parametrize("a8", [0, 2])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 31, 32, 40])
def test_greedy_head_int8_picks_the_full_int8_heads_argmax_in_every_form_and_row_count(k, isa, a8_form, rows, a8):
    """kernels.greedy_head_int8 (an int8-activation pass over the head packed as w8a8's, then the
    exact logits of the ids its bound leaves in doubt) picks what argmax_rows picks from the full
    int8 head's logits, on fp32 activations (a8 0: the int8 and int4 dtypes' head) or two int8
    limbs (a8 2: w8a16 and w4a16's, whose panels are the pass's own), ties and near-ties
    included, with every form of the integer pass and of the fp32-activation panels, at every row
    count."""
    from skipdecode.model import int8_head_bound

    V, K = 1000, 96
    q, sc = _int8_head_with_near_ties(V, K, rows)
    S, A, c = kernels.pack_scales(sc), kernels.pack_int8_vnni(q), int8_head_bound(q, sc)
    P = A if a8 else kernels.pack_weight(q)
    x1 = torch.randn(rows, K, generator=_gen(rows + 7)) * 3
    x1[0, :32] *= 1e-3  # blocks of very different scale
    x2 = torch.full((rows, K), 0.25)  # rows 3, 7, 11, 12 and V - 1 nearly or exactly tied at the top
    x2[:, 5] = 1.0
    for x in (x1, x2):
        full = k.argmax_rows(k.linear(x, P, None, V, S, a8))
        assert torch.equal(k.greedy_head_int8(x, P, S, V, A, c, a8), full)
    q2 = q.clone()
    q2[3] = q2[3].abs().clamp(max=126) + 1
    for i in (7, 12, V - 1):
        q2[i] = q2[3]
    q2[11] = q2[3][torch.randperm(K, generator=_gen(3))]
    q2[12, 5] = q2[3, 5] - 1
    A2, c2 = kernels.pack_int8_vnni(q2), int8_head_bound(q2, sc)
    P2 = A2 if a8 else kernels.pack_weight(q2)
    full = k.argmax_rows(k.linear(x2, P2, None, V, S, a8))
    assert torch.equal(k.greedy_head_int8(x2, P2, S, V, A2, c2, a8), full)
    assert int(full[0]) in (3, 11)  # the near-tied top: row 3 (its copies 7 and V - 1 after it) or its permutation


@needs_kernels
@pytest.mark.parametrize("a8", [0, 2])
@pytest.mark.parametrize("rows", [1, 8, 32])
def test_the_int8_pass_stays_within_the_bound_greedy_head_int8_counts(k, a8_form, rows, a8):
    """The int8-activation pass differs from the full int8 head (on fp32 activations, or two int8
    limbs) by at most nx_r c_n: c_n =
    int8_head_bound's ||w_n||_2 and nx_r the row's factor as greedy_head_int8 computes it
    (int8_head_row_factor: its activations' own quantization error, 5% over, plus both sides' fp32
    summation), with x random, with blocks of very different scale, and with huge and tiny values. And the bound is
    of use: random rows leave under 1% of the ids in doubt on average, 2% at most."""
    from skipdecode.model import int8_head_bound, int8_head_row_factor, quantize_int8

    V, K = 600, 576
    q, sc = quantize_int8(torch.randn(V, K, generator=_gen(rows)) * 0.05)
    c = int8_head_bound(q, sc).double()
    S = kernels.pack_scales(sc)
    x = torch.randn(rows, K, generator=_gen(rows + 1))
    x[0, 64:96] *= 1e4
    x[-1, :32] *= 1e-6
    z = k.linear(x, kernels.pack_int8_vnni(q) if a8 else kernels.pack_weight(q), None, V, S, a8).double()
    a = k.linear(x, kernels.pack_int8_vnni(q), None, V, S, 1).double()
    nx = int8_head_row_factor(x, two_limbs=a8 == 2)[:, None]
    assert ((a - z).abs() <= nx * c).all()
    doubt = ((a + nx * c) >= (a - nx * c).max(dim=1, keepdim=True).values).sum(dim=1)
    assert doubt.float().mean() <= V / 100 and doubt.max() <= V // 50, doubt


def test_int8_panel_weights_reads_back_the_weights_of_either_packing():
    from skipdecode.model import int8_panel_weights

    q = torch.randint(-127, 128, (37, 64), generator=_gen(5), dtype=torch.int8)
    assert torch.equal(int8_panel_weights(kernels.pack_weight(q), 37), q)
    assert torch.equal(int8_panel_weights(kernels.pack_int8_vnni(q), 37, vnni=True), q)


@needs_kernels
def test_greedy_head_int8_takes_the_full_head_where_the_bound_does_not_hold(k):
    """Rows with a NaN, an all-zero row and values past 1e30 take the full int8 head: the same
    picks as argmax_rows there. Mismatched arguments are refused with what was wrong."""
    from skipdecode.model import int8_head_bound, quantize_int8

    V, K = 100, 64
    q, sc = quantize_int8(torch.randn(V, K, generator=_gen(9)))
    P, S, A, c = kernels.pack_weight(q), kernels.pack_scales(sc), kernels.pack_int8_vnni(q), int8_head_bound(q, sc)
    x = _rows_out_of_the_bounds_range(K, 1e32)
    assert torch.equal(k.greedy_head_int8(x, P, S, V, A, c), k.argmax_rows(k.linear(x, P, None, V, S, 0)))
    with pytest.raises(RuntimeError, match="bound must be"):
        k.greedy_head_int8(x, P, S, V, A, c[:-1])
    with pytest.raises(RuntimeError, match="int8-activation copy"):
        k.greedy_head_int8(x, P, S, V, kernels.pack_weight(q.float()), c)
    with pytest.raises(RuntimeError, match="K % 32|multiple of 32|32"):
        k.greedy_head_int8(x[:, :48].contiguous(), kernels.pack_weight(q[:, :48]), S, V,
                           kernels.pack_int8_vnni(q[:, :48]), c)


def _same_tokens_with_and_without_the_heads_pass(llm, rows: int) -> None:
    """Greedy tokens of ``rows`` E2E prompts picked from the LM head's approximate pass and from the
    full head (``greedy_approx``), at full depth and at 3x: the same."""
    from skipdecode.bench.decode import PROMPTS
    from skipdecode.generate import generate_tokens

    net = llm.model
    ids = [llm.encode(PROMPTS[i % len(PROMPTS)]) for i in range(rows)]
    for speedup in (1.0, 3.0):
        sched = llm.make_schedule(speedup=speedup, expected_new_tokens=24)
        out = {}
        for on in (True, False):
            net.greedy_approx = on
            out[on] = [r.token_ids for r in generate_tokens(net, ids, sched, 24, eos_token_ids=())[0]]
        assert out[True] == out[False]


@needs_kernels
@pytest.mark.parametrize("dtype", ["int8", "int4", "w4a16"])
def test_native_greedy_steps_pick_the_same_tokens_from_the_int8_heads_integer_pass(dtype, monkeypatch):
    """The int8 and int4 dtypes keep the embedded model's head in int8 (w4a16: int8 on two-limb
    activations); from 8 rows (the untimed plan) greedy steps pick from its int8-activation pass and
    the exact logits of the ids it leaves in doubt: the tokens of the full head, at full depth and
    at 3x. At one row they take the full head."""
    from skipdecode import LLM

    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "0")
    llm = LLM.load("default-e2e", dtype=dtype)
    net, head = llm.model, llm.model.lm_head
    assert head.approx is not None and head.approx.dtype == torch.int8 and head.packed.dtype == torch.int8
    assert (head.approx is head.packed) == (dtype == "w4a16")  # a two-limb head is the pass's own panels
    assert head.greedy_plan[dispatch.bucket(8)] and not head.greedy_plan[dispatch.bucket(1)]
    assert net.native_greedy(8) and net.greedy_approx
    _same_tokens_with_and_without_the_heads_pass(llm, 8)


@needs_kernels
def test_an_int8_heads_greedy_plan_takes_the_integer_pass_where_it_was_measured_no_slower(k, monkeypatch, tmp_path):
    """dispatch.int8_greedy_head_plan: untimed, from 8 rows where the head is on its panels; timed,
    at the buckets where the pass and its exact logits took no longer than the full product on the
    panels, and never where the head's own plan is torch's int8 GEMM."""
    plan = ("hand", "hand", "hand", "hand", "hand", "int8mm", "hand", "hand")
    assert dispatch.int8_greedy_head_plan(64, 32, k, plan) == (False, False, False, True, True, False, True, True)
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "1")
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(dispatch, "time_greedy_head_int8", lambda *a, **kw: {
        "greedy": [2.0, 1.0, 1.0, 2.0, 3.0, 1.0, 5.0, 1.0], "panels": [1.0, 3.0, 3.0, 2.0, 4.0, 4.0, 4.0, 4.0]})
    monkeypatch.setattr(dispatch, "_TUNED", {})
    assert dispatch.int8_greedy_head_plan(64, 32, k, plan) == (False, True, True, True, True, False, False, True)
    assert json.loads((tmp_path / "autotune.json").read_text())  # measured once, kept for the next process
    assert dispatch.int8_greedy_head_plan(64, 32, None, plan) == tuple(False for _ in dispatch.BUCKETS)


@needs_kernels
def test_packing_a_model_puts_every_linear_norm_and_block_on_the_kernels(tiny_models, tiny_packed):
    net = tiny_packed["llama"]
    linears = [m for m in net.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 4 * net.n_layers + 1
    assert all(m.kernels is not None for m in linears)
    assert all(m.kernels is not None for m in net.modules() if isinstance(m, RMSNorm))
    assert all(b.kernels is not None for b in net.layers)
    assert all(b.fused_decode for b in net.layers)
    assert net.kernels is not None
    assert not any(b.fused_decode for arch in ("opt", "gpt2") for b in tiny_packed[arch].layers)
    # the training model is untouched: plain modules, no kernels
    assert not any(isinstance(m, PackedLinear) for m in tiny_models["llama"].modules())


def test_huge_page_arena_holds_the_same_bytes_end_to_end_from_a_2mb_boundary(monkeypatch):
    import mmap

    ts = [torch.randn(5, 7), torch.randint(-127, 128, (3, 100), dtype=torch.int8), torch.randn(9).bfloat16(),
          torch.randint(0, 255, (4, 33), dtype=torch.uint8)]
    got = kernels.huge_page_arena(ts)
    assert all(torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape for a, b in zip(ts, got))
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        assert all(a is b for a, b in zip(ts, got))  # no such advice here: the tensors as they were
        return
    ptrs = [t.data_ptr() for t in got]
    assert ptrs[0] % kernels.HUGE_PAGE == 0 and all(p % kernels.ARENA_ALIGN == 0 for p in ptrs)
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < kernels.HUGE_PAGE  # one buffer, in the order given
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1
    monkeypatch.setenv("SKIPDECODE_HUGEPAGES", "0")
    assert all(a is b for a, b in zip(ts, kernels.huge_page_arena(ts)))


@needs_kernels
def test_a_packed_model_decodes_the_same_from_its_huge_page_arena(tiny_dirs, monkeypatch):
    import mmap

    from skipdecode.checkpoint import load_model

    net = load_model(tiny_dirs["llama"])[0].pack_for_inference(weights="int8")
    monkeypatch.setenv("SKIPDECODE_HUGEPAGES", "0")
    plain = load_model(tiny_dirs["llama"])[0].pack_for_inference(weights="int8")
    panels = [m.packed for m in net.modules() if isinstance(m, PackedLinear)]
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert len({t.untyped_storage().data_ptr() for t in panels}) == 1  # every panel in one arena
    from skipdecode.generate import generate_tokens
    from skipdecode.schedule import SkipSchedule

    L = net.cfg.n_layers
    sched = SkipSchedule(L, L, 2, horizon=5, warmup_layers=1)
    prompts = [[1, 5, 9, 3, 4, 7], [2, 8, 6]]
    a, _ = generate_tokens(net, prompts, sched, 8)
    b, _ = generate_tokens(plain, prompts, sched, 8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_decode_attention_reads_each_rows_own_slots_of_a_pool(k, isa, heads, kv_heads):
    """Pool mode: row r attends to exactly slots start_r .. start_r + len_r - 1
    of a shared (K, slots, hd) pool; every other slot is NaN and never read."""
    hd, slots = 64, 200
    g = _gen(heads)
    kp = torch.full((kv_heads, slots, hd), float("nan"))
    vp = torch.full((kv_heads, slots, hd), float("nan"))
    rows = torch.tensor([[0, 7], [50, 1], [13, 37], [120, 80]])
    q = torch.randn(len(rows), heads, hd, generator=g)
    for s, n in rows.tolist():
        kp[:, s:s + n] = torch.randn(kv_heads, n, hd, generator=g)
        vp[:, s:s + n] = torch.randn(kv_heads, n, hd, generator=g)
    got = k.decode_attention(q, kp, vp, None, hd ** -0.5, rows)
    for r, (s, n) in enumerate(rows.tolist()):
        want = _sdpa_reference(q[r:r + 1], kp[None, :, s:s + n], vp[None, :, s:s + n], None)
        torch.testing.assert_close(got[r:r + 1], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        k.decode_attention(q[:1], kp, vp, None, hd ** -0.5, torch.tensor([[190, 20]]))


@needs_kernels
@pytest.mark.parametrize("n,kdim", [(16, 32), (40, 288), (3, 544), (24, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 32])
def test_int4_panels_equal_the_product_with_the_group_dequantized_weight(k, rows, n, kdim, isa):
    """Two codes per byte, one bf16 scale per output and 32 inputs: the fp32 product with
    ``(q - 8) * scale`` of each group, for row counts on every micro-kernel and K blocks of 256."""
    from skipdecode.model import dequantize_int4

    g = _gen(rows * 1000 + n)
    q = torch.randint(0, 16, (n, kdim), generator=g, dtype=torch.uint8)
    s = (torch.rand(n, kdim // 32, generator=g) * 0.01).bfloat16()
    b = torch.randn(n, generator=g)
    x = torch.randn(rows, kdim, generator=g)
    packed, ps = kernels.pack_int4(q, s)
    assert packed.dtype == torch.uint8 and packed.shape == ((n + 15) // 16, kdim // 2, 16)
    got = k.linear(x, packed, b, n, ps)
    torch.testing.assert_close(got, F.linear(x, dequantize_int4(q, s), b), rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="take their scales"):
        k.linear(x, packed, b, n)
    with pytest.raises(RuntimeError, match="bfloat16 scales"):
        k.linear(x, packed, b, n, ps.float())


@needs_kernels
@pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512 F/BW/VL/DQ")
def test_int4_panels_give_bitwise_identical_outputs_in_the_avx2_and_avx512_forms(k, fma_forms):
    """An AVX2-only CPU computes exactly what an AVX-512 one does with int4 weights: the same
    products (masked-word conversions on pre-scaled activations, or at one row the AVX-512 form's
    table lookups on the activations as they are) and FMA chains per column, 1 to 16 rows (13 ends
    in a block of one row; the AVX-512 form runs two of
    the AVX2 form's row blocks on one decode from 7 rows, and two panels at once from 2 to 8 rows),
    K over several blocks of 256, codes at both ends (nibble 7 carries the word's sign bit),
    activations with outliers, and 3 and 5 panels, the last partly filled (a pair's second panel
    or a share's odd last one)."""
    g = _gen(12)
    for n in (72, 40):
        q = torch.randint(0, 16, (n, 576), generator=g, dtype=torch.uint8)
        q[3], q[5] = 0, 15
        s = (torch.rand(n, 576 // 32, generator=g) * 0.01).bfloat16()
        x = torch.randn(16, 576, generator=g)
        x[:, 7] *= 50
        x[2] = 0
        b = torch.randn(n, generator=g)
        packed, ps = kernels.pack_int4(q, s)
        prev = k.set_isa(False)
        try:
            out = {}
            for form in (False, True):
                k.set_isa(form)
                out[form] = [k.linear(x[:m], packed, b, n, ps) for m in range(1, 17)]
        finally:
            k.set_isa(prev)
        for a, c in zip(out[False], out[True]):
            assert torch.equal(a, c)
        assert out[False][0].abs().sum() > 0 and torch.equal(out[False][2][2], b)


def _panels(dtype: str, n: int, kdim: int, g: torch.Generator):
    """A random weight packed as ``linear`` takes it in each panel dtype: (packed, scales)."""
    w = torch.randn(n, kdim, generator=g) * 0.05
    if dtype == "int8":
        q = torch.randint(-127, 128, (n, kdim), generator=g, dtype=torch.int8)
        return kernels.pack_weight(q), kernels.pack_scales(torch.rand(n, generator=g) * 0.01)
    if dtype == "int4":
        q = torch.randint(0, 16, (n, kdim), generator=g, dtype=torch.uint8)
        return kernels.pack_int4(q, (torch.rand(n, kdim // 32, generator=g) * 0.01).bfloat16())
    return kernels.pack_weight(w.bfloat16() if dtype == "bfloat16" else w), None


@needs_kernels
@pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512 F/BW/VL/DQ")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_batched_panels_give_each_row_the_same_bits_whatever_its_batch_mates_and_the_isa(k, dtype, fma_forms):
    """From 17 rows on every panel dtype runs the wide form (one FMA chain per output over k in
    order): a row's outputs are bitwise the same in a call of 17, 32 or 70 rows, with residual and
    bias, and the same on AVX2 as on AVX-512, so a batch does not change what a request decodes."""
    g = _gen(31)
    n, kdim = 72, 600 if dtype != "int4" else 576  # 5 panels (a ragged group of 4), K over 2 blocks
    packed, sc = _panels(dtype, n, kdim, g)
    b = torch.randn(n, generator=g)
    x = torch.randn(70, kdim, generator=g)
    x[:, 5] *= 40
    prev = k.set_isa(True)
    try:
        out = {}
        for form in (True, False):
            k.set_isa(form)
            out[form] = [k.linear(x[:m], packed, b, n, sc) for m in (17, 32, 70)]
    finally:
        k.set_isa(prev)
    for form in (True, False):
        for y in out[form]:
            assert torch.equal(y, out[form][-1][: len(y)])
        assert torch.equal(out[form][-1], out[True][-1])
    assert out[True][-1].abs().sum() > 0


@needs_kernels
@pytest.mark.parametrize("n", [40, 56, 72])
def test_fp32_panels_give_each_row_the_same_bits_from_two_rows_on_either_isa(k, n):
    """fp32 panels from 2 rows run the wide form, and from 4 rows the stream form (activations
    transposed; AVX-512: passes of up to 12 rows, four panels a pass up to 6 rows, three up to 9,
    two from 10; AVX2: passes of up to 4, one panel): every form is one FMA chain per output over
    k in order, so each row count from 2 to 17, and 33, gives every row the bits it gets in a call
    of 40 rows, on AVX2 and (where the CPU has it) AVX-512 alike, with a ragged last panel (3, 4
    and 5 panels: runs of one to four panels, the ragged one among them) and K over three blocks."""
    g = _gen(37)
    kdim = 600
    w = torch.randn(n, kdim, generator=g)
    packed, b = kernels.pack_weight(w), torch.randn(n, generator=g)
    x = torch.randn(40, kdim, generator=g)
    x[:, 7] *= 50
    forms = (True, False) if HAS_AVX512 else (False,)
    prev = k.set_isa(forms[0])
    try:
        out = {}
        for form in forms:
            k.set_isa(form)
            out[form] = {m: k.linear(x[:m], packed, b, n, None) for m in (*range(2, 18), 33, 40)}
    finally:
        k.set_isa(prev)
    full = out[False][40]
    torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    for form in forms:
        for m, y in out[form].items():
            assert torch.equal(y, full[:m]), (form, m)


def test_int4_quantization_is_llamacpp_q4_0s_rule():
    """Per output and 32 inputs: the largest-magnitude weight maps to code 0 (-8 steps), codes span
    0..15, every weight is within half a step of its code but those at the top code, which +8 steps
    would need and Q4_0 clamps (within one step)."""
    from skipdecode.model import dequantize_int4, quantize_int4

    w = torch.randn(40, 96, generator=_gen(7))
    q, s = quantize_int4(w)
    assert q.dtype == torch.uint8 and q.shape == (40, 96) and s.dtype == torch.bfloat16 and s.shape == (40, 3)
    assert int(q.max()) <= 15
    deq = dequantize_int4(q, s)
    step = s.float().abs().repeat_interleave(32, dim=1)
    err = (deq - w).abs()
    assert (err[q < 15] <= step[q < 15] / 2 + 1e-6).all() and (err <= step + 1e-6).all()
    wg = w.reshape(40, 3, 32)
    extreme = wg.gather(-1, wg.abs().argmax(-1, keepdim=True)).squeeze(-1)
    torch.testing.assert_close(-8 * s.float(), extreme, rtol=1e-2, atol=0)  # the bf16 scale, -8 steps
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(torch.randn(4, 40))


_ISA = set(__import__("skipdecode.dispatch").dispatch.cpu_features()["isa"])
HAS_VNNI = HAS_AVX512 and "avx512_vnni" in _ISA
HAS_AMX = HAS_VNNI and {"amx_tile", "amx_int8"} <= _ISA


@pytest.fixture(params=["portable", "avx2", "vnni", "amx"])
def a8_form(request, k):
    """Run the test on each form of the int8-activation kernels: the portable and AVX2 ones run on
    every CPU the kernels build on, the AVX512-VNNI and AMX ones where present."""
    if request.param == "vnni" and not HAS_VNNI:
        pytest.skip("this CPU has no AVX512-VNNI")
    if request.param == "amx" and not HAS_AMX:
        pytest.skip("this CPU has no AMX-INT8")
    prev = k.set_a8(request.param)
    yield request.param
    k.set_a8(prev)


def _a8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor, int4: bool,
                  top: float = 127.0):
    """The w8a8 / w4a8 product computed the slow, obviously right way: each row quantized to
    integers in [-top, top] in blocks of 32 (scale max|x| / top, round half to even; top = 127 * 128
    for w8a16 / w4a16), exact per-block integer sums (float64 holds them exactly), then the scales.
    Returns it and the sum of its terms' magnitudes."""
    M, K = x.shape
    xb = x.reshape(M, K // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, top) / amax, 0.0)  # `c / t` is c * (1 / t) in torch
    xq = torch.round(xb * inv).clamp(-top, top)
    xs = (amax / top).squeeze(-1).double()  # [M, K/32]
    wq = (q.double() - 8) if int4 else q.double()
    sums = torch.einsum("mbk,nbk->mnb", xq.double(), wq.reshape(q.shape[0], K // 32, 32))
    terms = sums * xs[:, None, :] * (scales.double()[None] if int4 else scales.double()[None, :, None])
    # fp32 accumulates one term per block: each step may round by half an ulp of the running sum
    return terms.sum(-1) + bias.double(), terms.abs().sum(-1)


@needs_kernels
@pytest.mark.parametrize("n,kdim", [(16, 32), (40, 288), (3, 544), (24, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 32])
@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("limbs", [1, 2])
def test_int8_activation_panels_equal_exact_integer_sums_of_block_quantized_rows(k, rows, n, kdim, int4, limbs,
                                                                                  a8_form):
    """limbs=1: int8 activations (w8a8 / w4a8); limbs=2: 15-bit activations as two int8 limbs
    (w8a16 / w4a16), whose rounding is 128 times finer."""
    from skipdecode.model import quantize_int4, quantize_int8

    g = _gen(rows * 1000 + n + int4)
    w = torch.randn(n, kdim, generator=g) * 0.05
    x = torch.randn(rows, kdim, generator=g)
    x[:, 5] *= 30  # an outlier channel: it coarsens its own block of 32 only
    x[0, kdim - 32:] = 0  # an all-zero block (the whole row where K is 32)
    b = torch.randn(n, generator=g)
    if int4:
        q, s = quantize_int4(w)
        (packed, ps), weight_only_panels = kernels.pack_int4_vnni(q, s), kernels.pack_int4(q, s)
    else:
        q, s = quantize_int8(w)
        packed, ps = kernels.pack_int8_vnni(q), kernels.pack_scales(s)
        weight_only_panels = (kernels.pack_weight(q), ps)
    assert packed.shape == weight_only_panels[0].shape and packed.dtype == weight_only_panels[0].dtype
    got = k.linear(x, packed, b, n, ps, a8=limbs)
    want, mag = _a8_reference(x, q, s, b, int4, 127.0 if limbs == 1 else 127.0 * 128)
    assert ((got.double() - want).abs() <= 2e-7 * kdim / 32 * mag + 1e-6).all()
    # and it is the weight-only product up to the activations' rounding (about 0.5% with int8 here)
    weight_only = k.linear(x, *weight_only_panels[:1], b, n, weight_only_panels[1])
    diff = ((got - weight_only).norm() / weight_only.norm()).item()
    assert diff < (0.02 if limbs == 1 else 2e-4) and (diff > 0 or kdim == 32 and rows == 1)


@needs_kernels
@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("limbs", [1, 2])
def test_int8_activation_forms_give_bitwise_identical_outputs(k, int4, limbs):
    """A CPU without VNNI (the AVX2 form) computes exactly what one with it does, and both exactly
    what the plain C++ form does, and so does AMX's tile form: 1 to 40 rows (the AVX2 form takes
    them 4 at a time, VNNI 8 or 12 of one panel below 4-9 rows and tiles of 4-6 rows x 2 panels from
    there, AMX up to 16 from 12 or 16 rows on), K over several blocks of 256,
    weights at the int8 extremes, activations with outliers, a bias and a partial last panel."""
    from skipdecode.model import quantize_int4, quantize_int8

    g = _gen(11)
    w, x = torch.randn(72, 576, generator=g), torch.randn(40, 576, generator=g)
    w[3, :64] = 40.0  # a column whose weights hit +-127 after rounding
    w[5, 64:128] = -40.0
    x[:, 7] *= 50  # an outlier channel: its block's other activations round to few levels
    x[2] = 0  # a row of zeros
    packed, ps = kernels.pack_int4_vnni(*quantize_int4(w)) if int4 else \
        (lambda q, s: (kernels.pack_int8_vnni(q), kernels.pack_scales(s)))(*quantize_int8(w))
    forms = ["portable", "avx2"] + (["vnni"] if HAS_VNNI else []) + (["amx"] if HAS_AMX else [])
    bias = torch.randn(72, generator=g)
    prev = k.set_a8("portable")
    try:
        out = {}
        for f in forms:
            k.set_a8(f)
            out[f] = [k.linear(x[:m], packed, bias if m % 2 else None, 72, ps, a8=limbs)
                      for m in (1, 2, 3, 4, 5, 8, 13, 16, 17, 32, 40)]
    finally:
        k.set_a8(prev)
    for f in forms[1:]:
        for a, b in zip(out["portable"], out[f]):
            assert torch.equal(a, b), f
    assert out["portable"][0].abs().sum() > 0


def test_w8a8_packing_refuses_minus_128():
    with pytest.raises(ValueError, match="-127, 127"):
        kernels.pack_int8_vnni(torch.tensor([[-128, 0, 1, 2]] * 16, dtype=torch.int8))


@needs_kernels
@pytest.mark.parametrize("int4", [False, True])
@pytest.mark.parametrize("limbs", [1, 2])
def test_int8_activation_rows_do_not_depend_on_their_batch_mates(k, int4, limbs, a8_form):
    """Each row's integer sums are exact and its fp32 steps do not depend on the row count, so a
    row computed in a call of 20 (AMX's tiles where the CPU has them) equals it computed alone, bit
    for bit (lossless verification and batching give 1x's numbers without forcing one-row forms)."""
    from skipdecode.model import quantize_int4, quantize_int8

    g = _gen(12)
    w, x = torch.randn(40, 320, generator=g), torch.randn(20, 320, generator=g)
    packed, ps = kernels.pack_int4_vnni(*quantize_int4(w)) if int4 else \
        (lambda q, s: (kernels.pack_int8_vnni(q), kernels.pack_scales(s)))(*quantize_int8(w))
    together = k.linear(x, packed, None, 40, ps, a8=limbs)
    for i in (0, 5, 12, 19):
        assert torch.equal(together[i], k.linear(x[i:i + 1], packed, None, 40, ps, a8=limbs)[0])


def test_int8_activation_form_follows_the_cpu_and_the_environment(monkeypatch):
    """AMX where the CPU has it unless SKIPDECODE_AMX=0, VNNI next, AVX2 otherwise or when forced."""
    monkeypatch.delenv("SKIPDECODE_AMX", raising=False)
    monkeypatch.delenv("SKIPDECODE_ISA", raising=False)
    assert kernels.a8_form() == ("amx" if HAS_AMX else "vnni" if HAS_VNNI else "avx2")
    monkeypatch.setenv("SKIPDECODE_AMX", "0")
    assert kernels.a8_form() == ("vnni" if HAS_VNNI else "avx2")
    monkeypatch.setenv("SKIPDECODE_ISA", "avx2")
    assert kernels.a8_form() == "avx2"
    monkeypatch.setenv("SKIPDECODE_AMX", "yes")
    monkeypatch.delenv("SKIPDECODE_ISA")
    if HAS_VNNI:
        with pytest.raises(ValueError, match="SKIPDECODE_AMX must be 0 or 1"):
            kernels.a8_form()


@needs_kernels
def test_int8_activations_refuse_float_panels_and_ragged_k(k):
    with pytest.raises(RuntimeError, match="int8 activations need int8 or int4 panels"):
        k.linear(torch.randn(2, 64), kernels.pack_weight(torch.randn(16, 64)), None, 16, a8=True)
    from skipdecode.model import quantize_int8

    q, s = quantize_int8(torch.randn(16, 40))
    with pytest.raises(RuntimeError, match="K divisible by 32"):
        k.linear(torch.randn(2, 40), kernels.pack_weight(q), None, 16, kernels.pack_scales(s), a8=True)


@pytest.fixture(scope="module")
def tiny_reduced(tiny_dirs):
    """The llama tiny model in each reduced-precision dtype on the kernels' panels: int8 and int4
    (weight-only, scaled panels), w8a8 and w4a8 (int8 activations), w8a16 and w4a16 (two limbs)."""
    from skipdecode.checkpoint import load_model

    return {w: load_model(tiny_dirs["llama"])[0].pack_for_inference(weights=w)
            for w in ("int8", "int4", "w8a8", "w4a8", "w8a16", "w4a16")}


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "llama3_rope", "qwen2", "mistral", "llama-int8", "llama-int4",
                                  "llama-w8a8", "llama-w4a8", "llama-w8a16", "llama-w4a16"])
@pytest.mark.parametrize("skip_first", [False, True])
def test_fused_decode_layer_equals_the_layer_op_by_op(tiny_packed, tiny_reduced, arch, skip_first, isa):
    """Rows of different lengths, each in its own pool slots: full-depth
    prefill, then one decode step, fused (one kernel call per layer) and
    unfused: same logits, same pool (int8 weights too: scaled panels)."""
    net = tiny_reduced[arch[6:]] if arch.startswith("llama-") else tiny_packed[arch]
    if arch in ("llama-w8a8", "llama-w4a8", "llama-w8a16", "llama-w4a16"):
        form = 2 if arch.endswith("a16") else 1
        assert all(b.wqkv.a8 == form and b.w2.a8 == form and b.fused_decode for b in net.layers)
        assert net.lm_head.a8 == form
    if arch == "llama-int8":
        assert net.layers[0].w13.packed.dtype == torch.int8 and net.layers[0].fused_decode
    if arch == "llama-int4":
        assert net.layers[0].w13.packed.dtype == torch.uint8 and net.layers[0].fused_decode
    cfg, L = net.cfg, net.n_layers
    lengths = [9, 4, 6]
    prompts = [torch.randint(3, 256, (n + 1,), generator=_gen(3 + n)) for n in lengths]
    starts = [0, 20, 40]

    def step(fused: bool):
        for b in net.layers:
            b.fused_decode = fused
        pool = KVPool([64] * L, cfg.n_kv_heads, cfg.head_dim)
        res = [Reservation([s] * L, [n + 1] * L) for s, n in zip(starts, lengths)]
        for p, n, r in zip(prompts, lengths, res):
            net(p[None, :n], torch.arange(n)[None], cache=RequestKV(pool, r), start=0)
        lens = torch.tensor(lengths) + 1
        slots = torch.stack([torch.tensor(starts), lens], 1)
        rows = [None if (skip_first and l == 0) else LayerRows(None, slots) for l in range(L)]
        logits = net.decode(torch.stack([p[-1] for p in prompts]), torch.tensor(lengths), rows, pool.pools())
        return logits, pool

    try:
        with torch.inference_mode():
            (got, got_pool), (want, want_pool) = step(True), step(False)
    finally:
        for b in net.layers:
            b.fused_decode = True
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_pool.k + got_pool.v, want_pool.k + want_pool.v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _stack_step(net, layer_rows_of, stacked: bool):
    """One decode step of three rows of different lengths after a full-depth prefill, with the
    model's layer stack on or off: (logits, pool)."""
    cfg, L = net.cfg, net.n_layers
    lengths, starts = [9, 4, 6], [0, 20, 40]
    prompts = [torch.randint(3, 256, (n + 1,), generator=_gen(7 + n)) for n in lengths]
    stack = net._stack
    net._stack = stack if stacked else None
    try:
        pool = KVPool([64] * L, cfg.n_kv_heads, cfg.head_dim)
        res = [Reservation([s] * L, [n + 1] * L) for s, n in zip(starts, lengths)]
        for p, n, r in zip(prompts, lengths, res):
            net(p[None, :n], torch.arange(n)[None], cache=RequestKV(pool, r), start=0)
        slots = torch.stack([torch.tensor(starts), torch.tensor(lengths) + 1], 1)
        with torch.inference_mode():
            logits = net.decode(torch.stack([p[-1] for p in prompts]), torch.tensor(lengths),
                                layer_rows_of(L, slots), pool.pools())
        return logits, pool
    finally:
        net._stack = stack


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-int4", "llama-w4a8", "llama-w8a16"])
@pytest.mark.parametrize("rows", ["all", "skip_first", "leading"])
def test_a_decode_step_as_one_layer_stack_call_equals_one_call_per_layer(tiny_packed, tiny_reduced, arch, rows):
    """The fused layers gathered in one LayerStack give a step bitwise the logits and keys/values
    of one decode_block call per layer: every row in every layer, the first layer skipped, and
    rows ordered by depth (upper layers on all three rows, lower ones on a leading block of 2
    or 1, as skipping the lower layers gives), so the stack is what a step runs."""
    net = tiny_reduced[arch[6:]] if arch.startswith("llama-") else tiny_packed[arch]
    assert net._stack is not None and len(net._stack) == net.n_layers
    L = net.n_layers
    leading = [1 if l == 0 else 2 if l < L // 2 else 3 for l in range(L)]  # rows of each layer, "leading"

    def layer_rows(L, slots):
        if rows == "all":
            return [LayerRows(None, slots) for _ in range(L)]
        if rows == "skip_first":
            return [None] + [LayerRows(None, slots) for _ in range(1, L)]
        return [LayerRows(None, slots) if m == 3 else LayerRows(m, slots[:m]) for m in leading]

    seen = []
    real = net._stack.run

    class Spy:  # the stack's run, recorded (a pybind object's method cannot be wrapped in place)
        def run(self, *a):
            seen.append(a[2])
            return real(*a)

    stack = net._stack
    net._stack = Spy()
    try:
        got, got_pool = _stack_step(net, layer_rows, True)
    finally:
        net._stack = stack
    want, want_pool = _stack_step(net, layer_rows, False)
    assert seen == [leading if rows == "leading" else [3] * (L - (rows == "skip_first"))]
    assert torch.equal(got, want)
    for a, b in zip(got_pool.k + got_pool.v, want_pool.k + want_pool.v):
        assert torch.equal(a, b)


@needs_kernels
def test_layers_on_any_subset_of_rows_other_kernels_or_unfused_run_one_call_each(tiny_packed):
    """The stack runs a step only where each layer it runs takes all rows or a leading block of
    them with the kernels the stack was built from; otherwise the step is one call per layer."""
    net = tiny_packed["llama"]
    L, R = net.n_layers, 3
    slots = torch.zeros(R, 2, dtype=torch.long)
    layers = list(net.layers)
    every = [LayerRows(None, slots) for _ in range(L)]
    assert net._stack_counts(layers, every, list(range(L)), R) == [R] * L
    subset = every[:-1] + [LayerRows(torch.tensor([0, 2]), slots[[0, 2]])]
    assert net._stack_counts(layers, subset, list(range(L)), R) is None
    b = net.layers[1]
    try:
        b.fused_decode = False
        assert net._stack_counts(layers, every, list(range(L)), R) is None
        b.fused_decode = True
        real = b.kernels
        b.kernels = type("OtherKernels", (), {})()
        assert net._stack_counts(layers, every, list(range(L)), R) is None
        b.kernels = real
        assert net._stack_counts(layers, every, list(range(L)), R) == [R] * L
    finally:
        b.fused_decode, b.kernels = True, net._stack_kernels


@needs_kernels
def test_layer_stack_refuses_arguments_that_do_not_fit_its_layers(tiny_packed):
    net = tiny_packed["llama"]
    cfg = net.cfg
    st = net._stack
    x = torch.randn(2, 1, cfg.dim)
    kp, vp = torch.zeros(cfg.n_kv_heads, 8, cfg.head_dim), torch.zeros(cfg.n_kv_heads, 8, cfg.head_dim)
    rows = torch.tensor([[0, 1], [4, 1]])
    cos, sin = torch.ones(2, 1, 1, cfg.head_dim), torch.zeros(2, 1, 1, cfg.head_dim)
    assert st.run(x, [0], [2], [kp], [vp], [rows], cos, sin).shape == x.shape
    with pytest.raises(RuntimeError, match="one row count, key pool, value pool and rows tensor per layer"):
        st.run(x, [0, 1], [2], [kp], [vp], [rows], cos, sin)
    with pytest.raises(RuntimeError, match="row count must be 1 to the rows of x"):
        st.run(x, [0], [3], [kp], [vp], [rows], cos, sin)
    with pytest.raises(RuntimeError, match="layer index outside the stack"):
        st.run(x, [len(st)], [2], [kp], [vp], [rows], cos, sin)
    with pytest.raises(RuntimeError, match="row slots outside the KV pool"):
        st.run(x, [0], [2], [kp], [vp], [torch.tensor([[0, 1], [8, 1]])], cos, sin)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        st.run(x, [0], [2], [kp[:1]], [vp[:1]], [rows], cos, sin)


def test_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SKIPDECODE_KERNELS", "0")
    kernels.load.cache_clear()
    try:
        assert kernels.load() is None
    finally:
        monkeypatch.delenv("SKIPDECODE_KERNELS")
        kernels.load.cache_clear()


@needs_kernels
def test_the_kernels_load_again_in_the_same_process(k):
    """Loading the built module a second time in one process (after turning the kernels off, or a
    second build beside the first) gives working kernels, layer stack included: pybind types it
    registers are the module's own, so the second load does not fail on the first's."""
    kernels.load.cache_clear()
    try:
        again = kernels.load()
        assert again is not None
        assert len(again.LayerStack()) == 0
    finally:
        kernels.load.cache_clear()


@needs_kernels
def test_a_build_killed_midway_does_not_hang_the_next_load(k):
    """torch marks a build in progress with a ``lock`` file; one killed mid-build leaves it, and
    torch alone would wait for it forever. The next load must go on."""
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    name = k.__name__  # the module is built: its directory is found by its name
    (Path(_get_build_directory(name, False)) / "lock").touch()
    code = "from skipdecode import kernels; assert kernels.load() is not None"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_amx_refused_by_the_os_falls_back_to_vnni_with_a_warning(monkeypatch):
    """Linux may refuse a process the AMX tile registers; the kernels then run the VNNI form, which
    computes the same outputs, and say so once instead of failing to load."""
    class Module:  # the two setters configure() calls on a built kernel module
        def __init__(self):
            self.a8 = []

        def set_isa(self, avx512):
            pass

        def set_a8(self, form):
            if form == "amx":
                raise RuntimeError("skipdecode kernel: the OS did not grant this process the AMX tile registers")
            self.a8.append(form)

    monkeypatch.setattr(kernels, "a8_form", lambda: "amx")
    monkeypatch.setattr(kernels, "amx_bf16", lambda: False)
    module = Module()
    with pytest.warns(UserWarning, match="AMX tile registers.*AVX512-VNNI"):
        assert kernels.configure(module) is module
    assert module.a8 == ["vnni"]


def test_amx_bf16_refused_by_the_os_leaves_the_fma_forms_with_a_warning(monkeypatch):
    """Where Linux refuses the tile registers the fp32-activation linears keep the FMA forms, and
    the kernels say so instead of failing to load."""
    class Module:
        def set_isa(self, avx512):
            pass

        def set_a8(self, form):
            pass

        def set_amx_bf16(self, on):
            raise RuntimeError("skipdecode kernel: the OS did not grant this process the AMX tile registers")

    monkeypatch.setattr(kernels, "a8_form", lambda: "vnni")
    monkeypatch.setattr(kernels, "amx_bf16", lambda: True)
    module = Module()
    with pytest.warns(UserWarning, match="AMX tile registers.*FMA forms"):
        assert kernels.configure(module) is module


def test_amx_bf16_follows_the_cpu_and_the_environment(monkeypatch):
    """The tiles run where the CPU has AMX-BF16 and the AVX-512 form runs, unless SKIPDECODE_AMX=0."""
    monkeypatch.delenv("SKIPDECODE_AMX", raising=False)
    monkeypatch.delenv("SKIPDECODE_ISA", raising=False)
    assert kernels.amx_bf16() == HAS_AMX_BF16
    monkeypatch.setenv("SKIPDECODE_AMX", "0")
    assert kernels.amx_bf16() is False
    monkeypatch.setenv("SKIPDECODE_AMX", "1")
    monkeypatch.setenv("SKIPDECODE_ISA", "avx2")
    assert kernels.amx_bf16() is False
    monkeypatch.delenv("SKIPDECODE_ISA")
    monkeypatch.setenv("SKIPDECODE_AMX", "on")
    with pytest.raises(ValueError, match="SKIPDECODE_AMX must be 0 or 1"):
        kernels.amx_bf16()


@needs_kernels
@pytest.mark.skipif(not HAS_AMX_BF16, reason="this CPU has no AMX-BF16")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
def test_amx_bf16_tiles_equal_the_fp32_product_and_each_row_is_the_same_in_any_batch(k, dtype):
    """On the tiles (bf16, int8 and int4 weights from 8 rows, fp32 in three limbs from 32; int4 as
    its codes, the group scales applied to each block's sums) the activations are split into bf16
    limbs that lose nothing: outputs are within fp32 rounding of the float64 product, no further
    from it than the FMA forms' (whose bits they do not share, which shows the tiles ran), with
    bias, ragged panels (a pair and a single one), K over several 32-k blocks, an outlier column
    and entries far below the rest; and a row's outputs are bitwise the same in calls of 8 (fp32:
    32) to 70 rows (row blocks of different heights, one or two a group), as a batch must leave
    what a request decodes alone."""
    _skip_unless_tiles(k)
    g = _gen(41)
    n, kdim = 40, 576
    packed, sc = _panels(dtype, n, kdim, g)
    b = torch.randn(n, generator=g)
    x = torch.randn(70, kdim, generator=g)
    x[:, 5] *= 40
    x[3, 100:140] = 1e-3
    prev = k.set_amx_bf16(False)
    try:
        w = k.linear(torch.eye(kdim), packed, None, n, sc).double().t()  # the weights as the panels hold them
        fma = k.linear(x, packed, b, n, sc)
    finally:
        k.set_amx_bf16(prev)
    ref = x.double() @ w.t() + b.double()
    rows = (32, 33, 48, 70) if dtype == "float32" else (8, 11, 16, 17, 32, 33, 70)
    out = {m: k.linear(x[:m], packed, b, n, sc) for m in rows}
    scale = ref.abs().max()
    err_amx = ((out[70].double() - ref).abs().max() / scale).item()
    err_fma = ((fma.double() - ref).abs().max() / scale).item()
    assert err_amx < 2e-6 and err_amx <= 2 * err_fma, (err_amx, err_fma)
    assert not torch.equal(out[70], fma)
    for m, y in out.items():
        assert torch.equal(y, out[70][:m]), m


@needs_kernels
@pytest.mark.skipif(not HAS_AMX_BF16, reason="this CPU has no AMX-BF16")
def test_fp32_weights_take_the_tiles_from_32_rows_where_two_row_blocks_fill_them(k):
    """fp32 panels run the FMA forms up to 31 rows (their bits exactly) and the tiles from 32 (other
    bits, within fp32 rounding of them): two row blocks of 12-15 rows left the tiles slower than the
    stream form (benchmarks/results/xeon-amx/kernel-ab-f32-tiles-from-32.json)."""
    _skip_unless_tiles(k)
    g = _gen(43)
    packed, _ = _panels("float32", 40, 576, g)
    x = torch.randn(32, 576, generator=g)
    k.set_amx_bf16(False)
    try:
        fma = {m: k.linear(x[:m], packed, None, 40) for m in (24, 31, 32)}
    finally:
        k.set_amx_bf16(True)
    for m in (24, 31):
        assert torch.equal(k.linear(x[:m], packed, None, 40), fma[m]), m
    tiles = k.linear(x, packed, None, 40)
    assert not torch.equal(tiles, fma[32]) and torch.allclose(tiles, fma[32], rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.skipif(not HAS_AMX_BF16, reason="this CPU has no AMX-BF16")
def test_int4_calls_of_4_and_5_rows_stack_every_rows_limbs_in_one_tile(k):
    """int4 panels at 4 and 5 rows run the tiles with a row's three activation limbs stacked in one A
    tile (3 M rows): other bits than the FMA forms', within fp32 rounding of the float64 product and
    no further from it than theirs (bias, ragged panels, several blocks, an outlier column, entries
    far below the rest), and each row the same bits in calls of 4 and 5 rows. 1-3 and 6-7 rows keep
    the FMA forms' bits (the tiles' one product per limb takes over from 8)."""
    _skip_unless_tiles(k)
    g = _gen(47)
    n, kdim = 40, 576
    packed, sc = _panels("int4", n, kdim, g)
    b = torch.randn(n, generator=g)
    x = torch.randn(7, kdim, generator=g)
    x[:, 5] *= 40
    x[2, 100:140] = 1e-3
    k.set_amx_bf16(False)
    try:
        w = k.linear(torch.eye(kdim), packed, None, n, sc).double()  # [K, n]: the weights as the panels hold them
        fma = {m: k.linear(x[:m], packed, b, n, sc) for m in range(1, 8)}
    finally:
        k.set_amx_bf16(True)
    out = {m: k.linear(x[:m], packed, b, n, sc) for m in range(1, 8)}
    for m in (1, 2, 3, 6, 7):
        assert torch.equal(out[m], fma[m]), m
    ref = x[:5].double() @ w + b.double()
    scale = ref.abs().max()
    err_stacked = ((out[5].double() - ref).abs().max() / scale).item()
    err_fma = ((fma[5].double() - ref).abs().max() / scale).item()
    assert err_stacked < 2e-6 and err_stacked <= 2 * err_fma, (err_stacked, err_fma)
    for m in (4, 5):
        assert not torch.equal(out[m], fma[m]), m
        assert torch.equal(out[m], out[5][:m]), m


@needs_kernels
def test_a_model_fuses_a_bucket_its_linears_left_unfused_where_its_timed_layers_are_faster(tiny_dirs, tmp_path,
                                                                                          monkeypatch):
    """pack_for_inference times the whole layers (fused stack call against layer by layer) at each
    bucket the linears' times left unfused and fuses it where fused was faster, and the timing
    leaves every layer's plan as it was."""
    from skipdecode import dispatch
    from skipdecode.checkpoint import load_model

    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path))
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "1")
    monkeypatch.setattr(dispatch, "_TUNED", {})
    n = len(dispatch.BUCKETS)
    linears = (True, True) + (False,) * (n - 2)
    monkeypatch.setattr(dispatch, "fused_plan", lambda shapes, k, weights="float32": linears)
    monkeypatch.setattr(dispatch, "plan_for", lambda o, i, k, weights="float32": ("hand",) * n)
    net = load_model(tiny_dirs["llama"])[0].pack_for_inference()
    (rec,) = [e for e in json.loads((tmp_path / "autotune.json").read_text()).popitem()[1].values()
              if "fused" in e]
    assert rec["seconds"]["fused"][:2] == [None, None] and all(t > 0 for t in rec["seconds"]["fused"][2:])
    assert all(t > 0 for t in rec["seconds"]["unfused"][2:])
    want = tuple(p or f <= u for p, f, u in zip(linears, rec["seconds"]["fused"], rec["seconds"]["unfused"]))
    assert net._stack_plan == want == tuple(rec["fused"])
    assert all(b.fuse_plan == want for b in net.layers)
    f, u = net._time_layers(4)
    assert f > 0 and u > 0 and all(b.fuse_plan == want for b in net.layers)  # timing leaves the plans as they were


@needs_kernels
@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8", "int4", "w8a8", "w4a8", "w8a16", "w4a16"])
def test_native_greedy_steps_pick_the_tokens_of_python_steps_in_every_weight_dtype(tiny_dirs, weights):
    """LayerStack.greedy (Transformer.greedy_steps) runs a step's layers, final norm, LM head
    (its scales and activation form) and argmax as a Python step does: generate's native bursts
    give the tokens of one Python step at a time in every weight dtype, 3 rows at 2x."""
    import skipdecode.generate as gen
    from skipdecode.checkpoint import load_model
    from skipdecode.generate import generate_tokens
    from skipdecode.schedule import SkipSchedule

    net = load_model(tiny_dirs["llama"])[0].pack_for_inference(weights=weights)
    assert net.native_greedy(3)
    g = _gen(41)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (3, 11, 7)]
    sched = SkipSchedule.for_speedup(2.0, 20, net.n_layers)
    out = {}
    prev = gen.DECODE_BURST
    try:
        for burst in (1, 8):
            gen.DECODE_BURST = burst
            out[burst] = [r.token_ids for r in generate_tokens(net, prompts, sched, 20)[0]]
    finally:
        gen.DECODE_BURST = prev
    assert out[8] == out[1]


@needs_kernels
def test_phase_timing_counts_every_layer_phase_and_head_of_a_native_step_and_nothing_when_off(tiny_dirs):
    """set_phase_timing / phase_times (benchmarks/step_phases.py): with timing on, each of a
    layer's phases is counted once a layer and native step, the head and the step once a step, and
    the phases of a step take no more than the step; off (the default), steps add nothing."""
    from skipdecode.checkpoint import load_model
    from skipdecode.generate import generate_tokens
    from skipdecode.schedule import SkipSchedule

    net = load_model(tiny_dirs["llama"])[0].pack_for_inference(weights="int8")
    k = net._stack_kernels
    assert net.native_greedy(2)
    sched = SkipSchedule.for_speedup(1.0, 12, net.n_layers)
    prompts = [[5, 9, 14], [7, 3]]
    layer_phases = ("norm1", "qkv", "rope", "attention", "o", "norm2", "gate_up", "silu", "down")
    assert k.set_phase_timing(False) is False  # off unless asked for
    k.phase_times(True)
    generate_tokens(net, prompts, sched, 12, eos_token_ids=())
    assert all(calls == 0 for _, calls in k.phase_times(True).values())
    k.set_phase_timing(True)
    try:
        before = k.phase_times(True)
        generate_tokens(net, prompts, sched, 12, eos_token_ids=())
        t = k.phase_times(True)
    finally:
        assert k.set_phase_timing(False) is True
    assert set(before) == set(layer_phases) | {"head", "step"}
    steps = t["step"][1]  # native steps (the first token comes from the prefill)
    assert steps == 11 and t["head"][1] == steps
    assert all(t[p][1] == steps * net.n_layers for p in layer_phases)
    assert all(t[p][0] > 0 for p in ("qkv", "gate_up", "down", "head", "step"))
    assert sum(t[p][0] for p in layer_phases) + t["head"][0] <= t["step"][0]


@needs_kernels
@pytest.mark.parametrize("rows", [1, 8])
def test_native_greedy_steps_pick_the_same_tokens_from_either_copy_of_the_fp32_head(rows, monkeypatch):
    """The embedded model's fp32 head keeps a copy that greedy steps pick from, with the exact
    logits of the ids it leaves in doubt: untimed the int8 copy (a quarter of its bytes), else the
    bf16 copy where the int8 one was measured slower. From either, the tokens of the full head, at
    full depth and at 3x. The untimed plans (the kernels' panels up to 8 rows) put the head on the
    panels whatever the autotuner would pick on this CPU."""
    from skipdecode import LLM
    from skipdecode.model import fp32_head_copy

    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "0")
    llm = LLM.load("default-e2e", dtype="float32")
    net, head = llm.model, llm.model.lm_head
    assert head.approx.dtype == torch.int8 and head.approx_scale is not None and head.approx_bound.shape[0] == 2
    assert net.native_greedy(rows) and net.greedy_approx
    _same_tokens_with_and_without_the_heads_pass(llm, rows)
    head.approx, head.approx_scale, head.approx_bound = fp32_head_copy(net._head_rows, "bfloat16")
    _same_tokens_with_and_without_the_heads_pass(llm, rows)


@needs_kernels
def test_greedy_steps_pick_from_a_copys_pass_where_it_was_measured_no_slower_than_onednn(
        k, tiny_dirs, monkeypatch, tmp_path):
    """Where an fp32 head's plan has oneDNN (the full product), greedy steps still take the native
    loop and its copy's pass at the buckets where dispatch.greedy_head_plan timed that copy's pass
    no slower than oneDNN's product and argmax (an AVX2 CPU's 2 and 8 rows, say), and the tokens
    are those of Python steps on oneDNN. Untimed, the plan alone decides, as before. The copy is
    int8 unless its picks summed over the buckets took longer than the bf16 copy's (or K is not
    in blocks of 32)."""
    from skipdecode.checkpoint import load_model
    from skipdecode.generate import generate_tokens
    from skipdecode.schedule import SkipSchedule

    plan = ("hand", "onednn", "hand", "onednn", "onednn", "onednn", "onednn", "onednn")
    assert dispatch.greedy_head_plan(64, 32, k, plan) == tuple(p == "hand" for p in plan)  # untimed
    assert dispatch.greedy_head_copy(64, 32, k) == "int8"  # untimed
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "1")
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path))
    timings = {"greedy": [1.0, 1.0, 1.0, 2.0, 5.0, 5.0, 5.0, 5.0], "greedy8": [0.5, 3.0, 1.0, 1.0, 1.0, 5.0, 9.0, 5.0],
               "onednn": [3.0, 3.0, 3.0, 2.0, 4.0, 4.0, 6.0, 4.0]}
    monkeypatch.setattr(dispatch, "time_greedy_head", lambda *a, **kw: dict(timings))
    monkeypatch.setattr(dispatch, "_TUNED", {})  # this process's memo of measured entries, restored after
    got = dispatch.greedy_head_plan(64, 32, k, plan)
    assert got == (True, True, True, True, False, False, True, False) and len(got) == len(dispatch.BUCKETS)
    assert dispatch.greedy_head_plan(64, 32, k, plan, "int8") == (True, True, True, True, True, False, False, False)
    assert json.loads((tmp_path / "autotune.json").read_text())  # measured once, kept for the next process
    assert dispatch.greedy_head_copy(64, 32, k) == "bfloat16"  # the int8 copy's picks took longer in all (25.5 > 25)
    assert dispatch.greedy_head_copy(64, 48, k) == "bfloat16"  # int8 activations take K in blocks of 32
    timings["greedy8"] = [0.5, 1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0]
    monkeypatch.setattr(dispatch, "_TUNED", {})
    (tmp_path / "autotune.json").unlink()
    assert dispatch.greedy_head_copy(64, 32, k) == "int8"
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "0")

    net = load_model(tiny_dirs["llama"])[0].pack_for_inference()
    head = net.lm_head
    assert head.approx is not None and head.onednn is not None
    head.plan = tuple("onednn" for _ in dispatch.BUCKETS)  # the full product on oneDNN at every bucket
    g = _gen(43)
    prompts = [torch.randint(3, 250, (length,), generator=g).tolist() for length in (3, 11, 7)]
    sched = SkipSchedule.for_speedup(2.0, 16, net.n_layers)
    out = {}
    for picks in (False, True):
        head.greedy_plan = tuple(picks for _ in dispatch.BUCKETS)
        assert net.native_greedy(3) == picks
        out[picks] = [r.token_ids for r in generate_tokens(net, prompts, sched, 16)[0]]
    assert out[True] == out[False]


@needs_kernels
def test_native_greedy_steps_refuse_tokens_and_positions_outside_the_model(tiny_packed):
    """A bad token id or a position past the RoPE tables is a clear error, not a read outside them."""
    net = tiny_packed["llama"]
    L = net.n_layers
    pools = [(torch.zeros(net.cfg.n_kv_heads, 8, net.cfg.head_dim), torch.zeros(net.cfg.n_kv_heads, 8, net.cfg.head_dim))
             for _ in range(L)]
    starts = torch.zeros(L, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="token id outside the embedding"):
        net.greedy_steps([net.cfg.vocab_size], [0], [list(range(L))], pools, starts)
    with pytest.raises(RuntimeError, match="row slots outside the KV pool"):
        net.greedy_steps([1], [8], [list(range(L))], pools, starts)
    assert len(net.greedy_steps([1], [0], [list(range(L))] * 3, pools, starts)) == 3
