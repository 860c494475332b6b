"""The Python front door: load a model once, generate text with a schedule.

    from skipdecode import LLM
    llm = LLM.load()  # default-e2e: the embedded model, skip-trained on E2E
    out = llm.generate(["Describe a cheap Italian pub."], speedup=2)
    print(out[0].text, out[0].decode_layer_speedup)
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from .checkpoint import load_model
from .config import WEIGHT_DTYPES, ModelError
from .engine import DEFAULT_LOSSLESS_SPEEDUP, Engine, EngineConfig, Request, SamplingParams
from .engine.kv_cache import KV_DTYPES
from .errors import SkipDecodeError
from .generate import GenerationError, Sampling, generate_tokens
from .tokenization import encode_prompt, has_tokenizer, load_tokenizer
from .model import Transformer
from .policies.select import schedule_for_speedup
from .schedule import DEFAULT_DECAY, SkipSchedule

# weight dtype -> the dtype the checkpoint is loaded in: bf16, int8 and int4 are the linears' weights only,
# rounded from fp32 when packed (activations, norms, embeddings and the KV cache stay fp32)
log = logging.getLogger("skipdecode")

_DTYPES = {**{d: torch.float32 for d in WEIGHT_DTYPES}, "float16": torch.float16}


@dataclass
class Completion:
    """One request's output and the numbers a user needs to judge it."""

    prompt: str
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    active_layers: list[list[int]]
    new_tokens: int
    finish_reason: str
    decode_layer_speedup: float
    seconds: float
    draft: dict | None = None  # lossless: drafted and accepted tokens, rounds, layer work

    def to_dict(self, trace: bool = False) -> dict:
        """Without ``trace``: the text, the generated ``token_ids`` and the numbers; with it,
        also the prompt's ids and the layers each token ran."""
        d = asdict(self)
        if not trace:
            for k in ("prompt_token_ids", "active_layers"):
                d.pop(k)
        if d["draft"] is None:
            d.pop("draft")
        return d


class LLM:
    """A loaded model + tokenizer; generation, training and evaluation share it."""

    def __init__(self, model: Transformer, tokenizer, path: Path, eos_token_ids: list[int]):
        self.model = model
        self.tokenizer = tokenizer
        self.path = path
        self.eos_token_ids = eos_token_ids
        # A skip-trained checkpoint records the schedules it was trained with;
        # a target speedup then means exactly that schedule.
        meta = path / "skipdecode.json"
        self.training: dict = json.loads(meta.read_text()) if meta.is_file() else {}
        self._warned_untrained = False

    @classmethod
    def load(cls, model: str | os.PathLike = "default-e2e", dtype: str = "float32", pack: bool = True,
             use_kernels: bool = True, kv_dtype: str | None = None) -> "LLM":
        """Load weights once. ``pack`` lays linear weights out for fast CPU decoding;
        ``use_kernels=False`` keeps oneDNN instead of the compiled kernels
        (``skipdecode.kernels``; also ``SKIPDECODE_KERNELS=0``). ``kv_dtype``: the KV
        cache's dtype for every generation and engine on this model, ``float32``,
        ``float16`` or ``bfloat16`` (default: the model's dtype); half-width keys and
        values halve the cache and what each decode step reads from it, rounded when stored."""
        if dtype not in _DTYPES:
            raise ModelError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise ModelError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
        net, path = load_model(model, _DTYPES[dtype])
        if dtype in WEIGHT_DTYPES and dtype != "float32" and not pack:
            raise ModelError(f"{dtype} weights exist only packed for inference: drop pack=False or use float32")
        if pack:
            net.pack_for_inference(use_kernels, weights=dtype if dtype != "float16" else None)
        net.kv_dtype = KV_DTYPES[kv_dtype] if kv_dtype is not None else None
        tokenizer = load_tokenizer(path) if has_tokenizer(path) else None
        eos = list(net.cfg.eos_token_ids)
        gen_cfg = path / "generation_config.json"
        if gen_cfg.is_file():
            g = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos += g if isinstance(g, list) else ([g] if g is not None else [])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        return cls(net, tokenizer, path, sorted(set(eos)))

    @property
    def num_layers(self) -> int:
        return self.model.cfg.n_layers

    def make_schedule(self, speedup: float | None = None, schedule: SkipSchedule | str | os.PathLike | None = None,
                      expected_new_tokens: int | None = None, mode: str | None = None, warmup_layers: int | None = None,
                      horizon: int | None = None, default_new_tokens: int = 64,
                      decay: float | None = None, layer_order: tuple[int, ...] | None = None) -> SkipSchedule:
        """A schedule from a target speedup, a file, or a ready object (full depth if none).

        For a checkpoint trained with skipdecode, a target it was trained at
        (and no explicit length, horizon, warm-up or decay) gives exactly the
        training schedule; other targets are solved for its training length
        and decay.
        """
        if speedup is not None and schedule is not None:
            raise GenerationError("give either a target speedup or a schedule, not both")
        if isinstance(schedule, SkipSchedule):
            if schedule.num_layers != self.num_layers:
                raise GenerationError(f"schedule is for {schedule.num_layers} layers, the model has {self.num_layers}")
            return schedule
        if schedule is not None:
            return SkipSchedule.from_file(schedule, self.num_layers)
        if speedup is None:
            return SkipSchedule.full_depth(self.num_layers)
        if speedup > 1 and not self.training.get("schedules") and not self._warned_untrained:
            self._warned_untrained = True
            log.warning("skipdecode: warning: %s was never trained to skip layers, so its output at %gx degrades; "
                        "load 'default-e2e' or fine-tune it first with 'skipdecode train'", self.path, speedup)
        return schedule_for_speedup(
            speedup, self.num_layers,
            expected_new_tokens or self.training.get("expected_new_tokens") or default_new_tokens,
            mode=mode, warmup_layers=warmup_layers, horizon=horizon,
            decay=self.training_decay if decay is None else decay,
            trained=self.training.get("schedules", {}), solve=expected_new_tokens is not None or decay is not None,
            layer_order=layer_order)

    @property
    def training_decay(self) -> float:
        """The decay the checkpoint's schedules were solved with: an untrained
        target is solved in the same shape (the default for other models)."""
        return float(self.training.get("config", {}).get("decay") or DEFAULT_DECAY)

    def _draft_speedup(self, lossless: bool, speedup: float | None, schedule) -> float | None:
        """A lossless request that names no schedule drafts at the measured default
        target (drafting at full depth would only add work), capped by what the model can skip."""
        if not lossless or speedup is not None or schedule is not None:
            return speedup
        w = 1  # the default warm-up layers: the deepest skip keeps warm-up + the last layer
        return min(DEFAULT_LOSSLESS_SPEEDUP, self.num_layers / (w + 1))

    def adaptive_plan(self, adaptive: bool | float | None, speedup: float | None,
                      schedule) -> tuple[float | None, float | None]:
        """``(schedule speedup, threshold)`` of an adaptive request (``(speedup, None)`` if not adaptive).
        ``True`` looks up the threshold calibrated for ``speedup`` (``skipdecode.json``'s
        ``adaptive``: the schedule it steps down and its threshold)."""
        if adaptive is None or adaptive is False:
            return speedup, None
        if adaptive is True:
            calibrated = self.training.get("adaptive", {})
            entry = calibrated.get(f"{speedup:g}x") if speedup is not None and schedule is None else None
            if entry is None:
                have = ", ".join(sorted(calibrated)) or "none"
                raise GenerationError(f"{self.path} has no adaptive threshold calibrated for "
                                      f"{'that schedule' if schedule is not None else f'{speedup}x'} (calibrated: "
                                      f"{have}); give a threshold in [0, 1] instead of true")
            return float(entry["schedule_speedup"]), float(entry["threshold"])
        from .policies.adaptive import check_threshold

        try:
            return speedup, check_threshold(adaptive)
        except SkipDecodeError as e:
            raise GenerationError(str(e)) from None

    def encode(self, prompt: str, chat: bool | None = None, system: str | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat, system)

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        speedup: float | None = None,
        schedule: SkipSchedule | str | os.PathLike | None = None,
        max_new_tokens: int = 64,
        expected_new_tokens: int | None = None,
        mode: str | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        chat: bool | None = None,
        system: str | None = None,
        ignore_eos: bool = False,
        on_text: Callable[[int, str], None] | None = None,
        lossless: bool = False,
        draft_tokens: int | None = None,
        adaptive: bool | float | None = None,
        draft_confidence: float | None = None,
        prompt_lookup: int | None = None,
    ) -> list[Completion]:
        """Generate for one or many prompts in one batch (on the engine: every
        prompt admitted at once, each leaving when done); see ``Completion``.
        ``on_text(row, delta)`` streams each row's text. ``lossless``: the
        schedule drafts ``draft_tokens`` per round and full depth verifies them,
        so the output is full depth's (greedy: the same tokens); a round stops
        drafting early after a draft below ``draft_confidence``; ``prompt_lookup=n``
        also drafts, at no layer cost, what followed the last ``n`` or more tokens
        where they occurred before (``policies.lookup``). ``adaptive``: each
        prompt steps down its schedule only on confident tokens (``policies.adaptive``);
        ``True`` takes the threshold the checkpoint calibrated for ``speedup``, a number
        is the threshold itself on the ``speedup`` schedule."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise GenerationError("prompts must be a string or a list of strings")
        if isinstance(stop, str):
            stop = [stop]
        speedup = self._draft_speedup(lossless, speedup, schedule)
        speedup, threshold = self.adaptive_plan(adaptive, speedup, schedule)
        sched = self.make_schedule(speedup, schedule, expected_new_tokens, mode, default_new_tokens=max_new_tokens)
        ids = [self.encode(p, chat, system) for p in prompts]
        rows, _ = generate_tokens(
            self.model, ids, sched, max_new_tokens,
            sampling=Sampling(temperature, top_k, top_p, seed),
            eos_token_ids=() if ignore_eos else self.eos_token_ids,
            tokenizer=self.tokenizer, stop=stop,
            on_text=on_text, lossless=lossless, draft_tokens=draft_tokens, adaptive_threshold=threshold,
            draft_confidence=draft_confidence, prompt_lookup=prompt_lookup,
        )
        return [Completion(p, r.text, pid, r.token_ids, r.active_layers, len(r.token_ids), r.finish_reason,
                           r.decode_layer_speedup, r.seconds, r.draft)
                for p, pid, r in zip(prompts, ids, rows)]

    # -- the engine: continuous batching for servers and replays -------------------
    def engine(self, config: EngineConfig | None = None) -> Engine:
        """A continuous-batching engine on this model (text, stop strings, EOS)."""
        return Engine(self.model, config, tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids)

    def request(self, engine: Engine, prompt: str | Sequence[int], *, speedup: float | None = None,
                schedule: SkipSchedule | str | os.PathLike | dict | None = None, max_new_tokens: int = 64,
                expected_new_tokens: int | None = None, mode: str | None = None, temperature: float = 0.0,
                top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                stop: str | Sequence[str] = (), chat: bool | None = None, system: str | None = None,
                ignore_eos: bool = False, request_id: str | None = None, lossless: bool = False,
                draft_tokens: int | None = None, logprobs: int | None = None,
                adaptive: bool | float | None = None, draft_confidence: float | None = None,
                prompt_lookup: int | None = None) -> Request:
        """A validated engine request from text (or token ids) and the options of ``generate``."""
        if isinstance(schedule, dict):
            schedule = SkipSchedule.from_dict(schedule, self.num_layers)
        speedup = self._draft_speedup(lossless, speedup, schedule)
        speedup, threshold = self.adaptive_plan(adaptive, speedup, schedule)
        sched = self.make_schedule(speedup, schedule, expected_new_tokens, mode, default_new_tokens=max_new_tokens)
        ids = list(prompt) if not isinstance(prompt, str) else self.encode(prompt, chat, system)
        return engine.make_request(ids, sched, max_new_tokens, SamplingParams(temperature, top_k, top_p, seed),
                                   stop, ignore_eos, request_id, lossless, draft_tokens, logprobs, threshold,
                                   draft_confidence, prompt_lookup)

    def replay(self, requests: Sequence[dict], config: EngineConfig | None = None) -> list[dict]:
        """Deterministic replay: request ``r`` (the keyword arguments of ``request``
        plus ``arrive_at_step``) is added when the engine reaches that step.
        Returns, in input order, each completion's fields with its
        ``arrived_step`` and ``finished_step``."""
        eng = self.engine(config)
        arrivals = sorted(range(len(requests)), key=lambda r: requests[r].get("arrive_at_step", 0))
        built = {}
        for r in arrivals:  # validate everything before running anything
            spec = {k: v for k, v in requests[r].items() if k not in ("arrive_at_step", "prompt")}
            try:
                built[r] = self.request(eng, requests[r]["prompt"], request_id=str(r), **spec)
            except SkipDecodeError as e:
                raise type(e)(f"request {r + 1}: {e}") from None
        done: dict[int, dict] = {}
        nxt = 0
        t0 = time.perf_counter()
        while nxt < len(arrivals) or eng.has_unfinished():
            while nxt < len(arrivals) and requests[arrivals[nxt]].get("arrive_at_step", 0) <= eng.step_count:
                eng.add(built[arrivals[nxt]])
                nxt += 1
            for o in eng.step():
                if o.finished:
                    r = int(o.request_id)
                    c = Completion(requests[r]["prompt"], o.text, o.prompt_token_ids, o.token_ids, o.active_layers,
                                   len(o.token_ids), o.finish_reason, o.decode_layer_speedup, o.finish_time - t0,
                                   o.draft.to_dict(self.num_layers, len(o.token_ids) - 1) if o.draft else None)
                    done[r] = dict(c.to_dict(trace=True), arrived_step=o.arrived_step, finished_step=o.finished_step)
        return [done[r] for r in range(len(requests))]
