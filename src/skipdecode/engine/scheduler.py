"""Which requests run in a step, and which rows run which layers.

Policy, no mechanism: the scheduler never touches the model or a tensor. Each
step it

1. admits waiting requests first come, first served, while the number of
   running requests and the KV pool allow (a request's KV is reserved whole at
   admission, so a running request never runs out);
2. plans prompt chunks at full depth up to a token budget per step (a
   prefix whose keys/values are cached is skipped), so the
   time per output token of running requests stays bounded while long prompts
   arrive; chunk boundaries are fixed multiples of ``prefill_chunk`` from the
   prompt's start, so a prompt's numerics never depend on its batch-mates;
3. gives every decoding row a budget and orders rows by it, deepest first;
4. lists the lossless requests whose drafts are ready: the runner verifies
   each round's positions at full depth as rows of the decode pass, ahead
   of the decoding rows.

Budgets, two policies:

- ``per_row`` (ours): each request feeds its next token with the budget of
  its *own* schedule at its own position. Its budget never increases, so every
  key/value it reads exists, whatever its batch-mates do. Layer ``l`` runs on
  the rows whose layer set holds it; with rows ordered by budget these are a
  leading block for any one layer family (skip, early exit, a nested order). A step costs the sum of the
  rows' budgets, not the maximum.
- ``shared`` (the paper's rule, kept for comparison): the whole step runs one
  layer set, the lowest next budget of the batch, never above what any row
  ran before (so no row's budget ever increases). Requests then get less depth
  than their schedules ask whenever a shallower request shares their step.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .kv_cache import KVPool, layer_needs
from .request import EngineError, Request, RequestState, Status

POLICIES = ("per_row", "shared")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 32  # requests running at once (prefilling or decoding)
    max_prefill_tokens: int = 256  # prompt tokens per step, over all chunks (at least one chunk runs)
    prefill_chunk: int = 128  # prompt chunk length; boundaries at multiples of it
    policy: str = "per_row"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_prefill_tokens", "prefill_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EngineError(f"{name} must be an integer >= 1, got {v!r}")
        if self.policy not in POLICIES:
            raise EngineError(f"policy must be one of {POLICIES}, got {self.policy!r}")


@dataclass
class StepPlan:
    """One step: prompt chunks to run, and the decoding rows with their layers."""

    step: int
    admitted: list[RequestState] = field(default_factory=list)
    cached: list[RequestState] = field(default_factory=list)  # prompt prefixes to copy from the prefix cache
    prefill: list[tuple[RequestState, int, int]] = field(default_factory=list)  # (request, start, end)
    verify: list[RequestState] = field(default_factory=list)  # lossless rounds to verify: rows before ``decode``
    decode: list[RequestState] = field(default_factory=list)  # deepest budget first
    budgets: list[int] = field(default_factory=list)  # per decode row
    # per layer, over the verifying rows then the decode rows: (n, None) = rows 0..n-1 run it;
    # (n, indices) = exactly those rows; n == 0: no row
    layers: list[tuple[int, list[int] | None]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode and not self.verify


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: KVPool, num_layers: int,
                 prefix_lookup: Callable[[Sequence[int]], int] | None = None):
        """``prefix_lookup(prompt)``: how many leading prompt tokens already have
        keys/values to copy (the prefix cache); they are not prefilled."""
        self.config, self.pool, self.num_layers = config, pool, num_layers
        self.prefix_lookup = prefix_lookup
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []

    # -- requests --------------------------------------------------------------
    def needs(self, r: Request) -> list[int]:
        return layer_needs(r.kv_schedule, len(r.prompt_token_ids), r.max_new_tokens)

    def check_fits(self, st: RequestState) -> None:
        """A request that could never be admitted is an error now, not a hang later."""
        self.check_capacity(st.request)
        if self.config.policy == "shared" and st.request.lossless:
            raise EngineError("lossless requests need the per_row policy: the shared policy runs one layer set "
                              "per step, and a verified request must run every layer")
        if self.config.policy == "shared" and _skips(st):
            kinds = {_kind(o.request.schedule) for o in self.running + list(self.waiting) if _skips(o)}
            if kinds and kinds != {_kind(st.request.schedule)}:
                raise EngineError("the shared policy runs one layer set per step: every request that skips needs "
                                  "the same mode and warm-up layers (or nested layer order); use the per_row policy "
                                  "to mix them")

    def check_capacity(self, r: Request) -> None:
        """Whether the request fits the empty pool; reads no queue, so any thread may call it."""
        needs = self.needs(r)
        if not self.pool.fits_empty(needs):
            worst = max(range(len(needs)), key=lambda l: needs[l] - self.pool.capacities[l])
            raise EngineError(
                f"request {r.request_id!r} needs {needs[worst]} KV slots at layer {worst} "
                f"({len(r.prompt_token_ids)} prompt tokens + up to {r.max_new_tokens - 1} fed back) but the pool "
                f"holds {self.pool.capacities[worst]}: shorten the prompt, lower max_new_tokens or enlarge the pool")

    def add(self, st: RequestState) -> None:
        self.check_fits(st)
        self.waiting.append(st)

    def remove(self, st: RequestState) -> None:
        """Take a request out (finished or aborted) and free its KV at once."""
        if st in self.waiting:
            self.waiting.remove(st)
        if st in self.running:
            self.running.remove(st)
        if st.reservation is not None:
            self.pool.release(st.reservation)
            st.reservation = None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- a step ------------------------------------------------------------------
    def schedule(self, step: int) -> StepPlan:
        plan = StepPlan(step)
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_num_seqs:  # first come, first served
            st = self.waiting[0]
            res = self.pool.reserve(self.needs(st.request))
            if res is None:
                break  # the head waits for KV; nobody overtakes it
            self.waiting.popleft()
            st.reservation, st.status = res, Status.PREFILL
            st.scheduled_time = time.perf_counter()
            self.running.append(st)
            plan.admitted.append(st)

        budget = cfg.max_prefill_tokens
        for st in self.running:  # prompts in admission order; a later one never overtakes an unfinished one
            if st.status is not Status.PREFILL:
                continue
            first = st.cached_prefix is None
            # a prompt's cached prefix is looked up when its first chunk runs, so it
            # sees the prefixes of every prompt that finished before
            start = (self.prefix_lookup(st.request.prompt_token_ids) if self.prefix_lookup else 0) if first \
                else st.prefilled
            pos = start
            while pos < st.prompt_len:
                end = min(st.prompt_len, (pos // cfg.prefill_chunk + 1) * cfg.prefill_chunk)
                if end - pos > budget and plan.prefill:
                    break
                plan.prefill.append((st, pos, end))
                budget -= end - pos
                pos = end
            if first and pos > start:
                st.cached_prefix = st.prefilled = start
                if start:
                    plan.cached.append(st)
            if pos < st.prompt_len or budget <= 0:
                break

        plan.verify = [st for st in self.running if st.status is Status.DECODE and st.verifying]
        rows = [st for st in self.running if st.status is Status.DECODE and not st.verifying]
        if rows:
            own = [st.next_own_budget() for st in rows]
            kinds = [_kind(st.request.schedule) for st in rows]
            if cfg.policy == "shared":
                b = min(own + [st.budgets[-1] for st in rows if st.budgets])
                budgets = [b] * len(rows)
                shared = next((_kind(st.request.schedule) for st in rows if _skips(st)),
                              tuple(range(self.num_layers)))
                kinds = [shared] * len(rows)
                for st in rows:  # a full-depth request runs the shared layer sets
                    st.layer_ranks = shared
            else:
                budgets = own
            order = sorted(range(len(rows)), key=lambda r: -budgets[r])  # stable: ties keep arrival order
            plan.decode = [rows[r] for r in order]
            plan.budgets = [budgets[r] for r in order]
            kinds = [kinds[r] for r in order]
        else:
            kinds = []
        if rows or plan.verify:  # verifying rows (every position of a round) run every layer and come first
            n = sum(len(st.drafts) + 1 for st in plan.verify)
            plan.layers = self._layer_rows([self.num_layers] * n + plan.budgets,
                                           [tuple(range(self.num_layers))] * n + kinds)
        return plan

    def burst(self, plan: StepPlan, steps: int) -> list[tuple[int, list[int]]]:
        """The decode steps from ``plan`` on (at most ``steps``) that a steady batch can run as a
        burst: each step's one budget and the layers every row runs (``_layer_rows`` of the
        budgets the rows' schedules give, as ``schedule`` would plan them). It ends before a
        step whose rows would run different layers. ``plan`` must be decode rows only, under the
        per_row policy, of requests whose budgets follow their schedules alone."""
        rows, L = plan.decode, self.num_layers
        kinds = [_kind(st.request.schedule) for st in rows]
        out = []
        for s in range(steps):
            budgets = plan.budgets if s == 0 else [st.request.schedule.budget(st.fed_index + s) for st in rows]
            if len(set(budgets)) != 1:
                break
            layers = self._layer_rows(budgets, kinds)
            if any(idx is not None or n not in (0, len(rows)) for n, idx in layers):
                break
            out.append((budgets[0], [l for l in range(L) if layers[l][0]]))
        return out

    def _layer_rows(self, budgets: list[int], kinds: list[tuple[int, ...]]) -> list[tuple[int, list[int] | None]]:
        """Per layer, how many rows run it and which: a leading block (rows are ordered by
        budget) when every partial-depth row shares one layer family, else their indices.
        ``kinds[r]`` is row ``r``'s family as layer ranks (``SkipSchedule.ranks``)."""
        L = self.num_layers
        partial = {k for k, b in zip(kinds, budgets) if b < L}  # a full-depth row runs every layer, whatever its kind
        if len(partial) <= 1:  # one family: each layer's rows are a leading block
            ranks = partial.pop() if partial else tuple(range(L))
            neg = sorted(-b for b in budgets)  # rows with b > rank: those with -b < -rank
            return [(bisect.bisect_left(neg, -ranks[l]), None) for l in range(L)]
        out = []
        for l in range(L):
            idx = [r for r, (ranks, b) in enumerate(zip(kinds, budgets)) if ranks[l] < b]
            out.append((len(idx), None if idx == list(range(len(idx))) else idx))
        return out


def _kind(s) -> tuple[int, ...]:
    """A schedule's layer family (its layer ranks): what, with a budget, fixes a layer set."""
    return s.ranks


def _skips(st: RequestState) -> bool:
    s = st.request.schedule
    return s.min_exit_layer < s.num_layers
