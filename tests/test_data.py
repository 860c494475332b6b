"""Data loaders: splits by group, multi-reference items, clear errors, prompt/target encoding."""

from __future__ import annotations

import csv
import os
from collections import defaultdict
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _train_helpers import E2E_ROWS, smollm2_tokenizer_dir, write_e2e_csv, write_jsonl  # noqa: E402
from skipdecode.data import (DataError, data_root, e2e_prompt, encode_example, encode_prompt,  # noqa: E402
                             load_e2e, load_jsonl, load_scitldr, load_task, parse_mr, split_by_group)

E2E = data_root() / "e2e" / "devset.csv"
SCITLDR = data_root() / "scitldr"
needs_shared = pytest.mark.skipif(not E2E.is_file(), reason="shared data not present")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


def test_parse_mr_and_prompt():
    mr = "name[The Eagle], eatType[coffee shop], customer rating[5 out of 5], priceRange[£20-25]"
    assert parse_mr(mr) == [("name", "The Eagle"), ("eatType", "coffee shop"),
                            ("customer rating", "5 out of 5"), ("priceRange", "£20-25")]
    assert e2e_prompt(mr) == ("Write one sentence describing this restaurant: name[The Eagle], "
                              "eatType[coffee shop], customer rating[5 out of 5], priceRange[£20-25].")
    with pytest.raises(ValueError):
        parse_mr("name The Eagle")


@needs_shared
def test_e2e_real_split_by_mr_keeps_all_references():
    with E2E.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    refs_per_mr = defaultdict(list)
    for r in rows:
        refs_per_mr[e2e_prompt(r["mr"])].append(r["ref"].strip())
    d = load_e2e(E2E, val_groups=60, seed=0)
    assert len(d.train) + len(d.validation) == len(rows) == 4672
    train_groups = {e.group for e in d.train}
    val_groups = {e.group for e in d.validation}
    assert len(val_groups) == 60 and not (train_groups & val_groups)
    assert len(train_groups) + len(val_groups) == 547
    items = d.eval_items()
    assert len(items) == 60
    for it in items:  # every reference of a held-out MR is there for scoring
        assert sorted(it.references) == sorted(refs_per_mr[it.prompt])
    # deterministic for a seed, different for another
    again = load_e2e(E2E, val_groups=60, seed=0)
    assert [e.group for e in again.validation] == [e.group for e in d.validation]
    other = load_e2e(E2E, val_groups=60, seed=1)
    assert {e.group for e in other.validation} != val_groups
    assert load_task("e2e").validation == d.validation  # the CLI name is the same split


@needs_shared
def test_scitldr_real():
    d = load_scitldr(SCITLDR)
    assert len(d.eval_items("validation")) == 619
    assert len(d.validation) > 619  # dev papers have several TL;DRs: one training example each
    assert not ({e.group for e in d.train} & {e.group for e in d.validation})
    it = d.eval_items()[0]
    assert len(it.references) >= 1 and it.prompt.startswith("Write a one-sentence TL;DR")
    assert len(d.eval_items("train")) == 1992


def test_split_by_group_never_splits_a_group(tmp_path):
    d = load_e2e(write_e2e_csv(tmp_path / "e2e.csv"), val_groups=2)
    assert len({e.group for e in d.validation}) == 2
    assert len(d.validation) == 4  # two references each
    assert not ({e.group for e in d.train} & {e.group for e in d.validation})
    train, val = split_by_group(d.train, 0.5, seed=3)
    assert len({e.group for e in val}) == 2 and len(train) == 4
    with pytest.raises(DataError, match="cannot hold out"):
        split_by_group(d.train, 4)


def test_e2e_errors_name_file_and_line(tmp_path):
    bad_header = tmp_path / "h.csv"
    bad_header.write_text("meaning,text\n\"name[A]\",\"A.\"\n")
    with pytest.raises(DataError, match=rf"{bad_header}:1: header"):
        load_e2e(bad_header)
    empty_ref = tmp_path / "e.csv"
    empty_ref.write_text('mr,ref\n"name[A]","A is nice."\n"name[B]",""\n')
    with pytest.raises(DataError, match=rf"{empty_ref}:3: empty 'ref'"):
        load_e2e(empty_ref)
    bad_mr = tmp_path / "m.csv"
    bad_mr.write_text('mr,ref\n"name[A]","A."\n"name[A]","A!"\n"nonsense","B."\n')
    with pytest.raises(DataError, match=rf"{bad_mr}:4: cannot parse"):
        load_e2e(bad_mr)
    bad_quote = tmp_path / "q.csv"
    bad_quote.write_text('mr,ref\n"name[A]","A."\n"name[B]"x,"B."\n')
    with pytest.raises(DataError, match=rf"{bad_quote}:3: malformed CSV"):
        load_e2e(bad_quote)
    fields = tmp_path / "f.csv"
    fields.write_text('mr,ref\n"name[A]","A.","extra"\n')
    with pytest.raises(DataError, match=rf"{fields}:2: expected 2 fields"):
        load_e2e(fields)
    with pytest.raises(DataError, match="does not exist"):
        load_e2e(tmp_path / "missing.csv")


def test_jsonl_loader_and_errors(tmp_path):
    good = write_jsonl(tmp_path / "g.jsonl", [{"prompt": "p1", "target": "t1"}, "",
                                              {"prompt": "p2", "target": ["t2a", "t2b"]},
                                              {"prompt": "p1", "target": "t1b"}])
    d = load_jsonl(good)
    assert [(e.prompt, e.target) for e in d.train] == [("p1", "t1"), ("p2", "t2a"), ("p2", "t2b"), ("p1", "t1b")]
    assert {it.prompt: it.references for it in d.eval_items("train")} == {"p1": ("t1", "t1b"), "p2": ("t2a", "t2b")}
    cases = {
        '{"prompt": "a", "target": "b"}\n{"prompt": "a", "target": \n': r":2: not valid JSON",
        '{"prompt": "a", "target": "b"}\n\n{"target": "b"}\n': r":3: missing field 'prompt'",
        '{"prompt": "a", "target": "  "}\n': r":1: field 'target' is empty",
        '{"prompt": "a", "target": 3}\n': r":1: field 'target' must be a string",
        '["prompt", "target"]\n': r":1: expected a JSON object",
        '{"prompt": "a", "target": ["x", ""]}\n': r":1: field 'target' holds an empty string",
    }
    for i, (text, msg) in enumerate(cases.items()):
        p = tmp_path / f"bad{i}.jsonl"
        p.write_text(text)
        with pytest.raises(DataError, match=str(p) + msg):
            load_jsonl(p)


def test_scitldr_errors(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"source": ["S."], "target": ["T."], "paper_id": "a"}\n'
                                          '{"source": ["S."], "target": [], "paper_id": "b"}\n')
    (tmp_path / "dev.jsonl").write_text('{"source": ["S."], "target": ["T."], "paper_id": "c"}\n')
    with pytest.raises(DataError, match=r"train.jsonl:2: field 'target'"):
        load_scitldr(tmp_path)


def test_chat_encoding_matches_generation_and_ends_with_eos(tokenizer):
    from skipdecode.llm import LLM

    prompt, target = E2E_ROWS[0][0], E2E_ROWS[0][1][0]
    p_ids, t_ids = encode_example(tokenizer, prompt, target)
    llm = LLM(None, tokenizer, Path("."), [tokenizer.eos_token_id])
    assert p_ids == llm.encode(prompt)  # the prompt the model sees at generation
    text = tokenizer.decode(p_ids)
    assert text.count("<|im_start|>user\n" + prompt + "<|im_end|>") == 1
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.convert_ids_to_tokens(t_ids[-1]) == "<|im_end|>" == tokenizer.eos_token
    assert tokenizer.decode(t_ids[:-1]) == target
    assert encode_prompt(tokenizer, prompt) == p_ids


def test_plain_encoding_continues_the_prompt(tokenizer):
    p_ids, t_ids = encode_example(tokenizer, "The capital of France is", "Paris.", chat=False)
    assert p_ids == tokenizer("The capital of France is")["input_ids"]
    assert tokenizer.decode(p_ids + t_ids[:-1]) == "The capital of France is Paris."
    assert t_ids[-1] == tokenizer.eos_token_id


def test_e2e_names_split_holds_out_whole_restaurant_names():
    """Validation MRs are those of held-out restaurant names; no training
    example mentions any of those names; at least 60 MRs are held out."""
    from skipdecode.data import load_task, parse_mr

    d = load_task("e2e-names")
    name = lambda g: dict(parse_mr(g)).get("name")  # noqa: E731
    held = {name(e.group) for e in d.validation}
    assert len({e.group for e in d.validation}) >= 60 and 0 < len(held) < 20
    assert not any(h in e.group or h in e.prompt for e in d.train for h in held)
    assert {name(e.group) for e in d.train}.isdisjoint(held)
    assert load_task("e2e-names").validation == d.validation, "deterministic"
    assert {e.group for e in load_task("e2e").validation} != {e.group for e in d.validation}


def test_e2e_heldout_has_select_and_report_parts_disjoint_by_name_and_from_training():
    """A quarter or more of the devset's MRs are held out as whole names, split by name into
    select (the names e2e-names validated on: every earlier choice was made there) and report
    (never chosen on); no training example mentions a held-out name."""
    from skipdecode.data import load_task, parse_mr, read_e2e

    d = load_task("e2e-heldout")
    name = lambda g: dict(parse_mr(g)).get("name")  # noqa: E731
    select = {name(e.group) for e in d.validation}
    report = {name(e.group) for e in d.report}
    assert select and report and select.isdisjoint(report)
    assert select == {name(e.group) for e in load_task("e2e-names").validation}
    n_mrs = len({e.group for e in read_e2e(data_root() / "e2e" / "devset.csv")})
    n_select, n_report = len(d.eval_items("select")), len(d.eval_items("report"))
    assert n_report >= n_select and n_select + n_report >= n_mrs / 4
    assert not any(h in e.group for e in d.train for h in select | report)
    assert d.eval_items("select") == d.eval_items("validation")
    assert load_task("e2e-heldout").report == d.report, "deterministic"
    with pytest.raises(DataError, match="report"):
        load_task("e2e-names").eval_items("report")
