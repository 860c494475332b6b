"""Processes: the torch.distributed group under torchrun (DDP or FSDP2), rank-0 messages."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
from torch import nn

from ..model import Transformer


@dataclass
class DistEnv:
    rank: int = 0
    world: int = 1
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


def init_distributed() -> DistEnv:
    """A gloo process group only when launched with WORLD_SIZE > 1 (torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    import torch.distributed as dist

    owns = False
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        owns = True
    return DistEnv(dist.get_rank(), dist.get_world_size(), owns)


def _say(env: DistEnv, msg: str) -> None:
    if env.main:
        print(msg, file=sys.stderr, flush=True)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A full tensor from an FSDP shard (a collective: every rank calls it) or a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard_model(net: Transformer) -> Transformer:
    """FSDP2: each layer is one shard group (all-gathered just before it runs, freed after),
    the embeddings, final norm and tied head the root group."""
    from torch.distributed.fsdp import fully_shard

    for block in net.layers:
        fully_shard(block)
    return fully_shard(net)


def unsharded_copy(net: Transformer) -> Transformer:
    """The whole model on every rank, from FSDP shards (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    plain = Transformer(net.cfg)
    plain.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    return plain.eval()


def _rank_divergence(model: nn.Module) -> float:
    """Largest difference between any rank's trainable weights and rank 0's (0.0 under correct DDP)."""
    import torch.distributed as dist

    worst = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        if p.requires_grad:
            ref = p.detach().clone()
            dist.broadcast(ref, 0)
            worst = torch.maximum(worst, (p.detach() - ref).abs().max().double().reshape(1))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())

