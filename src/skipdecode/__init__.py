"""skipdecode: batched, KV-cached SkipDecode generation (Del Corro et al., 2023)."""

from .config import ModelConfig, ModelError
from .generate import GenerationError, Sampling, generate_tokens
from .llm import LLM, Completion
from .schedule import ScheduleError, SkipSchedule

__all__ = ["LLM", "Completion", "SkipSchedule", "ScheduleError", "ModelError", "GenerationError",
           "ModelConfig", "Sampling", "generate_tokens"]
__version__ = "0.1.0"
