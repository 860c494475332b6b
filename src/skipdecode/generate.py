"""Static batches as a client of the engine: admit every prompt, step to the end.

There is one decode path (``engine/``): a static batch is continuous batching
whose requests all arrive at step 0. Each request gets its own KV slots (no
shared left padding), sized from the schedule; a request that finishes leaves
the batch at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .engine import Engine, EngineConfig, EngineError, SamplingParams, pool_for
from .engine.sampler import sample
from .model import Transformer
from .schedule import SkipSchedule

GenerationError = EngineError  # the error of bad generation input
Sampling = SamplingParams  # greedy when temperature == 0
# A static batch has no arrivals to admit: its steady greedy stretches run in the model's native
# loop, this many steps a call (EngineConfig.decode_burst; streamed text comes a burst at a time).
DECODE_BURST = 16

__all__ = ["GenerationError", "RowResult", "Sampling", "generate_tokens", "sample"]


@dataclass
class RowResult:
    token_ids: list[int] = field(default_factory=list)
    # active_layers[i]: the layers generated token i ran when fed back; the
    # final token ends generation and is never fed, so its entry is [].
    active_layers: list[list[int]] = field(default_factory=list)
    finish_reason: str = "length"  # "length" | "eos" | "stop"
    seconds: float = 0.0
    num_layers: int = 0
    decode_layer_speedup: float = 1.0
    text: str = ""
    draft: dict | None = None  # lossless: drafted/accepted tokens and the layer work (DraftStats.to_dict)


def generate_tokens(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    schedule: SkipSchedule | Sequence[SkipSchedule],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    eos_token_ids: Sequence[int] = (),
    on_token: Callable[[int, int], None] | None = None,
    on_text: Callable[[int, str], None] | None = None,
    policy: str = "per_row",
    tokenizer=None,
    stop: Sequence[str] = (),
    lossless: bool = False,
    draft_tokens: int | None = None,
    adaptive_threshold: float | None = None,
    draft_confidence: float | None = None,
    prompt_lookup: int | None = None,
) -> tuple[list[RowResult], dict]:
    """Generate for a batch of token-id prompts; returns per-row results and
    batch stats (prefill/decode seconds, KV bytes, decode steps).

    schedule: one for every row, or one per row. Sampled request ``r`` draws
    from seed ``sampling.seed + r``, whatever its batch-mates.
    on_token(row, token_id) is called for every new token; with a tokenizer,
    on_text(row, delta) for every piece of text (streaming; stop strings never shown).
    lossless: the schedule only drafts (``draft_tokens`` per round) and full depth
    verifies, so the tokens are full depth's (see ``engine.engine``); a round stops
    drafting early after a draft its pass gave less than ``draft_confidence``;
    ``prompt_lookup`` also drafts by prompt lookup (``policies.lookup``).
    adaptive_threshold: each row steps down its schedule only on tokens chosen with
    at least this top-1 probability (see ``policies.adaptive``).
    """
    if not prompts:
        raise GenerationError("no prompts given")
    scheds = list(schedule) if isinstance(schedule, (list, tuple)) else [schedule] * len(prompts)
    if len(scheds) != len(prompts):
        raise GenerationError(f"{len(scheds)} schedules for {len(prompts)} prompts")
    sampling = sampling or Sampling()
    base = sampling.seed
    if not sampling.greedy and base is None:
        base = torch.seed() % 2**62
    # validate every request first (a one-slot engine), then size the pool to hold them all exactly
    probe = Engine(model, EngineConfig(kv_slots=1), tokenizer=tokenizer)
    requests = []
    for r, (p, s) in enumerate(zip(prompts, scheds)):
        row_sampling = sampling if sampling.greedy else Sampling(sampling.temperature, sampling.top_k,
                                                                 sampling.top_p, base + r)
        try:
            requests.append(probe.make_request(p, s, max_new_tokens, row_sampling, stop, request_id=str(r),
                                               lossless=lossless, draft_tokens=draft_tokens,
                                               adaptive_threshold=adaptive_threshold,
                                               draft_confidence=draft_confidence,
                                               prompt_lookup=prompt_lookup))
        except EngineError as e:
            raise GenerationError(f"prompt {r}: {e}") from None
    lens = [len(q.prompt_token_ids) for q in requests]
    cfg = EngineConfig(max_num_seqs=len(prompts), max_prefill_tokens=sum(lens), policy=policy, decode_burst=DECODE_BURST,
                       kv_slots=pool_for([q.kv_schedule for q in requests], lens, [max_new_tokens] * len(requests)))
    engine = Engine(model, cfg, tokenizer=tokenizer, eos_token_ids=eos_token_ids)
    for q in requests:
        engine.add(q)
    L = model.cfg.n_layers
    kv_bytes = engine.pool.nbytes
    kv_full = engine.pool.slot_bytes * L * sum(n + max_new_tokens - 1 for n in lens)
    t0 = time.perf_counter()
    results = [RowResult(num_layers=L) for _ in prompts]
    first_step_done = None
    step_seconds: list[float] = []  # each decode step's wall time, after the first step
    while engine.has_unfinished():
        t_step, steps_before = time.perf_counter(), engine.step_count
        for out in engine.step():
            r = int(out.request_id)
            if on_token is not None:
                for tok in out.new_token_ids:
                    on_token(r, tok)
            if on_text is not None and out.text_delta:
                on_text(r, out.text_delta)
            if out.finished:
                res = results[r]
                res.token_ids, res.active_layers = out.token_ids, out.active_layers
                res.finish_reason, res.seconds = out.finish_reason, out.finish_time - t0
                res.decode_layer_speedup, res.text = out.decode_layer_speedup, out.text
                if out.draft is not None:
                    res.draft = out.draft.to_dict(L, len(out.token_ids) - 1)
        if first_step_done is None:
            first_step_done = time.perf_counter()
        else:  # a burst of decode steps (EngineConfig.decode_burst): each its share of the call
            n = engine.step_count - steps_before
            step_seconds += [(time.perf_counter() - t_step) / n] * n
    total = time.perf_counter() - t0
    c = engine.counters
    stats = {"prefill_seconds": (first_step_done or t0) - t0, "decode_seconds": total - ((first_step_done or t0) - t0),
             "seconds": total, "decode_steps": c["decode_steps"], "kv_cache_bytes": kv_bytes,
             "kv_cache_full_bytes": kv_full, "kv_cache_saved_bytes": kv_full - kv_bytes,
             "batch_size": len(prompts), "engine_steps": engine.step_count,
             "drafted_tokens": c["drafted_tokens"], "accepted_tokens": c["accepted_tokens"],
             "verify_rounds": c["verify_rounds"], "step_seconds": step_seconds}
    return results, stats
