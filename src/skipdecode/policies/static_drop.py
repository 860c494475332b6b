"""Static layer drop, the baseline SkipDecode must beat at equal decode compute.

The same layers are removed for every token, prompt included (ShortGPT, Men
et al., 2024): a layer's *Block Influence* is ``1 - cos(h_in, h_out)``
averaged over the tokens of calibration text, and the layers that change
their input least go first. Dropping ``L - round(L / speedup)`` layers costs
what a SkipDecode schedule of that mean budget costs per decode token. The
pruned model is an ordinary, smaller checkpoint: it is fine-tuned and served
like any other.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch

from ..checkpoint import save_hf_model
from ..errors import SkipDecodeError
from ..model import Transformer
from .importance import block_influence  # noqa: F401  (the measure static drop ranks layers by)

# the config.json key that holds the layer count, per architecture
_LAYER_KEY = {"llama": "num_hidden_layers", "opt": "num_hidden_layers", "gpt2": "n_layer"}


class PruneError(SkipDecodeError):
    """A layer drop that cannot be done as asked."""


def layers_to_drop(influence: Sequence[float], speedup: float) -> list[int]:
    """The ``L - round(L / speedup)`` least influential layers, ascending."""
    L = len(influence)
    if not 1 <= speedup <= L:
        raise PruneError(f"speedup must be in [1, {L}] for a {L}-layer model, got {speedup}")
    keep = max(1, round(L / speedup))
    order = sorted(range(L), key=lambda i: (influence[i], i))
    return sorted(order[: L - keep])


def drop_layers(net: Transformer, drop: Sequence[int]) -> Transformer:
    """A copy of ``net`` without the layers ``drop``: a smaller ordinary model."""
    kept = [i for i in range(net.n_layers) if i not in set(drop)]
    if not kept:
        raise PruneError("cannot drop every layer")
    out = copy.deepcopy(net)
    out.cfg = replace(net.cfg, n_layers=len(kept))
    out.layers = torch.nn.ModuleList(out.layers[i] for i in kept)
    return out


def save_pruned(net: Transformer, source: Path, out: Path, drop: Sequence[int], influence: Sequence[float],
                speedup: float) -> Path:
    """Write the pruned model as a Hugging Face directory whose config has the new layer count;
    ``skipdecode.json`` records which layers went and why."""
    pruned = drop_layers(net, drop)
    meta = {"static_layer_drop": {"method": "ShortGPT block influence (1 - cos(h_in, h_out))",
                                  "speedup": speedup, "num_layers": net.n_layers,
                                  "dropped_layers": list(drop), "block_influence": list(influence)}}
    return save_hf_model(pruned, source, out, meta, {_LAYER_KEY[net.cfg.arch]: pruned.n_layers})
