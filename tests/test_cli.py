"""``skipdecode generate`` end to end on a tiny Llama with a byte-level
tokenizer: JSON output, the per-token trace, schedule files, streaming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skipdecode.cli import main
from skipdecode.schedule import SkipSchedule

PROMPTS = ["Describe a pub.", "Name[The Eagle], food[Japanese], area[riverside]."]
NEW = 8
L = 6  # layers of the tiny CLI model


def run(capsys, *argv: str) -> tuple[str, str]:
    assert main(list(argv)) == 0
    return capsys.readouterr()


def run_json(capsys, model_dir, *argv: str) -> list[dict]:
    out, _ = run(capsys, "generate", "--model", str(model_dir), "--max-new-tokens", str(NEW), "--json", *argv)
    return [json.loads(line) for line in out.splitlines()]


def test_generate_json_prints_one_object_per_prompt(tiny_cli_dir, capsys):
    objs = run_json(capsys, tiny_cli_dir, "--speedup", "2", *PROMPTS)
    assert len(objs) == len(PROMPTS)
    expected_speedup = SkipSchedule.for_speedup(2, NEW, L).decode_layer_speedup(NEW)
    assert abs(expected_speedup / 2 - 1) <= 0.01
    for prompt, o in zip(PROMPTS, objs):
        assert set(o) == {"prompt", "text", "token_ids", "new_tokens", "finish_reason", "decode_layer_speedup",
                          "seconds"}
        assert o["prompt"] == prompt
        assert o["new_tokens"] == NEW and o["finish_reason"] == "length"
        assert o["decode_layer_speedup"] == pytest.approx(expected_speedup)
        assert o["seconds"] > 0 and isinstance(o["text"], str) and o["text"]


def test_generate_on_a_float16_kv_cache_gives_what_llm_load_with_it_gives(tiny_cli_dir, capsys):
    from skipdecode import LLM

    objs = run_json(capsys, tiny_cli_dir, "--speedup", "2", "--kv-dtype", "float16", *PROMPTS)
    want = LLM.load(tiny_cli_dir, kv_dtype="float16").generate(PROMPTS, speedup=2, max_new_tokens=NEW)
    assert [o["text"] for o in objs] == [w.text for w in want]
    assert main(["bench", "--kv-dtype", "float16"]) != 0
    assert "--kv-dtype applies to --llamacpp and --dtype-parity only" in capsys.readouterr().err


def test_generate_lossless_gives_full_depth_tokens_and_reports_its_drafts(tiny_cli_dir, capsys):
    full = run_json(capsys, tiny_cli_dir, *PROMPTS)
    for k in ("1", "3"):
        objs = run_json(capsys, tiny_cli_dir, "--speedup", "2", "--lossless", "--draft-tokens", k, *PROMPTS)
        for f, o in zip(full, objs):
            assert o["token_ids"] == f["token_ids"] and o["text"] == f["text"]
            d = o["draft"]
            assert d["drafted_tokens"] > 0 and 0 <= d["accepted_tokens"] <= d["drafted_tokens"]
            assert d["rounds"] * int(k) >= d["drafted_tokens"]
    _, err = run(capsys, "generate", "--model", str(tiny_cli_dir), "--max-new-tokens", "4", "--speedup", "2",
                 "--lossless", PROMPTS[0])
    assert "lossless" in err and "drafts accepted" in err
    assert main(["generate", "--model", str(tiny_cli_dir), "--draft-tokens", "2", PROMPTS[0]]) != 0
    assert "--draft-tokens applies to --lossless generation only" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_cli_dir), "--draft-confidence", "0.5", PROMPTS[0]]) != 0
    assert "--draft-confidence applies to --lossless generation only" in capsys.readouterr().err
    objs = run_json(capsys, tiny_cli_dir, "--speedup", "2", "--lossless", "--draft-confidence", "0.9", *PROMPTS)
    assert [o["token_ids"] for o in objs] == [f["token_ids"] for f in full]
    objs = run_json(capsys, tiny_cli_dir, "--speedup", "2", "--lossless", "--draft-confidence", "0.9",
                    "--prompt-lookup", "1", *PROMPTS)
    assert [o["token_ids"] for o in objs] == [f["token_ids"] for f in full]
    assert all("lookup_drafted_tokens" in o["draft"] for o in objs)
    assert main(["generate", "--model", str(tiny_cli_dir), "--prompt-lookup", "2", PROMPTS[0]]) != 0
    assert "--prompt-lookup applies to --lossless generation only" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_cli_dir), "--max-new-tokens", "4", "--lossless", "--prompt-lookup", "9",
                 PROMPTS[0]]) != 0
    assert "prompt_lookup must be an integer in [0, 4]" in capsys.readouterr().err


def test_generate_adaptive_threshold_zero_is_the_static_schedule_and_others_run_no_shallower(tiny_cli_dir, capsys):
    def untimed(objs: list[dict]) -> list[dict]:
        return [{k: v for k, v in o.items() if k != "seconds"} for o in objs]

    static = run_json(capsys, tiny_cli_dir, "--speedup", "2", "--trace", *PROMPTS)
    assert untimed(run_json(capsys, tiny_cli_dir, "--speedup", "2", "--trace", "--adaptive", "0", *PROMPTS)) == \
        untimed(static)
    for s, a in zip(static, run_json(capsys, tiny_cli_dir, "--speedup", "2", "--trace", "--adaptive", "0.9",
                                     *PROMPTS)):
        assert all(len(x) >= len(y) for x, y in zip(a["active_layers"], s["active_layers"]))
        assert a["decode_layer_speedup"] <= s["decode_layer_speedup"]
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tiny_cli_dir), "--speedup", "2", "--adaptive", "2", PROMPTS[0]])
    assert "[0, 1]" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_cli_dir), "--adaptive", "--speedup", "2", PROMPTS[0]]) == 2
    assert "no adaptive threshold calibrated for 2.0x" in capsys.readouterr().err


def test_replay_takes_lossless_requests_beside_plain_ones(tiny_cli_dir, tmp_path, capsys):
    f = tmp_path / "reqs.jsonl"
    f.write_text(json.dumps({"prompt": PROMPTS[0], "speedup": 2, "lossless": True, "draft_tokens": 3}) + "\n"
                 + json.dumps({"prompt": PROMPTS[1], "speedup": 2, "arrive_at_step": 1}) + "\n")
    out, _ = run(capsys, "generate", "--model", str(tiny_cli_dir), "--requests", str(f), "--json",
                 "--max-new-tokens", str(NEW))
    a, b = [json.loads(line) for line in out.splitlines()]
    (full,) = run_json(capsys, tiny_cli_dir, PROMPTS[0])
    assert a["token_ids"] == full["token_ids"] and a["draft"]["drafted_tokens"] > 0
    assert "draft" not in b
    f.write_text(json.dumps({"prompt": PROMPTS[0], "lossless": "yes"}) + "\n")
    assert main(["generate", "--model", str(tiny_cli_dir), "--requests", str(f)]) != 0
    assert "'lossless' has the wrong type" in capsys.readouterr().err


def test_lossless_without_a_speedup_drafts_at_the_default_target(tiny_cli_dir):
    from skipdecode import LLM

    llm = LLM.load(tiny_cli_dir)
    (full,) = llm.generate(PROMPTS[0], max_new_tokens=NEW)
    (o,) = llm.generate(PROMPTS[0], max_new_tokens=NEW, lossless=True)
    assert o.token_ids == full.token_ids
    assert o.draft["draft_layers"] < o.draft["drafted_tokens"] * L, "drafts skipped layers"


def test_generate_full_depth_reports_1x(tiny_cli_dir, capsys):
    (o,) = run_json(capsys, tiny_cli_dir, PROMPTS[0])
    assert o["decode_layer_speedup"] == 1.0


@pytest.mark.parametrize("mode", ["skip", "early_exit"])
def test_trace_gives_token_ids_and_the_schedule_layers(tiny_cli_dir, capsys, mode):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_cli_dir)
    objs = run_json(capsys, tiny_cli_dir, "--speedup", "2", "--mode", mode, "--trace", *PROMPTS)
    sched = SkipSchedule.for_speedup(2, NEW, L, mode=mode)
    for prompt, o in zip(PROMPTS, objs):
        assert {"prompt_token_ids", "token_ids", "active_layers"} <= set(o)
        assert o["prompt_token_ids"] == list(prompt.encode())  # byte-level tokenizer, no BOS
        n = o["new_tokens"]
        assert len(o["token_ids"]) == len(o["active_layers"]) == n == NEW
        assert o["active_layers"][:-1] == [sched.layers(i) for i in range(n - 1)]
        assert o["active_layers"][-1] == []
        assert o["text"] == tok.decode(o["token_ids"], skip_special_tokens=True)
        assert o["decode_layer_speedup"] == pytest.approx(L * (n - 1) / sum(map(len, o["active_layers"])))


def test_schedule_file_is_followed(tiny_cli_dir, tmp_path, capsys):
    sched = SkipSchedule(L, 5, 2, horizon=4, warmup_layers=1)
    f = tmp_path / "sched.json"
    f.write_text(json.dumps({k: v for k, v in sched.to_dict().items() if k != "num_layers"}))
    (o,) = run_json(capsys, tiny_cli_dir, "--schedule", str(f), "--trace", PROMPTS[1])
    assert o["active_layers"][:-1] == [sched.layers(i) for i in range(NEW - 1)]
    assert o["decode_layer_speedup"] == pytest.approx(sched.decode_layer_speedup(NEW))


def test_plain_and_streamed_output_are_the_json_text(tiny_cli_dir, capsys):
    (o,) = run_json(capsys, tiny_cli_dir, "--speedup", "1.5", PROMPTS[0])
    base = ["generate", "--model", str(tiny_cli_dir), "--max-new-tokens", str(NEW), "--speedup", "1.5"]
    out, err = run(capsys, *base, PROMPTS[0])
    assert out == o["text"] + "\n"
    assert f"[{NEW} tokens" in err and f"decode-layer speedup {o['decode_layer_speedup']:.2f}x, length]" in err
    out, _ = run(capsys, *base, "--stream", PROMPTS[0])
    assert out == o["text"] + "\n"


def test_batched_prompts_match_single_prompts(tiny_cli_dir, capsys):
    batch = run_json(capsys, tiny_cli_dir, "--speedup", "2", "--trace", *PROMPTS)
    for p, o in zip(PROMPTS, batch):
        (alone,) = run_json(capsys, tiny_cli_dir, "--speedup", "2", "--trace", p)
        assert alone["token_ids"] == o["token_ids"]


def test_requests_file_replays_arrivals_deterministically(tiny_cli_dir, capsys, tmp_path):
    """`generate --requests FILE.jsonl`: requests join the running engine at
    their arrival step; output in input order with the steps they arrived and
    finished; each one's tokens and layers equal the same request alone."""
    reqs = [{"prompt": PROMPTS[0], "speedup": 2, "max_new_tokens": 8, "arrive_at_step": 3},
            {"prompt": PROMPTS[1], "max_new_tokens": 6, "arrive_at_step": 0},
            {"prompt": "Tell me more.", "schedule": {"max_exit_layer": 6, "min_exit_layer": 2, "horizon": 4},
             "max_new_tokens": 7, "arrive_at_step": 1}]
    f = tmp_path / "reqs.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in reqs) + "\n")
    out, _ = run(capsys, "generate", "--model", str(tiny_cli_dir), "--requests", str(f), "--json", "--trace")
    objs = [json.loads(line) for line in out.splitlines()]
    assert [o["prompt"] for o in objs] == [r["prompt"] for r in reqs]
    for r, o in zip(reqs, objs):
        assert o["arrived_step"] == r["arrive_at_step"]
        assert o["finished_step"] >= o["arrived_step"] + o["new_tokens"]
        assert o["new_tokens"] == r["max_new_tokens"]
        argv = ["--max-new-tokens", str(r["max_new_tokens"]), "--trace"]
        if "speedup" in r:
            argv += ["--speedup", str(r["speedup"])]
        if "schedule" in r:
            sf = tmp_path / "s.json"
            sf.write_text(json.dumps(r["schedule"]))
            argv += ["--schedule", str(sf)]
        (alone,) = run_json(capsys, tiny_cli_dir, *argv, r["prompt"])
        assert o["token_ids"] == alone["token_ids"] and o["active_layers"] == alone["active_layers"]
        assert o["text"] == alone["text"]
    assert objs[0]["active_layers"][0] != objs[1]["active_layers"][0], "requests ran at different depths"
    again, _ = run(capsys, "generate", "--model", str(tiny_cli_dir), "--requests", str(f), "--json", "--trace")
    strip = lambda o: {k: v for k, v in o.items() if k != "seconds"}  # noqa: E731
    assert [strip(json.loads(x)) for x in again.splitlines()] == [strip(o) for o in objs]


@pytest.mark.parametrize("line, needle", [
    ("{not json", "bad.jsonl:1: not valid JSON"), ('{"speedup": 2}', 'needs a "prompt"'),
    ('{"prompt": "x", "colour": 1}', "unknown field(s) ['colour']"),
    ('{"prompt": "x", "arrive_at_step": -1}', "arrive_at_step must be >= 0"),
    ('{"prompt": "x", "max_new_tokens": "9"}', "'max_new_tokens' has the wrong type"),
    ('{"prompt": "x", "speedup": 2, "schedule": {"max_exit_layer": 6, "min_exit_layer": 2, "horizon": 4}}',
     "request 1: give either a target speedup or a schedule"),
    ('{"prompt": "x"}\n{"prompt": "y", "schedule": {"max_exit_layer": 9, "min_exit_layer": 2, "horizon": 4}}',
     "request 2: max_exit_layer (9) exceeds the model's 6 layers"),
])
def test_bad_requests_file_is_a_one_line_error(tiny_cli_dir, capsys, tmp_path, line, needle):
    f = tmp_path / "bad.jsonl"
    f.write_text(line + "\n")
    assert main(["generate", "--model", str(tiny_cli_dir), "--requests", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("skipdecode: error: ") and err.count("\n") == 1 and needle in err, err


def test_train_flags_are_derived_from_the_config_and_a_recipe_file_equals_its_flags(capsys):
    from dataclasses import fields

    from skipdecode.cli import main as cli_main, train_parser
    from skipdecode.training.config import TrainConfig

    flags = {o for a in train_parser()._actions for o in a.option_strings}
    for f in fields(TrainConfig):
        assert f"--{f.name.replace('_', '-')}" in flags and f.metadata["help"], f.name
    root = Path(__file__).resolve().parents[1]
    assert cli_main(["train", "--config", str(root / "recipes" / "default-e2e.yaml"), "--print-config"]) == 0
    recipe = capsys.readouterr().out
    assert cli_main(["train", "--model", "default", "--data", "e2e-heldout", "--lora", "--lora-r", "32", "--lora-alpha",
                     "64", "--horizon", "3", "--decay", "5", "--speedups", "1,1,2,3,4,5", "--steps", "900",
                     "--batch-size", "16", "--lr", "1e-3", "--save-every", "25", "--no-progress",
                     "--print-config"]) == 0
    assert capsys.readouterr().out == recipe
    assert cli_main(["train", "--config", str(root / "recipes" / "default-e2e.yaml"), "--lora-r", "8",
                     "--print-config"]) == 0
    assert "lora_r: 8\n" in capsys.readouterr().out  # a flag overrides the recipe


@pytest.mark.parametrize("recipe", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")))
def test_every_committed_recipe_is_a_valid_training_config(recipe, capsys):
    from skipdecode.cli import main as cli_main

    root = Path(__file__).resolve().parents[1]
    assert cli_main(["train", "--config", str(root / "recipes" / recipe), "--print-config"]) == 0
    assert "steps:" in capsys.readouterr().out


def test_a_recipe_with_an_unknown_or_mistyped_setting_is_a_one_line_error(tmp_path, capsys):
    from skipdecode.cli import main as cli_main

    bad = tmp_path / "bad.yaml"
    for text, want in (("lora_rank: 8\n", "unknown setting(s) ['lora_rank']"), ("- 1\n", "must be a mapping"),
                       ("steps: [\n", "not valid YAML"), ("lora_r: many\n", "lora_r")):
        bad.write_text(text)
        try:
            code = cli_main(["train", "--config", str(bad), "-o", str(tmp_path / "run"), "--model",
                             str(tmp_path / "no-model")])
        except SystemExit as e:  # argparse's own one-line error (a value its type refuses)
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and want in err and "Traceback" not in err, err
