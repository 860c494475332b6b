"""The serving engine: continuous batching where every request keeps its own
monotone schedule.

``Engine.step()`` admits waiting requests, runs prompt chunks and one decode
position for every generating request (each on its own layers), samples, and
returns what each request produced. ``LLM.generate`` is a client (admit all,
step to the end); ``AsyncEngine`` runs the same loop in a thread for a server
and streams each request's outputs to an ``async for``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import torch

from ..model import Transformer
from ..schedule import SkipSchedule
from .kv_cache import KVPool, layer_needs
from .prefix_cache import PrefixCache
from .request import EngineDeadError, EngineError, Request, RequestOutput, RequestState, SamplingParams, Status
from .runner import ModelRunner
from .sampler import sample_rows
from .scheduler import Scheduler, SchedulerConfig


@dataclass
class EngineConfig(SchedulerConfig):
    kv_slots: int | list[int] = 8192  # KV pool slots per layer (one int for every layer, or a list)
    prefix_cache_blocks: int = 256  # blocks of 16 prompt tokens whose keys/values are reused (0: off)


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
        dtype = next(model.parameters()).dtype
        self.pool = KVPool(caps, cfg.n_kv_heads, cfg.head_dim, dtype)
        pcb = self.config.prefix_cache_blocks
        if isinstance(pcb, bool) or not isinstance(pcb, int) or pcb < 0:
            raise EngineError(f"prefix_cache_blocks must be an integer >= 0, got {pcb!r}")
        self.prefix_cache = PrefixCache(pcb) if pcb else None
        self.scheduler = Scheduler(self.config, self.pool, L,
                                   prefix_lookup=self.prefix_cache.match if self.prefix_cache is not None else None)
        self.runner = ModelRunner(model, self.pool)
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)
        self.requests: dict[str, RequestState] = {}
        self.step_count = 0
        self.counters = {"prompt_tokens_computed": 0, "prompt_tokens_cached": 0, "generated_tokens": 0,
                         "decode_steps": 0, "decode_rows": 0,
                         "prefill_seconds": 0.0, "decode_seconds": 0.0}
        self._ids = itertools.count()

    @property
    def num_layers(self) -> int:
        return self.model.cfg.n_layers

    # -- requests ------------------------------------------------------------------
    def make_request(self, prompt_token_ids: Sequence[int], schedule: SkipSchedule | None = None,
                     max_new_tokens: int = 64, sampling: SamplingParams | None = None,
                     stop: str | Sequence[str] | None = (),
                     ignore_eos: bool = False, request_id: str | None = None) -> Request:
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
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return Request(rid, tuple(ids), schedule, max_new_tokens, sampling or SamplingParams(), stop, ignore_eos)

    def add(self, request: Request) -> RequestState:
        if request.request_id in self.requests:
            raise EngineError(f"request id {request.request_id!r} is already running")
        st = RequestState(request, arrived_step=self.step_count)
        st.layer_mode = (request.schedule.warmup_layers, request.schedule.mode)
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
        """Admit, run prompt chunks and one decode position per generating
        request, sample, finish; returns one output per request that changed."""
        plan = self.scheduler.schedule(self.step_count)
        self.step_count += 1
        if plan.empty:
            return []
        ready: list[tuple[RequestState, torch.Tensor]] = []  # (request, logits of its next token)
        t0 = time.perf_counter()
        if plan.decode:
            logits = self.runner.decode(plan)
            for st, b, row in zip(plan.decode, plan.budgets, logits):
                st.budgets.append(b)
                ready.append((st, row))
            self.counters["decode_steps"] += 1
            self.counters["decode_rows"] += len(plan.decode)
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
        if not ready:
            return []
        logits = torch.stack([r for _, r in ready])
        states = [st for st, _ in ready]
        picks = sample_rows(logits, [st.request.sampling for st in states], [st.generator for st in states],
                            self.model.argmax)
        now = time.perf_counter()
        outs = []
        for st, tok in zip(states, picks):
            outs.append(self._append(st, tok, now))
        return outs

    def _append(self, st: RequestState, tok: int, now: float) -> RequestOutput:
        st.token_ids.append(tok)
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
        if reason is not None:
            return self._finish(st, reason, [tok], delta)
        return RequestOutput(st.request_id, [tok], delta, list(st.token_ids), False,
                             arrived_step=st.arrived_step, arrival_time=st.arrival_time,
                             first_token_time=st.first_token_time)

    def _finish(self, st: RequestState, reason: str, new: list[int] | None = None, delta: str = "") -> RequestOutput:
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
            st.first_token_time, st.finish_time)

    def run(self) -> list[RequestOutput]:
        """Step until every request has finished; the final output of each."""
        done = []
        while self.has_unfinished():
            done += [o for o in self.step() if o.finished]
        return done


def pool_for(schedules: Sequence[SkipSchedule], prompt_lens: Sequence[int], max_new_tokens: Sequence[int]
             ) -> list[int]:
    """Per-layer capacity that holds exactly these requests at once (static batches)."""
    caps = None
    for s, p, n in zip(schedules, prompt_lens, max_new_tokens):
        need = layer_needs(s, p, n)
        caps = need if caps is None else [a + b for a, b in zip(caps, need)]
    return [max(c, 1) for c in caps or []]


class AsyncEngine:
    """The engine loop in a background thread, for servers: ``generate`` is an
    async iterator of one request's outputs. A consumer that stops iterating
    (a client that disconnects) aborts its request and frees its KV."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[tuple[Request, asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._aborts: list[str] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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
                        loop.call_soon_threadsafe(q.put_nowait, e)
                for rid in aborts:
                    self.engine.abort(rid)
                    self._queues.pop(rid, None)
                for out in self.engine.step():
                    target = self._queues.get(out.request_id)
                    if target is not None:
                        target[0].call_soon_threadsafe(target[1].put_nowait, out)
                        if out.finished:
                            self._queues.pop(out.request_id, None)
        except BaseException as e:  # noqa: BLE001 - a dead loop must fail every waiter, not hang them
            self.error = e
            for loop, q in list(self._queues.values()):
                loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"the engine loop failed: {e!r}"))
            with self._lock:
                for req, loop, q in self._inbox:
                    loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"the engine loop failed: {e!r}"))
                self._inbox = []

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._wake:
            self._inbox.append((request, loop, q))
            self._wake.notify()
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
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
