"""The serving core: requests, the scheduler, the KV pool, the model runner,
the sampler and the step loop. No HTTP, no argparse."""

from .engine import AsyncEngine, Engine, EngineConfig, pool_for
from .kv_cache import KVPool, layer_needs
from .prefix_cache import PrefixCache
from .request import (DEFAULT_DRAFT_TOKENS, DEFAULT_LOSSLESS_SPEEDUP, DraftStats, EngineDeadError, EngineError,
                      Request, RequestOutput, RequestState, SamplingParams, TokenLogprob)
from .scheduler import Scheduler, SchedulerConfig, StepPlan

__all__ = ["AsyncEngine", "DEFAULT_DRAFT_TOKENS", "DEFAULT_LOSSLESS_SPEEDUP", "DraftStats", "Engine", "EngineConfig",
           "EngineDeadError", "EngineError", "KVPool", "PrefixCache", "Request", "RequestOutput", "RequestState",
           "SamplingParams", "Scheduler", "SchedulerConfig", "StepPlan", "TokenLogprob", "layer_needs", "pool_for"]
