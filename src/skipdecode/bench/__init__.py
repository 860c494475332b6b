"""Benchmarks, each a committed command writing ``benchmarks/results/``:
``decode`` (decode speed against transformers) and ``engine`` (continuous
batching under Poisson arrivals against static waves)."""

from .decode import PROMPTS, machine_info, render_markdown, run_bench

__all__ = ["PROMPTS", "machine_info", "render_markdown", "run_bench"]
