"""Skip-aware fine-tuning: teacher forcing through the same skipping forward pass as generation.

SkipDecode only works on adapted models (SKIPDECODE.md, "Training"): the model
must learn to predict from a state that skipped its lower layers. So training
runs exactly what generation runs.

Alignment (the off-by-one, worked out once). At generation, the last prompt
token runs at full depth and predicts target token 0; target token ``i``, fed
back as input, runs the layers of ``b(i)`` and predicts token ``i + 1``. In
training, a row with prompt ``p`` (length P) and target ``t`` (length n) is laid
out as::

    column      T0-P .. T0-1        T0    T0+1  ...  T0+n-2
    input       p_0  .. p_{P-1}     t_0   t_1   ...  t_{n-2}
    label       -    .. t_0         t_1   t_2   ...  t_{n-1}
    layers      full depth          b(0)  b(1)  ...  b(n-2)

Prompts are LEFT-padded so every row's last prompt token sits at column
``T0 - 1`` and input column ``T0 + j`` always holds target token ``j``; targets
are right-padded. Budgets never increase, so the positions that run layer
``l`` are all prompt columns plus a prefix of target columns::

    active_len[l] = T0 + #{j < n_max - 1 : l in layers(b(j))}

and ``Transformer.forward(tokens, positions, active_len, key_valid=...)``
computes each layer on that prefix only: training pays the same saving as
inference. The loss is the cross-entropy on target tokens, averaged over every
target token of the global batch (all ranks, all micro-batches).

One checkpoint for many speedups: with ``speedups=[1, 2, 3]`` the schedule of
each optimizer step is drawn (seeded by ``seed`` and the step) from that set.

Fault tolerance: every ``save_every`` steps the model, optimizer, LR scheduler
and RNG states go into ``checkpoints/step-NNNNNN`` (written aside, renamed into
place). The data order and schedule draws are pure functions of
``(seed, step)``, so ``resume=True`` continues where the last checkpoint left
off and reaches the same weights as an uninterrupted run.

Distributed: under ``torchrun`` (``WORLD_SIZE > 1``) a gloo process group is
created, the model is wrapped in DDP and each rank takes its contiguous share
of the global batch. The per-rank loss is divided by the *global* number of
target tokens and scaled by the world size (DDP averages gradients), so the
update equals a single process on the same global batch. With ``fsdp=True``
each layer is sharded across the ranks instead (FSDP2, gradients averaged the
same way); checkpoints and the exported model hold the gathered whole.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import DEFAULT_MODEL, load_model, save_hf_model
from .config import ModelError
from .data import DataError, TaskData, encode_example, load_task
from .errors import SkipDecodeError
from .lora import LORA_TARGETS, apply_lora, merge_lora, merge_peft_model, save_adapter  # noqa: F401
from .model import Transformer
from .schedule import DEFAULT_DECAY, ScheduleError, SkipSchedule
from .tokenization import load_tokenizer
from .validation import SEED_MAX, check_float, check_int

IGNORE = -100
LOG_NAME = "train_log.jsonl"
CKPT_DIR = "checkpoints"
FAULT_ENV = "SKIPDECODE_FAULT"  # test seam: "kill_after_step=N" or "kill_in_save=N" (SIGKILLs itself)

# Settings that change the training trajectory: a resumed run must keep them.
_RESUME_KEYS = ("model", "data", "speedups", "schedule_file", "mode", "warmup_layers", "horizon", "decay",
                "expected_new_tokens", "lora", "lora_r", "lora_alpha", "lora_dropout", "steps", "epochs",
                "batch_size", "grad_accum", "lr", "weight_decay", "warmup_steps", "min_lr_ratio",
                "max_grad_norm", "seed", "max_length", "val_groups", "chat", "fsdp", "distill",
                "distill_temperature")


class TrainError(SkipDecodeError):
    """A training run that cannot start or continue as asked."""


@dataclass
class TrainConfig:
    """Every setting of a run; ``skipdecode.json`` records it next to the weights."""

    model: str = "default"
    data: str = "e2e"  # e2e | scitldr | a .jsonl of prompt/target | an E2E-style .csv
    output_dir: str = "runs/train"
    # schedules
    speedups: list[float] = field(default_factory=lambda: [1.0, 2.0, 3.0])
    schedule_file: str | None = None  # a fixed schedule instead of --speedups
    mode: str = "skip"
    warmup_layers: int = 1
    # self-distillation: the same model at full depth (no gradient) teaches each skipped step
    distill: float = 0.0  # weight of KL(full depth || skipped) on target tokens; 1 - distill on cross-entropy
    distill_temperature: float = 1.0
    horizon: int | None = None  # default: expected_new_tokens - 1 (SkipSchedule.for_speedup)
    decay: float = DEFAULT_DECAY  # preferred first budget / mean budget of solved schedules (1 = flat)
    expected_new_tokens: int | None = None  # default: median target length of the training data
    # parameters
    lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    merge: bool = False  # LoRA: also write the merged full model to output_dir/merged
    fsdp: bool = False  # under torchrun: shard parameters, gradients and optimizer state (FSDP2), not DDP
    # optimization
    steps: int | None = None  # optimizer steps; default: epochs over the training data
    epochs: float = 1.0
    batch_size: int = 16  # global examples per optimizer step (all ranks, all micro-batches)
    grad_accum: int = 1
    lr: float | None = None  # default 1e-4 full fine-tuning, 5e-4 LoRA
    weight_decay: float = 0.0
    warmup_steps: int | None = None  # default: 5% of the steps
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    max_grad_norm: float = 1.0
    seed: int = 0
    # data
    max_length: int | None = None  # drop longer examples; default: the model's context
    val_groups: float | None = None  # held-out groups (E2E: 60 MRs); a fraction if < 1
    chat: bool | None = None  # None: use the chat template when the tokenizer has one
    eval_examples: int = 32  # validation loss per schedule at the end (0: none)
    # checkpoints and output
    save_every: int = 50
    keep_checkpoints: int = 1
    resume: bool = False
    overwrite: bool = False
    progress: bool = True

    def validate(self) -> "TrainConfig":
        """Every field typed, finite and in range (the API's one check; the CLI's flags match it)."""
        E = TrainError
        for name, lo in (("batch_size", 1), ("grad_accum", 1), ("lora_r", 1), ("lora_alpha", 1),
                         ("save_every", 0), ("keep_checkpoints", 1), ("eval_examples", 0), ("warmup_layers", 0)):
            check_int(name, getattr(self, name), lo, error=E)
        for name in ("steps", "horizon", "expected_new_tokens", "max_length"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1, error=E,
                          hint=" (leave it unset for the default)" if name != "steps" else
                          " (leave it unset to train --epochs over the data)")
        if self.warmup_steps is not None:
            check_int("warmup_steps", self.warmup_steps, 0, error=E)
        check_int("seed", self.seed, 0, SEED_MAX - 1, error=E)
        if self.lr is not None:
            check_float("lr", self.lr, 0, lo_open=True, error=E)
        check_float("epochs", self.epochs, 0, lo_open=True, error=E)
        check_float("weight_decay", self.weight_decay, 0, error=E)
        check_float("min_lr_ratio", self.min_lr_ratio, 0, 1, error=E)
        check_float("max_grad_norm", self.max_grad_norm, 0, error=E, hint=" (0 disables clipping)")
        check_float("lora_dropout", self.lora_dropout, 0, 1, hi_open=True, error=E)
        check_float("decay", self.decay, 1, 2, error=E)
        check_float("distill", self.distill, 0, 1, error=E)
        check_float("distill_temperature", self.distill_temperature, 0, lo_open=True, error=E)
        if self.val_groups is not None:
            check_float("val_groups", self.val_groups, 0, lo_open=True, error=E)
        if self.mode not in ("skip", "early_exit"):
            raise E(f"mode must be 'skip' or 'early_exit', got {self.mode!r}")
        if not self.schedule_file:
            if not isinstance(self.speedups, (list, tuple)) or not self.speedups:
                raise E("give at least one speedup (e.g. speedups=[1, 2, 3]) or a schedule file")
            for sp in self.speedups:
                check_float("each speedup", sp, 1, error=E)
        return self

    def effective_lr(self) -> float:
        return self.lr if self.lr is not None else (5e-4 if self.lora else 1e-4)


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    losses: list[float]
    validation_loss: dict[str, float]
    schedules: dict[str, dict]
    merged_dir: Path | None = None
    model: nn.Module | None = None  # the trained module (a PeftModel for LoRA, a Transformer once merged)


# -- schedules ---------------------------------------------------------------------------
def schedule_label(target: float) -> str:
    return f"{target:g}x"


def schedule_for_speedup(target: float, expected_new_tokens: int, num_layers: int, cfg: TrainConfig) -> SkipSchedule:
    """1x is full depth; other targets are solved by ``SkipSchedule.for_speedup``
    with the run's horizon, warm-up, mode and decay."""
    if target == 1:
        return SkipSchedule.full_depth(num_layers)
    return SkipSchedule.for_speedup(target, expected_new_tokens, num_layers, horizon=cfg.horizon,
                                    warmup_layers=cfg.warmup_layers, mode=cfg.mode, decay=cfg.decay)


def draw_schedule(labels: Sequence[str], seed: int, step: int) -> str:
    """The schedule of an optimizer step: a pure function of (seed, step), so resume and ranks agree."""
    return random.Random(f"skipdecode-schedule:{seed}:{step}").choice(list(labels))


# -- batches -------------------------------------------------------------------------------
@dataclass
class Batch:
    tokens: torch.Tensor  # (B, W) inputs: left-padded prompt, then target tokens 0..n-2
    positions: torch.Tensor  # (B, W) per-row positions (0 at the first real prompt token)
    labels: torch.Tensor  # (B, W) target token i at column T0-1+i, IGNORE elsewhere
    key_valid: torch.Tensor | None  # (B, W) False on left padding; None if no row is padded
    active_len: list[int] | None  # per layer: leading columns that run it (None: all)
    t0: int  # column of target token 0 as an input; column T0-1 predicts it
    target_tokens: int
    input_tokens: int  # non-padding input tokens (prompt + fed-back target tokens)


def active_lengths(schedule: SkipSchedule, t0: int, max_target: int) -> list[int]:
    """Per layer: all ``t0`` prompt columns plus the target inputs ``j < max_target - 1`` that run it."""
    fed = max(max_target - 1, 0)  # the last target token is only a label, never an input
    return [t0 + schedule.steps_using_layer(layer, fed) for layer in range(schedule.num_layers)]


def make_batch(items: Sequence[tuple[Sequence[int], Sequence[int]]], schedule: SkipSchedule,
               pad_id: int = 0) -> Batch:
    """Lay out ``(prompt_ids, target_ids)`` pairs as in the module docstring."""
    if not items:
        raise TrainError("empty batch")
    B = len(items)
    t0 = max(len(p) for p, _ in items)
    n_max = max(len(t) for _, t in items)
    if t0 < 1 or min(len(t) for _, t in items) < 1:
        raise TrainError("every example needs at least one prompt token and one target token")
    W = t0 + n_max - 1
    tokens = torch.full((B, W), pad_id, dtype=torch.long)
    labels = torch.full((B, W), IGNORE, dtype=torch.long)
    pad = torch.empty(B, dtype=torch.long)
    for r, (p, t) in enumerate(items):
        pad[r] = t0 - len(p)
        tokens[r, t0 - len(p): t0] = torch.as_tensor(list(p), dtype=torch.long)
        if len(t) > 1:
            tokens[r, t0: t0 + len(t) - 1] = torch.as_tensor(list(t[:-1]), dtype=torch.long)
        labels[r, t0 - 1: t0 - 1 + len(t)] = torch.as_tensor(list(t), dtype=torch.long)
    cols = torch.arange(W)[None, :]
    positions = (cols - pad[:, None]).clamp(min=0)
    key_valid = cols >= pad[:, None] if bool((pad > 0).any()) else None
    active = active_lengths(schedule, t0, n_max)
    n_target = sum(len(t) for _, t in items)
    return Batch(tokens, positions, labels, key_valid, None if all(a == W for a in active) else active,
                 t0, n_target, sum(len(p) + len(t) - 1 for p, t in items))


def batch_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Summed cross-entropy over the batch's target tokens (the caller normalizes)."""
    return batch_objective(model, batch)[1]


def batch_objective(model: nn.Module, batch: Batch, distill: float = 0.0,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(objective_sum, cross_entropy_sum)`` over the batch's target tokens (the caller normalizes).

    With ``distill > 0`` and a skipping schedule, the same model at full depth,
    without gradient, is the teacher: the objective is
    ``(1 - distill) * CE + distill * T^2 * KL(p_full || p_skipped)`` per target
    token. The skipped pass learns to match what the whole network would say,
    not only the one reference sentence; a full-depth batch has nothing to
    distil and trains on cross-entropy alone."""
    s = batch.t0 - 1  # columns before the last prompt token predict nothing we train on
    logits = model(batch.tokens, batch.positions, batch.active_len, key_valid=batch.key_valid, logits_from=s)
    labels = batch.labels[:, s:].flatten()
    flat = logits.flatten(0, 1).float()
    ce = F.cross_entropy(flat, labels, ignore_index=IGNORE, reduction="sum")
    if distill <= 0 or batch.active_len is None:
        return ce, ce
    keep = labels != IGNORE
    was = model.training
    model.train(False)  # the teacher without dropout
    with torch.no_grad():
        teacher = model(batch.tokens, batch.positions, None, key_valid=batch.key_valid, logits_from=s)
    model.train(was)
    with torch.no_grad():
        t_logp = F.log_softmax(teacher.flatten(0, 1)[keep].float() / temperature, dim=-1)
    s_logp = F.log_softmax(flat[keep] / temperature, dim=-1)
    kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="sum") * temperature ** 2
    return (1 - distill) * ce + distill * kl, ce


# -- data order ------------------------------------------------------------------------------
def global_batch_indices(n_examples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Example indices of an optimizer step: a fresh seeded permutation per epoch (stateless)."""
    out = []
    start = step * batch_size
    for s in range(start, start + batch_size):
        epoch, k = divmod(s, n_examples)
        out.append(_epoch_perm(n_examples, seed, epoch)[k])
    return out


_perm_cache: dict[tuple[int, int, int], list[int]] = {}


def _epoch_perm(n: int, seed: int, epoch: int) -> list[int]:
    key = (n, seed, epoch)
    if key not in _perm_cache:
        if len(_perm_cache) > 4:
            _perm_cache.clear()
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        _perm_cache[key] = torch.randperm(n, generator=g).tolist()
    return _perm_cache[key]


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total``."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


# -- distributed ------------------------------------------------------------------------------
@dataclass
class DistEnv:
    rank: int = 0
    world: int = 1
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def init_distributed() -> DistEnv:
    """A gloo process group only when launched with WORLD_SIZE > 1 (torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    import torch.distributed as dist

    owns = False
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        owns = True
    return DistEnv(dist.get_rank(), dist.get_world_size(), owns)


# -- model -------------------------------------------------------------------------------------
def prepare_model(net: Transformer, cfg: TrainConfig) -> nn.Module:
    """Trainable parameters: all of them, or LoRA adapters on our fused linears (via peft)."""
    net.train()
    if not cfg.lora:
        return net.requires_grad_(True)
    return apply_lora(net, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.seed)


def base_transformer(model: nn.Module) -> Transformer:
    m = model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
    if hasattr(m, "get_base_model"):
        m = m.get_base_model()
    assert isinstance(m, Transformer)
    return m


def _full(t: torch.Tensor) -> torch.Tensor:
    """A full tensor from an FSDP shard (a collective: every rank calls it) or a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter, whole. Under FSDP this gathers shards: call it on every rank."""
    return {n: _full(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}


def shard_model(net: Transformer) -> Transformer:
    """FSDP2: each layer is one shard group (all-gathered just before it runs, freed after),
    the embeddings, final norm and tied head the root group."""
    from torch.distributed.fsdp import fully_shard

    for block in net.layers:
        fully_shard(block)
    return fully_shard(net)


def unsharded_copy(net: Transformer) -> Transformer:
    """The whole model on every rank, from FSDP shards (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    plain = Transformer(net.cfg)
    plain.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    return plain.eval()


def _optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, fsdp: bool) -> dict:
    """The optimizer state to save; under FSDP the shards gathered (every rank calls it)."""
    if not fsdp:
        return opt.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))


# -- checkpoints ----------------------------------------------------------------------------------
def _fault(point: str, step: int) -> None:
    """Test seam: die by SIGKILL at a chosen point (``SKIPDECODE_FAULT=kill_after_step=5``)."""
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{point}={step}":
        os.kill(os.getpid(), signal.SIGKILL)


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
    torch.save({"python": random.getstate(), "torch": torch.get_rng_state()}, tmp / f"rng-rank{env.rank}.pt")
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
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

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
    else:  # resumed on more ranks than saved: a deterministic stand-in
        random.seed(state["step"] * 7919 + env.rank)
        torch.manual_seed(state["step"] * 7919 + env.rank)
    return state


# what a run writes into --output-dir (besides tokenizer files): --overwrite removes all of it first
RUN_OUTPUTS = ("config.json", "adapter_config.json", "model.safetensors", "adapter_model.safetensors",
               "skipdecode.json", "generation_config.json", "README.md", LOG_NAME, CKPT_DIR, "merged")


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


# -- the run ---------------------------------------------------------------------------------------
def _tokenize(tokenizer: Any, task_rows, chat: bool | None, max_length: int) -> tuple[list, int]:
    out, dropped = [], 0
    for ex in task_rows:
        p, t = encode_example(tokenizer, ex.prompt, ex.target, chat)
        if len(p) + len(t) - 1 > max_length:
            dropped += 1
            continue
        out.append((p, t))
    return out, dropped


def _micro_batches(items: list, n: int) -> Iterator[list]:
    size = len(items) // n
    for k in range(n):
        yield items[k * size:(k + 1) * size]


def _say(env: DistEnv, msg: str) -> None:
    if env.main:
        print(msg, file=sys.stderr, flush=True)


def _check_resume(saved: dict, cfg: TrainConfig) -> None:
    cur = asdict(cfg)
    keys = [k for k in _RESUME_KEYS if cfg.lora or not k.startswith("lora_")]  # unused without --lora
    default = asdict(TrainConfig())  # a setting added later: older runs used its default
    diff = [k for k in keys if saved.get(k, default.get(k)) != cur.get(k)]
    if diff:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {cur.get(k)!r}" for k in diff)
        raise TrainError(f"cannot resume: settings differ from the checkpointed run ({shown})")


def build_schedules(cfg: TrainConfig, num_layers: int, expected_new_tokens: int) -> dict[str, SkipSchedule]:
    if cfg.schedule_file:
        s = SkipSchedule.from_file(cfg.schedule_file, num_layers)
        return {f"{s.decode_layer_speedup(expected_new_tokens):.2f}x": s}
    if not cfg.speedups:
        raise TrainError("give at least one speedup (e.g. --speedups 1,2,3) or --schedule")
    return {schedule_label(t): schedule_for_speedup(t, expected_new_tokens, num_layers, cfg) for t in cfg.speedups}


@torch.no_grad()
def evaluate_loss(model: nn.Module, items: list, schedule: SkipSchedule, pad_id: int, batch_size: int = 8) -> float:
    """Mean cross-entropy per target token under one schedule (teacher forced)."""
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for k in range(0, len(items), batch_size):
        b = make_batch(items[k:k + batch_size], schedule, pad_id)
        total += batch_loss_sum(model, b).item()
        n += b.target_tokens
    model.train(was)
    return total / max(n, 1)


def measure_step_time(model: nn.Module, items: list, schedules: dict[str, SkipSchedule], pad_id: int = 0,
                      repeats: int = 3, warmup: int = 2, lr: float = 1e-6) -> dict[str, Any]:
    """Seconds per training step on one batch, per schedule, and their ratio (first / second).

    A step is forward + backward + AdamW update; ``forward_backward`` leaves the
    update out (skipping cannot shorten it). Schedules alternate in every round
    after ``warmup`` untimed rounds (first steps pay for allocation), and the
    median round counts: timings on a shared machine are noisy. Also reports
    each schedule's layer-position work relative to full depth: prompt columns
    always run every layer, so a 3x decode schedule saves less in training.
    The weights change while measuring: use this on a model you do not keep.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    batches = {name: make_batch(items, s, pad_id) for name, s in schedules.items()}
    step_t: dict[str, list[float]] = {n: [] for n in schedules}
    fb_t: dict[str, list[float]] = {n: [] for n in schedules}
    names = list(schedules)
    for r in range(warmup + repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            b = batches[name]
            t = time.perf_counter()
            (batch_loss_sum(model, b) / b.target_tokens).backward()
            t_fb = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if r >= warmup:
                fb_t[name].append(t_fb - t)
                step_t[name].append(time.perf_counter() - t)
    out: dict[str, Any] = {
        "batch_size": len(items), "repeats": repeats,
        "prompt_tokens": sum(len(p) for p, _ in items), "target_tokens": sum(len(t) for _, t in items),
        "seconds": {n: statistics.median(v) for n, v in step_t.items()},
        "forward_backward_seconds": {n: statistics.median(v) for n, v in fb_t.items()},
        "work_fraction": {n: sum(b.active_len or [b.tokens.shape[1]] * schedules[n].num_layers)
                          / (b.tokens.shape[1] * schedules[n].num_layers) for n, b in batches.items()},
    }
    if len(names) == 2:
        a, b = names
        out["ratio"] = out["seconds"][a] / out["seconds"][b]
        out["forward_backward_ratio"] = out["forward_backward_seconds"][a] / out["forward_backward_seconds"][b]
    return out


def train(config: TrainConfig | None = None, **overrides: Any) -> TrainResult:
    """Fine-tune a model with its skip schedule(s); see the module docstring."""
    cfg = replace(config or TrainConfig(), **overrides).validate()
    if cfg.merge and not cfg.lora:
        raise TrainError("--merge merges a LoRA adapter: use it with --lora")
    if cfg.speedups:
        cfg.speedups = [float(s) for s in cfg.speedups]
    env = init_distributed()
    try:
        return _train(cfg, env)
    finally:
        if env.owns_group:
            torch.distributed.destroy_process_group()


def _train(cfg: TrainConfig, env: DistEnv) -> TrainResult:
    out = Path(cfg.output_dir)
    per_rank, rem = divmod(cfg.batch_size, env.world * cfg.grad_accum)
    if rem or per_rank < 1:
        raise TrainError(f"batch_size {cfg.batch_size} must be a multiple of world size x grad_accum "
                         f"= {env.world} x {cfg.grad_accum}")
    fsdp = cfg.fsdp and env.world > 1
    if cfg.fsdp and cfg.lora:
        raise TrainError("--fsdp shards full fine-tuning; LoRA adapters are small: train them with DDP "
                         "(drop --fsdp)")
    if cfg.fsdp and not fsdp:
        _say(env, "skipdecode train: --fsdp shards across processes (torchrun); one process trains unsharded")
    log_path = out / LOG_NAME
    if env.main:
        if out.exists() and not out.is_dir():
            raise TrainError(f"--output-dir {out} is a file: give a directory (new or holding a run)")
        if cfg.resume and cfg.overwrite:
            raise TrainError("--resume continues a run and --overwrite discards it: give one of them")
        if not cfg.resume and not cfg.overwrite and (log_path.exists() or checkpoint_dirs(out)
                                                     or any((out / f).exists() for f in RUN_OUTPUTS)):
            raise TrainError(f"{out} already holds a training run: pass --resume to continue it "
                             "or --overwrite to start again")
        out.mkdir(parents=True, exist_ok=True)
        if cfg.overwrite:  # the old run goes first: a crash later must not leave it looking complete
            remove_run(out)
        for stale in (out / CKPT_DIR).glob("*.tmp") if (out / CKPT_DIR).is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True)  # a checkpoint cut short by a kill
    env.barrier()

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    net, path = load_model(cfg.model)
    path = path.resolve()
    tokenizer = load_tokenizer(path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    L = net.cfg.n_layers
    task: TaskData = load_task(cfg.data, val_groups=cfg.val_groups, seed=cfg.seed)
    max_len = min(cfg.max_length or net.cfg.max_position, net.cfg.max_position)
    train_items, dropped = _tokenize(tokenizer, task.train, cfg.chat, max_len)
    if dropped:
        _say(env, f"skipdecode train: dropped {dropped} example(s) longer than {max_len} tokens")
    if len(train_items) < cfg.batch_size:
        raise TrainError(f"{len(train_items)} training examples are fewer than one batch of {cfg.batch_size}")
    val_rows = task.validation[: cfg.eval_examples] if cfg.eval_examples > 0 else []
    val_items, _ = _tokenize(tokenizer, val_rows, cfg.chat, max_len)

    expected = cfg.expected_new_tokens or int(statistics.median(len(t) for _, t in train_items))
    schedules = build_schedules(cfg, L, expected)
    labels = list(schedules)
    total = cfg.steps or math.ceil(cfg.epochs * len(train_items) / cfg.batch_size)
    if total < 1:
        raise TrainError("nothing to train: steps/epochs give 0 optimizer steps")
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.05 * total))

    model = prepare_model(net, cfg)
    if fsdp:
        model = shard_model(model)  # before the optimizer: it must see the sharded parameters
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.effective_lr(), weight_decay=cfg.weight_decay)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total, cfg.min_lr_ratio))

    start, elapsed0, tokens_seen = 0, 0.0, 0
    ckpts = checkpoint_dirs(out) if cfg.resume else []
    if cfg.resume and not ckpts:
        if _finished(out):
            raise TrainError(f"the run in {out} is already complete; pass --overwrite to train again")
        _say(env, f"skipdecode train: no checkpoint in {out / CKPT_DIR}; starting from step 0")
        if env.main:
            _truncate_log(log_path, 0)
    if ckpts:
        _check_resume(load_state(ckpts[-1])["config"], cfg)
        state = load_checkpoint(ckpts[-1], model, opt, lr_sched, env, fsdp)
        start, elapsed0, tokens_seen = state["step"], state["seconds"], state["tokens_seen"]
        if env.main:
            _truncate_log(log_path, start)
        _say(env, f"skipdecode train: resumed from {ckpts[-1]} at step {start}/{total}")
    env.barrier()

    runner: nn.Module = model
    if env.world > 1 and not fsdp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        runner = DDP(model)

    meta = {
        "skipdecode_training": True, "base_model": str(path), "data": cfg.data,
        "num_layers": L, "expected_new_tokens": expected, "warmup_steps": warmup, "total_steps": total,
        "schedules": {k: s.to_dict() for k, s in schedules.items()},
        "decode_layer_speedup": {k: s.decode_layer_speedup(expected) for k, s in schedules.items()},
        "train_examples": len(train_items), "world_size": env.world, "lr": cfg.effective_lr(),
        "config": asdict(cfg),
    }
    if env.main:
        _say(env, f"skipdecode train: {len(train_items)} examples, {total} steps of {cfg.batch_size}, "
                  f"{'LoRA' if cfg.lora else 'full'} fine-tuning of {L} layers, schedules "
                  + ", ".join(f"{k} (b {s.max_exit_layer}->{s.min_exit_layer}, "
                              f"{s.decode_layer_speedup(expected):.2f}x)" for k, s in schedules.items()))

    bar = None
    if env.main and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    losses: list[float] = []
    t_run = time.perf_counter()
    log_f = open(log_path, "a") if env.main else None
    try:
        for step in range(start, total):
            t_step = time.perf_counter()
            label = draw_schedule(labels, cfg.seed, step)
            sched = schedules[label]
            idx = global_batch_indices(len(train_items), cfg.batch_size, step, cfg.seed)
            global_items = [train_items[i] for i in idx]
            n_target = sum(len(t) for _, t in global_items)
            n_input = sum(len(p) + len(t) - 1 for p, t in global_items)
            local = global_items[env.rank * per_rank * cfg.grad_accum:(env.rank + 1) * per_rank * cfg.grad_accum]
            loss_sum, ce_sum = 0.0, 0.0
            for k, micro in enumerate(_micro_batches(local, cfg.grad_accum)):
                batch = make_batch(micro, sched, pad_id)
                sync = env.world == 1 or k == cfg.grad_accum - 1
                if fsdp:
                    runner.set_requires_gradient_sync(sync)
                with contextlib.nullcontext() if sync or fsdp else runner.no_sync():
                    ls, ce = batch_objective(runner, batch, cfg.distill, cfg.distill_temperature)
                    (ls * (env.world / n_target)).backward()
                loss_sum += ls.item()
                ce_sum += ce.item()
            if env.world > 1:
                t = torch.tensor([loss_sum, ce_sum], dtype=torch.float64)
                torch.distributed.all_reduce(t)
                loss_sum, ce_sum = t.tolist()
            loss = loss_sum / n_target
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm) if cfg.max_grad_norm > 0 else None
            grad_norm = None if grad_norm is None else _full(grad_norm)
            lr_now = opt.param_groups[0]["lr"]
            opt.step()
            lr_sched.step()
            opt.zero_grad(set_to_none=True)
            tokens_seen += n_input
            losses.append(loss)
            dt = time.perf_counter() - t_step
            if log_f is not None:
                rec = {"step": step + 1, "loss": loss, "cross_entropy": ce_sum / n_target, "lr": lr_now, "tokens": n_input, "target_tokens": n_target,
                       "seconds": dt, "schedule_target": label, "budget": [sched.max_exit_layer, sched.min_exit_layer],
                       "grad_norm": None if grad_norm is None else float(grad_norm),
                       "epoch": (step + 1) * cfg.batch_size / len(train_items)}
                log_f.write(json.dumps(rec) + "\n")
                log_f.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{n_input / dt:.0f}", x=label, refresh=False)
                bar.update(1)
            _fault("kill_after_step", step + 1)
            if cfg.save_every > 0 and (step + 1) % cfg.save_every == 0 and step + 1 < total:
                state = {"step": step + 1, "seconds": elapsed0 + time.perf_counter() - t_run,
                         "tokens_seen": tokens_seen, "config": asdict(cfg)}
                save_checkpoint(out, step + 1, model, opt, lr_sched, state, env, cfg.keep_checkpoints, fsdp)
    finally:
        if bar is not None:
            bar.close()
        if log_f is not None:
            log_f.close()

    if fsdp:  # one whole model on every rank, gathered from the shards
        model = unsharded_copy(model)
    elif env.world > 1:
        meta["max_abs_diff_across_ranks"] = _rank_divergence(model)
    base = base_transformer(model)
    val_loss = {}
    if env.main and val_items:
        for k, s in schedules.items():
            val_loss[k] = evaluate_loss(model, val_items, s, pad_id, max(1, per_rank))
        _say(env, "skipdecode train: validation loss " + ", ".join(f"{k} {v:.3f}" for k, v in val_loss.items()))
    meta.update({"steps_done": total, "final_loss": losses[-1] if losses else None, "validation_loss": val_loss,
                 "seconds": elapsed0 + time.perf_counter() - t_run, "tokens_seen": tokens_seen})
    merged = None
    if env.main:
        if cfg.lora:
            # a named base ("default") stays portable; a local base is recorded by its path
            save_adapter(model, cfg.model if cfg.model == DEFAULT_MODEL else path, out, meta, tokenizer)
            if cfg.merge:
                model = merge_peft_model(model)
                merged = save_hf_model(model, path, out / "merged", meta)
        else:
            save_hf_model(base, path, out, meta)
        shutil.rmtree(out / CKPT_DIR, ignore_errors=True)  # the run is complete; its output is exported
        _say(env, f"skipdecode train: wrote {out}" + (f" and {merged}" if merged else ""))
    env.barrier()
    return TrainResult(out, total, losses, val_loss, meta["schedules"], merged, model.eval())


def _rank_divergence(model: nn.Module) -> float:
    """Largest difference between any rank's trainable weights and rank 0's (0.0 under correct DDP)."""
    import torch.distributed as dist

    worst = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        if p.requires_grad:
            ref = p.detach().clone()
            dist.broadcast(ref, 0)
            worst = torch.maximum(worst, (p.detach() - ref).abs().max().double().reshape(1))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


# -- command line --------------------------------------------------------------------------------------
def add_train_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``train`` verb on the ``skipdecode`` command line."""
    from .schedule import parse_speedups
    from .validation import NON_NEGATIVE, POSITIVE, SEED, VAL_GROUPS, float_arg

    d = TrainConfig()
    t = subparsers.add_parser(
        "train", help="skip-aware fine-tuning (full or LoRA) with the inference schedule(s)",
        description="Teacher-forced fine-tuning where target position i runs exactly the layers of b(i), "
                    "as at generation. Writes a Hugging Face directory (or a PEFT adapter) to --output-dir.")
    t.add_argument("--model", default=d.model, help="'default', a local HF directory or a .gguf file")
    t.add_argument("--data", default=d.data,
                   help="e2e | e2e-names | scitldr | FILE.jsonl ({prompt, target}) | FILE.csv (mr,ref)")
    t.add_argument("--output-dir", "-o", default=None, help="where the run writes (required unless measuring)")
    s = t.add_mutually_exclusive_group()
    s.add_argument("--speedups", type=parse_speedups, default=d.speedups,
                   help="schedule targets drawn per batch, e.g. 1,2,3,4,5 (default 1,2,3)")
    s.add_argument("--schedule", dest="schedule_file", help="a fixed schedule JSON file instead")
    t.add_argument("--mode", choices=["skip", "early_exit"], default=d.mode)
    t.add_argument("--warmup-layers", type=NON_NEGATIVE, default=d.warmup_layers)
    t.add_argument("--horizon", type=POSITIVE, default=None, help="decay horizon H (default: expected new tokens - 1)")
    t.add_argument("--decay", type=float_arg(1, 2), default=d.decay,
                   help="solved schedules: preferred first budget / mean budget, in [1, 2] (1 = flat; default 1.5)")
    t.add_argument("--expected-new-tokens", type=POSITIVE, default=None,
                   help="length the schedules are solved for (default: median target length of the data)")
    t.add_argument("--distill", type=float_arg(0, 1), default=d.distill,
                   help="self-distillation weight in [0, 1]: the model at full depth (no gradient) teaches "
                        "each skipped step by KL on target tokens; the rest is cross-entropy (default 0)")
    t.add_argument("--distill-temperature", type=float_arg(0, lo_open=True), default=d.distill_temperature)
    t.add_argument("--lora", action="store_true", help="train LoRA adapters on wqkv, wo, w13, w2 (peft)")
    t.add_argument("--lora-r", type=POSITIVE, default=d.lora_r)
    t.add_argument("--lora-alpha", type=POSITIVE, default=d.lora_alpha)
    t.add_argument("--lora-dropout", type=float_arg(0, 1, hi_open=True), default=d.lora_dropout)
    t.add_argument("--merge", action="store_true", help="LoRA: also write the merged model to OUTPUT/merged")
    t.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard parameters, gradients and optimizer state (FSDP2) "
                        "instead of replicating them (DDP); full fine-tuning")
    t.add_argument("--steps", type=POSITIVE, default=None, help="optimizer steps (default: --epochs over the data)")
    t.add_argument("--epochs", type=float_arg(0, lo_open=True), default=d.epochs)
    t.add_argument("--batch-size", type=POSITIVE, default=d.batch_size, help="global examples per optimizer step")
    t.add_argument("--grad-accum", type=POSITIVE, default=d.grad_accum, help="micro-batches per step and rank")
    t.add_argument("--lr", type=float_arg(0, lo_open=True), default=None, help="peak learning rate (default 1e-4, LoRA 5e-4)")
    t.add_argument("--weight-decay", type=float_arg(0), default=d.weight_decay)
    t.add_argument("--warmup-steps", type=NON_NEGATIVE, default=None, help="linear LR warm-up (default 5%% of steps)")
    t.add_argument("--min-lr-ratio", type=float_arg(0, 1), default=d.min_lr_ratio)
    t.add_argument("--max-grad-norm", type=float_arg(0), default=d.max_grad_norm, help="0 disables clipping")
    t.add_argument("--seed", type=SEED, default=d.seed)
    t.add_argument("--max-length", type=POSITIVE, default=None)
    t.add_argument("--val-groups", type=VAL_GROUPS, default=None,
                   help="held-out groups (E2E MRs; default 60) or a fraction < 1")
    chat = t.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None)
    chat.add_argument("--no-chat", dest="chat", action="store_false")
    t.add_argument("--eval-examples", type=NON_NEGATIVE, default=d.eval_examples)
    t.add_argument("--save-every", type=NON_NEGATIVE, default=d.save_every, help="checkpoint every N steps (0: never)")
    t.add_argument("--keep-checkpoints", type=POSITIVE, default=d.keep_checkpoints)
    t.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    t.add_argument("--overwrite", action="store_true", help="discard a previous run in --output-dir")
    t.add_argument("--no-progress", dest="progress", action="store_false")
    t.add_argument("--measure-step-time", action="store_true",
                   help="only time one training step at full depth vs --measure-speedup on one batch")
    t.add_argument("--measure-speedup", type=float_arg(1), default=3.0)
    t.add_argument("--measure-repeats", type=POSITIVE, default=3)
    t.set_defaults(func=cmd_train)
    return t


def cmd_train(a: argparse.Namespace) -> int:
    names = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(a).items() if k in names and v is not None or k == "chat"})
    if a.output_dir is None and not a.measure_step_time:
        print("skipdecode: error: give --output-dir (-o) for the trained model", file=sys.stderr)
        return 2
    try:
        if a.measure_step_time:
            print(json.dumps(measure_cli(cfg, a.measure_speedup, a.measure_repeats), indent=2))
            return 0
        r = train(cfg)
    except SkipDecodeError as e:
        print(f"skipdecode: error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun, rank 0 reports
    print(json.dumps({"output_dir": str(r.output_dir), "steps": r.steps,
                      "final_loss": r.losses[-1] if r.losses else None,
                      "validation_loss": r.validation_loss,
                      "merged_dir": str(r.merged_dir) if r.merged_dir else None}))
    return 0


def measure_cli(cfg: TrainConfig, speedup: float = 3.0, repeats: int = 3) -> dict[str, Any]:
    """Step time at full depth vs ``speedup`` on the first ``batch_size`` training examples."""
    net, path = load_model(cfg.model)
    tok = load_tokenizer(path)
    task = load_task(cfg.data, val_groups=cfg.val_groups, seed=cfg.seed)
    items, _ = _tokenize(tok, task.train[: cfg.batch_size], cfg.chat, net.cfg.max_position)
    expected = cfg.expected_new_tokens or int(statistics.median(len(t) for _, t in items))
    L = net.cfg.n_layers
    sched = {"1x": SkipSchedule.full_depth(L),
             schedule_label(speedup): schedule_for_speedup(speedup, expected, L, cfg)}
    model = prepare_model(net, cfg)
    r = measure_step_time(model, items, sched, tokenizer_pad(tok), repeats)
    r["note"] = "step = forward + backward + AdamW update; prompt columns run every layer in both"
    r["model"], r["lora"], r["expected_new_tokens"] = str(path), cfg.lora, expected
    r["schedule"] = sched[schedule_label(speedup)].to_dict()
    r["threads"] = torch.get_num_threads()
    return r


def tokenizer_pad(tok: Any) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else 0
