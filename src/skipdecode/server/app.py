"""The OpenAI-compatible HTTP server: translates HTTP into engine requests.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as
server-sent events, ``stream_options.include_usage``), ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus). The model loads in a thread
after the server starts, so ``/health`` and every route answer 503 until it
is ready instead of refusing connections. The engine loop runs in its own
thread (``AsyncEngine``); a client that disconnects aborts its request and
frees its KV. Every error has OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from jinja2 import TemplateError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import AsyncEngine, EngineConfig, EngineDeadError, EngineError, RequestOutput
from ..errors import SkipDecodeError
from ..generate import GenerationError
from .protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse

log = logging.getLogger("skipdecode.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}


def error_response(e: APIError) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=e.headers)


@dataclass
class ServerConfig:
    model: str = "default-e2e"
    served_model_name: str | None = None  # the name clients send; default: the --model argument
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_queue: int = 256  # requests waiting beyond max_num_seqs before 429
    default_speedup: float | None = None  # when a request gives neither speedup nor schedule
    default_max_tokens: int = 256  # chat completions without max_tokens
    api_key: str | None = None
    dtype: str = "float32"
    max_model_len: int | None = None  # cap on prompt + max_tokens per request (default: the model's context)
    max_body_bytes: int = 4 * 2**20  # larger request bodies are refused (413)
    chat_template: str | None = None  # a Jinja file or template replacing the tokenizer's
    stats_interval: float = 10.0  # seconds between activity lines in the log (0: none)


class _EngineCounters:
    """The engine's own monotone counters as Prometheus counters, read at scrape time."""

    def __init__(self, state: "ServerState"):
        self.state = state

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        eng, name = self.state.engine, self.state.model_name
        c = eng.counters if eng is not None else {}
        cached, computed = c.get("prompt_tokens_cached", 0), c.get("prompt_tokens_computed", 0)
        run, full = c.get("decode_layers_run", 0), c.get("decode_layers_full", 0)
        prefix_on = eng is not None and eng.prefix_cache is not None
        for metric, doc, value in (
                ("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                 cached + computed if prefix_on else 0),
                ("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache (copied, not recomputed)", cached),
                ("skipdecode:decode_layers_run", "decoder layers run by decode rows (a verified position: all)", run),
                ("skipdecode:decode_layers_skipped", "decoder layers decode rows skipped", full - run),
                ("skipdecode:lossless_draft_tokens", "tokens drafted by lossless requests",
                 c.get("drafted_tokens", 0)),
                ("skipdecode:lossless_accepted_tokens", "drafted tokens full depth accepted",
                 c.get("accepted_tokens", 0))):
            m = CounterMetricFamily(metric, doc, labels=["model_name"])
            m.add_metric([name], value)
            yield m


class Metrics:
    """Prometheus metrics under vLLM's names (``vllm:...``, label ``model_name``),
    so dashboards built for vLLM read them, plus skipdecode's own (``skipdecode:...``):
    layers run and skipped, the decode-layer speedup, lossless drafting."""

    def __init__(self, state: "ServerState"):
        self.registry = r = CollectorRegistry()
        name = state.model_name
        lab = ["model_name"]

        def gauge(metric: str, doc: str, fn) -> None:
            Gauge(metric, doc, lab, registry=r).labels(name).set_function(fn)

        gauge("vllm:num_requests_running", "requests in the engine batch",
              lambda: state.engine.num_running if state.engine else 0)
        gauge("vllm:num_requests_waiting", "requests queued for admission",
              lambda: state.engine.num_waiting if state.engine else 0)
        gauge("vllm:kv_cache_usage_perc", "fraction of the KV pool's slots reserved (1 = full)",
              lambda: state.engine.pool.used_slots / max(sum(state.engine.pool.capacities), 1)
              if state.engine else 0)
        gauge("skipdecode:kv_slots_used", "KV pool slots reserved (all layers)",
              lambda: state.engine.pool.used_slots if state.engine else 0)
        gauge("skipdecode:kv_slots_total", "KV pool slots (all layers)",
              lambda: sum(state.engine.pool.capacities) if state.engine else 0)
        r.register(_EngineCounters(state))
        self.prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens admitted", lab, registry=r).labels(name)
        self.generation_tokens = Counter("vllm:generation_tokens", "tokens generated", lab,
                                         registry=r).labels(name)
        self._requests = Counter("vllm:request_success", "finished requests", lab + ["finished_reason"],
                                 registry=r)
        self.requests = lambda reason: self._requests.labels(name, reason)

        def hist(metric: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(metric, doc, lab, registry=r, buckets=buckets).labels(name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "time to first token",
                         (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.tpot = hist("vllm:time_per_output_token_seconds", "time per output token after the first",
                         (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1))
        self.e2e = hist("vllm:e2e_request_latency_seconds", "request latency",
                        (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.queue = hist("vllm:request_queue_time_seconds", "time waiting for admission (KV and a batch row)",
                          (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.speedup = hist("skipdecode:decode_layer_speedup", "decode-layer speedup per request",
                            (1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6))

    def finished(self, out: RequestOutput) -> None:
        self.requests(out.finish_reason or "").inc()
        if out.scheduled_time is not None:
            self.queue.observe(out.scheduled_time - out.arrival_time)
        if out.finish_reason == "abort" or out.first_token_time is None:
            return
        n = len(out.token_ids)
        self.generation_tokens.inc(n)
        self.ttft.observe(out.first_token_time - out.arrival_time)
        if n > 1:
            self.tpot.observe((out.finish_time - out.first_token_time) / (n - 1))
        self.e2e.observe(out.finish_time - out.arrival_time)
        self.speedup.observe(out.decode_layer_speedup)


class BodyLimit:
    """ASGI middleware: a POST body is read whole before routing, and one over
    ``limit`` bytes (declared or sent) is refused with 413 in OpenAI's shape."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await self._too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(scope, receive, send)
            if not msg.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # http.disconnect, for requests that watch their client

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        r = error_response(APIError(413, f"the request body is over {self.limit} bytes", param=None,
                                    code="request_too_large"))
        await r(scope, receive, send)


class _Slot:
    """A request's place in flight: taken when it is accepted, given back once."""

    def __init__(self, state: "ServerState"):
        self.state, self.held = state, True
        state.in_flight += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.state.in_flight -= 1


def read_chat_template(spec: str) -> str:
    """``--chat-template``: a Jinja file, or the template itself (as vLLM takes it)."""
    from pathlib import Path

    p = Path(spec).expanduser()
    if p.is_file():
        return p.read_text(encoding="utf-8")
    if "{{" in spec or "{%" in spec:
        return spec
    raise SkipDecodeError(f"--chat-template {spec!r} is neither a file nor a Jinja template")


class ServerState:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.llm = None
        self.engine = None
        self.aengine: AsyncEngine | None = None
        self.load_error: str | None = None
        self.draining = False
        self.in_flight = 0
        self.model_name = config.served_model_name or config.model
        self.names = {self.model_name}
        self.metrics = Metrics(self)
        self.on_load_failure: Callable[[], None] | None = None  # serve(): stop the process
        self._ignored_fields: set[str] = set()

    def load(self) -> None:
        t0 = time.perf_counter()
        try:
            from ..llm import LLM

            llm = LLM.load(self.config.model, dtype=self.config.dtype)
            if self.config.chat_template is not None:
                llm.tokenizer.chat_template = read_chat_template(self.config.chat_template)
            engine = llm.engine(self.config.engine)
            self.llm, self.engine = llm, engine
            self.aengine = AsyncEngine(engine)
        except Exception as e:  # noqa: BLE001 - logged; /health and every route report it
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("skipdecode: the model %r failed to load: %s", self.config.model, self.load_error,
                      exc_info=not isinstance(e, SkipDecodeError))
            if self.on_load_failure is not None:
                self.on_load_failure()
            return
        load_seconds = time.perf_counter() - t0
        import torch

        pool = engine.pool
        log.info("skipdecode: serving %r as %r: %d layers, %s weights, %d threads, KV pool %d slots per layer "
                 "(%d in all, %s, %.0f MB), up to %d requests at once, context %d tokens, loaded in %.1f s",
                 self.config.model, self.model_name, llm.num_layers, self.config.dtype, torch.get_num_threads(),
                 max(pool.capacities), sum(pool.capacities), str(pool.dtype).removeprefix("torch."), pool.nbytes / 1e6,
                 self.config.engine.max_num_seqs, self.max_model_len, load_seconds)

    @property
    def max_model_len(self) -> int:
        """The context a request may use: the model's, or less with ``--max-model-len``."""
        ctx = self.llm.model.cfg.max_position
        return min(ctx, self.config.max_model_len) if self.config.max_model_len else ctx

    def warn_ignored(self, body) -> None:
        """Log (once per field name) the body fields this server does not know and ignores."""
        extra = set(body.model_extra or ())
        if body.stream_options is not None:
            extra |= {f"stream_options.{k}" for k in body.stream_options.model_extra or ()}
        new = extra - self._ignored_fields
        if new and len(self._ignored_fields) < 1000:
            self._ignored_fields |= new
            log.warning("skipdecode: ignoring request field(s) this server does not support: %s",
                        ", ".join(sorted(new)[:20]))

    def stats_line(self, since: dict) -> str | None:
        """One line of engine activity since the last (``since`` holds the last counters);
        None when nothing happened."""
        eng = self.engine
        if eng is None:
            return None
        c, now = dict(eng.counters), time.perf_counter()
        dt = now - since.get("t", now)
        prev = since.get("c", {})
        gen = c["generated_tokens"] - prev.get("generated_tokens", 0)
        prompt = (c["prompt_tokens_computed"] + c["prompt_tokens_cached"]
                  - prev.get("prompt_tokens_computed", 0) - prev.get("prompt_tokens_cached", 0))
        since.update(t=now, c=c)
        if not gen and not prompt and not eng.num_running and not eng.num_waiting:
            return None
        run = c["decode_layers_run"] - prev.get("decode_layers_run", 0)
        full = c["decode_layers_full"] - prev.get("decode_layers_full", 0)
        pool = eng.pool
        return (f"skipdecode: prompt {prompt / max(dt, 1e-9):.1f} tok/s, generation {gen / max(dt, 1e-9):.1f} tok/s, "
                f"running {eng.num_running}, waiting {eng.num_waiting}, "
                f"KV {100 * pool.used_slots / max(sum(pool.capacities), 1):.1f}% used, "
                f"decode layers run {run} of {full}")

    @property
    def ready(self) -> bool:
        return self.aengine is not None and self.aengine.alive and not self.draining


def build_app(config: ServerConfig, load_in_background: bool = True) -> FastAPI:
    state = ServerState(config)

    async def stats_loop() -> None:
        since: dict = {}
        while True:
            await asyncio.sleep(config.stats_interval)
            line = state.stats_line(since)
            if line:
                log.info(line)

    async def lifespan(app: FastAPI):
        if state.llm is None and state.load_error is None:  # not loaded by the caller (a Ray replica loads first)
            t = threading.Thread(target=state.load, name="skipdecode-load", daemon=True)
            t.start()
            if not load_in_background:
                await asyncio.to_thread(t.join)
        stats = asyncio.ensure_future(stats_loop()) if config.stats_interval > 0 else None
        yield
        if stats is not None:
            stats.cancel()
        state.draining = True
        if state.aengine is not None:
            state.aengine.shutdown()

    app = FastAPI(title="skipdecode", version="1", lifespan=lifespan,
                  responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
                             404: {"model": ErrorResponse}, 429: {"model": ErrorResponse},
                             503: {"model": ErrorResponse}})
    app.state.skipdecode = state
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)

    def openapi() -> dict:
        """The schema, with ``model`` limited to the names this server serves."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                schema["components"]["schemas"][name]["properties"]["model"]["enum"] = sorted(state.names)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.exception_handler(APIError)
    async def _api_error(_r: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_r: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = str(first.get("msg", "invalid request"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        return error_response(APIError(400, f"{'.'.join(loc) + ': ' if loc else ''}{msg}",
                                       param=loc[0] if loc else None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_r: Request, e: StarletteHTTPException):  # unknown routes, wrong methods, unreadable bodies
        return error_response(APIError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                                       else "internal_error", headers=getattr(e, "headers", None)))

    @app.exception_handler(RecursionError)
    async def _deep(_r: Request, e: RecursionError):  # JSON nested deeper than the parser recurses
        return error_response(APIError(400, "the request body is nested too deeply"))

    @app.exception_handler(Exception)
    async def _bug(_r: Request, e: Exception):  # a bug: logged with its traceback, answered in OpenAI's shape
        logging.getLogger("skipdecode.server").exception("internal error")
        return error_response(APIError(500, f"internal error ({type(e).__name__}); see the server log",
                                       "internal_error"))

    @app.exception_handler(SkipDecodeError)
    async def _user_error(_r: Request, e: SkipDecodeError):
        return error_response(APIError(400, str(e)))

    def check_key(request: Request) -> None:
        key = config.api_key
        if key is None:
            return
        auth = request.headers.get("authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    def check_ready() -> None:
        if state.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", headers={"Retry-After": "1"})
        if state.load_error:
            raise APIError(503, f"the model failed to load: {state.load_error}", "service_unavailable")
        if state.aengine is None:
            raise APIError(503, "the model is loading", "service_unavailable", headers={"Retry-After": "2"})
        if not state.aengine.alive:
            raise APIError(503, f"the engine loop stopped: {state.aengine.error!r}", "service_unavailable")

    def check_model(name: str) -> None:
        if name not in state.names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {sorted(state.names)}",
                           param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        if state.ready:
            return {"status": "ok"}
        status = "draining" if state.draining else ("failed" if state.load_error or state.aengine else "loading")
        return JSONResponse({"status": status, "error": state.load_error}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "skipdecode"}
                                           for n in sorted(state.names)]}

    def make_request(body, prompt_ids: list[int], max_tokens: int):
        llm, eng = state.llm, state.engine
        state.warn_ignored(body)
        ctx = state.max_model_len
        if len(prompt_ids) + max_tokens - 1 > ctx:
            raise APIError(400, f"this server's context is {ctx} tokens; the prompt has {len(prompt_ids)} and "
                                f"max_tokens is {max_tokens}: shorten the prompt or lower max_tokens",
                           param="max_tokens" if len(prompt_ids) < ctx else
                           ("messages" if hasattr(body, "messages") else "prompt"),
                           code="context_length_exceeded")
        speedup = body.speedup
        if speedup is None and body.schedule is None:
            speedup = config.default_speedup
        sched = body.schedule.model_dump(exclude_none=True) if body.schedule is not None else None
        try:
            req = llm.request(eng, prompt_ids, speedup=speedup, schedule=sched, max_new_tokens=max_tokens,
                              mode=body.mode, temperature=body.temperature, top_k=body.top_k,
                              top_p=None if body.top_p >= 1 else body.top_p, seed=body.seed, stop=body.stop or [],
                              request_id=f"{uuid.uuid4().hex}", lossless=body.lossless,
                              draft_tokens=body.draft_tokens, draft_confidence=body.draft_confidence,
                              prompt_lookup=body.prompt_lookup,
                              logprobs=body.top_logprobs_count,
                              adaptive=body.adaptive)
            eng.scheduler.check_capacity(req)  # the rest is checked by the engine thread
        except (EngineError, GenerationError) as e:
            code = "context_length_exceeded" if "KV slots" in str(e) else None
            raise APIError(400, str(e), code=code) from None
        if state.in_flight >= config.engine.max_num_seqs + config.max_queue:
            raise APIError(429, f"the queue is full ({state.in_flight} requests in flight): retry later",
                           "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        return req, _Slot(state)  # taken before any await: a burst cannot overshoot the queue

    async def run(req, slot: "_Slot") -> AsyncIterator[RequestOutput]:
        """The request's outputs; gives its place in flight back and records its metrics."""
        state.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        finished = False
        try:
            async for out in state.aengine.generate(req):
                if out.finished:
                    finished = True
                    state.metrics.finished(out)
                yield out
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        except EngineError as e:  # refused at admission by the engine thread
            raise APIError(400, str(e)) from None
        finally:
            slot.release()
            if not finished:
                state.metrics.requests("abort").inc()

    async def collect(req, slot: "_Slot", request: Request) -> RequestOutput:
        """Run to the end; a client that goes away aborts the request."""
        async def consume():
            last = None
            async for out in run(req, slot):
                last = out
            return last

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if not done and await request.is_disconnected():
                    task.cancel()
                    try:
                        await task
                    except (asyncio.CancelledError, Exception):  # noqa: BLE001
                        pass
                    raise APIError(499, "client disconnected")
        finally:
            slot.release()  # also when the task was cancelled before it ran
        return task.result()

    def usage(prompt_len: int, out: RequestOutput) -> dict:
        n = len(out.token_ids)
        u = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n,
             "decode_layer_speedup": round(out.decode_layer_speedup, 4)}
        if out.draft is not None:  # lossless: drafted, accepted and the layer work it took
            u.update(out.draft.to_dict(state.llm.num_layers, max(n - 1, 0)))
        return u

    def finish_reason(out: RequestOutput) -> str | None:
        return {"eos": "stop", "stop": "stop", "length": "length"}.get(out.finish_reason or "", out.finish_reason)

    def trace(out: RequestOutput) -> dict:
        return {"prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids,
                "active_layers": out.active_layers}

    def token_text(tid: int) -> str:
        return state.llm.tokenizer.decode([tid]) if state.llm.tokenizer is not None else str(tid)

    def completion_logprobs(entries, offset: int) -> dict:
        """OpenAI's legacy completions shape; ``offset``: text offset of the first token."""
        tokens, offsets = [], []
        for e in entries:
            tokens.append(token_text(e.token_id))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{token_text(t): v for t, v in e.top} for e in entries],
                "text_offset": offsets}

    def chat_logprobs(entries) -> dict:
        def one(tid: int, v: float) -> dict:
            t = token_text(tid)
            return {"token": t, "logprob": v, "bytes": list(t.encode("utf-8", "replace"))}

        return {"content": [dict(one(e.token_id, e.logprob), top_logprobs=[one(t, v) for t, v in e.top])
                            for e in entries]}

    def logprobs_of(kind: str, entries, offset: int = 0) -> dict | None:
        if entries is None:
            return None
        return completion_logprobs(entries, offset) if kind == "completion" else chat_logprobs(entries)

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def streaming(req, slot: "_Slot", body, kind: str, rid: str, prompt_len: int) -> StreamingResponse:
        gen = stream(req, slot, body, kind, rid, prompt_len)
        weakref.finalize(gen, slot.release)  # a stream never started (its client left first) gives its place back
        return StreamingResponse(gen, media_type="text/event-stream")

    async def stream(req, slot: "_Slot", body, kind: str, rid: str, prompt_len: int) -> AsyncIterator[str]:
        created = int(time.time())
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        base = {"id": rid, "object": obj, "created": created, "model": body.model}

        offset = 0  # text offset of the next token (completions' logprobs)

        def chunk(delta: str, reason: str | None, out: RequestOutput | None = None, first: bool = False) -> dict:
            nonlocal offset
            lp = logprobs_of(kind, out.new_logprobs, offset) if out is not None else None
            if lp is not None and kind == "completion":
                offset = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp["tokens"] else offset
            if kind == "completion":
                c = {"index": 0, "text": delta, "logprobs": lp, "finish_reason": reason}
            else:
                d = ({"role": "assistant", "content": delta} if first else {"content": delta}) if delta or first \
                    else {}
                c = {"index": 0, "delta": d, "logprobs": lp, "finish_reason": reason}
            if out is not None and out.finished and body.trace:
                c.update(trace(out))
            return dict(base, choices=[c])

        # chat's role chunk goes out with the first token, as vLLM sends it: clients (`vllm bench
        # serve` among them) take the first chunk for the first token when they time TTFT
        role_sent = kind != "chat"
        try:
            async for out in run(req, slot):
                if not role_sent:
                    role_sent = True
                    yield sse(chunk("", None, first=True))
                if out.finished:
                    yield sse(chunk(out.text_delta, finish_reason(out), out))
                    if body.stream_options is not None and body.stream_options.include_usage:
                        yield sse(dict(base, choices=[], usage=usage(prompt_len, out)))
                elif out.text_delta or out.new_logprobs:
                    yield sse(chunk(out.text_delta, None, out))
        except APIError as e:  # the status line is gone: the error travels as an event, as vLLM does
            yield sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, request: Request):
        check_ready()
        check_model(body.model)
        if isinstance(body.prompt, str):
            try:
                ids = state.llm.encode(body.prompt, chat=False)
            except SkipDecodeError as e:
                raise APIError(400, str(e), param="prompt") from None
        else:
            ids = list(body.prompt)
        req, slot = make_request(body, ids, body.max_tokens or 16)
        rid = f"cmpl-{req.request_id}"
        if body.stream:
            return streaming(req, slot, body, "completion", rid, len(ids))
        out = await collect(req, slot, request)
        choice = {"index": 0, "text": out.text, "logprobs": logprobs_of("completion", out.logprobs),
                  "finish_reason": finish_reason(out)}
        if body.trace:
            choice.update(trace(out))
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": body.model,
                "choices": [choice], "usage": usage(len(ids), out)}

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_ready()
        check_model(body.model)
        from ..tokenization import encode_messages

        try:
            msgs = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        try:
            ids = encode_messages(state.llm.tokenizer, msgs)
        except TemplateError as e:  # e.g. a template that wants roles to alternate
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        except SkipDecodeError as e:  # text no tokenizer can encode (lone surrogates)
            raise APIError(400, str(e), param="messages") from None
        max_tokens = body.max_completion_tokens or body.max_tokens or \
            max(1, min(config.default_max_tokens, state.max_model_len - len(ids) + 1))
        req, slot = make_request(body, ids, max_tokens)
        rid = f"chatcmpl-{req.request_id}"
        if body.stream:
            return streaming(req, slot, body, "chat", rid, len(ids))
        out = await collect(req, slot, request)
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "logprobs": logprobs_of("chat", out.logprobs), "finish_reason": finish_reason(out)}
        if body.trace:
            choice.update(trace(out))
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": body.model,
                "choices": [choice], "usage": usage(len(ids), out)}

    return app

