"""``skipdecode bench`` writes the result files the README and issues quote:
every row names its engine, batch, target and speeds; skip rows carry the
cost-model prediction; full-depth rows carry the matmul floor."""

from __future__ import annotations

import json

import pytest

from skipdecode import dispatch
from skipdecode.bench import run_bench
from skipdecode.bench.decode import cost_line, round_ratios

from conftest import needs_kernels


@pytest.mark.slow
def test_bench_writes_every_engine_and_dtype_with_speeds_and_the_floor(tmp_path):
    # best of 3 repeats, so the timings are the least disturbed runs
    report = run_bench("default", out_dir=tmp_path, batch_sizes=[2], speedups=[2.0], new_tokens=16, repeats=3,
                       vllm_venv=tmp_path / "no-venv")
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved == json.loads(json.dumps(report))
    rows = {(r["engine"], r["speedup_target"]): r for r in saved["results"]}
    engines = {(e, sp) for e in ("skipdecode", "skipdecode-bf16", "skipdecode-int8") for sp in (1.0, 2.0)}
    engines.add(("transformers", 1.0))
    if saved["settings"]["decode_kernels"].startswith("skipdecode"):  # and the same engine without them
        engines.add(("skipdecode-onednn", 1.0))
    assert set(rows) == engines
    for r in rows.values():
        assert r["batch_size"] == 2 and r["decode_tokens_per_s"] > 0 and r["ms_per_step"] > 0
        assert r["decode_tokens_per_s"] == pytest.approx(2 * 1000 / r["ms_per_step"], rel=0.01)
    full, skip = rows[("skipdecode", 1.0)], rows[("skipdecode", 2.0)]
    assert full["decode_layer_speedup"] == 1.0 and skip["decode_layer_speedup"] > 1.5
    assert 1 < skip["predicted_speedup"] < skip["decode_layer_speedup"]
    # the cost model's line runs through full depth and the engine's k-layer step, both timed here (k: the
    # fewest layers a step reads past 1.5x the last-level cache in), and the one-layer line beside it
    L, k = saved["settings"]["num_layers"], skip["calibration_layers"]
    assert 1 <= k <= L // 2
    per_layer = (full["ms_per_step"] - skip["calibration_ms_per_step"]) / (L - k)
    assert skip["fixed_ms_per_step"] == pytest.approx(skip["calibration_ms_per_step"] - k * per_layer, abs=0.011)
    assert 0 < skip["calibration_ms_per_step"] < full["ms_per_step"]
    per_layer1 = (full["ms_per_step"] - skip["one_layer_ms_per_step"]) / (L - 1)
    assert skip["one_layer_fixed_ms_per_step"] == pytest.approx(skip["one_layer_ms_per_step"] - per_layer1, abs=0.011)
    assert 0 < skip["one_layer_ms_per_step"] < full["ms_per_step"]
    # and the same ratio round by round (3 repeats: 3 paired ratios), their median beside it
    assert len(skip["measured_over_predicted_rounds"]) == 3
    assert skip["measured_over_predicted_round_median"] == sorted(skip["measured_over_predicted_rounds"])[1]
    # every round's step time is there too; each step's best summed is no slower than any whole round
    for r in (full, skip):
        assert len(r["ms_per_step_rounds"]) == 3 and min(r["ms_per_step_rounds"]) >= r["ms_per_step"] - 0.01
    # the floor is timed apart from the step; where matmuls are ~90% of a step (no AMX, batch 2),
    # 16 tokens of noise can put it a few percent above: a floor twice the step would be a wrong floor
    assert 0 < full["matmul_ms_per_step"] < 1.25 * full["ms_per_step"]
    assert saved["machine"]["torch"] and saved["settings"]["new_tokens"] == 16
    assert saved["machine"]["cpu_features"]["cpu"] == saved["machine"]["cpu"]
    llc = dispatch.llc_bytes() // 2 ** 20 or None  # hosts with one CPU name differ: the cache tells them apart
    assert saved["machine"]["llc_mib"] == llc
    for dt in ("bf16", "int8"):  # reduced-precision rows: the cost model and the step against fp32
        r = rows[(f"skipdecode-{dt}", 2.0)]
        assert r["ms_per_step_vs_fp32"] > 0 and 1 < r["predicted_speedup"] < r["decode_layer_speedup"]
    assert "vLLM not run" in saved["settings"]["vllm_note"]  # no peer virtualenv: said, not hidden
    md = (tmp_path / "bench.md").read_text()
    assert "| 2 | transformers | 1x |" in md and "ratio bound" in md
    assert saved["settings"]["decode_kernels"] in md
    assert (f"last-level cache {llc} MiB" in md) == (llc is not None)
    assert set(saved["settings"]["plans"]) == {"float32", "bfloat16", "int8"}  # every dtype's chosen forms
    assert "- int8: wqkv: " in md


def test_a_slow_round_slows_the_lines_steps_and_the_skipping_step_alike_and_leaves_its_ratio():
    """Paired: each round's ratio comes from that round's three decode times, so a round run 1.5x
    slower throughout gives the same ratio, where the best of each step over the rounds mixes rounds."""
    L, k, mean_layers = 30, 12, 6.05
    full, short = 8.0, 3.8
    _, predicted = cost_line(full, L, short, k, mean_layers)
    skip = full / (0.9 * predicted)  # a skipping step that keeps 0.9 of the line's speedup
    slow = [1.0, 1.5, 0.8, 1.2]
    got = round_ratios([full * f for f in slow], [short * f for f in slow], [skip * f for f in slow], L, k, mean_layers)
    assert got == pytest.approx([0.9] * 4)
    # a slow spell that hits the skipping step alone shows in that round only
    got = round_ratios([full] * 3, [short] * 3, [skip, 1.25 * skip, skip], L, k, mean_layers)
    assert got == pytest.approx([0.9, 0.72, 0.9])


@needs_kernels
def test_the_matmul_floor_takes_the_head_as_a_greedy_step_runs_it():
    """Greedy steps of an fp32 head pick from its copy (a quarter of its bytes) and the exact logits
    the copy leaves in doubt, so the floor under such a step times that pick, not the full product:
    the same tokens as the head's argmax."""
    import torch

    from skipdecode import LLM
    from skipdecode.bench.decode import greedy_head_call

    net = LLM.load("default").model
    call = greedy_head_call(net, 2)
    assert call is not net.lm_head
    x = torch.randn(2, 1, net.lm_head.in_features, generator=torch.Generator().manual_seed(0))
    assert call(x).tolist() == net.lm_head(x).argmax(-1).flatten().tolist()


@pytest.mark.slow
def test_lookup_bench_compares_prompt_lookup_on_both_tasks_and_every_output_is_full_depths(tmp_path):
    from skipdecode.bench.lookup import TASKS, run_lookup_bench

    report = run_lookup_bench("default-e2e", out_dir=tmp_path, dtypes=("int8",), quick=True)
    assert json.loads((tmp_path / "lossless-lookup.json").read_text()) == json.loads(json.dumps(report))
    d = report["dtypes"]["int8"]
    assert d["chosen_ngram"] == 2 and set(d["tasks"]) == set(TASKS)
    for rows in d["tasks"].values():
        assert set(rows) == {"1x", "lossless", "lossless, lookup 2"}
        for name, parts in rows.items():
            for part in ("report", "tuning"):
                r = parts[part]
                assert r["decode_tokens_per_s"] > 0
                if name != "1x":
                    assert r["identical_to_full_depth"] == 3, (name, part)
        assert rows["lossless"]["report"]["lookup_drafted"] == 0
    # SciTLDR's summaries copy their abstracts: lookups are drafted and accepted there
    sci = d["tasks"]["scitldr"]["lossless, lookup 2"]["report"]
    assert 0 < sci["lookup_accepted"] <= sci["lookup_drafted"]
    md = (tmp_path / "lossless-lookup.md").read_text()
    assert "skipdecode bench --lossless-lookup" in md and "lookup 2" in md
