"""Training under torchrun: 2 CPU processes (gloo) end with identical weights and reproduce the
loss of one process on the same global batch."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _train_helpers import make_tiny, one_thread, write_e2e_csv  # noqa: E402
from skipdecode.training import TrainConfig, train  # noqa: E402

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def _torchrun(cfg: TrainConfig, dump: Path, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "_ddp_worker.py"), json.dumps(dataclasses.asdict(cfg)), str(dump)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **(extra_env or {}),
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_ddp_two_ranks_match_one_process(tmp_path):
    from safetensors.torch import load_file

    model = make_tiny(tmp_path / "model", layers=6)
    data = write_e2e_csv(tmp_path / "e2e.csv")
    base = TrainConfig(model=str(model), data=str(data), output_dir="", steps=3, batch_size=4, lr=3e-3,
                       speedups=[1.0, 2.0], val_groups=1, save_every=0, eval_examples=0, progress=False, seed=5)

    single = train(dataclasses.replace(base, output_dir=str(tmp_path / "single")))
    want = {k: v for k, v in single.model.state_dict().items() if k != "lm_head.weight"}

    dump = tmp_path / "dump"
    dump.mkdir()
    # 2 ranks x 2 micro-batches of 1 example = the same global batch of 4 (exercises no_sync too)
    p = _torchrun(dataclasses.replace(base, output_dir=str(tmp_path / "ddp"), grad_accum=2), dump)
    assert p.returncode == 0, p.stderr[-3000:]

    r0, r1 = load_file(str(dump / "rank0.safetensors")), load_file(str(dump / "rank1.safetensors"))
    assert set(r0) == set(r1) == set(want)
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k  # DDP keeps the replicas bit-identical
        # Same update as one process, up to float noise. Adam divides by sqrt(v): a gradient
        # element that is ~0 may flip under reordered sums and move by ~lr, so a rare element
        # may differ by more than 1e-5; the bulk must agree to float precision.
        d = (r0[k] - want[k]).abs()
        assert d.mean() < 1e-7 and (d > 1e-5).float().mean() < 0.01, k
    before = load_file(str(model / "model.safetensors"))["model.layers.0.input_layernorm.weight"]
    assert not torch.equal(r0["layers.0.attn_norm.weight"], before)  # training moved the weights

    log = [json.loads(x) for x in (tmp_path / "ddp" / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3]
    for a, b in zip(log, single.losses):
        assert a["loss"] == pytest.approx(b, abs=1e-5)
    meta = json.loads((tmp_path / "ddp" / "skipdecode.json").read_text())
    assert meta["world_size"] == 2 and meta["max_abs_diff_across_ranks"] == 0.0
    assert (tmp_path / "ddp" / "model.safetensors").is_file()


def test_fsdp_two_ranks_match_one_process_and_resume_after_a_kill(tmp_path):
    """FSDP2 shards each layer across 2 ranks: the exported model equals one process on the same
    global batch, and a run SIGKILLed after a checkpoint resumes to the same weights."""
    from safetensors.torch import load_file

    model = make_tiny(tmp_path / "model", layers=6)
    data = write_e2e_csv(tmp_path / "e2e.csv")
    base = TrainConfig(model=str(model), data=str(data), output_dir="", steps=4, batch_size=4, lr=3e-3,
                       speedups=[1.0, 2.0], val_groups=1, save_every=2, eval_examples=0, progress=False, seed=5,
                       grad_accum=2)
    single = train(dataclasses.replace(base, output_dir=str(tmp_path / "single"), grad_accum=1))
    want = load_file(str(tmp_path / "single" / "model.safetensors"))

    fsdp = dataclasses.replace(base, output_dir=str(tmp_path / "fsdp"), fsdp=True)
    (tmp_path / "d1").mkdir()
    p = _torchrun(fsdp, tmp_path / "d1")
    assert p.returncode == 0, p.stderr[-3000:]
    got = load_file(str(tmp_path / "fsdp" / "model.safetensors"))
    assert set(got) == set(want)
    for k in got:
        d = (got[k] - want[k]).abs()
        assert d.mean() < 1e-7 and (d > 1e-5).float().mean() < 0.01, k
    r0, r1 = load_file(str(tmp_path / "d1" / "rank0.safetensors")), load_file(str(tmp_path / "d1" / "rank1.safetensors"))
    assert all(torch.equal(r0[k], r1[k]) for k in r0)  # every rank returns the same whole model
    log = [json.loads(x) for x in (tmp_path / "fsdp" / "train_log.jsonl").read_text().splitlines()]
    for a, b in zip(log, single.losses, strict=True):
        assert a["loss"] == pytest.approx(b, abs=1e-5)

    killed = dataclasses.replace(fsdp, output_dir=str(tmp_path / "killed"))
    (tmp_path / "d2").mkdir()
    p = _torchrun(killed, tmp_path / "d2", {"SKIPDECODE_FAULT": "kill_after_step=3"})
    assert p.returncode != 0 and not (tmp_path / "killed" / "model.safetensors").exists()
    p = _torchrun(dataclasses.replace(killed, resume=True), tmp_path / "d2")
    assert p.returncode == 0, p.stderr[-3000:]
    again = load_file(str(tmp_path / "killed" / "model.safetensors"))
    assert all(torch.allclose(again[k], got[k], atol=1e-6) for k in got)


def test_accelerate_launch_runs_the_cli_unchanged_on_two_cpu_ranks(tmp_path):
    """``accelerate launch --multi_gpu`` starts torch's elastic launcher, which works on CPU
    (gloo); ``--cpu`` alone would start one process. The CLI needs no change to run under it,
    and its loss equals one process on the same global batch."""
    model = make_tiny(tmp_path / "model", layers=6)
    data = write_e2e_csv(tmp_path / "e2e.csv")
    args = ["--model", str(model), "--data", str(data), "--steps", "3", "--batch-size", "4", "--lr", "3e-3",
            "--speedups", "1,2", "--val-groups", "1", "--eval-examples", "0", "--save-every", "0",
            "--no-progress", "--seed", "5"]
    accelerate = Path(sys.executable).parent / "accelerate"
    cmd = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29533",
           "-m", "skipdecode.cli", "train", *args, "-o", str(tmp_path / "acc")]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    meta = json.loads((tmp_path / "acc" / "skipdecode.json").read_text())
    assert meta["world_size"] == 2 and meta["max_abs_diff_across_ranks"] == 0.0

    one = subprocess.run([sys.executable, "-m", "skipdecode.cli", "train", *args, "-o", str(tmp_path / "one")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    losses = [[json.loads(x)["loss"] for x in (tmp_path / d / "train_log.jsonl").read_text().splitlines()]
              for d in ("acc", "one")]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], abs=1e-5)
