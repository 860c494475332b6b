"""Prompt lookup: drafts that cost no layer at all, for lossless requests.

Where the output copies its input (a quoted phrase, a term from an abstract,
a name), the tokens after the last few generated ones are often the tokens
that followed the same few tokens earlier in the prompt (Saxena 2023, "prompt
lookup decoding"; transformers' ``prompt_lookup_num_tokens``, vLLM's n-gram
proposer). A skipped pass that is unsure of its draft, on inputs unlike its
training data, is often wrong there, and a lookup drafts for free: full depth
verifies it like any draft, so the output stays full depth's.

Torch-free: the engine calls :func:`lookup_drafts` with the request's prompt,
its verified tokens and the round's drafts so far.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

MAX_NGRAM = 4  # longest suffix matched first: a longer match predicts its continuation better


def lookup_drafts(context: Sequence[int], min_ngram: int, k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the
    context's last ``n`` tokens, trying ``n`` from ``max_ngram`` down to
    ``min_ngram``; ``[]`` when no suffix that long occurred before."""
    if k < 1 or min_ngram < 1 or len(context) <= min_ngram:
        return []
    ctx = np.asarray(context, dtype=np.int64)
    T = len(ctx)
    # candidate ends: earlier positions holding the last token (never the last position itself)
    ends = np.flatnonzero(ctx[:-1] == ctx[-1])
    for n in range(min(max_ngram, T - 1), min_ngram - 1, -1):
        c = ends[ends >= n - 1]
        for j in range(1, n):  # keep the ends whose j-th token back matches too
            c = c[ctx[c - j] == ctx[T - 1 - j]]
        if len(c):
            e = int(c[-1])  # the latest occurrence: the most recent context predicts best
            return ctx[e + 1:e + 1 + k].tolist()
    return []
