"""`skipdecode compare`: two evaluate reports on the same items, the gap with a paired interval."""

import json

import pytest

from skipdecode.cli import main
from skipdecode.evaluation import compare, score

NAMES = ("Mill", "Eagle", "Vaults", "Punter", "Phoenix", "Cricketers", "Rice Boat", "Olive Grove")
REFS = [[f"the {w} is a pub by the river", f"by the river is the {w}, a pub"] for w in NAMES]


def _report(texts_by_speedup: dict[float, list[str]], prompts: list[str] | None = None) -> dict:
    prompts = prompts or [f"name[The {w}], eatType[pub], area[riverside]" for w in NAMES]
    return {"model": "m", "data": "devset.csv", "split": "validation-names",
            "results": [{"speedup_target": sp, **score(texts, REFS, bertscore=False),
                         "outputs": [{"prompt": p, "text": t, "references": r}
                                     for p, t, r in zip(prompts, texts, REFS)]}
                        for sp, texts in texts_by_speedup.items()]}


GOOD = [r[0] for r in REFS]
WORSE = [t if i % 2 else "a pub" for i, t in enumerate(GOOD)]


def test_a_report_against_itself_differs_by_exactly_nothing():
    rep = _report({1.0: GOOD, 2.0: WORSE})
    res = compare(rep, rep)
    for row in res["results"]:
        for m in ("bleu", "rougeL"):
            assert row[m]["difference"] == 0 and row[m]["difference_95ci"] == [0.0, 0.0]
            assert row[m]["ratio_95ci"] == [1.0, 1.0]


def test_a_clearly_worse_checkpoint_gets_an_interval_below_zero_at_the_shared_speedups_only():
    new, old = _report({2.0: WORSE, 3.0: WORSE}), _report({1.0: GOOD, 2.0: GOOD})
    res = compare(new, old, resamples=500)
    assert [r["speedup_target"] for r in res["results"]] == [2.0]  # 3x and 1x are not in both
    b = res["results"][0]["bleu"]
    assert b["difference"] == pytest.approx(b["new"] - b["old"], abs=1e-3) and b["difference"] < 0
    lo, hi = b["difference_95ci"]
    assert lo <= b["difference"] <= hi < 0  # half the items lost: a measured loss, not noise
    assert res["n_examples"] == len(NAMES)


def test_cli_prints_each_gap_with_its_interval_and_writes_json(tmp_path, capsys):
    (tmp_path / "new.json").write_text(json.dumps(_report({1.0: WORSE})))
    (tmp_path / "old.json").write_text(json.dumps(_report({1.0: GOOD})))
    assert main(["compare", str(tmp_path / "new.json"), str(tmp_path / "old.json"), "--out",
                 str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "c.json").read_text())
    b = saved["results"][0]["bleu"]
    assert out.startswith(f"1x  BLEU {b['new']:.2f} vs {b['old']:.2f}: {b['difference']:+.2f} (")
    assert "paired bootstrap" in out


@pytest.mark.parametrize("new, message", [
    ("not json", "is not JSON"),
    (json.dumps({"results": [{"speedup_target": 1.0, "bleu": 1.0}]}), "with outputs"),
    (json.dumps(_report({1.0: GOOD}, prompts=[f"p{i}" for i in range(len(NAMES))])), "different items"),
    (json.dumps(_report({5.0: GOOD})), "share no speedup"),
])
def test_cli_refuses_reports_that_cannot_be_paired_with_a_one_line_error(tmp_path, capsys, new, message):
    (tmp_path / "new.json").write_text(new)
    (tmp_path / "old.json").write_text(json.dumps(_report({1.0: GOOD})))
    assert main(["compare", str(tmp_path / "new.json"), str(tmp_path / "old.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("skipdecode: error: ") and message in err and "Traceback" not in err
