"""Checkpoint state of a run: written aside and renamed, loaded weights-only; the run directory's outputs."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import TrainError
from .dist import DistEnv, _full

LOG_NAME = "train_log.jsonl"


CKPT_DIR = "checkpoints"


FAULT_ENV = "SKIPDECODE_FAULT"  # test seam: "kill_after_step=N" or "kill_in_save=N" (SIGKILLs itself)


def _fault(point: str, step: int) -> None:
    """Test seam: die by SIGKILL at a chosen point (``SKIPDECODE_FAULT=kill_after_step=5``)."""
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{point}={step}":
        os.kill(os.getpid(), signal.SIGKILL)


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter, whole. Under FSDP this gathers shards: call it on every rank."""
    return {n: _full(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}


def _optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, fsdp: bool) -> dict:
    """The optimizer state to save; under FSDP the shards gathered (every rank calls it)."""
    if not fsdp:
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))


def checkpoint_dirs(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories are never complete)."""
    d = out / CKPT_DIR
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and p.name.startswith("step-")
                  and not p.name.endswith(".tmp") and (p / "state.json").is_file())


def save_checkpoint(out: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
                    state: dict, env: DistEnv, keep: int, fsdp: bool = False) -> Path:
    """Write ``checkpoints/step-NNNNNN`` atomically: all files go to ``.tmp``, then one rename.

    Every rank writes its own RNG state (LoRA dropout draws differ per rank);
    rank 0 writes the rest and renames. A kill at any point leaves either the
    previous checkpoint or the new one, never a half-written one.
    """
    root = out / CKPT_DIR
    final = root / f"step-{step:06d}"
    tmp = root / f"step-{step:06d}.tmp"
    if env.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    env.barrier()
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # LoRA dropout on a GPU draws from its generator
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, tmp / f"rng-rank{env.rank}.pt")
    if env.main or fsdp:  # FSDP gathers the shards: a collective every rank joins
        weights, opt_state = trainable_state(model), _optimizer_state(model, opt, fsdp)
    env.barrier()
    if env.main:
        torch.save(weights, tmp / "trainable.pt")
        _fault("kill_in_save", step)
        torch.save(opt_state, tmp / "optimizer.pt")
        torch.save(sched.state_dict(), tmp / "scheduler.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in checkpoint_dirs(out)[:-max(keep, 1)]:
            shutil.rmtree(old, ignore_errors=True)
    env.barrier()
    return final


def _load_pt(path: Path) -> Any:
    """A checkpoint file, weights only: tensors and plain containers, never code.
    A file that holds anything else (a crafted pickle) or is cut short is refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise TrainError(f"checkpoint file {path} is missing: delete {path.parent} to resume from the one "
                         "before it") from None
    except Exception as e:  # UnpicklingError, EOFError, RuntimeError from a truncated zip, ...
        raise TrainError(f"checkpoint file {path} cannot be loaded as weights only ({type(e).__name__}): it is "
                         f"corrupt or not written by skipdecode; delete {path.parent} to resume from the one "
                         "before it") from None


def load_state(ckpt: Path) -> dict:
    """A checkpoint's ``state.json`` (step, seconds, config), or a clear error."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
        if not isinstance(state, dict) or not isinstance(state.get("config"), dict) \
                or isinstance(state.get("step"), bool) or not isinstance(state.get("step"), int):
            raise ValueError("step or config missing")
        return state
    except (OSError, ValueError) as e:
        raise TrainError(f"checkpoint {ckpt} has no readable state.json ({e}): delete {ckpt} to resume from "
                         "the one before it, or pass --overwrite to start again") from None


def load_checkpoint(ckpt: Path, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, env: DistEnv,
                    fsdp: bool = False) -> dict:
    state = load_state(ckpt)
    params = dict(model.named_parameters())
    saved = _load_pt(ckpt / "trainable.pt")
    missing = [n for n, p in params.items() if p.requires_grad and n not in saved]
    if missing:
        raise TrainError(f"checkpoint {ckpt} does not match the model (missing {missing[:3]})")
    opt_state = _load_pt(ckpt / "optimizer.pt")
    if fsdp:  # every rank read the whole state; each keeps its shards
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, saved, options=full)
        set_optimizer_state_dict(model, opt, optim_state_dict=opt_state, options=full)
    else:
        with torch.no_grad():
            for n, t in saved.items():
                params[n].copy_(t)
        opt.load_state_dict(opt_state)
    sched.load_state_dict(_load_pt(ckpt / "scheduler.pt"))
    rng_file = ckpt / f"rng-rank{env.rank}.pt"
    if rng_file.is_file():
        rng = _load_pt(rng_file)  # python's state is a tuple of ints: weights-only loads it
        random.setstate(rng["python"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:  # resumed on more ranks than saved: a deterministic stand-in
        random.seed(state["step"] * 7919 + env.rank)
        torch.manual_seed(state["step"] * 7919 + env.rank)
    return state


# what a run writes into --output-dir (besides tokenizer files): --overwrite removes all of it first
LAYER_ORDER_FILE = "layer_order.json"  # mode nested: the order a run measured (read back on resume)
RUN_OUTPUTS = ("config.json", "adapter_config.json", "model.safetensors", "adapter_model.safetensors",
               "skipdecode.json", "generation_config.json", "README.md", LOG_NAME, CKPT_DIR, "merged",
               LAYER_ORDER_FILE)


def remove_run(out: Path) -> None:
    """Delete a previous run's outputs, completion markers (config files) first."""
    for name in RUN_OUTPUTS:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


def _finished(out: Path) -> bool:
    meta = out / "skipdecode.json"
    try:
        return meta.is_file() and "steps_done" in json.loads(meta.read_text())
    except json.JSONDecodeError:
        return False


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines of steps after the checkpoint (a killed run may have logged them)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            break  # a line cut by the kill
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)

