"""``skipdecode generate`` end to end on a tiny Llama with a byte-level
tokenizer: JSON output, the per-token trace, schedule files, streaming."""

from __future__ import annotations

import json

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
        assert set(o) == {"prompt", "text", "new_tokens", "finish_reason", "decode_layer_speedup", "seconds"}
        assert o["prompt"] == prompt
        assert o["new_tokens"] == NEW and o["finish_reason"] == "length"
        assert o["decode_layer_speedup"] == pytest.approx(expected_speedup)
        assert o["seconds"] > 0 and isinstance(o["text"], str) and o["text"]


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
