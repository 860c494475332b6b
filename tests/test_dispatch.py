"""Runtime dispatch: the autotuner picks the form it measured faster, per row-count bucket, and
caches it per machine; every weight dtype's linear equals its plain-torch reference; bf16 and
int8 models follow the fp32 model they were packed from."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import BUILDABLE, needs_kernels
from skipdecode import dispatch, kernels
from skipdecode.model import PackedLinear, quantize_int8


def test_a_call_uses_the_first_bucket_that_holds_its_rows():
    assert [dispatch.bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 32, 33, 128, 129, 4096)] == \
        [0, 1, 2, 2, 3, 3, 4, 5, 6, 7, 7, 7]


def test_single_row_forms_put_every_call_in_the_first_bucket_and_nest():
    with dispatch.single_row_forms():
        assert [dispatch.bucket(m) for m in (1, 5, 4096)] == [0, 0, 0]
        with dispatch.single_row_forms():
            assert dispatch.bucket(9) == 0
        assert dispatch.bucket(9) == 0
    assert dispatch.bucket(9) == 4


@needs_kernels
def test_rows_in_single_row_forms_round_like_one_row_calls_where_forms_differ():
    """An int8 linear whose buckets pick different forms: five rows at once run
    torch's int8 GEMM (bf16 activations) and land about 1e-2 from one row at a
    time on the panels (fp32 activations); under ``single_row_forms`` they run
    the panels too and differ only by fp32 summation order (what a lossless
    verification relies on to reproduce 1x's greedy tokens)."""
    lin = _linear(n_in=64)
    p = PackedLinear(lin, kernels.load(), "int8", keep_panels=True)
    p.plan = ("hand",) + ("int8mm",) * (len(dispatch.BUCKETS) - 1)
    p.qweight, p.scales = quantize_int8(lin.weight.detach())  # torch's int8 GEMM for every larger bucket
    x = torch.randn(5, 1, 64)
    alone = torch.cat([p(x[r:r + 1]) for r in range(5)])
    mixed = (p(x) - alone).abs().max()
    with dispatch.single_row_forms():
        single = (p(x) - alone).abs().max()
    assert single <= 1e-5 * alone.abs().max()
    assert mixed > 100 * single and mixed > 1e-3


def test_the_faster_form_wins_each_bucket_and_a_tie_keeps_the_first():
    n = len(dispatch.BUCKETS)
    hand = [1.0] * n
    onednn = [0.5 if i % 2 else 1.0 for i in range(n)]
    assert dispatch.choose({"hand": hand, "onednn": onednn}) == tuple(
        "onednn" if i % 2 else "hand" for i in range(n))


def test_a_layer_is_fused_where_its_linears_are_faster_on_the_panels_in_sum(monkeypatch):
    n = len(dispatch.BUCKETS)
    secs = {(8, 4): {"hand": [1.0] * n, "onednn": [2.0] * n},  # panels win by 1 everywhere
            (4, 8): {"hand": [1.0] * (n - 1) + [9.0], "onednn": [1.5] * n}}  # ... but lose 7.5 at the last
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "1")
    monkeypatch.setattr(dispatch, "tune", lambda o, i, k, w="float32": {"seconds": secs[(o, i)]})
    assert dispatch.fused_plan([(8, 4), (4, 8)], object()) == (True,) * (n - 1) + (False,)
    assert dispatch.fused_plan([(8, 4)], None) == (False,) * n  # no kernels: nothing to fuse


def test_buckets_the_linears_leave_unfused_are_timed_again_as_whole_layers_once_per_machine(tmp_path, monkeypatch):
    n = len(dispatch.BUCKETS)
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path))
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "1")
    monkeypatch.setattr(dispatch, "_TUNED", {})
    monkeypatch.setattr(dispatch, "_machine_key", lambda k: "this machine")
    timed = []

    def time_layers(rows):  # fused faster up to 32 rows, slower above
        timed.append(rows)
        return (1.0, 2.0) if rows <= 32 else (3.0, 2.0)

    linears = (True,) * 3 + (False,) * (n - 3)  # the linears alone fuse the first three buckets
    want = tuple(b <= 32 for b in dispatch.BUCKETS)
    assert dispatch.layers_fused_plan("sig", linears, object(), time_layers) == want
    assert timed == list(dispatch.BUCKETS[3:])  # a bucket the linears already fuse is not timed again
    rec = json.loads((tmp_path / "autotune.json").read_text())["this machine"]["layers sig"]
    assert rec["fused"] == list(want) and rec["seconds"]["fused"][:3] == [None] * 3
    monkeypatch.setattr(dispatch, "_TUNED", {})
    assert dispatch.layers_fused_plan("sig", linears, object(), time_layers) == want
    assert len(timed) == n - 3  # a new process reads the cache
    assert dispatch.layers_fused_plan("other", (True,) * n, object(), time_layers) == (True,) * n
    assert len(timed) == n - 3  # nothing left unfused: nothing to time
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "0")
    assert dispatch.layers_fused_plan("new", linears, object(), time_layers) == linears  # no timing: the linears' plan


@needs_kernels
def test_the_autotuner_times_once_per_machine_and_shape_and_keeps_its_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path))
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "1")
    monkeypatch.setattr(dispatch, "_TUNED", {})
    k = kernels.load()
    calls = []
    real = dispatch.time_forms
    monkeypatch.setattr(dispatch, "time_forms", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    plan = dispatch.plan_for(48, 32, k)
    entry = json.loads((tmp_path / "autotune.json").read_text())
    (key, shapes), = entry.items()
    assert dispatch.cpu_features()["cpu"] in key and f"threads {torch.get_num_threads()}" in key
    rec = shapes["48x32"]
    assert plan == tuple(rec["plan"]) == dispatch.choose(rec["seconds"])  # the measured faster one
    assert len(calls) == 1
    assert dispatch.plan_for(48, 32, k) == plan and len(calls) == 1  # this process: remembered
    monkeypatch.setattr(dispatch, "_TUNED", {})
    assert dispatch.plan_for(48, 32, k) == plan and len(calls) == 1  # a new process: read from the cache
    monkeypatch.setattr(dispatch, "_TUNED", {})
    (tmp_path / "autotune.json").write_text("{not json")
    dispatch.plan_for(48, 32, k)
    assert len(calls) == 2  # a damaged cache is measured again, not trusted
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "0")
    assert dispatch.plan_for(48, 32, k) == dispatch.default_plan(True)
    assert dispatch.plan_for(48, 32, None) == ("onednn",) * len(dispatch.BUCKETS)


def test_cpu_features_name_the_cpu_and_only_known_isa_extensions():
    f = dispatch.cpu_features()
    assert f["cpu"] and set(f["isa"]) <= set(dispatch.ISA_FLAGS)
    assert f["torch_capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "NO AVX")


def _linear(n_out=40, n_in=24, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.3)
        if bias:
            lin.bias.normal_(0, 0.3)
    return lin


@needs_kernels
@pytest.mark.parametrize("form", ["hand", "onednn"])
@pytest.mark.parametrize("rows", [1, 5, 40, 200])
def test_every_fp32_form_equals_f_linear(monkeypatch, form, rows):
    monkeypatch.setattr(dispatch, "plan_for", lambda o, i, k, w="float32": (form,) * len(dispatch.BUCKETS))
    lin = _linear()
    p = PackedLinear(lin, kernels.load(), "float32")
    assert (p.packed is not None) == (form == "hand") and (p.onednn is not None) == (form == "onednn")
    x = torch.randn(rows, 24)
    torch.testing.assert_close(p(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p(x.view(1, rows, 24)), F.linear(x, lin.weight, lin.bias)[None], rtol=1e-5,
                               atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_bf16_panels_equal_f_linear_on_the_bf16_weight_exactly_in_fp32(monkeypatch, rows):
    """bf16 panels widen to fp32 in registers: the result is the fp32 product with the rounded
    weight, to fp32 accuracy (the input is not rounded)."""
    monkeypatch.setattr(dispatch, "plan_for", lambda o, i, k, w="float32": ("hand",) * len(dispatch.BUCKETS))
    lin = _linear()
    p = PackedLinear(lin, kernels.load(), "bfloat16")
    assert p.packed.dtype == torch.bfloat16 and p.onednn is None
    x = torch.randn(rows, 24)
    want = F.linear(x, lin.weight.bfloat16().float(), lin.bias)
    torch.testing.assert_close(p(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("onednn_bf16", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_bf16_weights_equal_f_linear_on_bf16_rounded_inputs(monkeypatch, rows, onednn_bf16):
    """fp32 in, fp32 out, the GEMM on bf16 weights and bf16-rounded inputs; where oneDNN has no
    bf16 (no AVX-512-BF16 / AMX), plain torch on the same bf16 weights."""
    if onednn_bf16 and not dispatch.cpu_features()["onednn_bf16"]:
        pytest.skip("oneDNN has no bf16 on this CPU")
    monkeypatch.setattr(dispatch, "cpu_features", lambda: {"onednn_bf16": onednn_bf16})
    lin = _linear()
    p = PackedLinear(lin, None, "bfloat16")
    assert (p.onednn is not None) == onednn_bf16 and (p.dense is not None) != onednn_bf16
    x = torch.randn(rows, 24)
    want = F.linear(x.bfloat16().float(), lin.weight.bfloat16().float(), lin.bias.bfloat16().float())
    got = p(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("n_in", [64, 24])
def test_int8_weights_equal_the_dequantized_weight_in_plain_torch(rows, n_in):
    """Reduction dims that are multiples of 32 run torch's int8 GEMM on one byte per weight;
    others (which that GEMM misreads) hold the same rounded weights in bf16."""
    lin = _linear(n_in=n_in)
    p = PackedLinear(lin, None, "int8")
    q, s = quantize_int8(lin.weight)
    deq = q.float() * s.float()[:, None]
    assert (deq - lin.weight).abs().max() <= s.float().max() / 2 + 1e-6  # rounding, half a step
    x = torch.randn(rows, n_in)
    want = F.linear(x.bfloat16().float(), deq, lin.bias.bfloat16().float())
    got = p(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=3e-2 * n_in / 24)
    if n_in % 32 == 0:
        assert p.qweight.dtype == torch.int8 and p.qweight.shape == (40, n_in) and s.shape == (40,)
        assert p.qweight.element_size() * p.qweight.numel() == 40 * n_in  # one byte per weight
    else:
        assert p.qweight is None and p.dense.dtype == torch.bfloat16


@needs_kernels
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("n_in", [64, 24])
def test_int8_panels_equal_the_dequantized_weight_in_fp32(monkeypatch, rows, n_in):
    """int8 panels widen to fp32 in registers and scale each finished sum: the fp32 product with
    the dequantized weight (the input is not rounded), for any reduction dim."""
    monkeypatch.setattr(dispatch, "plan_for", lambda o, i, k, w="float32": ("hand",) * len(dispatch.BUCKETS))
    lin = _linear(n_in=n_in)
    p = PackedLinear(lin, kernels.load(), "int8")
    q, s = quantize_int8(lin.weight)
    assert p.packed.dtype == torch.int8 and p.qweight is None and p.dense is None
    assert p.packed.numel() == 48 * n_in  # one byte per weight, 40 outputs padded to 3 panels of 16
    x = torch.randn(rows, n_in)
    want = F.linear(x, q.float() * s.float()[:, None], lin.bias)
    torch.testing.assert_close(p(x), want, rtol=1e-5, atol=1e-5)


def test_int8_shapes_torchs_gemm_misreads_run_on_the_panels_only(monkeypatch):
    n = len(dispatch.BUCKETS)
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "1")
    monkeypatch.setattr(dispatch, "tune", lambda *a, **kw: pytest.fail("nothing to choose between"))
    assert dispatch.plan_for(40, 24, object(), "int8") == ("hand",) * n
    assert dispatch.plan_for(40, 24, None, "int8") == ("int8mm",) * n  # no kernels: PackedLinear dequantizes
    assert dispatch.fused_plan([(40, 24), (24, 64)], object(), "int8") == (True,) * n
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "0")
    assert dispatch.plan_for(40, 64, object(), "int8") == dispatch.default_plan(True, "int8")
    assert set(dispatch.default_plan(True, "int8")) == {"hand", "int8mm"}


@needs_kernels
def test_the_int8_autotuner_times_the_panels_against_torchs_int8_gemm(tmp_path, monkeypatch):
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path))
    monkeypatch.setenv("SKIPDECODE_AUTOTUNE", "1")
    monkeypatch.setattr(dispatch, "_TUNED", {})
    plan = dispatch.plan_for(48, 64, kernels.load(), "int8")
    (shapes,) = json.loads((tmp_path / "autotune.json").read_text()).values()
    rec = shapes["48x64 int8"]
    assert set(rec["seconds"]) == {"hand", "int8mm"} and all(t > 0 for v in rec["seconds"].values() for t in v)
    assert plan == tuple(rec["plan"]) == dispatch.choose(rec["seconds"])


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_reduced_precision_models_follow_their_fp32_model(tiny_dirs, dtype):
    """Same tokens in, logits close to fp32 (bf16 activations), greedy agreement on most steps."""
    from skipdecode import LLM

    ref = LLM.load(tiny_dirs["llama"])
    low = LLM.load(tiny_dirs["llama"], dtype=dtype)
    assert all(isinstance(getattr(b, n), PackedLinear) and getattr(b, n).weights == dtype
               for b in low.model.layers for n in ("wqkv", "wo", "w13", "w2"))
    assert low.model.inv_freq.dtype == torch.float32  # RoPE frequencies keep full precision
    assert all(p.dtype == torch.float32 for p in low.model.parameters())  # weight-only: the rest stays fp32
    if low.model.kernels is not None:  # bf16 / int8 panels: the same fused layer, 1/2 or 1/4 the weight bytes
        want = torch.bfloat16 if dtype == "bfloat16" else torch.int8
        assert all(b.fused_decode and b.wqkv.packed.dtype == want for b in low.model.layers)
    tokens = torch.tensor([[5, 17, 99, 3, 42, 7, 200, 11]])
    pos = torch.arange(8)[None]
    with torch.no_grad():
        a, b = ref.model(tokens, pos), low.model(tokens, pos)
    assert b.dtype == torch.float32
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < 0.05, rel
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree >= 0.75, agree


@needs_kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "int4", "w8a8", "w4a8", "w8a16", "w4a16"])
def test_every_dtype_generates_on_an_avx2_only_cpu_with_the_autotuner_on(tiny_cli_dir, tmp_path, dtype):
    """An AVX2-only CPU (an AMD EPYC without AVX-512) simulated on any machine: oneDNN capped at
    AVX2 (``ONEDNN_MAX_CPU_ISA``: its bf16 reorder raises there, so neither packing nor the
    autotuner may call it) and the kernels' AVX2 form (``SKIPDECODE_ISA=avx2``). Every reduced
    dtype packs, autotunes and generates; bf16, int4 and the int8-activation dtypes (their
    portable form here, no VNNI) run on the compiled panels only."""
    import os
    import subprocess
    import sys

    script = (
        "import json, torch; from skipdecode import LLM, kernels; from skipdecode.dispatch import cpu_features\n"
        f"llm = LLM.load({str(tiny_cli_dir)!r}, dtype={dtype!r})\n"
        "o = llm.generate('Describe a pub.', max_new_tokens=6, speedup=2, ignore_eos=True)[0]\n"
        "print(json.dumps({'onednn_bf16': cpu_features()['onednn_bf16'], 'isa': kernels.isa(),\n"
        "                  'tokens': len(o.token_ids), 'forms': sorted(set(llm.model.layers[0].wqkv.plan))}))\n")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", SKIPDECODE_ISA="avx2", SKIPDECODE_AUTOTUNE="1",
               SKIPDECODE_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["onednn_bf16"] is False and out["isa"] == "avx2" and out["tokens"] == 6
    if dtype != "int8":
        assert out["forms"] == ["hand"]


@pytest.mark.parametrize("use_kernels", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_int4_weights_equal_the_group_dequantized_weight(use_kernels, rows):
    """int4 runs on the kernels' int4 panels (the fp32 product with the dequantized weight) and,
    without them, anywhere torch runs: the same codes dequantized on torch's bf16 GEMM."""
    from skipdecode.model import dequantize_int4, quantize_int4

    if use_kernels and not BUILDABLE:
        pytest.skip("no AVX2/FMA CPU or no C++ compiler")
    lin = _linear(n_in=96)
    p = PackedLinear(lin, kernels.load() if use_kernels else None, "int4")
    q, s = quantize_int4(lin.weight.detach())
    deq = dequantize_int4(q, s)
    x = torch.randn(rows, 96)
    if use_kernels:
        assert p.packed.dtype == torch.uint8 and p.dense is None and p.plan == ("hand",) * len(dispatch.BUCKETS)
        assert p.packed.numel() == 48 * 96 // 2  # half a byte per weight, 40 outputs padded to 3 panels
        torch.testing.assert_close(p(x), F.linear(x, deq, lin.bias), rtol=1e-5, atol=1e-5)
    else:
        assert p.packed is None and p.dense.dtype == torch.bfloat16
        want = F.linear(x.bfloat16().float(), deq, lin.bias.bfloat16().float())
        torch.testing.assert_close(p(x), want, rtol=2e-2, atol=1e-1)


def test_int4_keeps_int8_where_inputs_do_not_fill_groups_of_32():
    p = PackedLinear(_linear(n_in=24), kernels.load(), "int4")
    assert p.weights == "int8"


@pytest.mark.parametrize("use_kernels", [True, False])
def test_an_int4_model_generates_as_the_fp32_model_of_its_dequantized_weights(tiny_dirs, use_kernels):
    """End to end on a tiny Llama: int4 packing changes the block weights to their int4 codes and the
    LM head to int8 (as llama.cpp's Q4_0 keeps its output matrix at higher precision), nothing else."""
    from skipdecode.checkpoint import load_model
    from skipdecode.model import dequantize_int4, quantize_int4

    if use_kernels and not BUILDABLE:
        pytest.skip("no AVX2/FMA CPU or no C++ compiler")
    net4 = load_model(tiny_dirs["llama"])[0].pack_for_inference(use_kernels=use_kernels, weights="int4")
    ref = load_model(tiny_dirs["llama"])[0]
    with torch.no_grad():
        for m in ref.modules():
            if m is ref.lm_head:
                q, sc = quantize_int8(m.weight)
                m.weight.copy_(q.float() * sc.float()[:, None])
            elif isinstance(m, nn.Linear) and m.in_features % 32 == 0:
                m.weight.copy_(dequantize_int4(*quantize_int4(m.weight)))
    ref = ref.pack_for_inference(use_kernels=use_kernels)
    assert net4.layers[0].w13.weights == "int4" and net4.lm_head.weights == "int8"
    toks = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 11]])
    pos = torch.arange(8)[None]
    with torch.inference_mode():
        got, want = net4(toks, pos), ref(toks, pos)
    # kernels: both fp32 products (summation order only); torch fallback: activations rounded to bf16
    tol = 1e-4 if use_kernels else 5e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * 10)


@needs_kernels
@pytest.mark.parametrize("dtype", ["w8a8", "w4a8", "w8a16", "w4a16"])
def test_int8_activation_models_follow_fp32_and_a_row_never_depends_on_its_batch_mates(tiny_dirs, dtype):
    """w8a8 / w4a8 (w8a16 / w4a16): every block linear and the LM head quantize their activations
    (the head keeps int8 weights under w4a8 / w4a16); logits close to those of the same weights with
    fp32 activations (int8 / int4; 15-bit activations much closer); and since each row's sums are exact
    integers, greedy tokens of requests decoded together, at 1x and skipping, and lossless
    requests, equal each request decoded alone at 1x or at its own schedule, token for token."""
    from skipdecode import LLM
    from skipdecode.engine import Engine, EngineConfig
    from skipdecode.schedule import SkipSchedule

    base = {"w8a8": "int8", "w4a8": "int4", "w8a16": "int8", "w4a16": "int4"}[dtype]
    form = 2 if dtype.endswith("a16") else 1
    ref = LLM.load(tiny_dirs["llama"], dtype=base)  # the same weights, fp32 activations
    low = LLM.load(tiny_dirs["llama"], dtype=dtype)
    net = low.model
    assert all(getattr(b, n).a8 == form and getattr(b, n).weights == base and b.fused_decode
               for b in net.layers for n in ("wqkv", "wo", "w13", "w2"))
    assert net.lm_head.a8 == form and net.lm_head.weights == "int8"
    tokens = torch.tensor([[5, 17, 99, 3, 42, 7, 200, 11]])
    pos = torch.arange(8)[None]
    with torch.no_grad():
        a, b = ref.model(tokens, pos), net(tokens, pos)
    assert ((a - b).norm() / a.norm()).item() < (0.05 if form == 1 else 1e-3)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.75

    L = net.n_layers
    prompts = [[5, 17, 99, 3], [42, 7, 200, 11, 9, 8, 60], [77, 12]]
    kinds = [dict(), dict(schedule=SkipSchedule.for_speedup(1.5, 12, L)),
             dict(schedule=SkipSchedule.for_speedup(2, 12, L), lossless=True, draft_tokens=3)]

    def run(pairs):
        eng = Engine(net, EngineConfig(kv_slots=512))
        for p, kw in pairs:
            eng.add_request(p, max_new_tokens=12, ignore_eos=True, **kw)
        return [o.token_ids for o in sorted(eng.run(), key=lambda o: int(o.request_id.split("-")[1]))]

    together = run(list(zip(prompts, kinds)))
    alone = [run([(p, kw)])[0] for p, kw in zip(prompts, kinds)]
    assert together == alone
    assert together[2] == run([(prompts[2], {})])[0]  # lossless: 1x's tokens


def test_the_last_level_cache_is_the_largest_data_cache_of_the_highest_level_sysfs_lists(tmp_path):
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
                                             (3, "Unified", "491520K")]):
        d = tmp_path / "cache" / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert dispatch.cache_bytes(tmp_path) == 491520 * 1024
    (tmp_path / "cache" / "index3" / "size").write_text("garbled\n")
    assert dispatch.cache_bytes(tmp_path) == 2048 * 1024  # an unreadable entry is left out
    assert dispatch.cache_bytes(tmp_path / "nowhere") == 0


def test_median_times_runs_the_untimed_preparation_before_every_call():
    log = []
    dispatch._median_times([lambda: log.append("a"), lambda: log.append("b")], 3, before=lambda: log.append("-"))
    assert log == ["-", "a"] * 2 + ["-", "b"] * 2 + ["-", "a", "-", "b"] * 3


@needs_kernels
@pytest.mark.parametrize("llc", [0, 1 << 20])
def test_a_weight_timed_alone_is_read_cold_where_the_last_level_cache_would_hold_it(monkeypatch, llc):
    """A weight of COLD_BYTES or more is timed as one copy: where it fits the last-level cache, each
    timed call follows a read of more than that cache (as a step reads it after every layer)."""
    monkeypatch.setattr(dispatch, "COLD_BYTES", 1000.0)  # a 48 x 32 fp32 weight (6 KB) is then timed alone
    monkeypatch.setattr(dispatch, "llc_bytes", lambda: llc)
    seen = []
    real = dispatch._median_times
    monkeypatch.setattr(dispatch, "_median_times", lambda fns, n, before=None: seen.append(before) or real(fns, n))
    times = dispatch.time_forms(48, 32, kernels.load(), reps=2)
    assert len(seen) == len(dispatch.BUCKETS) and all(len(t) == len(dispatch.BUCKETS) for t in times.values())
    if llc:
        assert all(callable(b) for b in seen)
    else:
        assert all(b is None for b in seen)  # no cache size known: nothing to read past


@needs_kernels
def test_every_copy_of_a_timed_weight_is_read_once_before_any_call_is_timed(monkeypatch):
    """The autotuner's copies of a weight are each read once, before the first timed call: the
    copies packed last would otherwise start in the caches and win the first bucket."""
    monkeypatch.setattr(dispatch, "COLD_BYTES", 48 * 32 * 4 * 5.0)  # five copies of a 48 x 32 fp32 weight
    real = kernels.load()
    calls, timed = [], []

    class Recording:
        def linear(self, x, wp, bias, n, sp):
            calls.append(wp.data_ptr())
            return real.linear(x, wp, bias, n, sp)

    def median_times(fns, n, before=None):
        timed.append(len(calls))
        return [1.0 for _ in fns]

    monkeypatch.setattr(dispatch, "_median_times", median_times)
    dispatch.time_forms(48, 32, Recording(), reps=2)
    first = calls[: timed[0]]
    assert len(first) == 5 and len(set(first)) == 5
