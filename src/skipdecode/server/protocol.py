"""OpenAI-compatible request and response bodies, with the skip extensions.

Standard fields follow OpenAI's API (defaults included: ``temperature`` 1,
``max_tokens`` 16 for completions). Skip controls ride as extra body fields,
the way vLLM takes ``top_k``: ``speedup`` or ``schedule`` (the fields of
``SkipSchedule``), ``mode``, ``trace`` (token ids and the layers each
token ran, per choice), ``lossless`` with ``draft_tokens``,
``draft_confidence`` and ``prompt_lookup`` (the schedule drafts, full depth
verifies; streams carry verified tokens only), and
``adaptive`` (``true``: the model's calibrated threshold for ``speedup``; a
number in [0, 1]: step down the schedule only after tokens that sure).

Unknown top-level fields (``tools``, ``response_format``, vendor fields) are
accepted and ignored with a warning in the server log, as vLLM does, so
clients written for other servers keep working; every known field is still
validated, and the skip extension's own ``schedule`` object refuses unknown
keys (a typo there would silently change the schedule).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ScheduleFields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_exit_layer: int
    min_exit_layer: int
    horizon: int
    warmup_layers: int = 1
    mode: Literal["skip", "early_exit", "nested"] = "skip"
    layer_order: list[int] | None = None  # mode nested: the layers, most important first
    num_layers: int | None = None


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # skipdecode extensions
    speedup: float | None = Field(None, ge=1.0)
    schedule: ScheduleFields | None = None
    mode: Literal["skip", "early_exit", "nested"] | None = None  # None: the checkpoint's layer family
    trace: bool = False
    lossless: bool = False  # the schedule drafts, full depth verifies: full depth's output
    draft_tokens: int | None = Field(None, ge=1, le=16)
    draft_confidence: float | None = Field(None, ge=0.0, lt=1.0)  # stop drafting after a less sure draft
    prompt_lookup: int | None = Field(None, ge=0, le=4)  # unsure drafts give way to prompt lookup (policies.lookup)
    adaptive: StrictBool | float | None = None  # step down only after confident tokens (policies.adaptive)

    @field_validator("temperature", "top_p", "speedup", "presence_penalty", "frequency_penalty")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > 4:
            raise ValueError("at most 4 stop strings")
        if any(len(x) > MAX_STOP_CHARS for x in v):
            raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _supported(self) -> "_Sampling":
        if self.n != 1:
            raise ValueError("n: only n=1 is supported")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty/frequency_penalty: not supported (use 0)")
        if self.speedup is not None and self.schedule is not None:
            raise ValueError("speedup/schedule: give either a target speedup or a schedule, not both")
        for name in ("draft_tokens", "draft_confidence", "prompt_lookup"):
            if getattr(self, name) is not None and not self.lossless:
                raise ValueError(f"{name}: applies to lossless requests only (add \"lossless\": true)")
        a = self.adaptive
        if a is not None and not isinstance(a, bool) and not (math.isfinite(a) and 0 <= a <= 1):
            raise ValueError("adaptive: true, false or a top-1 probability threshold in [0, 1]")
        if a not in (None, False) and self.lossless:
            raise ValueError("adaptive: adaptive budgets and lossless mode do not combine; drop one")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream=true")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[StrictInt] | list[str] = Field(..., description="text, or token ids; a list of one string")
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="log-probabilities of each token and of this many alternatives")

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (a list of one string, or token ids)")
            v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt is empty")
        if isinstance(v, list) and not v:
            raise ValueError("prompt is empty")
        return v

    @model_validator(mode="after")
    def _no_echo(self) -> "CompletionRequest":
        if self.echo:
            raise ValueError("echo: not supported")
        return self


class ChatMessage(BaseModel):
    """A message must say something: no content, empty content, or a part that is
    not text is a 400 (other servers answer it with an empty turn)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict]

    @field_validator("content")
    @classmethod
    def _has_text(cls, v: str | list[dict]) -> str | list[dict]:
        if isinstance(v, list):  # [{"type": "text", "text": ...}, ...]
            if not v:
                raise ValueError("content is an empty list: give text")
            for p in v:
                if p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise ValueError("only text content parts are supported: {\"type\": \"text\", \"text\": ...}")
            if not any(p["text"] for p in v):
                raise ValueError("content is empty: give text")
        elif not v:
            raise ValueError("content is empty: give text")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p["text"] for p in self.content)
        return self.content


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs \"logprobs\": true")
        return self

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
