"""The decoding loop: full-depth prefill, then one schedule step per token.

Every row of the batch runs the same layer set at a step (rule 1), budgets
never increase (rule 2), lower layers are skipped (rule 3). Prompts of
different lengths are left-padded so all rows write the same cache slot at
every step; each row keeps its own positions. A finished row leaves the batch
(its cache rows are dropped), it is not merely masked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .cache import KVCache, layer_slots
from .model import Transformer
from .schedule import SkipSchedule


class GenerationError(ValueError):
    """Bad generation input, with what to do about it."""


@dataclass
class Sampling:
    """Greedy when ``temperature == 0`` (the default)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise GenerationError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class RowResult:
    token_ids: list[int] = field(default_factory=list)
    # active_layers[i]: the layers generated token i ran when fed back; the
    # final token ends generation and is never fed, so its entry is [].
    active_layers: list[list[int]] = field(default_factory=list)
    finish_reason: str = "length"  # "length" | "eos" | "stop"
    seconds: float = 0.0

    num_layers: int = 0

    @property
    def decode_layer_speedup(self) -> float:
        """``L / mean`` layers over the tokens this row fed back."""
        ran = [len(a) for a in self.active_layers if a]
        return self.num_layers * len(ran) / sum(ran) if ran else 1.0


def sample(logits: torch.Tensor, s: Sampling, gens: Sequence[torch.Generator] = (),
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Next token per row from ``(B, vocab)`` logits.

    Sampling draws row ``b`` from its own generator ``gens[b]``, so a sampled
    request does not depend on which other requests share its batch. Greedy
    uses ``argmax`` (the model's, on the kernels) when given.
    """
    if s.temperature == 0:
        return argmax(logits) if argmax is not None else logits.argmax(dim=-1)
    logits = logits.float() / s.temperature
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= s.top_p  # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(gens)])


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_position: int) -> None:
    if not prompts:
        raise GenerationError("no prompts given")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for r, p in enumerate(prompts):
        if len(p) == 0:
            raise GenerationError(f"prompt {r} is empty: give at least one token")
        if len(p) + max_new_tokens - 1 > max_position:  # the last new token is never fed back
            raise GenerationError(
                f"prompt {r} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens - 1} positions but the model's context is {max_position}: "
                "shorten the prompt or lower max_new_tokens"
            )


@torch.inference_mode()
def generate_tokens(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    schedule: SkipSchedule,
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    eos_token_ids: Sequence[int] = (),
    stop: Callable[[int, list[int]], bool] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    pad_id: int = 0,
) -> tuple[list[RowResult], dict]:
    """Generate for a batch of token-id prompts. Returns per-row results and
    batch stats (prefill/decode seconds, KV bytes, steps).

    stop(row, token_ids) -> True ends that row (stop strings live there).
    on_token(row, token_id) is called for every new token (streaming).
    """
    cfg = model.cfg
    if schedule.num_layers != cfg.n_layers:
        raise GenerationError(f"schedule is for {schedule.num_layers} layers, the model has {cfg.n_layers}")
    check_prompts(prompts, max_new_tokens, cfg.max_position)
    sampling = sampling or Sampling()
    gens: list[torch.Generator] = []  # request r samples from seed + r, whatever its batch-mates
    if sampling.temperature > 0:
        base = sampling.seed if sampling.seed is not None else torch.seed() % 2**62
        gens = [torch.Generator().manual_seed(base + r) for r in range(len(prompts))]
    eos = set(eos_token_ids)
    dtype = next(model.parameters()).dtype
    t0 = time.perf_counter()

    B, P = len(prompts), max(len(p) for p in prompts)
    pad = torch.tensor([P - len(p) for p in prompts])
    tokens = torch.full((B, P), pad_id, dtype=torch.long)
    for r, p in enumerate(prompts):
        tokens[r, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
    slots = torch.arange(P + max_new_tokens)
    key_valid = slots[None, :] >= pad[:, None]  # (B, S): False on left padding
    positions = (torch.arange(P)[None, :] - pad[:, None]).clamp(min=0)
    cache = KVCache(B, cfg.n_kv_heads, cfg.head_dim, layer_slots(schedule, P, max_new_tokens),
                    P + max_new_tokens - 1, dtype)
    kv_bytes, kv_full = cache.nbytes, cache.full_nbytes

    results = [RowResult(num_layers=cfg.n_layers) for _ in prompts]
    rows = torch.arange(B)  # batch row -> request index
    padded = bool((pad > 0).any())

    logits = model(tokens, positions, None, cache=cache, start=0,
                   key_valid=key_valid[:, :P] if padded else None, last_only=True)
    t_prefill = time.perf_counter() - t0
    nxt = sample(logits[:, -1], sampling, gens, model.argmax)

    steps = 0
    for i in range(max_new_tokens):
        # record token i of every live row; decide who finishes
        keep = []
        ids = nxt.tolist()
        for b, req in enumerate(rows.tolist()):
            res = results[req]
            res.token_ids.append(ids[b])
            res.active_layers.append([])
            if on_token is not None:
                on_token(req, ids[b])
            done = None
            if ids[b] in eos:
                done = "eos"
            elif stop is not None and stop(req, res.token_ids):
                done = "stop"
            elif i + 1 == max_new_tokens:
                done = "length"
            if done:
                res.finish_reason = done
                res.seconds = time.perf_counter() - t0
            else:
                keep.append(b)
        if not keep:
            break
        if len(keep) < len(rows):  # finished rows leave the computation
            k = torch.tensor(keep)
            rows, nxt, pad, key_valid = rows[k], nxt[k], pad[k], key_valid[k]
            cache.keep_rows(k)
            padded = bool((pad > 0).any())
        # feed token i through the layers of b(i)
        layers = schedule.layers(i)
        run = set(layers)
        active = None if len(run) == cfg.n_layers else [int(l in run) for l in range(cfg.n_layers)]
        for req in rows.tolist():
            results[req].active_layers[i] = list(layers)
        start = P + i
        pos = (start - pad)[:, None]
        logits = model(nxt[:, None], pos, active, cache=cache, start=start,
                       key_valid=key_valid[:, : start + 1] if padded else None)
        nxt = sample(logits[:, -1], sampling, [gens[r] for r in rows.tolist()] if gens else (), model.argmax)
        steps += 1

    total = time.perf_counter() - t0
    stats = {"prefill_seconds": t_prefill, "decode_seconds": total - t_prefill, "seconds": total,
             "decode_steps": steps, "kv_cache_bytes": kv_bytes, "kv_cache_full_bytes": kv_full,
             "kv_cache_saved_bytes": kv_full - kv_bytes, "batch_size": B}
    return results, stats
