"""Training in several processes with torch's own engine: torchrun launches, DDP averages gradients.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK for each process it starts; without them a run is one
process and nothing here does anything. Processes talk over NCCL on GPUs and gloo on CPUs.

The data split keeps N processes equivalent to one: every process draws the same global batch of
windows from the same seeded generator and trains on its own contiguous slice of the rows. DDP
averages the gradients, so N processes with batch B each take the steps one process takes with
batch N x B (up to float rounding).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from aftgen.errors import AftgenError

# Setting up may take long: rank 0 trains the tokenizer and tokenizes the corpus while the others wait.
SETUP_TIMEOUT = timedelta(minutes=30)
# A training step, a quick eval or a checkpoint save takes far less; past this a silent peer means a
# dead or stuck process, and the collective fails instead of waiting forever.
STEP_TIMEOUT = timedelta(minutes=5)


def local_rank() -> int:
    """This process's index on its machine (which GPU it uses): 0 outside torchrun."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass
class World:
    """This process's place among the training processes (rank 0 of 1 when alone)."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    group: dist.ProcessGroup | None = None  # the training collectives' group, with the short timeout

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def slot(self) -> tuple[int, int]:
        """(rank, size): which rows of every global batch are this process's."""
        return self.rank, self.size

    @property
    def main(self) -> bool:
        """Rank 0 alone writes files, metrics and progress."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def share_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` on every rank (others pass None)."""
        if not self.distributed:
            assert payload is not None
            return payload
        size = torch.tensor([len(payload) if self.main else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(size, 0)
        if self.main:
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            buffer = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        dist.broadcast(buffer, 0)
        return payload if self.main else buffer.cpu().numpy().tobytes()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over all ranks (the values themselves when alone)."""
        if not self.distributed:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, group=self.group)
        return tensor.tolist()

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as the training step calls it: DDP when distributed, itself otherwise."""
        if not self.distributed:
            return model
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, process_group=self.group)


@contextlib.contextmanager
def join(device: torch.device) -> Iterator[World]:
    """Join the other processes torchrun started (or stay alone); leave the group on the way out."""
    if not launched_by_torchrun():
        yield World(device=device)
        return
    if device.type == "mps":
        raise AftgenError("multi-process training does not support MPS; use --device cpu or a CUDA machine")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=SETUP_TIMEOUT)
    try:
        group = dist.new_group(timeout=STEP_TIMEOUT)
        yield World(rank=dist.get_rank(), size=dist.get_world_size(), device=device, group=group)
    finally:
        dist.destroy_process_group()


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another process died or stopped answering."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Timed out", "NCCL")
    )
