"""Quantization-aware fine-tuning for int4: train through the rounding inference applies.

``--dtype int4`` rounds every block linear to llama.cpp's Q4_0 codes (``model.quantize_int4``).
Rounding a model trained in fp32 moves its greedy choices, and more so at high speedups, where
fewer layers run. Here each block linear's forward uses the weight rounded by that same rule and
its gradient passes straight through the rounding (Bengio et al., 2013's estimator) to the fp32
weight it was rounded from, so the optimizer moves the fp32 weights while the loss sees int4's.
The written model holds the rounded weights: ``--dtype int4`` rounds them back to exactly the
codes training used, and fp32 inference runs that int4 model's values.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from .. import kernels
from ..model import BLOCK_LINEARS, Transformer, dequantize_int4, quantize_int4


class Int4RoundTrip(nn.Module):
    """A weight's forward value: its Q4_0 rounding; its gradient: the identity (straight through)."""

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            rounded = dequantize_int4(*quantize_int4(w)).to(w.dtype)
        return w + (rounded - w).detach()


def rounded_linears(net: Transformer) -> list[nn.Linear]:
    """The block linears int4 inference rounds: those whose inputs split into whole groups of 32."""
    out = []
    for block in net.layers:
        for name in BLOCK_LINEARS:
            lin = getattr(block, name, None)
            if isinstance(lin, nn.Linear) and kernels.whole_groups(lin.in_features):
                out.append(lin)
    return out


def attach(net: Transformer) -> None:
    """Train ``net``'s block linears through int4 rounding."""
    for lin in rounded_linears(net):
        if not parametrize.is_parametrized(lin, "weight"):
            parametrize.register_parametrization(lin, "weight", Int4RoundTrip())


def detach(net: Transformer) -> None:
    """Replace each rounded linear's fp32 weight by its rounding (what int4 inference runs), as a
    plain parameter again, so the model saves and loads as any other."""
    for lin in rounded_linears(net):
        if parametrize.is_parametrized(lin, "weight"):
            parametrize.remove_parametrizations(lin, "weight", leave_parametrized=True)
