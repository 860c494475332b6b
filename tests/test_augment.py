"""Name augmentation renames names consistently in prompt and reference, draws as a pure function
of (seed, epoch, example), and changes what a training run sees only when asked."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _train_helpers import make_tiny, one_thread, write_e2e_csv, write_jsonl  # noqa: E402
from skipdecode.data import Example, e2e_prompt  # noqa: E402
from skipdecode.training import TrainConfig, TrainError, train  # noqa: E402
from skipdecode.training.augment import NameAugmenter, augment_example, name_words, synthetic_name  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", layers=8)


def _ex(mr: str, ref: str) -> Example:
    return Example(e2e_prompt(mr), ref, mr)


def test_names_are_renamed_alike_in_prompt_and_reference_and_nothing_else_changes():
    ex = _ex("name[The Mill], food[Thai], near[The Mill Pub]", "The Mill serves Thai food near The Mill Pub.")
    out = augment_example(ex, random.Random(3), ["Garden", "River"])
    name = out.prompt.split("name[")[1].split("]")[0]
    near = out.prompt.split("near[")[1].split("]")[0]
    assert name != "The Mill" and near != "The Mill Pub"  # a name inside the other is not half-replaced
    assert out.target == f"{name} serves Thai food near {near}."
    assert out.prompt == e2e_prompt(f"name[{name}], food[Thai], near[{near}]")
    assert out.group == ex.group  # the unit of the split is the original MR


def test_a_reference_that_paraphrases_the_name_is_left_alone():
    ex = _ex("name[The Eagle], food[Thai]", "Eagle serves Thai food.")
    assert augment_example(ex, random.Random(0), []) is None
    only_near = _ex("name[The Eagle], near[Burger King]", "Eagle is near Burger King.")
    out = augment_example(only_near, random.Random(0), [])
    assert "name[The Eagle]" in out.prompt and "Burger King" not in out.prompt + out.target


def test_synthetic_names_mix_vocabulary_words_and_invented_ones(tiny):
    from skipdecode.tokenization import load_tokenizer

    words = name_words(load_tokenizer(tiny))  # whole words of the vocabulary, capitalized
    assert "Food" in words and all(w[0].isupper() and w[1:].islower() and w.isalpha() for w in words)
    vocab = ["Garden", "River", "Lantern", "Copper", "Willow", "Harbour"]
    names = [synthetic_name(random.Random(i), vocab) for i in range(200)]
    assert len(set(names)) > 150  # six words and "The" repeat; invented words rarely do
    parts = {p for n in names for p in n.removeprefix("The ").split()}
    assert parts & set(vocab) and parts - set(vocab)  # both kinds occur


def test_the_augmented_item_is_a_pure_function_of_seed_epoch_and_example(tiny):
    from skipdecode.tokenization import load_tokenizer

    tok = load_tokenizer(tiny)
    rows = [_ex(f"name[Place {i}], food[Thai]", f"Place {i} serves Thai food.") for i in range(8)]
    items = [(tok.encode(r.prompt), tok.encode(r.target)) for r in rows]
    aug = NameAugmenter(rows, items, 0.5, seed=0, tokenizer=tok, chat=False, max_length=512)
    again = NameAugmenter(rows, items, 0.5, seed=0, tokenizer=tok, chat=False, max_length=512)
    firsts = [aug.batch(range(8), 8 * e) for e in range(4)]
    assert firsts == [again.batch(range(8), 8 * e) for e in range(4)]
    renamed = [sum(b[i] != items[i] for i in range(8)) for b in firsts]
    assert 0 < sum(renamed) < 32 and len({tuple(map(str, b)) for b in firsts}) > 1  # p = 0.5, fresh each epoch
    assert NameAugmenter(rows, items, 0.0, 0, tok, False, 512).batch(range(8), 0) == items
    other_seed = NameAugmenter(rows, items, 0.5, 1, tok, False, 512).batch(range(8), 0)
    assert other_seed != firsts[0]


def _cfg(model: Path, data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(model=str(model), data=str(data), output_dir=str(out), steps=3, batch_size=4, lr=3e-3,
                speedups=[1.0, 3.0], val_groups=1, save_every=0, eval_examples=0, progress=False, seed=0)
    return TrainConfig(**{**base, **kw})


def test_a_run_with_name_augmentation_trains_on_other_tokens_and_records_the_setting(tmp_path, tiny):
    data = write_e2e_csv(tmp_path / "e2e.csv")
    logs = {}
    for name, p in (("plain", 0.0), ("aug", 1.0), ("aug-again", 1.0)):
        train(_cfg(tiny, data, tmp_path / name, augment_names=p))
        logs[name] = [json.loads(line) for line in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logs["aug"]] == [r["loss"] for r in logs["aug-again"]]
    assert [r["tokens"] for r in logs["aug"]] != [r["tokens"] for r in logs["plain"]]
    rec = json.loads((tmp_path / "aug" / "skipdecode.json").read_text())
    assert rec["config"]["augment_names"] == 1.0


def test_name_augmentation_on_data_without_names_and_out_of_range_are_refused(tmp_path, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"Say {i}.", "target": f"{i} said."} for i in range(8)])
    with pytest.raises(TrainError, match=r"has none \(leave it at 0\)"):
        train(_cfg(tiny, data, tmp_path / "x", augment_names=0.5))
    with pytest.raises(TrainError, match="augment_names"):
        train(_cfg(tiny, data, tmp_path / "y", augment_names=1.5))
