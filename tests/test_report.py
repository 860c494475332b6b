"""The study report: kept fractions against the right full-depth score."""

import json

from skipdecode.evaluation.report import kept, main


def _eval(scores: dict[float, float]) -> dict:
    return {"data": "d.csv", "split": "validation", "model": "m",
            "settings": {"max_new_tokens": 64, "bertscore_model": "MiniLM-L6"},
            "results": [{"speedup_target": sp, "decode_layer_speedup": sp, "bleu": b, "rougeL": b,
                         "bertscore": None, "n_examples": 2, "new_tokens": 10, "seconds": 1.0,
                         "schedule": {"max_exit_layer": 4, "min_exit_layer": 2, "horizon": 3,
                                      "warmup_layers": 1, "mode": "skip"},
                         "outputs": [{"text": "x"}]} for sp, b in scores.items()]}


def test_kept_divides_by_own_1x_score_by_default():
    rows = kept(_eval({1.0: 50.0, 2.0: 40.0})["results"])
    assert [r["bleu_kept"] for r in rows] == [1.0, 0.8]
    assert "outputs" not in rows[0]


def test_kept_divides_by_reference_1x_score_when_given():
    rows = kept(_eval({2.0: 45.0})["results"], _eval({1.0: 60.0})["results"])
    assert rows[0]["bleu_kept"] == 0.75


def test_report_cli_uses_reference_for_every_row(tmp_path):
    (tmp_path / "ref.json").write_text(json.dumps(_eval({1.0: 60.0, 2.0: 30.0})))
    (tmp_path / "only2x.json").write_text(json.dumps(_eval({1.0: 20.0, 2.0: 54.0})))
    out = tmp_path / "study"
    assert main(["--title", "T", "--eval", f"ref={tmp_path / 'ref.json'}",
                 "--eval", f"2x-only={tmp_path / 'only2x.json'}", "--reference", "ref", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["bleu_kept"] for r in data["results"]["2x-only"]] == [round(20 / 60, 4), 0.9]
    assert data["results"]["2x-only"][1]["bleu_kept_own"] == 2.7
    md = out.with_suffix(".md").read_text()
    assert "| 2x-only | 2x | 2.00 | 54.00 | 90.0% | 54.00 | 90.0% |  |  | 270.0% | 270.0% | 10 |" in md
    assert "BLEU kept (own 1x) | ROUGE-L kept (own 1x) |" in md


def test_kept_fractions_carry_paired_intervals_when_the_reports_hold_their_outputs(tmp_path):
    names = ("Mill", "Eagle", "Vaults", "Punter", "Phoenix", "Cricketers")
    refs = [[f"the {w} serves food by the river"] for w in names]

    def ev(texts_by_speedup: dict[float, list[str]]) -> dict:
        from skipdecode.evaluation import score

        e = _eval({sp: 0.0 for sp in texts_by_speedup})
        for r, texts in zip(e["results"], texts_by_speedup.values()):
            r.update(score(texts, refs, bertscore=False))
            r["outputs"] = [{"prompt": f"p{i}", "text": t, "references": ref}
                            for i, (t, ref) in enumerate(zip(texts, refs))]
        return e

    good = [r[0] for r in refs]
    half = [t if i % 2 else "food" for i, t in enumerate(good)]
    (tmp_path / "ref.json").write_text(json.dumps(ev({1.0: good})))
    (tmp_path / "sd.json").write_text(json.dumps(ev({1.0: good, 2.0: half})))
    out = tmp_path / "study"
    assert main(["--title", "T", "--eval", f"ref={tmp_path / 'ref.json'}", "--eval", f"sd={tmp_path / 'sd.json'}",
                 "--reference", "ref", "--out", str(out)]) == 0
    one, two = json.loads(out.with_suffix(".json").read_text())["results"]["sd"]
    assert one["rougeL_kept_95ci"] == [1.0, 1.0]  # the same outputs as the reference's: exactly 1
    assert "bleu_kept_own_95ci" not in one  # a row is not compared with itself
    lo, hi = two["rougeL_kept_95ci"]
    assert lo < two["rougeL_kept"] < hi < 1.0  # half the outputs lost: below 1 with room either side
    assert two["rougeL_kept_own_95ci"] == two["rougeL_kept_95ci"]  # own 1x and reference answer alike
    md = out.with_suffix(".md").read_text()
    assert f"{100 * two['rougeL_kept']:.1f}% ({100 * lo:.1f}-{100 * hi:.1f})" in md
    # reports without outputs for the same items (older files, other splits) get no interval
    assert "rougeL_kept_95ci" not in kept(_eval({2.0: 40.0})["results"], _eval({1.0: 50.0})["results"])[0]


def test_report_row_names_may_contain_an_equals_sign(tmp_path):
    (tmp_path / "lora.json").write_text(json.dumps(_eval({1.0: 50.0})))
    out = tmp_path / "study"
    assert main(["--title", "T", "--eval", f"LoRA r=16={tmp_path / 'lora.json'}", "--out", str(out)]) == 0
    assert "| LoRA r=16 | 1x |" in out.with_suffix(".md").read_text()


def test_training_summary_comes_from_a_run_or_a_saved_summary(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "skipdecode.json").write_text(json.dumps({"config": {"lora": False, "batch_size": 8, "lr": 2e-4,
                                                                "speedups": [1.0, 2.0]},
                                                     "schedules": {}, "validation_loss": {"1x": 2.0}}))
    (run / "train_log.jsonl").write_text("".join(json.dumps({"loss": 3.0 - i, "seconds": 30.0}) + "\n"
                                                 for i in range(2)))
    (tmp_path / "e.json").write_text(json.dumps(_eval({1.0: 30.0, 2.0: 29.0})))
    out = tmp_path / "study"
    assert main(["--title", "T", "--eval", f"a={tmp_path / 'e.json'}", "--train", f"a={run}",
                 "--out", str(out)]) == 0
    summary = json.loads(out.with_suffix(".json").read_text())["training"]["a"]
    assert summary["steps"] == 2 and summary["seconds"] == 60.0 and summary["final_loss"] == 2.0
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    again = tmp_path / "again"
    assert main(["--title", "T", "--eval", f"a={tmp_path / 'e.json'}", "--train", f"a={tmp_path / 'summary.json'}",
                 "--out", str(again)]) == 0
    assert again.with_suffix(".md").read_text() == out.with_suffix(".md").read_text()
    assert "2 steps of 8 examples, full fine-tuning" in out.with_suffix(".md").read_text()
