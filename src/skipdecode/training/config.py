"""A training run's settings (``TrainConfig``, validated in one place), its result, and the schedules it trains with."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Sequence

from torch import nn

from ..errors import SkipDecodeError
from ..policies import select
from ..schedule import DEFAULT_DECAY, SkipSchedule
from ..validation import SEED_MAX, check_float, check_int

MIXED_PRECISION = ("no", "bf16")

# Settings that change the training trajectory: a resumed run must keep them.
_RESUME_KEYS = ("model", "data", "speedups", "schedule_file", "mode", "warmup_layers", "horizon", "decay",
                "expected_new_tokens", "lora", "lora_r", "lora_alpha", "lora_dropout", "lora_norms", "steps", "epochs",
                "batch_size", "grad_accum", "lr", "weight_decay", "warmup_steps", "min_lr_ratio",
                "max_grad_norm", "seed", "max_length", "val_groups", "chat", "fsdp", "distill",
                "distill_temperature", "mixed_precision")


class TrainError(SkipDecodeError):
    """A training run that cannot start or continue as asked."""


@dataclass
class TrainConfig:
    """Every setting of a run; ``skipdecode.json`` records it next to the weights."""

    model: str = "default-e2e"  # the shipped skip-trained model; "default" is the base it was trained from
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
    lora_norms: bool = False  # LoRA: also train every norm's weight whole (a few KB per layer)
    merge: bool = False  # LoRA: also write the merged full model to output_dir/merged
    fsdp: bool = False  # under torchrun: shard parameters, gradients and optimizer state (FSDP2), not DDP
    # "bf16": forward and backward matmuls in bfloat16 under torch.autocast (fast where the CPU has AMX or
    # AVX-512-BF16); weights, gradients, optimizer state and the loss stay fp32
    mixed_precision: str = "no"
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
        check_float("decay", self.decay, 1, error=E)
        check_float("distill", self.distill, 0, 1, error=E)
        check_float("distill_temperature", self.distill_temperature, 0, lo_open=True, error=E)
        if self.val_groups is not None:
            check_float("val_groups", self.val_groups, 0, lo_open=True, error=E)
        if self.mixed_precision not in MIXED_PRECISION:
            raise E(f"mixed_precision must be one of {MIXED_PRECISION}, got {self.mixed_precision!r}")
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


def schedule_label(target: float) -> str:
    return f"{target:g}x"


def schedule_for_speedup(target: float, expected_new_tokens: int, num_layers: int, cfg: TrainConfig) -> SkipSchedule:
    """1x is full depth; other targets are solved by ``SkipSchedule.for_speedup``
    with the run's horizon, warm-up, mode and decay."""
    return select.schedule_for_speedup(target, num_layers, expected_new_tokens, horizon=cfg.horizon,
                                       warmup_layers=cfg.warmup_layers, mode=cfg.mode, decay=cfg.decay)


def draw_schedule(labels: Sequence[str], seed: int, step: int) -> str:
    """The schedule of an optimizer step: a pure function of (seed, step), so resume and ranks agree."""
    return random.Random(f"skipdecode-schedule:{seed}:{step}").choice(list(labels))


def schedule_draws(cfg: TrainConfig, schedules: dict[str, SkipSchedule]) -> list[str]:
    """The labels an optimizer step draws from, each equally likely: a target listed twice
    (``--speedups 1,1,2,3``) is drawn twice as often, which weights the training toward it."""
    return [schedule_label(t) for t in cfg.speedups] if not cfg.schedule_file else list(schedules)


def build_schedules(cfg: TrainConfig, num_layers: int, expected_new_tokens: int) -> dict[str, SkipSchedule]:
    if cfg.schedule_file:
        s = SkipSchedule.from_file(cfg.schedule_file, num_layers)
        return {f"{s.decode_layer_speedup(expected_new_tokens):.2f}x": s}
    if not cfg.speedups:
        raise TrainError("give at least one speedup (e.g. --speedups 1,2,3) or --schedule")
    return {schedule_label(t): schedule_for_speedup(t, expected_new_tokens, num_layers, cfg) for t in cfg.speedups}


def _check_resume(saved: dict, cfg: TrainConfig) -> None:
    cur = asdict(cfg)
    keys = [k for k in _RESUME_KEYS if cfg.lora or not k.startswith("lora_")]  # unused without --lora
    default = asdict(TrainConfig())  # a setting added later: older runs used its default
    diff = [k for k in keys if saved.get(k, default.get(k)) != cur.get(k)]
    if diff:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {cur.get(k)!r}" for k in diff)
        raise TrainError(f"cannot resume: settings differ from the checkpointed run ({shown})")



@dataclass
class TrainingRecord:
    """What a trained model's ``skipdecode.json`` holds. Generation reads ``schedules`` (a target
    speedup the model was trained at means exactly that schedule) and ``expected_new_tokens``;
    the rest documents the run."""

    base_model: str
    data: str
    num_layers: int
    expected_new_tokens: int
    warmup_steps: int
    total_steps: int
    schedules: dict[str, dict]
    decode_layer_speedup: dict[str, float]
    train_examples: int
    world_size: int
    lr: float
    config: dict
    skipdecode_training: bool = True
    steps_done: int | None = None
    final_loss: float | None = None
    validation_loss: dict[str, float] = field(default_factory=dict)
    seconds: float | None = None
    tokens_seen: int | None = None
    max_abs_diff_across_ranks: float | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> "TrainingRecord":
        """Read a record back; unknown keys (from a newer version) are ignored, missing required ones refused."""
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as e:
            raise TrainError(f"skipdecode.json is not a training record: {e}") from None
