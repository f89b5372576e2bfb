"""Data-parallel training under torchrun: which process this is, its device, and the few
collectives the Trainer needs. Without torchrun's environment (WORLD_SIZE unset or 1) there is
one process and every collective is the identity, so the Trainer has a single code path."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class Processes:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 alone validates and writes checkpoints, state and logs."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP sums gradients across processes during backward (and divides by world_size)."""
        if not self.distributed:
            return model
        # The buffers are constant tables: nothing to broadcast. static_graph: the same parameters
        # take part every step, and some (the Graph-Transformer's first norm_a) never do.
        return DistributedDataParallel(model, device_ids=[self.device] if self.device.type == "cuda" else None,
                                       forward_sync_buffers=False, static_graph=True)

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor

    def gather(self, obj) -> list | None:
        """Every process's `obj`, in rank order, on the main process (None elsewhere)."""
        if not self.distributed:
            return [obj]
        gathered = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered

    def from_main(self, obj):
        """The main process's `obj` on every process."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.distributed:
            dist.barrier()
            dist.destroy_process_group()


def start(device: str) -> Processes:
    """Join torchrun's process group when there is one: gloo on CPU; NCCL with --device cuda,
    each process on GPU LOCAL_RANK of its node."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and not {"RANK", "LOCAL_RANK"} <= set(os.environ):
        raise SystemExit(f"WORLD_SIZE={world_size} but RANK/LOCAL_RANK are unset: launch with torchrun")
    rank, local_rank = (int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])) if world_size > 1 else (0, 0)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda (NCCL between processes) needs a CUDA GPU and none is visible; "
                             "use --device cpu (gloo)")
        if local_rank >= torch.cuda.device_count():
            raise SystemExit(f"process LOCAL_RANK={local_rank} has no GPU of its own ({torch.cuda.device_count()} "
                             "visible): start at most one process per GPU")
        where = torch.device("cuda", local_rank)
        torch.cuda.set_device(where)
    else:
        where = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size)
    return Processes(rank, world_size, where)
