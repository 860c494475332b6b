"""Batch layout for teacher forcing with a skip schedule, the objective, and the data order
(pure functions of seed and step)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..data import IGNORE, encode_example, left_pad
from ..schedule import SkipSchedule
from .config import TrainError


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

    def to(self, device: torch.device | str) -> "Batch":
        """The same batch with its tensors on ``device`` (laid out on the CPU, run where the model is)."""
        if torch.device(device).type == "cpu":
            return self
        mv = {k: getattr(self, k).to(device, non_blocking=True) for k in ("tokens", "positions", "labels")}
        return replace(self, **mv, key_valid=None if self.key_valid is None else self.key_valid.to(device))


def active_lengths(schedule: SkipSchedule, t0: int, max_target: int) -> list[int]:
    """Per layer: all ``t0`` prompt columns plus the target inputs ``j < max_target - 1`` that run it."""
    fed = max(max_target - 1, 0)  # the last target token is only a label, never an input
    return [t0 + schedule.steps_using_layer(layer, fed) for layer in range(schedule.num_layers)]


def make_batch(items: Sequence[tuple[Sequence[int], Sequence[int]]], schedule: SkipSchedule,
               pad_id: int = 0) -> Batch:
    """Lay out ``(prompt_ids, target_ids)`` pairs as in the module docstring."""
    if not items:
        raise TrainError("empty batch")
    n_max = max(len(t) for _, t in items)
    if max(len(p) for p, _ in items) < 1 or min(len(t) for _, t in items) < 1:
        raise TrainError("every example needs at least one prompt token and one target token")
    lay = left_pad(items, pad_id)
    tokens, positions, labels, t0 = lay.tokens, lay.positions, lay.labels, lay.t0
    W = tokens.shape[1]
    key_valid = None if bool(lay.key_valid.all()) else lay.key_valid
    active = active_lengths(schedule, t0, n_max)
    n_target = sum(len(t) for _, t in items)
    return Batch(tokens, positions, labels, key_valid, None if all(a == W for a in active) else active,
                 t0, n_target, sum(len(p) + len(t) - 1 for p, t in items))


def autocast(mixed_precision: str = "no", device: str = "cpu") -> torch.autocast:
    """The forward pass's precision: ``bf16`` runs matmuls and attention in
    bfloat16 (torch.autocast on the run's device); parameters stay fp32, so gradients
    and AdamW's state do too, and the loss is taken in fp32 (``logits.float()``)."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=mixed_precision == "bf16")


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


def _tokenize(tokenizer: Any, task_rows, chat: bool | None, max_length: int, kept: list | None = None
              ) -> tuple[list, int]:
    """``(items, dropped)``: the rows that fit ``max_length`` as ``(prompt_ids, target_ids)``; the
    rows themselves are appended to ``kept`` when given (one per item)."""
    out, dropped = [], 0
    for ex in task_rows:
        p, t = encode_example(tokenizer, ex.prompt, ex.target, chat)
        if len(p) + len(t) - 1 > max_length:
            dropped += 1
            continue
        out.append((p, t))
        if kept is not None:
            kept.append(ex)
    return out, dropped


def _micro_batches(items: list, n: int) -> Iterator[list]:
    size = len(items) // n
    for k in range(n):
        yield items[k * size:(k + 1) * size]


def tokenizer_pad(tok: Any) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else 0

