"""Skip-aware fine-tuning: the batch layout matches generation exactly, training runs end to end
(full and LoRA), exports load in transformers, and a SIGKILLed run resumes to the same weights."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _train_helpers import make_tiny, one_thread, weights, write_e2e_csv, write_jsonl  # noqa: E402
from skipdecode.checkpoint import (convert_state_dict, export_state_dict, load_model,  # noqa: E402
                                   read_state_dict, save_hf_model)
from skipdecode.generate import generate_tokens  # noqa: E402
from skipdecode.schedule import SkipSchedule  # noqa: E402
from skipdecode.lora import LORA_TARGETS, merge_lora  # noqa: E402
from skipdecode.training import (IGNORE, TrainConfig, TrainError, active_lengths, batch_loss_sum,  # noqa: E402
                                 batch_objective, build_schedules, draw_schedule, global_batch_indices, make_batch,
                                 measure_step_time, schedule_draws, train)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory) -> Path:
    """8-layer random Llama with the SmolLM2 tokenizer (and its chat template)."""
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model", layers=8)


@pytest.fixture(scope="module")
def e2e_csv(tmp_path_factory) -> Path:
    return write_e2e_csv(tmp_path_factory.mktemp("data") / "e2e.csv")


def _run_cfg(model: Path, data: Path, out: Path, **kw) -> TrainConfig:
    base = dict(model=str(model), data=str(data), output_dir=str(out), steps=6, batch_size=4, lr=3e-3,
                speedups=[1.0, 3.0], val_groups=1, save_every=0, eval_examples=4, progress=False, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


# -- the layout: exact alignment with generation -----------------------------------------------
def test_batch_layout_labels_and_active_len():
    sched = SkipSchedule(8, 6, 3, horizon=3, warmup_layers=1)  # budgets 6, 5, 4, 3, 3, ...
    items = [([11, 12, 13], [21, 22, 23, 24, 25]), ([31], [41, 42])]
    b = make_batch(items, sched, pad_id=0)
    assert b.t0 == 3
    assert b.tokens.tolist() == [[11, 12, 13, 21, 22, 23, 24], [0, 0, 31, 41, 0, 0, 0]]
    assert b.labels.tolist() == [[IGNORE, IGNORE, 21, 22, 23, 24, 25], [IGNORE, IGNORE, 41, 42] + [IGNORE] * 3]
    assert b.positions.tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 4]]
    assert b.key_valid.tolist() == [[True] * 7, [False, False] + [True] * 5]
    # input column T0+j holds target token j and runs layers(b(j)); prompt columns run all layers
    assert b.active_len == [7, 3, 3, 4, 5, 6, 7, 7]
    for layer in range(8):
        runs = [layer in sched.layers(j) for j in range(4)]
        assert runs == sorted(runs, reverse=True)  # a prefix of the target inputs
        assert b.active_len[layer] == 3 + sum(runs)
    assert b.target_tokens == 7 and b.input_tokens == 3 + 4 + 1 + 1
    assert active_lengths(SkipSchedule.full_depth(8), 3, 5) == [7] * 8
    assert make_batch(items, SkipSchedule.full_depth(8)).active_len is None


def test_teacher_forcing_reproduces_skip_generation(tmp_path):
    """Greedy tokens generated with a 3x schedule are exactly the argmax of the training pass."""
    net, _ = load_model(make_tiny(tmp_path / "m", vocab=256, layers=8, tokenizer=False))
    sched = SkipSchedule(8, 6, 2, horizon=6, warmup_layers=1)
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41]]
    rows, _ = generate_tokens(net, prompts, sched, 10)
    targets = [r.token_ids for r in rows]
    for r in rows:  # generation fed token i through layers(b(i))
        assert r.active_layers[:9] == [sched.layers(i) for i in range(9)]
    b = make_batch(list(zip(prompts, targets)), sched)
    with torch.no_grad():
        logits = net(b.tokens, b.positions, b.active_len, key_valid=b.key_valid)
        full = net(b.tokens, b.positions, None, key_valid=b.key_valid)
    s = b.t0 - 1
    for r, t in enumerate(targets):
        assert logits[r, s:s + len(t)].argmax(-1).tolist() == t
    # the check has teeth: at full depth the same inputs predict other tokens
    assert any(full[r, s:s + len(t)].argmax(-1).tolist() != t for r, t in enumerate(targets))
    # and the loss only reads target positions: changing padding tokens changes nothing
    b2 = make_batch(list(zip(prompts, targets)), sched, pad_id=77)
    with torch.no_grad():
        assert torch.allclose(batch_loss_sum(net, b), batch_loss_sum(net, b2), atol=1e-5)


def test_schedule_draws_and_data_order_are_pure_functions():
    labels = ["1x", "2x", "3x", "4x", "5x"]
    seq = [draw_schedule(labels, 7, s) for s in range(200)]
    assert seq == [draw_schedule(labels, 7, s) for s in range(200)]
    assert set(seq) == set(labels)
    assert seq != [draw_schedule(labels, 8, s) for s in range(200)]
    epoch = [i for s in range(5) for i in global_batch_indices(20, 4, s, seed=1)]
    assert sorted(epoch) == list(range(20))  # one epoch visits every example once
    assert global_batch_indices(20, 4, 5, 1) == global_batch_indices(20, 4, 5, 1)


def test_a_speedup_listed_twice_is_drawn_twice_as_often():
    cfg = TrainConfig(speedups=[1.0, 1.0, 3.0])
    scheds = {"1x": None, "3x": None}
    labels = schedule_draws(cfg, scheds)
    assert labels == ["1x", "1x", "3x"]
    seq = [draw_schedule(labels, 0, s) for s in range(3000)]
    assert abs(seq.count("1x") / len(seq) - 2 / 3) < 0.03
    plain = TrainConfig(speedups=[1.0, 2.0, 3.0])  # no repeats: the same draws as before
    assert schedule_draws(plain, {"1x": None, "2x": None, "3x": None}) == ["1x", "2x", "3x"]
    assert schedule_draws(TrainConfig(schedule_file="s.json"), {"2.00x": None}) == ["2.00x"]


def test_decay_setting_shapes_the_training_schedules():
    steep = build_schedules(TrainConfig(speedups=[1, 2]), 30, 29)
    gentle = build_schedules(TrainConfig(speedups=[1, 2], decay=1.25), 30, 29)
    assert steep["1x"] == gentle["1x"]
    assert (steep["2x"].max_exit_layer, steep["2x"].min_exit_layer) == (24, 5)
    assert gentle["2x"].min_exit_layer > steep["2x"].min_exit_layer
    assert gentle["2x"].decode_layer_speedup(29) == pytest.approx(2, rel=0.01)


def test_self_distillation_is_kl_from_the_full_depth_pass_of_the_same_model(tmp_path):
    """The objective is (1 - a) CE + a KL(p_full || p_skipped) per target token, the teacher carries
    no gradient, and a full-depth batch (nothing to distil) is plain cross-entropy."""
    net, _ = load_model(make_tiny(tmp_path / "m", vocab=256, layers=8, tokenizer=False))
    net.requires_grad_(True)
    sched = SkipSchedule(8, 6, 2, horizon=6, warmup_layers=1)
    items = [([5, 6, 7, 8], [20, 21, 22, 23, 24]), ([40, 41], [50, 51, 52])]
    b = make_batch(items, sched)
    obj, ce = batch_objective(net, b, distill=0.25)
    assert torch.allclose(ce, batch_loss_sum(net, b))
    with torch.no_grad():  # the KL by hand, on the 8 target tokens only
        s = b.t0 - 1
        keep = b.labels[:, s:].flatten() != IGNORE
        student = net(b.tokens, b.positions, b.active_len, key_valid=b.key_valid)[:, s:].flatten(0, 1)[keep]
        teacher = net(b.tokens, b.positions, None, key_valid=b.key_valid)[:, s:].flatten(0, 1)[keep]
        p_t = teacher.softmax(-1)
        kl = (p_t * (p_t.log() - student.log_softmax(-1))).sum()
    assert keep.sum() == b.target_tokens == 8
    assert kl > 0.1  # skipping changes the distribution of this random model
    assert torch.allclose(obj, 0.75 * ce + 0.25 * kl, rtol=1e-4)
    obj.backward()  # the gradient flows through the student only: the teacher ran under no_grad
    assert all(p.grad is not None for p in net.parameters())
    full = make_batch(items, SkipSchedule.full_depth(8))
    o, c = batch_objective(net, full, distill=0.25)
    assert o is c
    with pytest.raises(TrainError, match="distill must be a number in"):
        train(TrainConfig(distill=1.5))


# -- end to end -------------------------------------------------------------------------------------
def test_full_finetune_end_to_end_exports_hf_directory(tmp_path, tiny_text, e2e_csv):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    r = train(_run_cfg(tiny_text, e2e_csv, out))
    log = _log(out)
    assert [x["step"] for x in log] == list(range(1, 7))
    assert {x["schedule_target"] for x in log} <= {"1x", "3x"}
    for x in log:
        assert x["tokens"] > x["target_tokens"] > 0 and x["seconds"] > 0 and x["lr"] > 0
    assert log[0]["lr"] < log[1]["lr"] > log[2]["lr"] > log[5]["lr"]  # warm-up, then cosine decay
    assert sum(x["loss"] for x in log[-2:]) / 2 < log[0]["loss"] - 0.5
    assert set(r.validation_loss) == {"1x", "3x"}
    # a Hugging Face directory: transformers loads it and agrees with our model
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "skipdecode.json"):
        assert (out / f).is_file(), f
    assert not (out / "checkpoints").exists()
    meta = json.loads((out / "skipdecode.json").read_text())
    assert set(meta["schedules"]) == {"1x", "3x"} and meta["config"]["speedups"] == [1.0, 3.0]
    assert meta["decode_layer_speedup"]["3x"] == pytest.approx(3.0, rel=0.1)
    changed = weights(out)
    before = weights(tiny_text)
    assert not torch.equal(changed["model.layers.0.self_attn.q_proj.weight"],
                           before["model.layers.0.self_attn.q_proj.weight"])
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ours, _ = load_model(out)
    x = torch.tensor([[1, 52, 95, 198, 40, 17, 300]])
    with torch.no_grad():
        ref = hf(x).logits
        got = ours(x, torch.arange(7)[None])
    assert torch.allclose(ref, got, atol=1e-4)
    from skipdecode import LLM

    out_llm = LLM.load(out).generate("Describe Aromi.", speedup=3, max_new_tokens=3, ignore_eos=True)
    assert out_llm[0].new_tokens == 3
    # a finished run is neither silently retrained nor "resumed" from scratch
    with pytest.raises(TrainError, match="already holds a training run"):
        train(_run_cfg(tiny_text, e2e_csv, out))
    with pytest.raises(TrainError, match="already complete"):
        train(_run_cfg(tiny_text, e2e_csv, out, resume=True))
    with pytest.raises(TrainError, match="--merge"):
        train(_run_cfg(tiny_text, e2e_csv, tmp_path / "x", merge=True))


def test_bf16_mixed_precision_runs_matmuls_in_bf16_and_keeps_fp32_state(tmp_path, tiny_text, e2e_csv):
    """--mixed-precision bf16: the loss differs from fp32 by bf16 rounding only, the run still
    learns, the saved weights are fp32, and a run cannot switch precision on resume."""
    fp32 = train(_run_cfg(tiny_text, e2e_csv, tmp_path / "fp32", eval_examples=0))
    bf16 = train(_run_cfg(tiny_text, e2e_csv, tmp_path / "bf16", eval_examples=0, mixed_precision="bf16"))
    a, b = fp32.losses[0], bf16.losses[0]
    assert a != b and abs(a - b) / a < 0.02, (a, b)  # the same step, rounded in bf16
    assert sum(bf16.losses[-2:]) / 2 < bf16.losses[0] - 0.5
    assert all(t.dtype == torch.float32 for t in weights(tmp_path / "bf16").values())
    meta = json.loads((tmp_path / "bf16" / "skipdecode.json").read_text())
    assert meta["config"]["mixed_precision"] == "bf16"
    from skipdecode.training.config import _check_resume

    with pytest.raises(TrainError, match="mixed_precision: 'bf16' -> 'no'"):
        _check_resume(meta["config"], replace(TrainConfig(**meta["config"]), mixed_precision="no"))
    older = {k: v for k, v in meta["config"].items() if k != "mixed_precision"}  # saved before the setting
    _check_resume(older, replace(TrainConfig(**meta["config"]), mixed_precision="no"))
    with pytest.raises(TrainError, match="mixed_precision must be one of"):
        train(TrainConfig(mixed_precision="fp16"))


@pytest.mark.parametrize("arch", ["llama_untied", "opt", "gpt2"])
def test_export_state_dict_inverts_convert(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    src = make_tiny(tmp_path / "src", arch=arch, layers=2, tokenizer=False)
    net, path = load_model(src)
    hf_sd = read_state_dict(src)
    exported = export_state_dict(net.cfg, net.state_dict())
    for k, v in exported.items():
        assert torch.equal(v, hf_sd[k]), k
    assert set(hf_sd) - set(exported) <= {"lm_head.weight"}  # only a tied head is left out
    back = convert_state_dict(net.cfg, exported)
    for k, v in net.state_dict().items():
        if k in back:
            assert torch.equal(back[k], v), k
    out = save_hf_model(net, path, tmp_path / "out", {"note": "export test"})
    x = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(src).eval()(x).logits
        b = AutoModelForCausalLM.from_pretrained(out).eval()(x).logits
    assert torch.equal(a, b)
    assert json.loads((out / "skipdecode.json").read_text()) == {"note": "export test"}


def test_lora_adapter_and_merge(tmp_path, tiny_text, e2e_csv):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    r = train(_run_cfg(tiny_text, e2e_csv, out, lora=True, lora_r=4, steps=3, lr=1e-2, merge=True,
                       speedups=[2.0], eval_examples=0))
    acfg = json.loads((out / "adapter_config.json").read_text())
    assert (out / "adapter_model.safetensors").is_file()
    assert set(acfg["target_modules"]) == set(LORA_TARGETS) and acfg["r"] == 4
    assert Path(acfg["base_model_name_or_path"]) == tiny_text.resolve()
    assert r.merged_dir == out / "merged" and (out / "merged" / "config.json").is_file()
    x = torch.tensor([[1, 52, 95, 198, 40, 17]])
    pos = torch.arange(6)[None]
    base, _ = load_model(tiny_text)
    with torch.no_grad():
        base_logits = base(x, pos)
        adapted = PeftModel.from_pretrained(base, str(out)).eval()(x, pos)
        merged_hf = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(x).logits
    assert not torch.allclose(adapted, base_logits, atol=1e-3)  # training moved the adapter
    assert torch.allclose(merged_hf, adapted, atol=1e-4)
    again = merge_lora(out, tmp_path / "merged2")
    a, b = weights(out / "merged"), weights(again)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    # an adapter shipped in float16 (half the bytes) merges into the fp32 base alike
    from safetensors.torch import load_file, save_file

    half = tmp_path / "half"
    shutil.copytree(out, half, ignore=shutil.ignore_patterns("merged"))
    sd = load_file(out / "adapter_model.safetensors")
    save_file({k: v.half() for k, v in sd.items()}, half / "adapter_model.safetensors", metadata={"format": "pt"})
    c = weights(merge_lora(half, tmp_path / "merged-half"))
    base_w = weights(tiny_text)
    moved = max((a[k] - base_w[k]).abs().max().item() for k in a)
    off = max((a[k] - c[k]).abs().max().item() for k in a)
    assert all(c[k].dtype == a[k].dtype for k in a) and off < moved / 100, (off, moved)


def test_the_training_seed_never_moves_the_validation_split_and_the_split_seed_does(tmp_path, tiny_text):
    import csv

    from skipdecode.data import load_task

    data = tmp_path / "e2e.csv"  # MR i has i + 1 references: which MR is held out shows in the train count
    with open(data, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mr", "ref"])
        for i in range(6):
            for j in range(i + 1):
                w.writerow([f"name[Place {i}], food[Thai]", f"Place {i} serves Thai food, take {j}."])
    n_train = {s: len(load_task(str(data), val_groups=1, seed=s).train) for s in (0, 1)}
    assert n_train[0] != n_train[1]  # the two split seeds hold out different MRs

    def run(name: str, **kw) -> dict:
        train(_run_cfg(tiny_text, data, tmp_path / name, steps=1, speedups=[1.0], eval_examples=0, **kw))
        return json.loads((tmp_path / name / "skipdecode.json").read_text())

    a, b, c = run("seed0"), run("seed1", seed=1), run("split1", split_seed=1)
    assert a["train_examples"] == b["train_examples"] == n_train[0]
    assert c["train_examples"] == n_train[1]


def test_a_device_torch_cannot_use_is_refused_before_any_work(tmp_path, tiny_text, e2e_csv):
    with pytest.raises(TrainError, match="device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        train(_run_cfg(tiny_text, e2e_csv, tmp_path / "gpu", device="gpu"))
    if torch.cuda.is_available():
        bad, why = f"cuda:{torch.cuda.device_count()}", "CUDA device"
    else:
        bad, why = "cuda", "sees no CUDA GPU"
    with pytest.raises(TrainError, match=why):
        train(_run_cfg(tiny_text, e2e_csv, tmp_path / "cuda", device=bad))
    assert not (tmp_path / "cuda").exists() and not (tmp_path / "gpu").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available())")
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_run_on_cuda_follows_the_cpu_run_to_fp32_rounding_and_writes_cpu_weights(tmp_path, tiny_text, e2e_csv,
                                                                                   lora):
    from safetensors.torch import load_file

    kw = dict(steps=8, speedups=[1.0, 3.0], lora=lora, lora_r=4, lora_dropout=0.0, save_every=3)
    runs = {dev: train(_run_cfg(tiny_text, e2e_csv, tmp_path / dev, device=dev, **kw)) for dev in ("cpu", "cuda")}
    cpu, gpu = runs["cpu"], runs["cuda"]
    assert len(cpu.losses) == len(gpu.losses) == 8
    assert [round(a, 3) for a in cpu.losses] == pytest.approx([round(b, 3) for b in gpu.losses], abs=2e-3)
    assert cpu.validation_loss == pytest.approx(gpu.validation_loss, rel=1e-3)
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    a, b = load_file(tmp_path / "cpu" / name), load_file(tmp_path / "cuda" / name)
    assert a.keys() == b.keys() and all(t.device.type == "cpu" for t in b.values())
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 5e-3, worst  # Adam turns rounding-level gradient differences into up to lr-sized steps
    assert [r["schedule_target"] for r in _log(tmp_path / "cpu")] == [r["schedule_target"] for r in _log(tmp_path / "cuda")]
    # a killed GPU run resumes from its checkpoint (here on the same device) to the same end
    env = dict(os.environ, SKIPDECODE_FAULT="kill_after_step=5")
    args = [sys.executable, "-m", "skipdecode.cli", "train", "--model", str(tiny_text), "--data", str(e2e_csv),
            "-o", str(tmp_path / "killed"), "--steps", "8", "--batch-size", "4", "--lr", "3e-3",
            "--speedups", "1,3", "--val-groups", "1", "--save-every", "3", "--eval-examples", "4",
            "--no-progress", "--device", "cuda", "--lora-dropout", "0"] + (["--lora", "--lora-r", "4"] if lora else [])
    killed = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    done = subprocess.run(args + ["--resume"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    c = load_file(tmp_path / "killed" / name)
    assert max((b[k] - c[k]).abs().max().item() for k in b) < 5e-3


def test_nested_mode_measures_the_layer_order_on_the_base_and_generation_keeps_it(tmp_path, tiny_text, e2e_csv,
                                                                                 monkeypatch):
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path / "cache"))  # its merge stays out of the user's cache
    from skipdecode import LLM
    from skipdecode.policies.importance import answer_influence, nested_order

    out = tmp_path / "nested"
    r = train(_run_cfg(tiny_text, e2e_csv, out, lora=True, lora_r=4, steps=2, mode="nested", importance_examples=8,
                       speedups=[1.0, 3.0], eval_examples=0))
    meta = json.loads((out / "skipdecode.json").read_text())
    order = tuple(meta["schedules"]["3x"]["layer_order"])
    assert meta["schedules"]["3x"]["mode"] == "nested" and sorted(order) == list(range(8))
    assert order == nested_order(meta["layer_influence"])
    base, _ = load_model(tiny_text)  # measured before training: the base model's influence
    from skipdecode.data import load_task  # the same first examples the run measured on
    from skipdecode.tokenization import load_tokenizer
    from skipdecode.training.batch import _tokenize

    tok = load_tokenizer(tiny_text)
    items, _ = _tokenize(tok, load_task(str(e2e_csv), val_groups=1, seed=0).train, None, base.cfg.max_position)
    want = answer_influence(base, items[:8])
    assert meta["layer_influence"] == pytest.approx(want, abs=1e-6)
    llm = LLM.load(out)
    sched = llm.make_schedule(speedup=3)
    assert sched.to_dict() == r.schedules["3x"]
    done = llm.generate("name[Aromi], food[Chinese]", speedup=3, max_new_tokens=6, ignore_eos=True)[0]
    assert done.active_layers[1] == sched.layers(1)


def test_nested_mode_can_measure_the_order_by_greedy_removal(tmp_path, tiny_text, e2e_csv):
    from skipdecode.data import load_task
    from skipdecode.policies.importance import removal_order
    from skipdecode.tokenization import load_tokenizer
    from skipdecode.training.batch import _tokenize

    out = tmp_path / "nested-removal"
    train(_run_cfg(tiny_text, e2e_csv, out, lora=True, lora_r=4, steps=1, mode="nested", importance="removal",
                   importance_examples=6, speedups=[1.0, 3.0], eval_examples=0))
    meta = json.loads((out / "skipdecode.json").read_text())
    base, _ = load_model(tiny_text)  # measured on the base, before any update, on the first examples
    items, _ = _tokenize(load_tokenizer(tiny_text), load_task(str(e2e_csv), val_groups=1, seed=0).train, None,
                         base.cfg.max_position)
    want, loss = removal_order(base, items[:6])
    assert tuple(meta["schedules"]["3x"]["layer_order"]) == want
    assert meta["removal_loss"] == pytest.approx(loss, rel=1e-5) and "layer_influence" not in meta
    saved = json.loads((out / "layer_order.json").read_text())  # what a resumed run reads back
    assert tuple(saved["layer_order"]) == want and saved["seconds"] >= 0
    with pytest.raises(TrainError, match="importance must be"):
        _run_cfg(tiny_text, e2e_csv, out, mode="nested", importance="cosine").validate()


def test_lora_norms_train_the_norm_weights_and_load_back_exactly(tmp_path, tiny_text, e2e_csv, monkeypatch):
    monkeypatch.setenv("SKIPDECODE_CACHE", str(tmp_path / "cache"))  # its merge stays out of the user's cache
    from peft import PeftModel

    out = tmp_path / "lora-norms"
    train(_run_cfg(tiny_text, e2e_csv, out, lora=True, lora_r=4, lora_norms=True, steps=3, lr=1e-2,
                   speedups=[1.0, 2.0], eval_examples=0))
    from safetensors.torch import load_file

    sd = load_file(out / "adapter_model.safetensors")
    norms = [k for k in sd if "norm" in k]
    # every block's two norms and the final norm are saved whole, beside the LoRA matrices
    assert {k.removeprefix("base_model.model.") for k in norms} == \
        {f"layers.{i}.{n}.weight" for i in range(8) for n in ("attn_norm", "mlp_norm")} | {"norm.weight"}, norms
    base, _ = load_model(tiny_text)
    trained_gain = [v for k, v in sd.items() if k.endswith("layers.3.mlp_norm.weight")]
    assert len(trained_gain) == 1 and not torch.equal(trained_gain[0], base.layers[3].mlp_norm.weight)
    x = torch.tensor([[1, 52, 95, 198, 40, 17]])
    pos = torch.arange(6)[None]
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(load_model(tiny_text)[0], str(out)).eval()(x, pos)
        loaded = load_model(out)[0](x, pos)  # the adapter directory loads as a merged model, norms included
    assert torch.allclose(loaded, adapted, atol=1e-5)
    assert not torch.allclose(loaded, base(x, pos), atol=1e-3)


def test_measure_step_time_reports_ratio_and_work(tmp_path, tiny_text):
    from transformers import AutoTokenizer

    from skipdecode.data import encode_example
    from skipdecode.training import prepare_model

    net, _ = load_model(tiny_text)
    tok = AutoTokenizer.from_pretrained(tiny_text)
    items = [encode_example(tok, "Describe a pub.", "The Punter is a pub near the river.")] * 4
    scheds = {"1x": SkipSchedule.full_depth(8), "3x": SkipSchedule.for_speedup(3, 12, 8)}
    r = measure_step_time(prepare_model(net, TrainConfig()), items, scheds, repeats=1, warmup=1)
    b = make_batch(items, scheds["3x"])
    assert r["work_fraction"]["1x"] == 1.0
    assert r["work_fraction"]["3x"] == pytest.approx(sum(b.active_len) / (b.tokens.shape[1] * 8))
    assert r["work_fraction"]["3x"] < 0.95
    assert r["ratio"] > 0 and all(v > 0 for v in r["seconds"].values())


def test_cli_reports_malformed_data(tmp_path, tiny_text, capsys):
    from skipdecode.cli import main

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "target": "b"}, '{"prompt": "a"'])
    assert main(["train", "--model", str(tiny_text), "--data", str(bad), "-o", str(tmp_path / "o")]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err


# -- fault tolerance ---------------------------------------------------------------------------------
@pytest.mark.parametrize("lora,qat,fault", [(False, "no", "kill_after_step=5"), (True, "no", "kill_in_save=6"),
                                             (False, "int4", "kill_after_step=5")])
def test_sigkill_then_resume_reaches_the_same_weights(tmp_path, tiny_text, e2e_csv, lora, qat, fault):
    common = dict(steps=8, save_every=2, seed=3, speedups=[1.0, 2.0, 3.0], lr=1e-3, eval_examples=0,
                  lora=lora, lora_r=4, lora_dropout=0.2, qat=qat)
    ref = tmp_path / "ref"
    train(_run_cfg(tiny_text, e2e_csv, ref, **common))

    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "skipdecode.cli", "train", "--model", str(tiny_text), "--data", str(e2e_csv),
           "-o", str(out), "--steps", "8", "--batch-size", "4", "--lr", "1e-3", "--speedups", "1,2,3",
           "--val-groups", "1", "--save-every", "2", "--seed", "3", "--eval-examples", "0", "--no-progress"]
    if lora:
        cmd += ["--lora", "--lora-r", "4", "--lora-dropout", "0.2"]
    cmd += ["--qat", qat]
    env = dict(os.environ, SKIPDECODE_FAULT=fault, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert (out / "checkpoints" / "step-000004" / "state.json").is_file()
    assert not (out / "config.json").exists() and not (out / "adapter_config.json").exists()
    if fault.startswith("kill_in_save"):  # the cut-short checkpoint is only a .tmp
        assert (out / "checkpoints" / "step-000006.tmp").is_dir()
        assert not (out / "checkpoints" / "step-000006").exists()
    else:
        assert [x["step"] for x in _log(out)] == [1, 2, 3, 4, 5]

    train(_run_cfg(tiny_text, e2e_csv, out, resume=True, **common))
    log, ref_log = _log(out), _log(ref)
    assert [x["step"] for x in log] == list(range(1, 9))
    assert [x["schedule_target"] for x in log] == [x["schedule_target"] for x in ref_log]
    for a, b in zip(log, ref_log):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    from safetensors.torch import load_file

    got, want = load_file(str(out / name)), load_file(str(ref / name))
    assert set(got) == set(want)
    for k in want:
        assert torch.allclose(got[k], want[k], atol=1e-6, rtol=0), k
    if not lora:
        assert not torch.equal(want["model.layers.3.mlp.up_proj.weight"],
                               weights(tiny_text)["model.layers.3.mlp.up_proj.weight"])


def test_untrained_targets_are_solved_with_the_checkpoints_decay(tmp_path):
    """A checkpoint trained with --decay 1.25 at 1x/2x, asked for 2.2x, gets a
    schedule of the same gentle shape and warm-up; its 2x stays the training schedule."""
    from types import SimpleNamespace

    from skipdecode import LLM, SkipSchedule

    cfg = TrainConfig(speedups=[1, 2], decay=1.25)
    trained = build_schedules(cfg, 30, 29)
    (tmp_path / "skipdecode.json").write_text(json.dumps({
        "expected_new_tokens": 29, "schedules": {k: s.to_dict() for k, s in trained.items()},
        "config": {"decay": 1.25}}))
    llm = LLM(SimpleNamespace(cfg=SimpleNamespace(n_layers=30)), None, tmp_path, [])
    assert llm.make_schedule(speedup=2) == trained["2x"]
    got = llm.make_schedule(speedup=2.2)
    assert got == SkipSchedule.for_speedup(2.2, 29, 30, decay=1.25, warmup_layers=trained["2x"].warmup_layers)
    steep = SkipSchedule.for_speedup(2.2, 29, 30)
    assert got.max_exit_layer < steep.max_exit_layer and got.min_exit_layer > steep.min_exit_layer
    # an explicit decay (and horizon) re-solves even a trained target: front-loading at inference
    front = llm.make_schedule(speedup=2, horizon=3, decay=5)
    assert front == SkipSchedule.for_speedup(2, 29, 30, horizon=3, decay=5, warmup_layers=1)
    assert front.budget(0) == 30 and front != trained["2x"]
    assert llm.make_schedule(speedup=2, decay=1.25) == trained["2x"]  # the same shape solves to the same


class _Payload:
    """A pickle that runs code when loaded: it creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", ["rng-rank0.pt", "trainable.pt", "optimizer.pt", "scheduler.pt"])
def test_resume_refuses_a_crafted_pickle_in_any_checkpoint_file_without_running_it(tmp_path, tiny_text, e2e_csv,
                                                                                     name):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "skipdecode.cli", "train", "--model", str(tiny_text), "--data", str(e2e_csv),
           "-o", str(out), "--steps", "6", "--batch-size", "4", "--lr", "3e-3", "--seed", "0", "--speedups", "1,3",
           "--val-groups", "1", "--save-every", "2", "--eval-examples", "0", "--no-progress"]
    env = dict(os.environ, SKIPDECODE_FAULT="kill_after_step=3", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    ckpt = out / "checkpoints" / "step-000002"
    marker = tmp_path / "pwned"
    torch.save({"python": _Payload(marker), "torch": _Payload(marker)}, ckpt / name)
    with pytest.raises(TrainError, match=f"{name} cannot be loaded as weights only"):
        train(_run_cfg(tiny_text, e2e_csv, out, resume=True, steps=6, save_every=2, speedups=[1.0, 3.0],
                       eval_examples=0))
    assert not marker.exists(), "loading the checkpoint ran code"
    (ckpt / name).write_bytes((ckpt / name).read_bytes()[:40])  # truncated: the same clear error
    with pytest.raises(TrainError, match="cannot be loaded as weights only"):
        train(_run_cfg(tiny_text, e2e_csv, out, resume=True, steps=6, save_every=2, speedups=[1.0, 3.0],
                       eval_examples=0))


def test_training_record_reads_back_what_a_run_writes_and_refuses_what_is_not_one(tmp_path, tiny_text, e2e_csv):
    from skipdecode.training.config import TrainingRecord

    out = tmp_path / "run"
    train(_run_cfg(tiny_text, e2e_csv, out, steps=2, eval_examples=0))
    rec = TrainingRecord.from_json(json.loads((out / "skipdecode.json").read_text()))
    assert rec.steps_done == 2 and set(rec.schedules) == {"1x", "3x"} and rec.config["steps"] == 2
    assert rec.num_layers == 8 and rec.skipdecode_training
    with pytest.raises(TrainError, match="not a training record"):
        TrainingRecord.from_json({"schedules": {}})


def test_int4_round_trip_forwards_the_q4_0_rounding_and_passes_gradients_straight_through():
    from skipdecode.model import dequantize_int4, quantize_int4
    from skipdecode.training.qat import Int4RoundTrip

    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    y = Int4RoundTrip()(w)
    assert torch.equal(y.detach(), dequantize_int4(*quantize_int4(w.detach())))
    assert not torch.equal(y.detach(), w.detach())
    g = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    y.backward(g)
    assert torch.equal(w.grad, g)


def test_int4_qat_keeps_the_models_layer_order_and_writes_weights_int4_rounds_to_themselves(tmp_path, tiny_text,
                                                                                            e2e_csv):
    from skipdecode.model import dequantize_int4, quantize_int4

    nested = tmp_path / "nested"
    train(_run_cfg(tiny_text, e2e_csv, nested, steps=1, mode="nested", importance_examples=8, eval_examples=0))
    order = json.loads((nested / "skipdecode.json").read_text())["schedules"]["3x"]["layer_order"]
    out = tmp_path / "qat"
    r = train(_run_cfg(nested, e2e_csv, out, steps=3, mode="nested", importance="model", qat="int4", lr=1e-2))
    meta = json.loads((out / "skipdecode.json").read_text())
    assert meta["schedules"]["3x"]["layer_order"] == order and meta["config"]["qat"] == "int4"
    assert set(r.validation_loss) == {"1x", "3x"}
    before, after = weights(nested), weights(out)
    block = [k for k in after if ".layers." in k and k.endswith("proj.weight")]
    assert len(block) == 8 * 7  # q, k, v, o, gate, up, down of every layer
    for k in block:  # each is its own int4 rounding: --dtype int4 runs exactly the weights trained through
        assert torch.equal(dequantize_int4(*quantize_int4(after[k])), after[k]), k
    assert sum(not torch.equal(before[k], after[k]) for k in block) > len(block) // 2
    from skipdecode.bench.dtype_parity import reference_model

    assert reference_model(str(out)) == str(nested.resolve())  # held against the fp32 it was made from
    with pytest.raises(TrainError, match="records none"):
        train(_run_cfg(tiny_text, e2e_csv, tmp_path / "x", steps=1, mode="nested", importance="model"))
    with pytest.raises(TrainError, match="drop --lora"):
        _run_cfg(nested, e2e_csv, tmp_path / "y", qat="int4", lora=True).validate()
