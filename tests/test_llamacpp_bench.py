"""``skipdecode bench --llamacpp``: llama.cpp is a peer in its own virtualenv; without it the bench says
which make target builds it; bytes per step and bandwidth fractions are what the weights weigh; with it
(``make llamacpp-venv``), the same weights decode the same greedy tokens in llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from skipdecode.bench import llamacpp
from skipdecode.bench.decode import round_median
from skipdecode.bench.llamacpp import (LlamaCppMissing, llamacpp_paths, read_bandwidth_gbs, same_precision_lines,
                                       step_bytes, step_macs)

VENV = Path(__file__).resolve().parents[1] / ".venv-llamacpp"


def test_a_missing_llamacpp_venv_is_a_one_line_error_naming_the_make_target(tmp_path, capsys):
    from skipdecode.cli import main

    with pytest.raises(LlamaCppMissing, match="make llamacpp-venv"):
        llamacpp_paths(tmp_path / "nowhere")
    assert main(["bench", "--llamacpp", "--llamacpp-venv", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("skipdecode: error: ") and err.count("\n") == 1 and "make llamacpp-venv" in err, err


def test_the_avx2_build_has_its_own_make_target_and_unknown_builds_are_refused(tmp_path):
    from skipdecode.errors import SkipDecodeError

    with pytest.raises(LlamaCppMissing, match="make llamacpp-venv` then `make llamacpp-avx2"):
        llamacpp_paths(tmp_path / "nowhere", "build-avx2")
    with pytest.raises(LlamaCppMissing, match="make llamacpp-venv` then `make llamacpp-noamx"):
        llamacpp_paths(tmp_path / "nowhere", "build-noamx")
    with pytest.raises(SkipDecodeError, match="unknown llama.cpp build 'build-avx512'"):
        llamacpp_paths(VENV, "build-avx512")


def test_the_default_build_is_the_one_without_amx_on_a_cpu_that_reports_amx(tmp_path, monkeypatch):
    import skipdecode.dispatch as dispatch
    from skipdecode.bench.llamacpp import auto_build

    for isa, want in ((["avx2", "fma", "avx512f", "amx_tile", "amx_int8"], "llamacpp-noamx"),
                      (["avx2", "fma", "avx512f"], None), (["avx2", "fma"], None)):
        monkeypatch.setattr(dispatch, "cpu_features", lambda isa=isa: {"isa": isa})
        assert auto_build() == ("build-noamx" if want else "build")
        with pytest.raises(LlamaCppMissing) as e:
            llamacpp_paths(tmp_path / "nowhere", "auto")
        assert (f"`make {want}`" in str(e.value)) == bool(want), str(e.value)


def test_step_bytes_count_each_linear_and_the_head_in_its_stored_dtype_and_step_macs_each_weight_once(tiny_dirs):
    from skipdecode import LLM

    llm32 = LLM.load(tiny_dirs["llama"], dtype="float32")
    llm8 = LLM.load(tiny_dirs["llama"], dtype="int8")
    cfg = json.loads((tiny_dirs["llama"] / "config.json").read_text())
    h, f, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 2 * f * h + f * h  # wqkv, wo, w13, w2
    params = L * per_layer + V * h
    head = llm32.model.lm_head
    if head.approx is not None:  # a greedy step reads the fp32 head's int8 copy and its scales (kernels.greedy_head)
        assert step_bytes(llm32) == 4 * (params - V * h) + V * h + 4 * V
        llm32.model.greedy_approx = False
    assert step_bytes(llm32) == 4 * params
    outs = L * ((h + 2 * kv) + h + 2 * f + h) + V  # one bf16 scale per output channel
    assert step_bytes(llm8) == params + 2 * outs
    llm4 = LLM.load(tiny_dirs["llama"], dtype="int4")
    for llm in (llm32, llm8, llm4):  # one multiply-add per weight, whatever its dtype
        assert step_macs(llm) == params, llm.model.lm_head


def test_every_reader_of_the_bandwidth_is_timed_and_each_is_a_plausible_memory_speed():
    from skipdecode import kernels

    k = kernels.load()
    probe = llamacpp.read_probe(gib=0.125)
    assert probe.dtype == torch.float32 and probe.numel() == 2**25 and bool((probe == 1).all())
    rates = llamacpp.read_rates_gbs(probe, k, repeats=1)
    want = {"torch"} | ({f"stream-{pf}" for pf in kernels.READ_PREFETCH_BYTES} if k is not None else set())
    assert set(rates) == want
    for name, gbs in rates.items():
        assert 0.5 < gbs < 2000, (name, gbs)  # GB/s: a DRAM or cache read rate, not a unit slip
    bw = read_bandwidth_gbs(repeats=1, probe=probe, module=k)
    assert 0.5 < bw < 2000, bw


def test_the_probe_is_found_on_huge_pages_only_where_linux_put_it_there():
    assert not llamacpp.read_probe_huge(torch.ones(1000))  # a small tensor on the ordinary heap
    probe = llamacpp.read_probe(gib=0.0625)
    smaps = Path("/proc/self/smaps")
    if not smaps.exists() or "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        return  # no smaps to read, or every mapping may get 2 MB pages: nothing to tell apart
    assert llamacpp.read_probe_huge(probe) == (_huge_kb_at(smaps.read_text(), probe.data_ptr()) > 0)


def _huge_kb_at(smaps: str, addr: int) -> int:
    """AnonHugePages (kB) of the mapping holding ``addr``, read independently of the bench's parser."""
    blocks = smaps.split("\n")
    for i, line in enumerate(blocks):
        parts = line.split(" ", 1)
        if "-" in parts[0] and not parts[0].endswith(":"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                for rest in blocks[i + 1:]:
                    if rest.startswith("AnonHugePages:"):
                        return int(rest.split()[1])
    return 0


def test_the_report_names_every_reader_of_the_bandwidth_and_reads_older_reports():
    new = {"threads": 2, "read_probe_pages": "2 MB",
           "read_rates_gbs": {"torch": 29.1, "stream-0": 29.0, "stream-1024": 34.4}}
    text = llamacpp.read_text(new)
    assert "2 MB pages" in text and "torch sum and max 29.1 GB/s" in text
    assert "0 / 1024 bytes ahead 29.0 / 34.4 GB/s" in text
    assert llamacpp.read_text({"threads": 2}) == "torch sum and max over 1 GiB, 2 threads, best of every round"


def test_staged_directory_adds_the_architecture_and_links_the_rest(tiny_dirs, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    cfg = json.loads((tiny_dirs["gpt2"] / "config.json").read_text())
    cfg.pop("architectures", None)
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "model.safetensors").write_bytes(b"weights")
    staged = llamacpp._staged_hf_dir(src, tmp_path / "staged")
    assert json.loads((staged / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert (staged / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((src / "config.json").read_text()).get("architectures") is None  # the source is untouched


needs_llamacpp = pytest.mark.skipif(not (VENV / ".installed").is_file(),
                                    reason="llama.cpp not built here (make llamacpp-venv)")


@pytest.mark.slow
@needs_llamacpp
def test_llamacpp_f32_decodes_the_same_greedy_tokens_as_skipdecode(default_llm, tmp_path):
    """The peer runs the same model: converted from the same directory, its F32 greedy tokens follow ours."""
    from skipdecode.generate import generate_tokens

    paths = llamacpp_paths(VENV)
    ggufs = llamacpp.make_ggufs(default_llm.path, ["f32", "q8_0"], VENV)
    assert llamacpp.gguf_step_bytes(ggufs["q8_0"]) < 0.3 * llamacpp.gguf_step_bytes(ggufs["f32"])
    ids = [default_llm.encode("Write one sentence describing this restaurant: name[The Eagle], food[Japanese].")]
    got = llamacpp.run_llamacpp(paths, ggufs["f32"], ids, [1, 2], 16, 1, torch.get_num_threads())
    ours = generate_tokens(default_llm.model, ids, default_llm.make_schedule(speedup=1.0), 16, eos_token_ids=())
    assert got["tokens"][:12] == ours[0][0].token_ids[:12]
    for b in ("1", "2"):  # one repeat: the 15 decode steps' seconds
        (t,) = got["batches"][b]["t_decode"]
        assert 0 < t < 60


@pytest.mark.slow
@pytest.mark.skipif(not (VENV / "build-avx2" / "bin" / "llama-server").is_file(),
                    reason="llama.cpp's AVX2 build not made here (make llamacpp-avx2)")
def test_llamacpp_avx2_build_runs_without_avx512_and_decodes_the_same_tokens(default_llm):
    """The AVX2 build is what an AVX2-only CPU runs: llama.cpp itself reports no AVX-512, and it
    decodes what the native build does."""
    ggufs = llamacpp.make_ggufs(default_llm.path, ["f32"], VENV)
    ids = [default_llm.encode("Write one sentence describing this restaurant: name[The Eagle], food[Japanese].")]
    got = {b: llamacpp.run_llamacpp(llamacpp_paths(VENV, b), ggufs["f32"], ids, [1], 12, 1, torch.get_num_threads())
           for b in ("build", "build-avx2")}
    info = got["build-avx2"]["system_info"]
    assert "AVX2 = 1" in info and "AVX512" not in info.replace("AVX512 = 0", ""), info
    assert got["build-avx2"]["tokens"] == got["build"]["tokens"]


def test_the_report_holds_only_same_activation_dtypes_against_q8_0_and_q4_0_in_its_same_precision_table():
    def row(engine, batch, vs, target=1.0):
        return {"engine": engine, "batch_size": batch, "speedup_target": target, "vs_llamacpp": "x",
                "tokens_per_s_vs_llamacpp": vs}

    rows = [row("skipdecode", 1, 1.17), row("skipdecode-int8", 1, 1.86), row("skipdecode-w8a8", 1, 1.72),
            row("skipdecode-w4a8", 8, 2.46), row("skipdecode-int4", 8, 1.51), row("skipdecode-w8a8", 1, 3.97, 3.0),
            {"engine": "llama.cpp-f32", "batch_size": 1, "speedup_target": 1.0}]
    lines = same_precision_lines(rows)
    assert lines[3] == "| batch | float32 / f32 | w8a8 / q8_0 | w4a8 / q4_0 |"
    assert lines[5:] == ["| 1 | 1.17x | 1.72x |  |", "| 8 |  |  | 2.46x |"]  # int8 / int4 and 3x rows left out
    assert same_precision_lines([row("skipdecode-int4", 1, 1.63)]) == []


def test_a_paired_ratio_is_the_median_of_each_rounds_own_ratio_and_needs_the_same_rounds():
    ours = [2.0, 3.0, 2.2, 2.1]  # a slow second round slows both engines
    peer = [3.0, 4.5, 3.3, 4.2]  # and a spell in the last round slowed the peer alone
    assert round_median(peer, ours) == pytest.approx(1.5)
    assert round_median(peer, ours[:3]) is None  # not timed in the same rounds
    assert round_median([], []) is None

