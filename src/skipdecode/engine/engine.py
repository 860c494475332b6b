"""The serving engine: continuous batching where every request keeps its own
monotone schedule.

``Engine.step()`` admits waiting requests, runs prompt chunks and one decode
position for every generating request (each on its own layers), samples, and
returns what each request produced. ``LLM.generate`` is a client (admit all,
step to the end); ``AsyncEngine`` runs the same loop in a thread for a server
and streams each request's outputs to an ``async for``.

Lossless requests (self-speculative decoding, batched): the request's skip
schedule *drafts* up to ``draft_tokens`` tokens, one decode row per step like
any other request, then full depth verifies its last verified token and the
drafts, as consecutive rows of the next decode pass. Greedy keeps the
longest prefix of drafts that full depth agrees with, plus full depth's own
token at the first disagreement; sampled requests use the speculative-sampling
rule (Leviathan et al. 2023; Chen et al. 2023), so the output is distributed
exactly as full depth's. Outputs carry verified tokens only.

The invariant that replaces monotone budgets for such a request: **every
verified position holds keys/values at every layer** (the verifying pass
writes them all). So a round's drafts may start again from any budget; within
a round the budgets never increase, so a draft reads only keys/values that a
verified position or an earlier draft of the round wrote. A lossless request
reserves full depth in the pool; the slots of rejected drafts lie past its
length and are rewritten before anything reads them. While more requests run
than ``draft_batch_limit``, a step is compute-bound and drafting would cost
more than it saves: such a request then decodes at full depth, like 1x.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import torch

from ..model import Transformer
from ..policies.lookup import MAX_NGRAM, lookup_drafts
from ..schedule import SkipSchedule
from .kv_cache import KV_DTYPES, KVPool, layer_needs
from .prefix_cache import PrefixCache
from .request import (MAX_DRAFT_TOKENS, MAX_LOGPROBS, DraftStats, EngineDeadError, EngineError, Request,
                      RequestOutput, RequestState, SamplingParams, Status, TokenLogprob)
from .runner import ModelRunner
from .sampler import filter_logits, sample_rows
from .scheduler import Scheduler, SchedulerConfig


@dataclass
class EngineConfig(SchedulerConfig):
    kv_slots: int | list[int] = 8192  # KV pool slots per layer (one int for every layer, or a list)
    prefix_cache_blocks: int = 256  # blocks of 16 prompt tokens whose keys/values are reused (0: off)
    # lossless requests draft only while at most this many requests run; beyond it a step is
    # compute-bound and verifying drafts costs more than it saves, so they decode at full depth
    draft_batch_limit: int = 4
    # decode steps one ``step`` may run in the model's native greedy loop while the batch is steady
    # (every request decoding greedily, its budgets from its schedule alone, all on one layer set
    # per step; a burst ends at the step where a request finishes, so a request waiting for its
    # seat is admitted when it would be): at batch 1 a Python step costs 0.5-1.6 ms beside its
    # kernels. Outputs then come a burst at a time, and a request arriving meanwhile waits for the
    # burst's end; 1 runs every step in Python.
    decode_burst: int = 1
    # the KV pool's dtype: "float32", "float16" or "bfloat16" (kv_cache.KV_DTYPES); None: the
    # model's kv_dtype (LLM.load's), else its parameters' dtype
    kv_dtype: str | None = None


def _lossless_option(name: str, value, lossless: bool):
    """A lossless-only request option: ``Request``'s default when not given, an error when
    given to a request that is not lossless."""
    if value is None:
        return getattr(Request, name)
    if not lossless:
        raise EngineError(f"{name} applies to lossless requests only: add lossless=True or drop it")
    return value


class Engine:
    def __init__(self, model: Transformer, config: EngineConfig | None = None, *, tokenizer=None,
                 eos_token_ids: Sequence[int] = ()):
        self.model, self.config = model, config or EngineConfig()
        cfg = model.cfg
        L = cfg.n_layers
        slots = self.config.kv_slots
        caps = [slots] * L if isinstance(slots, int) else list(slots)
        if len(caps) != L or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in caps):
            raise EngineError(f"kv_slots must be an integer >= 1 or {L} of them (one per layer), got {slots!r}")
        kvd = self.config.kv_dtype
        if kvd is not None and kvd not in KV_DTYPES:
            raise EngineError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or None: the model's), got {kvd!r}")
        dtype = KV_DTYPES[kvd] if kvd is not None else (model.kv_dtype or next(model.parameters()).dtype)
        self.pool = KVPool(caps, cfg.n_kv_heads, cfg.head_dim, dtype)
        pcb = self.config.prefix_cache_blocks
        if isinstance(pcb, bool) or not isinstance(pcb, int) or pcb < 0:
            raise EngineError(f"prefix_cache_blocks must be an integer >= 0, got {pcb!r}")
        dbl = self.config.draft_batch_limit
        if isinstance(dbl, bool) or not isinstance(dbl, int) or dbl < 0:
            raise EngineError(f"draft_batch_limit must be an integer >= 0, got {dbl!r}")
        burst = self.config.decode_burst
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise EngineError(f"decode_burst must be an integer >= 1, got {burst!r}")
        self.prefix_cache = PrefixCache(pcb) if pcb else None
        self.scheduler = Scheduler(self.config, self.pool, L,
                                   prefix_lookup=self.prefix_cache.match if self.prefix_cache is not None else None)
        self.runner = ModelRunner(model, self.pool)
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.step_count = 0
        self.counters = {"prompt_tokens_computed": 0, "prompt_tokens_cached": 0, "generated_tokens": 0,
                         "decode_steps": 0, "decode_rows": 0, "drafted_tokens": 0, "accepted_tokens": 0,
                         "verify_rounds": 0, "decode_layers_run": 0, "decode_layers_full": 0,
                         "prefill_seconds": 0.0, "decode_seconds": 0.0}
        self._ids = itertools.count()

    @property
    def num_layers(self) -> int:
        return self.model.cfg.n_layers

    # -- requests ------------------------------------------------------------------
    def make_request(self, prompt_token_ids: Sequence[int], schedule: SkipSchedule | None = None,
                     max_new_tokens: int = 64, sampling: SamplingParams | None = None,
                     stop: str | Sequence[str] | None = (),
                     ignore_eos: bool = False, request_id: str | None = None, lossless: bool = False,
                     draft_tokens: int | None = None, logprobs: int | None = None,
                     adaptive_threshold: float | None = None, draft_confidence: float | None = None,
                     prompt_lookup: int | None = None) -> Request:
        """A validated request (raises ``EngineError`` saying what is wrong)."""
        L = self.num_layers
        schedule = schedule or SkipSchedule.full_depth(L)
        if not isinstance(schedule, SkipSchedule):
            raise EngineError(f"schedule must be a SkipSchedule, got {type(schedule).__name__}")
        if schedule.num_layers != L:
            raise EngineError(f"schedule is for {schedule.num_layers} layers, the model has {L}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        ids = list(prompt_token_ids)
        if not ids:
            raise EngineError("the prompt is empty: give at least one token")
        V = self.model.cfg.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V for t in ids):
            raise EngineError(f"prompt token ids must be integers in [0, {V})")
        ctx = self.model.cfg.max_position
        if len(ids) + max_new_tokens - 1 > ctx:  # the last new token is never fed back
            raise EngineError(
                f"the prompt has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(ids) + max_new_tokens - 1} positions but the model's context is {ctx}: "
                "shorten the prompt or lower max_new_tokens")
        if stop is None:
            stop = ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise EngineError("stop must be a string or a list of strings")
        stop = tuple(s for s in stop if s)
        if any(not isinstance(s, str) for s in stop):
            raise EngineError("stop must be a string or a list of strings")
        if stop and self.tokenizer is None:
            raise EngineError("stop strings need a tokenizer; this engine has none")
        if not isinstance(lossless, bool):
            raise EngineError(f"lossless must be true or false, got {lossless!r}")
        draft_tokens = _lossless_option("draft_tokens", draft_tokens, lossless)
        if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) \
                or not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise EngineError(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {draft_tokens!r}")
        draft_confidence = _lossless_option("draft_confidence", draft_confidence, lossless)
        if isinstance(draft_confidence, bool) or not isinstance(draft_confidence, (int, float)) \
                or not 0.0 <= draft_confidence < 1.0:
            raise EngineError(f"draft_confidence must be a number in [0, 1), got {draft_confidence!r}")
        prompt_lookup = _lossless_option("prompt_lookup", prompt_lookup, lossless)
        if isinstance(prompt_lookup, bool) or not isinstance(prompt_lookup, int) \
                or not 0 <= prompt_lookup <= MAX_NGRAM:
            raise EngineError(f"prompt_lookup must be an integer in [0, {MAX_NGRAM}] (the shortest n-gram "
                              f"matched; 0 = off), got {prompt_lookup!r}")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_LOGPROBS):
            raise EngineError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (or None), got {logprobs!r}")
        if adaptive_threshold is not None:
            from ..policies.adaptive import check_threshold
            from ..schedule import ScheduleError

            if lossless:
                raise EngineError("adaptive budgets and lossless mode do not combine: drop one of them")
            try:
                adaptive_threshold = check_threshold(adaptive_threshold)
            except ScheduleError as e:
                raise EngineError(str(e)) from None
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return Request(rid, tuple(ids), schedule, max_new_tokens, sampling or SamplingParams(), stop, ignore_eos,
                       lossless, draft_tokens, logprobs, adaptive_threshold, float(draft_confidence),
                       prompt_lookup)

    def add(self, request: Request) -> RequestState:
        if request.request_id in self.requests:
            raise EngineError(f"request id {request.request_id!r} is already running")
        st = RequestState(request, arrived_step=self.step_count)
        if request.lossless:
            st.spec = DraftStats()
            n = self.model.draft_vocab  # drafts also score the prompt's own rarer tokens (names to copy)
            st.draft_extra = torch.tensor(sorted({t for t in request.prompt_token_ids if t >= n}), dtype=torch.long)
        self.scheduler.add(st)  # raises if it can never fit
        s = request.sampling
        if not s.greedy:
            st.generator = torch.Generator().manual_seed(s.seed if s.seed is not None else torch.seed() % 2**62)
        if self.tokenizer is not None:
            from ..tokenization import Detokenizer

            st.detok = Detokenizer(self.tokenizer, request.stop)
        self.requests[request.request_id] = st
        return st

    def add_request(self, prompt_token_ids: Sequence[int], **kw) -> RequestState:
        """Validate and queue a request (see ``make_request`` for the arguments)."""
        return self.add(self.make_request(prompt_token_ids, **kw))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV; None if it is not here."""
        st = self.requests.get(request_id)
        if st is None:
            return None
        return self._finish(st, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- a step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit, run prompt chunks, lossless verifications and one decode
        position per generating request, sample, finish; returns one output
        per request that produced verified tokens or finished."""
        plan = self.scheduler.schedule(self.step_count)
        self.step_count += 1
        if plan.empty:
            return []
        burst = self._burst(plan)
        if burst is not None:
            return burst
        ready: list[tuple[RequestState, torch.Tensor]] = []  # (request, logits of its next token)
        drafted: list[tuple[RequestState, torch.Tensor]] = []  # (lossless request, logits of its next draft)
        t0 = time.perf_counter()
        rounds: list[torch.Tensor] = []  # per verified round, full depth's logits of each of its positions
        decode_logits = None  # the decode rows' logits, in plan.decode's order
        if plan.decode or plan.verify:
            logits = self.runner.decode(plan)
            lo = 0
            for st in plan.verify:
                rounds.append(logits[lo:lo + len(st.drafts) + 1])
                lo += len(st.drafts) + 1
            decode_logits = logits[lo:]
            for st, b, row in zip(plan.decode, plan.budgets, decode_logits):
                if st.round_size:  # a lossless request's draft
                    st.draft_budgets.append(b)
                    drafted.append((st, row))
                else:
                    st.budgets.append(b)
                    ready.append((st, row))
                    if st.spec is not None:  # a lossless request's plain full-depth step
                        st.spec.verify_layers += b
            self.counters["decode_steps"] += 1
            self.counters["decode_rows"] += len(plan.decode)
            verify_rows = sum(len(st.drafts) + 1 for st in plan.verify)
            self.counters["decode_layers_run"] += sum(plan.budgets) + self.num_layers * verify_rows
            self.counters["decode_layers_full"] += self.num_layers * (len(plan.decode) + verify_rows)
        t1 = time.perf_counter()
        for st in plan.cached:  # a cached prompt prefix: copied into its slots, not recomputed
            self.counters["prompt_tokens_cached"] += st.cached_prefix
            self.prefix_cache.load(st.request.prompt_token_ids, st.cached_prefix, self.pool.k, self.pool.v,
                                   st.reservation.starts)
        lasts = self.runner.prefill(plan.prefill) if plan.prefill else []
        for (st, start, end), last in zip(plan.prefill, lasts):
            st.prefilled = end
            self.counters["prompt_tokens_computed"] += end - start
            if last is not None:
                st.status = Status.DECODE
                ready.append((st, last))
                if self.prefix_cache is not None:
                    self.prefix_cache.store(st.request.prompt_token_ids, self.pool.k, self.pool.v,
                                            st.reservation.starts)
        t2 = time.perf_counter()
        self.counters["decode_seconds"] += t1 - t0
        self.counters["prefill_seconds"] += t2 - t1
        now = time.perf_counter()
        outs = [self._verify(st, full, now) for st, full in zip(plan.verify, rounds)]
        self._draft(drafted)
        if not ready:
            return outs
        # every row ready to sample is a plain decode row, in order: their logits are already one
        # tensor (a stack would copy rows x vocab floats each step)
        plain = not drafted and not plan.prefill and decode_logits is not None and len(ready) == len(decode_logits)
        logits = decode_logits if plain else torch.stack([r for _, r in ready])
        states = [st for st, _ in ready]
        picks = sample_rows(logits, [st.request.sampling for st in states], [st.generator for st in states],
                            self.model.argmax)
        for st, tok, row in zip(states, picks, logits):
            out = self._append(st, tok, now, row=row)
            if st.request.lossless and not out.finished:
                self._begin_round(st)
            outs.append(out)
        return outs

    def _burst(self, plan: StepPlan) -> list[RequestOutput] | None:
        """Run this step and up to ``decode_burst - 1`` more in the model's native greedy loop
        when the batch is steady (``EngineConfig.decode_burst``), with each step's bookkeeping
        as ``step`` does it; one output per request for the burst. None when it is not steady."""
        rows = plan.decode
        if (self.config.decode_burst <= 1 or not rows or plan.prefill or plan.verify or plan.cached
                or plan.admitted or self.config.policy != "per_row"):
            return None
        for st in rows:
            r = st.request
            if (not r.sampling.greedy or r.lossless or r.adaptive_threshold is not None or r.logprobs is not None
                    or r.stop or st.drafts or st.round_size):
                return None
        if not self.model.native_greedy(len(rows)):
            return None
        room = min(st.request.max_new_tokens - len(st.token_ids) for st in rows)
        steps = self.scheduler.burst(plan, min(self.config.decode_burst, room))
        if len(steps) < 2:
            return None
        t0 = time.perf_counter()
        eos = () if all(st.request.ignore_eos for st in rows) else sorted(self.eos)
        picks = self.runner.greedy_burst(rows, [layers for _, layers in steps], eos)
        self.counters["decode_seconds"] += time.perf_counter() - t0
        now = time.perf_counter()
        R, L = len(rows), self.num_layers
        outs: dict[str, RequestOutput] = {}
        for s, ((b, _), toks) in enumerate(zip(steps, picks)):
            if s:  # the first is this step, counted by step
                self.step_count += 1
            self.counters["decode_steps"] += 1
            self.counters["decode_rows"] += R
            self.counters["decode_layers_run"] += b * R
            self.counters["decode_layers_full"] += L * R
            for st, tok in zip(rows, toks):
                st.budgets.append(b)
                outs[st.request_id] = self._append(st, tok, now, merge=outs.get(st.request_id))
        return list(outs.values())

    # -- lossless rounds ------------------------------------------------------------------
    def _begin_round(self, st: RequestState) -> None:
        """Start drafting after the last verified token: as many drafts as the
        request still has room for. With no room, or more requests running than
        ``draft_batch_limit``, the round has no drafts: the request's next step
        is a plain full-depth decode row (a verified position, like 1x)."""
        room = st.request.max_new_tokens - len(st.token_ids) - 1  # a round yields up to drafts + 1 tokens
        st.drafts, st.draft_probs, st.draft_budgets, st.lookup_drafts = [], [], [], 0
        busy = len(self.scheduler.running) > self.config.draft_batch_limit
        st.round_size = 0 if busy else max(0, min(st.request.draft_tokens, room))
        st.verifying = False

    def _draft(self, drafted: list[tuple[RequestState, torch.Tensor]]) -> None:
        """Take each lossless row's next draft from its skipped pass's logits,
        with the probability the skipped pass gave it (its confidence)."""
        if not drafted:
            return
        greedy = [(st, row) for st, row in drafted if st.request.sampling.greedy]
        if greedy:
            rows = torch.stack([r for _, r in greedy])
            picks = self.model.argmax(rows)
            conf = rows.float().softmax(-1).gather(1, picks[:, None])[:, 0].tolist() \
                if any(st.request.draft_confidence > 0 for st, _ in greedy) else [1.0] * len(greedy)
            for (st, _), tok, c in zip(greedy, picks.tolist(), conf):
                self._add_draft(st, tok, None, c)
        for st, row in drafted:
            s = st.request.sampling
            if not s.greedy:
                q = filter_logits(row[None], s.temperature, s.top_k, s.top_p).softmax(-1)[0]
                tok = int(torch.multinomial(q, 1, generator=st.generator))
                self._add_draft(st, tok, q, float(q[tok]))

    def _add_draft(self, st: RequestState, tok: int, q: torch.Tensor | None, confidence: float) -> None:
        """Append a draft; the round goes to verification at its size, after an
        end-of-sequence draft, or after a draft below the request's
        ``draft_confidence`` (a choice made from the draft pass alone, so
        verification stays exact: greedy or sampled, every kept token is full depth's).

        With ``prompt_lookup``, a draft below ``draft_confidence`` gives way to what
        followed the tokens before it where they occurred earlier in the prompt or
        output (``policies.lookup``: copied names and spans, the drafts a skipped
        pass gets wrong), and the round is verified. Exact for sampled requests
        too: where a lookup exists, the proposal here is the skip pass's draw if it
        is sure, the lookup token otherwise, so it is distributed as q with the
        unsure mass moved onto the lookup token, and the acceptance rule uses that;
        the later lookup drafts are certain given it (one-hot)."""
        c = st.request.draft_confidence
        unsure = confidence < c
        found: list[int] = []
        if st.request.prompt_lookup and (unsure or q is not None):
            found = lookup_drafts([*st.request.prompt_token_ids, *st.token_ids, *st.drafts],
                                  st.request.prompt_lookup, st.round_size - len(st.drafts))
            if found and q is not None:  # the distribution this position's proposal is drawn from
                low = q < c
                mass = float(q[low].sum())
                q = torch.where(low, torch.zeros_like(q), q)
                q[found[0]] += mass
        if found and unsure:
            st.spec.draft_layers += st.draft_budgets.pop()  # the unsure draft's pass ran; its draft gives way
            for j, t in enumerate(found):
                st.drafts.append(t)
                if q is not None:
                    st.draft_probs.append(q if j == 0 else torch.nn.functional.one_hot(
                        torch.tensor(t), q.numel()).to(q.dtype))
                st.lookup_drafts += 1
                if t in self.eos and not st.request.ignore_eos:
                    break
            st.verifying = True
            return
        st.drafts.append(tok)
        if q is not None:
            st.draft_probs.append(q)
        eos = tok in self.eos and not st.request.ignore_eos  # nothing to draft past an end
        st.verifying = eos or len(st.drafts) >= st.round_size or unsure

    def _verify(self, st: RequestState, full: torch.Tensor, now: float) -> RequestOutput:
        """Accept drafts against full depth's logits ``(drafts + 1, vocab)``, append
        the verified tokens, and start the next round (or finish)."""
        r, L = st.request, self.num_layers
        drafts, k = st.drafts, len(st.drafts)
        s = r.sampling
        if s.greedy:
            target = self.model.argmax(full).tolist()
            m = next((j for j, d in enumerate(drafts) if target[j] != d), k)
            new = drafts[:m] + [target[m]]
        else:  # speculative sampling: exact full-depth distribution
            p = filter_logits(full, s.temperature, s.top_k, s.top_p).softmax(-1)
            new = []
            for j, d in enumerate(drafts):
                q = st.draft_probs[j]
                u = float(torch.rand((), generator=st.generator))
                if u * float(q[d]) < float(p[j, d]):  # accept with probability min(1, p/q)
                    new.append(d)
                    continue
                residual = (p[j] - q).clamp(min=0)
                if float(residual.sum()) <= 0:  # p == q up to rounding: any draw from p is exact
                    residual = p[j]
                new.append(int(torch.multinomial(residual, 1, generator=st.generator)))
                break
            else:
                new.append(int(torch.multinomial(p[k], 1, generator=st.generator)))
            m = len(new) - 1
        spec = st.spec
        spec.rounds += 1
        spec.drafted += k
        spec.accepted += m
        spec.draft_layers += sum(st.draft_budgets)
        spec.verify_layers += L * (k + 1)
        first = len(st.token_ids)  # generated position of the first draft
        # the drafts full depth judged: those it accepted and the first it rejected (later ones never count)
        spec.acceptance += [(first + j, b, j < m) for j, b in enumerate(st.draft_budgets[:min(m + 1, k)])]
        skipped = k - st.lookup_drafts  # a round's lookup drafts follow its skipped-pass drafts
        spec.lookup_drafted += st.lookup_drafts
        spec.lookup_accepted += max(0, m - skipped)
        self.counters["drafted_tokens"] += k
        self.counters["accepted_tokens"] += m
        self.counters["verify_rounds"] += 1
        st.drafts, st.draft_probs, st.draft_budgets, st.verifying, st.lookup_drafts = [], [], [], False, 0
        out = None
        for j, tok in enumerate(new):
            st.budgets.append(L)  # the position fed before this token is verified at every layer
            out = self._append(st, tok, now, merge=out, row=full[j])
            if out.finished:
                return out
        self._begin_round(st)
        return out

    def _append(self, st: RequestState, tok: int, now: float, merge: RequestOutput | None = None,
                row: torch.Tensor | None = None) -> RequestOutput:
        """Append one token chosen from logits ``row``; ``merge``: an output of this
        step to extend (a lossless round's tokens)."""
        st.token_ids.append(tok)
        t = st.request.adaptive_threshold
        if t is not None and row is not None and (t == 0 or torch.softmax(row.float(), -1).max().item() >= t):
            st.confident += 1  # the step just taken was sure: the next token may run shallower
        lp = None
        if st.request.logprobs is not None:
            lp = (merge.new_logprobs if merge is not None else []) + [token_logprob(row, tok, st.request.logprobs)]
            st.logprobs.append(lp[-1])
        self.counters["generated_tokens"] += 1
        if st.first_token_time is None:
            st.first_token_time = now
        delta = ""
        if st.detok is not None:
            delta = st.detok.add(tok)
        r = st.request
        reason = None
        if tok in self.eos and not r.ignore_eos:
            reason = "eos"
        elif st.detok is not None and st.detok.stopped:
            reason = "stop"
        elif len(st.token_ids) >= r.max_new_tokens:
            reason = "length"
        new = (merge.new_token_ids if merge is not None else []) + [tok]
        delta = (merge.text_delta if merge is not None else "") + delta
        if reason is not None:
            return self._finish(st, reason, new, delta, lp)
        return RequestOutput(st.request_id, new, delta, list(st.token_ids), False,
                             arrived_step=st.arrived_step, arrival_time=st.arrival_time,
                             first_token_time=st.first_token_time, new_logprobs=lp)

    def _finish(self, st: RequestState, reason: str, new: list[int] | None = None, delta: str = "",
                new_logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        self.scheduler.remove(st)
        self.requests.pop(st.request_id, None)
        st.status, st.finish_reason = Status.FINISHED, reason
        st.finish_time, st.finished_step = time.perf_counter(), self.step_count
        if st.detok is not None:
            delta += st.detok.finish()
            st.text = st.detok.text
        return RequestOutput(
            st.request_id, new or [], delta, list(st.token_ids), True, reason, st.text,
            list(st.request.prompt_token_ids), st.active_layers(self.num_layers),
            st.decode_layer_speedup(self.num_layers), st.arrived_step, st.finished_step, st.arrival_time,
            st.first_token_time, st.finish_time, draft=st.spec,
            scheduled_time=st.scheduled_time,
            new_logprobs=new_logprobs if st.request.logprobs is not None else None,
            logprobs=list(st.logprobs) if st.request.logprobs is not None else None)

    def run(self) -> list[RequestOutput]:
        """Step until every request has finished; the final output of each."""
        done = []
        while self.has_unfinished():
            done += [o for o in self.step() if o.finished]
        return done


def token_logprob(row: torch.Tensor, tok: int, k: int) -> TokenLogprob:
    """``tok``'s log-probability under logits ``row`` and the ``k`` most likely tokens'."""
    lp = torch.log_softmax(row.float(), dim=-1)
    top = ()
    if k:
        v, i = torch.topk(lp, k)
        top = tuple(zip(i.tolist(), v.tolist()))
    return TokenLogprob(tok, float(lp[tok]), top)


def pool_for(schedules: Sequence[SkipSchedule], prompt_lens: Sequence[int], max_new_tokens: Sequence[int]
             ) -> list[int]:
    """Per-layer capacity that holds exactly these requests at once (static batches)."""
    caps = None
    for s, p, n in zip(schedules, prompt_lens, max_new_tokens):
        need = layer_needs(s, p, n)
        caps = need if caps is None else [a + b for a, b in zip(caps, need)]
    return [max(c, 1) for c in caps or []]


class _Mailbox:
    """One request's outputs on their way to an event loop. A consumer that reads
    slowly (a client draining its stream slowly) finds one merged output, not a
    queue that grows by one output per step: what is buffered stays bounded by
    the request's own text, and the engine never waits for a reader."""

    def __init__(self) -> None:
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:  # on the consumer's loop
        if isinstance(item, BaseException):
            self._error = item
        elif self._pending is None:
            self._pending = item
        else:
            a = self._pending
            lp = None if item.new_logprobs is None else (a.new_logprobs or []) + item.new_logprobs
            self._pending = dataclasses.replace(item, new_token_ids=a.new_token_ids + item.new_token_ids,
                                                text_delta=a.text_delta + item.text_delta, new_logprobs=lp)
        self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        self._ready.clear()
        if self._pending is not None:  # outputs first: a finished request's last output precedes any failure
            out, self._pending = self._pending, None
            if self._error is not None:
                self._ready.set()
            return out
        raise self._error


class AsyncEngine:
    """The engine loop in a background thread, for servers: ``generate`` is an
    async iterator of one request's outputs. A consumer that stops iterating
    (a client that disconnects) aborts its request and frees its KV."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple[Request, asyncio.AbstractEventLoop, _Mailbox]] = []
        self._aborts: list[str] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, _Mailbox]] = {}
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="skipdecode-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._stop or self._inbox or self._aborts or self.engine.has_unfinished()):
                        self._wake.wait()
                    if self._stop:
                        return
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                for req, loop, q in inbox:
                    try:
                        self.engine.add(req)
                        self._queues[req.request_id] = (loop, q)
                    except Exception as e:  # noqa: BLE001 - the caller gets it
                        loop.call_soon_threadsafe(q.put, e)
                for rid in aborts:
                    self.engine.abort(rid)
                    self._queues.pop(rid, None)
                for out in self.engine.step():
                    target = self._queues.get(out.request_id)
                    if target is not None:
                        target[0].call_soon_threadsafe(target[1].put, out)
                        if out.finished:
                            self._queues.pop(out.request_id, None)
        except BaseException as e:  # noqa: BLE001 - a dead loop must fail every waiter, not hang them
            self.error = e
            for loop, q in list(self._queues.values()):
                loop.call_soon_threadsafe(q.put, EngineDeadError(f"the engine loop failed: {e!r}"))
            with self._lock:
                for req, loop, q in self._inbox:
                    loop.call_soon_threadsafe(q.put, EngineDeadError(f"the engine loop failed: {e!r}"))
                self._inbox = []

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        q = _Mailbox()
        with self._wake:
            self._inbox.append((request, loop, q))
            self._wake.notify()
        finished = False
        try:
            while True:
                out = await q.get()
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout)
