"""What a request asks for, the engine's state of it, and what it reports back."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum

from ..errors import SkipDecodeError
from ..schedule import SkipSchedule


class EngineError(SkipDecodeError):
    """A request the engine cannot take as given (says what to change)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a bug or a failure): not the request's fault."""


GREEDY_BELOW = 1e-5  # temperature under which sampling is greedy
DEFAULT_DRAFT_TOKENS = 4  # drafts per lossless round (benchmarks/results/lossless.md measures 2..8)
DEFAULT_LOSSLESS_SPEEDUP = 5.0  # the draft schedule when a lossless request names none (same measurement)
MAX_DRAFT_TOKENS = 16
# a lossless round stops drafting after a draft its skipped pass gave less than this
# probability: it would likely be rejected, and every further draft with it. 5x, K=4 and 0.6
# are the setting benchmarks/results/lossless.md chooses on its tuning prompts, fp32 and int8
DEFAULT_DRAFT_CONFIDENCE = 0.6
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's chat limit)


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when ``temperature`` is 0 (the default) or below 1e-5. A sampled request draws
    from its own generator seeded ``seed``, so its tokens do not depend on its
    batch-mates or on when it arrived."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise EngineError(f"temperature must be a finite number >= 0, got {t!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise EngineError(f"top_k must be an integer >= 1, got {self.top_k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p)
                              or not 0 < p <= 1):
            raise EngineError(f"top_p must be in (0, 1], got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**63):
            raise EngineError(f"seed must be an integer in [0, 2**63), got {s!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy: dividing logits by them overflows."""
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class Request:
    """One generation: prompt token ids, its own schedule and sampling."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    schedule: SkipSchedule
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # lossless: the schedule only drafts; a full-depth pass verifies every token (see engine.py)
    lossless: bool = False
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    # log-probabilities: None = off; k = the chosen token's and the k most likely tokens'
    logprobs: int | None = None
    # adaptive budgets: the schedule's clock ticks only on tokens chosen with top-1 probability >= this
    adaptive_threshold: float | None = None
    # lossless: end a round's drafting after a draft of lower probability than this (0 = never early)
    draft_confidence: float = DEFAULT_DRAFT_CONFIDENCE
    # lossless: an unsure draft gives way to prompt lookup on the last >= this many tokens (0 = off)
    prompt_lookup: int = 0

    @property
    def kv_schedule(self) -> SkipSchedule:
        """The schedule its KV reservation follows: a lossless request ends with
        every position verified at full depth; an adaptive one may never step down."""
        if self.lossless:
            return SkipSchedule.full_depth(self.schedule.num_layers)
        if self.adaptive_threshold is not None:
            from ..policies.adaptive import worst_case

            return worst_case(self.schedule)
        return self.schedule


class Status(Enum):
    WAITING = "waiting"  # queued, no KV yet
    PREFILL = "prefill"  # KV reserved, prompt chunks running
    DECODE = "decode"  # generating
    FINISHED = "finished"


@dataclass
class RequestState:
    """The engine's view of one request while it lives."""

    request: Request
    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None  # when it was admitted (KV reserved): its queue time ends
    status: Status = Status.WAITING
    reservation: object | None = None  # kv_cache.Reservation while KV is held
    prefilled: int = 0  # prompt tokens whose keys/values are written
    cached_prefix: int | None = None  # prompt tokens copied from the prefix cache (None: not looked up yet)
    token_ids: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)  # budgets[i]: layers generated token i ran when fed back
    layer_ranks: tuple[int, ...] | None = None  # the layer family it ran (SkipSchedule.ranks); None: its own
    finish_reason: str | None = None
    text: str = ""
    arrived_step: int | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    finished_step: int | None = None
    detok: object | None = None  # tokenization.Detokenizer when the engine has a tokenizer
    generator: object | None = None  # torch.Generator of a sampled request
    # lossless requests: the round in flight and what drafting achieved
    drafts: list[int] = field(default_factory=list)  # drafted, not yet verified
    draft_probs: list = field(default_factory=list)  # a sampled request's draft distribution per draft
    draft_budgets: list[int] = field(default_factory=list)  # budget each draft's input ran at, this round
    round_size: int = 0  # drafts this round aims for (fewer if a draft is EOS)
    verifying: bool = False  # the round's drafts are done: the next step verifies them
    lookup_drafts: int = 0  # of the round's drafts, those taken by prompt lookup (they come last)
    draft_extra: object | None = None  # token ids beyond the draft vocabulary its drafts score (its prompt's)
    spec: "DraftStats | None" = None
    logprobs: list["TokenLogprob"] = field(default_factory=list)  # per generated token, when asked for
    confident: int = 0  # adaptive requests: tokens chosen with top-1 probability >= the threshold

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def fed_index(self) -> int:
        """Generated position of the token it feeds next (a lossless round's drafts count)."""
        return len(self.token_ids) - 1 + len(self.drafts)

    def next_own_budget(self) -> int:
        """The budget its own schedule gives the token it feeds next (a lossless
        request between drafting rounds feeds it at full depth)."""
        if self.request.lossless and not self.round_size:
            return self.request.schedule.num_layers
        if self.request.adaptive_threshold is not None:
            from ..policies.adaptive import clock_budget

            return clock_budget(self.request.schedule, self.confident)
        return self.request.schedule.budget(self.fed_index)

    def active_layers(self, num_layers: int) -> list[list[int]]:
        """The layers each generated token ran when fed back ([] for the last, never fed)."""
        ranks = self.layer_ranks or self.request.schedule.ranks
        out = [[l for l in range(num_layers) if ranks[l] < b] for b in self.budgets]
        return out + [[]] * (len(self.token_ids) - len(out))

    def decode_layer_speedup(self, num_layers: int) -> float:
        return num_layers * len(self.budgets) / sum(self.budgets) if self.budgets else 1.0


@dataclass
class DraftStats:
    """What a lossless request's drafting achieved. ``acceptance`` holds, per
    draft full depth judged (each accepted one and the first rejected one of a
    round), its generated position, the budget of the pass that drafted it and
    whether full depth agreed: where skipping loses, measured."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    draft_layers: int = 0  # layers run by the drafting passes
    verify_layers: int = 0  # layers run by the verifying passes (every position at full depth)
    acceptance: list[tuple[int, int, bool]] = field(default_factory=list)
    lookup_drafted: int = 0  # drafts taken by prompt lookup (no layers run), of ``drafted``
    lookup_accepted: int = 0  # of ``accepted``

    def to_dict(self, num_layers: int, fed: int) -> dict:
        """Totals and the layer work against full depth (``fed`` positions at ``num_layers`` each)."""
        work = self.draft_layers + self.verify_layers
        return {"drafted_tokens": self.drafted, "accepted_tokens": self.accepted, "rounds": self.rounds,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
                "lookup_drafted_tokens": self.lookup_drafted, "lookup_accepted_tokens": self.lookup_accepted,
                "draft_layers": self.draft_layers, "verify_layers": self.verify_layers,
                "layer_work_vs_full_depth": round(work / (num_layers * fed), 4) if fed else None}


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the pass that chose it (the
    skipped pass for a skipped step, full depth for a verified lossless token),
    from the raw logits before temperature, top-k and top-p, as vLLM reports
    them; ``top``: the most likely tokens, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta), and its totals so far."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    text: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    active_layers: list[list[int]] = field(default_factory=list)  # filled when finished
    decode_layer_speedup: float = 1.0
    arrived_step: int | None = None
    finished_step: int | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None  # set when the engine failed this request
    draft: DraftStats | None = None  # lossless requests: drafting and verification totals
    scheduled_time: float | None = None  # when it was admitted (filled when finished)
    new_logprobs: list[TokenLogprob] | None = None  # per new token, when the request asked for logprobs
    logprobs: list[TokenLogprob] | None = None  # every token's, when finished
