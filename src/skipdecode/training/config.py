"""A training run's settings (``TrainConfig``, validated in one place), its result, and the schedules it trains with."""

from __future__ import annotations

import random
import re
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
_RESUME_KEYS = ("model", "data", "speedups", "schedule_file", "mode", "importance", "importance_examples",
                "warmup_layers",
                "horizon", "decay",
                "expected_new_tokens", "lora", "qat", "lora_r", "lora_alpha", "lora_dropout", "lora_norms", "steps", "epochs",
                "batch_size", "grad_accum", "lr", "weight_decay", "warmup_steps", "min_lr_ratio",
                "max_grad_norm", "seed", "split_seed", "max_length", "val_groups", "chat", "fsdp", "distill",
                "distill_temperature", "mixed_precision", "augment_names")


class TrainError(SkipDecodeError):
    """A training run that cannot start or continue as asked."""


def _opt(default, help: str, **meta):
    """A setting with its ``--help`` text: the command line is derived from these
    fields (``transformers.HfArgumentParser``), never kept by hand beside them."""
    if isinstance(default, list):
        return field(default_factory=lambda d=tuple(default): list(d), metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class TrainConfig:
    """Every setting of a run; ``skipdecode.json`` records it next to the weights.
    ``skipdecode train`` takes each field as a flag (``--lora-r 32``) or from a
    recipe file (``--config recipes/default-e2e.yaml``)."""

    model: str = _opt("default-e2e", "'default-e2e' (shipped, skip-trained), 'default' (its base), a pulled "
                                     "model (skipdecode pull), a local HF directory or a .gguf file")
    data: str = _opt("e2e", "e2e | e2e-names | e2e-heldout (train part; select validates) | scitldr | FILE.jsonl ({prompt, target}) | FILE.csv (mr,ref)")
    output_dir: str = _opt("runs/train", "where the run writes its checkpoints and the trained model",
                           aliases=["-o"])
    # schedules
    speedups: list[float] = _opt([1.0, 2.0, 3.0], "schedule targets drawn per batch, e.g. 1,2,3,4,5; a target "
                                                   "listed twice is drawn twice as often")
    schedule_file: str | None = _opt(None, "a fixed schedule JSON file instead of --speedups",
                                     aliases=["--schedule"])
    mode: str = _opt("skip", "skip (the lower layers), early_exit (the upper ones) or nested (the least "
                             "influential ones, measured on the training data before training)",
                     choices=["skip", "early_exit", "nested"])
    importance: str = _opt("influence", "mode nested: how the layer order is measured: influence (Block Influence, "
                                        "1 - cos of a layer's input and output), removal (greedy removal by "
                                        "answer loss, SLEB-style; minutes), or model (kept from a model "
                                        "trained nested: the order in its skipdecode.json)",
                           choices=["influence", "removal", "model"])
    importance_examples: int = _opt(64, "mode nested: training examples the layer order is measured on")
    warmup_layers: int = _opt(1, "layers every token runs before the skipped block")
    # self-distillation: the same model at full depth (no gradient) teaches each skipped step
    distill: float = _opt(0.0, "self-distillation weight in [0, 1]: the model at full depth (no gradient) teaches "
                               "each skipped step by KL on target tokens; the rest is cross-entropy")
    distill_temperature: float = _opt(1.0, "temperature of the distillation KL")
    horizon: int | None = _opt(None, "decay horizon H (default: expected new tokens - 1)")
    decay: float = _opt(DEFAULT_DECAY, "solved schedules: preferred first budget / mean budget, >= 1 (1 = flat); "
                                       "with a short --horizon, a decay >= the target starts at full depth")
    expected_new_tokens: int | None = _opt(None, "length the schedules are solved for (default: median target "
                                                 "length of the data)")
    # parameters
    lora: bool = _opt(False, "train LoRA adapters on wqkv, wo, w13, w2 (peft) instead of every weight")
    lora_r: int = _opt(16, "LoRA rank")
    lora_alpha: int = _opt(32, "LoRA alpha")
    lora_dropout: float = _opt(0.05, "LoRA dropout")
    lora_norms: bool = _opt(False, "LoRA: also train every norm's weight whole (a few KB per layer)")
    qat: str = _opt("no", "int4: quantization-aware full fine-tuning; the block linears' forward uses their "
                          "int4 rounding (--dtype int4's, Q4_0), gradients pass straight through, and the "
                          "written weights are that rounding", choices=["no", "int4"])
    merge: bool = _opt(False, "LoRA: also write the merged full model to OUTPUT_DIR/merged")
    fsdp: bool = _opt(False, "under torchrun: shard parameters, gradients and optimizer state (FSDP2) instead of "
                             "replicating them (DDP); full fine-tuning")
    mixed_precision: str = _opt("no", "bf16: matmuls and attention in bfloat16 (torch.autocast), faster where the "
                                      "CPU has AMX or AVX-512-BF16; weights, gradients, optimizer state and the "
                                      "loss stay fp32", choices=list(MIXED_PRECISION))
    device: str = _opt("cpu", "where the steps run: cpu, or cuda / cuda:N (one GPU, one process; fp32 matmuls "
                              "stay fp32, TF32 off). The data order and schedule draws are the same as on the "
                              "CPU; sums round in another order and LoRA dropout draws other masks")
    # optimization
    steps: int | None = _opt(None, "optimizer steps (default: --epochs over the training data)")
    epochs: float = _opt(1.0, "passes over the training data when --steps is unset")
    batch_size: int = _opt(16, "global examples per optimizer step (all ranks, all micro-batches)")
    grad_accum: int = _opt(1, "micro-batches per step and rank")
    lr: float | None = _opt(None, "peak learning rate (default 1e-4; LoRA 5e-4)")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    warmup_steps: int | None = _opt(None, "linear learning-rate warm-up (default: 5%% of the steps)")
    min_lr_ratio: float = _opt(0.0, "the cosine schedule decays to lr * min_lr_ratio")
    max_grad_norm: float = _opt(1.0, "gradient clipping (0 disables it)")
    seed: int = _opt(0, "seed of data order, schedule draws and LoRA init")
    split_seed: int = _opt(0, "seed of the train/validation split of E2E and JSONL data (evaluate --seed names "
                              "the same split); apart from --seed, so that a run at another seed never trains "
                              "on the names or MRs a model is scored on")
    # data
    max_length: int | None = _opt(None, "drop longer examples (default: the model's context)")
    augment_names: float = _opt(0.0, "E2E: the probability that a drawn example gets fresh synthetic names in "
                                     "name[...] and near[...], in its reference too, so that names are copied "
                                     "from the input rather than recalled from the few in training")
    val_groups: float | None = _opt(None, "held-out groups (E2E: MRs, default 60), or a fraction < 1")
    chat: bool | None = _opt(None, "use the chat template (default: when the tokenizer has one)")
    eval_examples: int = _opt(32, "validation loss per schedule at the end (0: none)")
    # checkpoints and output
    save_every: int = _opt(50, "checkpoint every N steps (0: never)")
    keep_checkpoints: int = _opt(1, "checkpoints kept")
    resume: bool = _opt(False, "continue from the last checkpoint in --output-dir")
    overwrite: bool = _opt(False, "discard a previous run in --output-dir")
    progress: bool = _opt(True, "a progress bar")

    def validate(self) -> "TrainConfig":
        """Every field typed, finite and in range (the API's one check; the CLI's flags match it)."""
        E = TrainError
        for name, lo in (("batch_size", 1), ("grad_accum", 1), ("lora_r", 1), ("lora_alpha", 1),
                         ("save_every", 0), ("keep_checkpoints", 1), ("eval_examples", 0), ("warmup_layers", 0),
                         ("importance_examples", 1)):
            check_int(name, getattr(self, name), lo, error=E)
        for name in ("steps", "horizon", "expected_new_tokens", "max_length"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1, error=E,
                          hint=" (leave it unset for the default)" if name != "steps" else
                          " (leave it unset to train --epochs over the data)")
        if self.warmup_steps is not None:
            check_int("warmup_steps", self.warmup_steps, 0, error=E)
        check_int("seed", self.seed, 0, SEED_MAX - 1, error=E)
        check_int("split_seed", self.split_seed, 0, SEED_MAX - 1, error=E)
        if self.lr is not None:
            check_float("lr", self.lr, 0, lo_open=True, error=E)
        check_float("epochs", self.epochs, 0, lo_open=True, error=E)
        check_float("weight_decay", self.weight_decay, 0, error=E)
        check_float("min_lr_ratio", self.min_lr_ratio, 0, 1, error=E)
        check_float("max_grad_norm", self.max_grad_norm, 0, error=E, hint=" (0 disables clipping)")
        check_float("lora_dropout", self.lora_dropout, 0, 1, hi_open=True, error=E)
        check_float("decay", self.decay, 1, error=E)
        check_float("distill", self.distill, 0, 1, error=E)
        check_float("augment_names", self.augment_names, 0, 1, error=E)
        check_float("distill_temperature", self.distill_temperature, 0, lo_open=True, error=E)
        if self.val_groups is not None:
            check_float("val_groups", self.val_groups, 0, lo_open=True, error=E)
        if self.mixed_precision not in MIXED_PRECISION:
            raise E(f"mixed_precision must be one of {MIXED_PRECISION}, got {self.mixed_precision!r}")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise E(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.mode not in ("skip", "early_exit", "nested"):
            raise E(f"mode must be 'skip', 'early_exit' or 'nested', got {self.mode!r}")
        if self.importance not in ("influence", "removal", "model"):
            raise E(f"importance must be 'influence', 'removal' or 'model', got {self.importance!r}")
        if self.qat not in ("no", "int4"):
            raise E(f"qat must be 'no' or 'int4', got {self.qat!r}")
        if self.qat != "no" and self.lora:
            raise E("--qat int4 trains every weight through its rounding; LoRA adapters merged afterwards would be "
                    "rounded again, untrained: drop --lora")
        if self.qat != "no" and self.fsdp:
            raise E("--qat int4 rounds whole weights; --fsdp shards them: train unsharded (DDP: drop --fsdp)")
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


def schedule_for_speedup(target: float, expected_new_tokens: int, num_layers: int, cfg: TrainConfig,
                         layer_order: tuple[int, ...] | None = None) -> SkipSchedule:
    """1x is full depth; other targets are solved by ``SkipSchedule.for_speedup``
    with the run's horizon, warm-up, mode (and, nested, its measured layer order) and decay."""
    return select.schedule_for_speedup(target, num_layers, expected_new_tokens, horizon=cfg.horizon,
                                       warmup_layers=cfg.warmup_layers, mode=cfg.mode, decay=cfg.decay,
                                       layer_order=layer_order)


def draw_schedule(labels: Sequence[str], seed: int, step: int) -> str:
    """The schedule of an optimizer step: a pure function of (seed, step), so resume and ranks agree."""
    return random.Random(f"skipdecode-schedule:{seed}:{step}").choice(list(labels))


def schedule_draws(cfg: TrainConfig, schedules: dict[str, SkipSchedule]) -> list[str]:
    """The labels an optimizer step draws from, each equally likely: a target listed twice
    (``--speedups 1,1,2,3``) is drawn twice as often, which weights the training toward it."""
    return [schedule_label(t) for t in cfg.speedups] if not cfg.schedule_file else list(schedules)


def build_schedules(cfg: TrainConfig, num_layers: int, expected_new_tokens: int,
                    layer_order: tuple[int, ...] | None = None) -> dict[str, SkipSchedule]:
    if cfg.schedule_file:
        s = SkipSchedule.from_file(cfg.schedule_file, num_layers)
        return {f"{s.decode_layer_speedup(expected_new_tokens):.2f}x": s}
    if not cfg.speedups:
        raise TrainError("give at least one speedup (e.g. --speedups 1,2,3) or --schedule")
    return {schedule_label(t): schedule_for_speedup(t, expected_new_tokens, num_layers, cfg, layer_order)
            for t in cfg.speedups}


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
    layer_influence: list[float] | None = None  # mode nested: each layer's measured Block Influence
    removal_loss: list[float] | None = None  # mode nested, importance removal: answer loss per budget L-1, L-2, ...

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
