"""`TensorParallel`: this process's place in a tensor-parallel group and the collectives a sharded model runs.

A sharded model keeps 1/size of every split weight (`deltaspec.parallel.shard`); after each attention / GDN
output projection, each MLP or MoE and the vocabulary-parallel embedding its rank holds a partial sum, which
`all_reduce` adds up in place on every rank, and the LM head's slices of the vocabulary meet in `gather_vocab`.
The group runs on torch.distributed: NCCL between GPUs (inside CUDA graphs too), gloo between CPU processes.
`SINGLE` is the group of one process: every collective is the identity, so one-GPU code pays nothing. Under pipeline
parallelism each stage's ranks form a group of their own (`group`), built by `deltaspec.engine.workers`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `size` (of its pipeline stage); `expert_parallel`: the routed experts are split whole among the
    ranks rather than each expert's intermediate size (`deltaspec.parallel.shard`)."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False
    group: object = None  # the torch.distributed group of the ranks (None: the whole world, i.e. one stage)

    @property
    def sharded(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x [...]: the sum of every rank's x, on every rank (in place)."""
        if self.sharded:
            with torch.no_grad():  # some callers (drafters) run outside inference mode; nothing here needs gradients
                dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, vocab / size] of this rank's slice of the vocabulary -> [N, vocab], every rank's slice in
        rank order."""
        if not self.sharded:
            return logits
        rows = logits.shape[0]
        parts = torch.empty((self.size * rows, logits.shape[1]), dtype=logits.dtype, device=logits.device)
        with torch.no_grad():
            ALL_GATHER(parts, logits.contiguous(), group=self.group)  # [size * N, vocab / size], rank by rank
        columns = logits.shape[1]
        return parts.view(self.size, rows, columns).permute(1, 0, 2).reshape(rows, self.size * columns)


SINGLE = TensorParallel()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
