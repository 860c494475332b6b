"""Error-compensating 4-bit rounding (GPTQ, Frantar et al., 2023) in llama.cpp's Q4_0 format.

Rounding each weight to its nearest 4-bit code ignores that the errors of one output's inputs add
up: what matters is the error of the product ``W x`` on the inputs the layer sees, which is
``(W - Q) H (W - Q)^T`` with ``H = X^T X``. GPTQ rounds one input column at a time and moves the
column's rounding error onto the columns not yet rounded, weighted by the inverse of ``H``, so later
columns absorb what earlier ones lost.

The format stays Q4_0's (``model.quantize_int4``): per output channel and group of 32 inputs, a
bf16 scale ``d`` with the group's entry of largest magnitude at code 0 (``-8 d``). A group's scale is
taken from its (already updated) weights when GPTQ reaches it, and that entry is held at code 0, so
the rounded weights written in fp32 round back to the same codes and scales: ``--dtype int4``
(``w4a8``, ``w4a16``) on the written checkpoint runs exactly these codes, and fp32 on it computes
what they stand for.

``H`` comes from teacher-forced training examples run with the checkpoint's own skip schedules
(``awq.each_linear_input``): at 3x the upper layers see a skipped prefix's embeddings, not what
full depth feeds them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import kernels
from .awq import LINEARS, calibration_set, check_supported, each_linear_input
from .config import ModelError
from .model import Transformer, dequantize_int4, int4_scale, quantize_int4


def hessians(net: Transformer, items: Sequence[tuple[list[int], list[int]]], schedules: Sequence,
             batch_size: int = 16) -> dict[tuple[int, str], tuple[torch.Tensor, int]]:
    """Per ``(layer, linear)``: ``X^T X`` (float64) over every input row it receives in passes
    over ``items`` under each schedule, and the number of rows."""
    out: dict[tuple[int, str], list] = {}

    def add(key, x):
        x = x.double()
        acc = out.setdefault(key, [torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64), 0])
        acc[0] += x.T @ x
        acc[1] += x.shape[0]

    each_linear_input(net, items, schedules, add, batch_size)
    return {k: (h, n) for k, (h, n) in out.items()}


def round_int4(w: torch.Tensor, h: torch.Tensor, damp: float = 0.01, block: int = 128) -> torch.Tensor:
    """``w`` ``[N, K]`` rounded to Q4_0 codes by GPTQ against ``h = X^T X`` ``[K, K]``; returns the
    fp32 weights the codes stand for. ``damp`` (a share of ``h``'s mean diagonal) keeps the
    inverse stable; ``block`` columns are updated together (a multiple of the group)."""
    g = kernels.INT4_GROUP
    n, k = w.shape
    if k % g or block % g:
        raise ValueError(f"int4 rounds groups of {g} inputs; got {k} inputs and blocks of {block}")
    if h.shape != (k, k):
        raise ValueError(f"expected a [{k}, {k}] input Hessian for a [{n}, {k}] weight, got {list(h.shape)}")
    W = w.detach().float().clone()
    H = h.detach().double().clone()
    dead = torch.diagonal(H) == 0  # inputs that were never nonzero: nothing to keep, nothing to move
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diagonal(H).mean() * torch.eye(k, dtype=H.dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    Q = torch.empty_like(W)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        Wb, Ub = W[:, b0:b1].clone(), U[b0:b1, b0:b1]
        err = torch.empty_like(Wb)
        for i in range(b1 - b0):
            if i % g == 0:  # the group's scale from its weights as they stand now (Q4_0's rule)
                d, inv, top = (t[:, 0] for t in int4_scale(Wb[:, i:i + g]))
            q = torch.round(Wb[:, i] * inv + 8).clamp(0, 15)
            q[top == i % g] = 0  # the entry that set the scale stays at -8 d, so the codes round back
            Q[:, b0 + i] = (q - 8) * d
            err[:, i] = (Wb[:, i] - Q[:, b0 + i]) / Ub[i, i]
            Wb[:, i:] -= err[:, i:i + 1] * Ub[i:i + 1, i:]
        W[:, b1:] -= err @ U[b0:b1, b1:]
    return Q


def product_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """``sum ||X (w - q)^T||^2`` from ``h = X^T X``: what GPTQ lowers."""
    e = (w - q).double()
    return float(torch.einsum("nk,kl,nl->", e, h.double(), e))


def apply(net: Transformer, hs: dict[tuple[int, str], tuple[torch.Tensor, int]], damp: float = 0.01) -> list[dict]:
    """Round every block linear of ``net`` (in place) to int4 codes by GPTQ; one record per linear
    with its product error as a share of round-to-nearest's (below 1: GPTQ closer)."""
    records = []
    with torch.no_grad():
        for li, block in enumerate(net.layers):
            for name in LINEARS:
                lin = getattr(block, name)
                w = lin.weight.float()
                h, rows = hs[(li, name)]
                q = round_int4(w, h, damp)
                nearest = dequantize_int4(*quantize_int4(w))
                base = product_error(w, nearest, h)
                records.append({"layer": li, "linear": name, "rows": rows,
                                "error_share": round(product_error(w, q, h) / base, 4) if base else 1.0})
                lin.weight.copy_(q.to(lin.weight.dtype))
    return records


def fit(llm, task: str = "e2e-heldout", examples: int = 64, speedups: Sequence[float] = (1.0, 2.0, 3.0),
        damp: float = 0.01) -> dict:
    """Round the block linears of an unpacked fp32 ``LLM`` (``LLM.load(..., pack=False)``) to int4
    codes by GPTQ, ``X^T X`` from ``examples`` training examples of ``task`` run under its schedules
    at ``speedups`` (in place). Returns the fit's record: its settings and one entry per linear."""
    net = llm.model
    check_supported(net)
    if any(getattr(b, n).weight.dtype != torch.float32 for b in net.layers for n in LINEARS):
        raise ModelError("GPTQ writes int4 values into fp32 weights; load the model unpacked in float32")
    items, schedules = calibration_set(llm, task, examples, speedups)
    records = apply(net, hessians(net, items, schedules), damp)
    return {"task": task, "examples": len(items), "speedups": list(map(float, speedups)), "damp": damp,
            "format": "Q4_0 (int4)", "linears": records}
