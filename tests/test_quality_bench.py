"""``skipdecode bench --quality``: each method's BLEU comes from its evaluation report, its speed
is measured in the same run against the full-depth reference (each distinct schedule once, on the
base model's shapes), and a pruned model's layer reduction counts against the reference's depth."""

from __future__ import annotations

import json

import pytest

from _train_helpers import one_thread
from skipdecode.bench.quality import REFERENCE, Row, run_quality_bench
from skipdecode.schedule import SkipSchedule


def _report(path, results):
    path.write_text(json.dumps({"data": "devset.csv", "split": "validation-names", "results": results}))
    return str(path)


def _res(target, bleu, sched, prompts):
    return {"speedup_target": target, "decode_layer_speedup": sched.decode_layer_speedup(8), "bleu": bleu,
            "rougeL": 1.0, "bertscore": 1.0, "schedule": sched.to_dict(),
            "outputs": [{"prompt": p, "text": f"{p} {bleu}", "references": [p, f"{p} nearby"]} for p in prompts]}


def test_quality_rows_are_measured_in_one_run_against_the_reference(tmp_path, tiny_cli_dir):
    prompts = ["a cheap pub", "an Italian restaurant by the river", "a coffee shop"]
    full = SkipSchedule.full_depth(6)
    skip3 = SkipSchedule.for_speedup(3, 8, 6)
    ref = _report(tmp_path / "ref.json", [_res(1.0, 50.0, full, prompts)])
    sd = _report(tmp_path / "sd.json", [_res(1.0, 48.0, full, prompts), _res(3.0, 36.0, skip3, prompts)])
    drop = _report(tmp_path / "drop.json", [_res(1.0, 30.0, SkipSchedule.full_depth(2), prompts)])
    # the trained models need not be on this machine: only their reports and the base model
    rows = [Row(REFERENCE, {1.0: ref}, {1.0: "runs/ref"}),
            Row("SkipDecode", {1.0: sd, 3.0: sd}, {1.0: "runs/sd", 3.0: "runs/sd"}),
            Row("static", {3.0: drop}, {3.0: "runs/drop-3x"}, static=True),
            Row("missing", {2.0: str(tmp_path / "none.json")}, {2.0: "runs/none"})]
    with one_thread():
        rep = run_quality_bench(tmp_path / "out", new_tokens=4, batch=2, repeats=1, rows=rows,
                                base=str(tiny_cli_dir))
    got = {(r["method"], r["speedup_target"]): r for r in rep["results"]}
    assert set(got) == {(REFERENCE, 1.0), ("SkipDecode", 1.0), ("SkipDecode", 3.0), ("static", 3.0)}
    assert got[(REFERENCE, 1.0)]["wall_clock_speedup"] == 1.0
    # one schedule, one timing: the same full-depth schedule is not timed twice
    assert got[("SkipDecode", 1.0)]["seconds"] == got[(REFERENCE, 1.0)]["seconds"]
    assert rep["settings"]["distinct_schedules_timed"] == 3
    assert got[("SkipDecode", 3.0)]["model"] == "runs/sd"
    sd3 = got[("SkipDecode", 3.0)]
    assert sd3["bleu"] == 36.0 and sd3["bleu_kept_own"] == pytest.approx(36 / 48, abs=1e-4)
    assert sd3["bleu_kept_vs_reference"] == pytest.approx(36 / 50, abs=1e-4)
    # kept figures carry paired-bootstrap intervals; a row against itself is exactly [1, 1]
    lo, hi = sd3["bleu_kept_own_95ci"]
    assert lo <= hi and "bleu_kept_vs_reference_95ci" in sd3
    assert got[("SkipDecode", 1.0)]["bleu_kept_own_95ci"] == [1.0, 1.0]
    assert sd3["wall_clock_speedup"] == pytest.approx(rep["reference"]["seconds"] / sd3["seconds"], rel=0.05)
    st = got[("static", 3.0)]
    assert st["num_layers"] == 2 and st["decode_layer_speedup"] == pytest.approx(3.0)  # 6 / 2 layers
    assert st["bleu"] == 30.0 and "bleu_kept_own" not in st  # no 1x of its own
    assert st["timed_on"] == f"{tiny_cli_dir} with 2 of its 6 layers"
    md = (tmp_path / "out" / "quality-names.md").read_text()
    assert "| SkipDecode | 3x |" in md and "| static | 3x |" in md
    assert f"CPU: {rep['machine'].get('cpu')}, " in md and "{" not in md.split("| method |")[0]
    assert (tmp_path / "out" / "quality-names.png").stat().st_size > 1000
    assert json.loads((tmp_path / "out" / "quality-names.json").read_text()) == json.loads(json.dumps(rep))
    # the by-MR training split mentions the held-out names: said in the report
    assert rep["held_out_names"] and rep["by_mr_training_examples_with_held_out_names"] > 0
    assert f"{rep['by_mr_training_examples_with_held_out_names']} examples that mention a held-out name" in md


def test_paired_bootstrap_brackets_the_kept_ratio_and_is_exact_for_identical_systems():
    from sacrebleu import corpus_bleu

    from skipdecode.evaluation import paired_bleu_bootstrap

    refs = [[f"the {w} is a pub near the river", f"a pub called the {w} by the river"]
            for w in ("Punter", "Eagle", "Mill", "Phoenix", "Wrestlers", "Vaults", "Rice Boat", "Olive Grove")]
    good = [r[0] for r in refs]
    worse = [r[0].replace("near the river", "in town") if i % 2 else r[0] for i, r in enumerate(refs)]
    same = paired_bleu_bootstrap(good, good, refs)
    assert same == {"ratio": [1.0, 1.0], "difference": [0.0, 0.0]}  # the same output on every resample
    got = paired_bleu_bootstrap(worse, good, refs, resamples=500)
    streams = [[r[k] for r in refs] for k in range(2)]
    point = corpus_bleu(worse, streams).score / corpus_bleu(good, streams).score
    lo, hi = got["ratio"]
    assert lo < point < hi <= 1.0 and lo < 0.95  # half the items are worse: clearly below 1, not a point
    assert got["difference"][0] < got["difference"][1] <= 0
    assert paired_bleu_bootstrap(worse, good, refs, resamples=500) == got  # seeded: reproducible
    with pytest.raises(ValueError, match="same items"):
        paired_bleu_bootstrap(worse[:3], good, refs)


def test_rouge_bootstrap_brackets_the_kept_mean_rouge_l_and_is_exact_for_identical_systems():
    from skipdecode.evaluation import paired_rouge_bootstrap, score

    refs = [[f"we propose {w} for sparse attention in long documents", f"{w}: faster sparse attention"]
            for w in ("Alpha", "Beta", "Gamma", "Delta", "Epsilon", "Zeta", "Eta", "Theta", "Iota", "Kappa")]
    good = [r[0] for r in refs]
    worse = [f"we study {r[0].split()[2]}" if i % 2 else r[0] for i, r in enumerate(refs)]
    assert paired_rouge_bootstrap(good, good, refs) == {"ratio": [1.0, 1.0], "difference": [0.0, 0.0]}
    got = paired_rouge_bootstrap(worse, good, refs, resamples=500)
    point = score(worse, refs, bertscore=False)["rougeL"] / score(good, refs, bertscore=False)["rougeL"]
    lo, hi = got["ratio"]
    assert lo < point < hi <= 1.0 and lo < 0.9  # half the summaries lose most of their words
    assert got["difference"][0] < got["difference"][1] <= 0
    assert paired_rouge_bootstrap(worse, good, refs, resamples=500) == got
    with pytest.raises(ValueError, match="same items"):
        paired_rouge_bootstrap(worse, good[:4], refs)


def test_runs_against_a_reference_give_bleu_differences_and_agreement_per_speedup():
    from skipdecode.bench.dtype_parity import against_reference

    def report(bleus, outs):
        return {"results": [{"speedup_target": sp, "bleu": b, "outputs": [{"token_ids": t} for t in o]}
                            for sp, b, o in zip((1.0, 3.0), bleus, outs)]}

    ref = report((70.0, 75.0), ([[1, 2, 3]], [[4, 5]]))
    rows = against_reference({"ref": ref, "int4": report((71.5, 72.25), ([[1, 2, 9]], [[4, 5]]))}, ref)
    assert rows["ref"]["3x"] == {"bleu": 75.0, "bleu_minus_fp32": 0.0, "token_agreement": 1.0, "identical_outputs": 1.0}
    assert rows["int4"]["1x"] == {"bleu": 71.5, "bleu_minus_fp32": 1.5, "token_agreement": round(2 / 3, 4),
                                  "identical_outputs": 0.0}
    assert rows["int4"]["3x"]["bleu_minus_fp32"] == -2.75


def test_token_agreement_counts_the_reference_tokens_reproduced_before_the_first_difference():
    from skipdecode.bench.dtype_parity import agreement

    assert agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == {"token_agreement": 0.5, "identical_outputs": 0.0}
    assert agreement([[1, 2], [3]], [[1, 2], [3, 4]]) == {"token_agreement": 1.0, "identical_outputs": 0.5}
    assert agreement([[5, 6, 7]], [[5]]) == {"token_agreement": round(1 / 3, 4), "identical_outputs": 0.0}


def test_names_copied_counts_outputs_that_spell_the_mrs_restaurant_name_exactly():
    from skipdecode.evaluation.metrics import names_copied

    outs = [{"prompt": "Describe: name[The Punter], food[Chinese].", "text": "The Punter serves Chinese food."},
            {"prompt": "Describe: name[The Punter], area[riverside].", "text": "The Puni is by the river."},
            {"prompt": "Describe: name[Blue Spice].", "text": "Near the river is Blue Spice."}]
    assert names_copied({"outputs": outs}) == pytest.approx(2 / 3)
    assert names_copied({"outputs": [{"prompt": "a summary", "text": "x"}]}) is None  # not E2E: no name


@pytest.mark.slow
def test_evaluate_reports_each_speedups_share_of_its_own_1x_with_a_paired_interval(tmp_path, default_llm):
    from pathlib import Path

    from skipdecode.evaluation import evaluate

    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "e2e" / "devset.csv"
    rep = evaluate("e2e", data, speedups=(1, 2), limit=6, max_new_tokens=16, bertscore=False, llm=default_llm,
                   out=tmp_path / "r.json", split="validation-names")
    full, half = rep["results"]
    assert "bleu_kept_own" not in full  # 1x is what the others are kept of
    assert half["bleu_kept_own"] == pytest.approx(half["bleu"] / full["bleu"], abs=1e-4)
    lo, hi = half["bleu_kept_own_95ci"]
    assert 0 <= lo <= hi
    assert half["rougeL_kept_own"] == pytest.approx(half["rougeL"] / full["rougeL"], abs=1e-4)
    lo, hi = half["rougeL_kept_own_95ci"]
    assert 0 <= lo <= hi
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(rep))


def test_the_heldout_table_scores_report_and_select_and_times_each_row_in_one_run(tmp_path, tiny_cli_dir):
    from skipdecode.bench.heldout import REFERENCE as REF, HeldoutRow, run_heldout_quality

    prompts = ["a cheap pub", "an Italian restaurant by the river", "a coffee shop"]
    full, skip3 = SkipSchedule.full_depth(6), SkipSchedule.for_speedup(3, 8, 6)
    res = tmp_path / "results"
    res.mkdir()
    for split, bonus in (("select", 5.0), ("report", 0.0)):
        (res / f"eval-{split}-ref.json").write_text(json.dumps({"results": [_res(1.0, 50.0 + bonus, full, prompts)]}))
        (res / f"eval-{split}-sd.json").write_text(json.dumps({"results": [
            {**_res(1.0, 48.0 + bonus, full, prompts), "names_copied": 1.0, "bleu_many_attributes": 40.0},
            {**_res(3.0, 36.0 + bonus, skip3, prompts), "names_copied": 0.5, "bleu_many_attributes": 30.0}]}))
    rows = [HeldoutRow(REF, "ref", "runs/ref", base=str(tiny_cli_dir), targets=(1.0,)),
            HeldoutRow("SkipDecode", "sd", "runs/sd", base=str(tiny_cli_dir), targets=(1.0, 3.0)),
            HeldoutRow("never run", "none", "runs/none", base=str(tiny_cli_dir), targets=(2.0,)),
            # scored, but its budgets follow a model that is not on this machine: listed, never timed
            HeldoutRow("adaptive", "sd", str(tmp_path / "runs" / "gone"), base=str(tiny_cli_dir), targets=(3.0,),
                       adaptive=True, own="SkipDecode")]
    with one_thread():
        rep = run_heldout_quality(tmp_path / "out", res, new_tokens=4, batch=2, repeats=1, rows=rows)
    got = {(r["method"], r["speedup_target"]): r for r in rep["results"]}
    assert set(got) == {(REF, 1.0), ("SkipDecode", 1.0), ("SkipDecode", 3.0)}
    assert rep["not_yet_measured"] == ["never run 2x"]
    assert rep["not_timed"] == [f"adaptive 3x ({tmp_path / 'runs' / 'gone'} not present)"]
    sd3 = got[("SkipDecode", 3.0)]
    assert sd3["report"]["bleu"] == 36.0 and sd3["select"]["bleu"] == 41.0  # each split from its own report
    assert sd3["report"]["bleu_kept_own"] == pytest.approx(36 / 48, abs=1e-4)
    assert sd3["select"]["bleu_kept_own"] == pytest.approx(41 / 53, abs=1e-4)
    assert sd3["report"]["bleu_vs_reference"] == pytest.approx(36 / 50, abs=1e-4)
    assert sd3["report"]["names_kept_own"] == 0.5 and sd3["report"]["bleu_many_attributes"] == 30.0
    lo, hi = sd3["report"]["bleu_kept_own_95ci"]
    assert lo <= hi
    # full depth of the base is the speed reference: a 1x row runs at about 1.0x
    assert got[("SkipDecode", 1.0)]["wall_clock_speedup"] == pytest.approx(1.0, abs=1e-9)
    md = (tmp_path / "out" / "quality.md").read_text()
    assert "| SkipDecode | 3x |" in md and "never run 2x" in md and "50%" in md and "Scored but not timed" in md
    for png in ("quality.png", "quality-appendix.png"):
        assert (tmp_path / "out" / png).stat().st_size > 1000


def test_timing_runs_every_schedule_once_per_round_in_turn_and_keeps_each_ones_fastest():
    from skipdecode.bench.quality import best_of_interleaved

    calls: list[str] = []
    # a slow spell during round 1 (calls 3-4) must not decide either run's figure
    spell = {3: 9.0, 4: 9.0}
    base = {"2x": 2.0, "3x": 1.5}

    def run(name: str):
        def once() -> float:
            calls.append(name)
            return base[name] + spell.get(len(calls), 0.0) + 0.1 * len(calls)
        return once

    best = best_of_interleaved({"2x": run("2x"), "3x": run("3x")}, rounds=3)
    assert calls == ["2x", "3x"] + ["2x", "3x"] * 3  # one warm-up each, then interleaved rounds
    assert best == {"2x": pytest.approx(2.0 + 0.1 * 5), "3x": pytest.approx(1.5 + 0.1 * 6)}


def test_the_seed_spread_gives_each_seeds_bleu_kept_and_names_with_mean_and_range(tmp_path):
    from skipdecode.bench.heldout import SEED_REFERENCE as REF, render_markdown, seed_spread

    def write(stem: str, split: str, scores: dict[float, float]) -> None:
        (tmp_path / f"eval-{split}-{stem}.json").write_text(json.dumps({"results": [
            {"speedup_target": t, "bleu": b, "names_copied": 0.5} for t, b in scores.items()]}))

    write("ref-a", "report", {1.0: 60.0})
    write("ref-b", "report", {1.0: 64.0})
    write("rec-a", "report", {1.0: 50.0, 3.0: 45.0})
    write("rec-b", "report", {1.0: 60.0, 3.0: 57.0})
    write("rec-c", "select", {1.0: 70.0})  # a seed scored on one split only counts on that split
    groups = {REF: ("ref-a", "ref-b", "ref-missing"), "recipe": ("rec-a", "rec-b", "rec-c")}
    spread = seed_spread(tmp_path, groups, {"recipe": REF})
    got = {(g["recipe"], g["split"], g["speedup_target"]): g for g in spread}
    assert set(got) == {(REF, "report", 1.0), ("recipe", "report", 1.0), ("recipe", "report", 3.0),
                        ("recipe", "select", 1.0)}
    three = got["recipe", "report", 3.0]
    assert three["seeds"] == ["rec-a", "rec-b"] and three["bleu"] == [45.0, 57.0]
    assert three["bleu_stats"] == {"mean": 51.0, "min": 45.0, "max": 57.0}
    assert three["kept_own"] == [0.9, 0.95] and three["kept_own_stats"]["mean"] == pytest.approx(0.925)
    assert got[REF, "report", 1.0]["bleu_stats"]["mean"] == 62.0
    md = render_markdown({"machine": {"cpu": "x"}, "settings": {"batch": 1, "new_tokens": 1, "repeats": 1,
                                                                 "threads": 1, "torch": "t"},
                          "splits": {"select": "s", "report": "r"}, "title": "t", "results": [],
                          "not_yet_measured": [], "commands": [], "seed_spread": spread})
    assert "| recipe | report | 3x | rec-a / rec-b | 45.00 / 57.00 | 51.00 (45.00-57.00) | 90.0% / 95.0% | 92.5% |" in md
    assert "report, 1x: recipe 55.00 mean BLEU against the full-depth-only reference's 62.00 (difference -7.00" in md
