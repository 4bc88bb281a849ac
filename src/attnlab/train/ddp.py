"""Multi-process data parallelism through `torchrun` (DDP; gloo on CPU, nccl on CUDA).

    torchrun --nproc_per_node=2 -m attnlab.train configs/tiny.toml

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; `init_distributed` reads them and joins
the process group (a plain `python` run is world size 1 and touches nothing). Every rank
builds the same model from the same seed, reads its own shard of each global batch, and
DDP averages gradients, so a run on N ranks follows the single-process run with the
same global batch (`train.batch_size`) up to floating-point summation order.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_from_environment() -> DistEnv:
    """Rank and world size as torchrun sets them (world size 1 without torchrun)."""
    return DistEnv(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )


def init_distributed(device: torch.device) -> DistEnv:
    """Join the process group when launched by torchrun; pick the rank's GPU on CUDA."""
    env = env_from_environment()
    if not env.distributed:
        return env
    if device.type == "cuda":
        torch.cuda.set_device(env.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return env


def rank_device(device: torch.device, env: DistEnv) -> torch.device:
    """On CUDA each rank owns the GPU of its local rank."""
    return torch.device("cuda", env.local_rank) if device.type == "cuda" and env.distributed else device


def wrap_model(model: torch.nn.Module, env: DistEnv, find_unused_parameters: bool = False) -> torch.nn.Module:
    """DDP-wrap the model in a distributed run (parameters are broadcast from rank 0).

    find_unused_parameters: set it when some parameter takes no part in the loss (DDP would
    otherwise wait for its gradient forever); it costs a graph traversal per step."""
    if not env.distributed:
        return model
    ids = [env.local_rank] if next(model.parameters()).is_cuda else None
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=find_unused_parameters)


def no_sync(model: torch.nn.Module, skip: bool):
    """Skip the gradient all-reduce on accumulation micro-steps that are not the last one."""
    if skip and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def mean_over_ranks(values: list[float], env: DistEnv) -> list[float]:
    """Average a few floats across ranks (identity in a single process)."""
    if not env.distributed:
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / env.world_size).tolist()


def max_over_ranks(value: float, env: DistEnv) -> float:
    """The largest of one float across ranks (identity in a single process)."""
    if not env.distributed:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def shutdown(env: DistEnv, synchronize: bool = True) -> None:
    """Leave the process group. Call it after the last DDP wrapper is gone (`Trainer.release`).

    The order matters: gloo's process group joins its worker threads when it is destroyed, and a
    DDP reducer that held the last reference would destroy it from Python with the GIL held while
    a worker thread, releasing the last gradient all-reduce, waits for the GIL to free its tensors:
    a deadlock that left a finished rank alive until killed (seen about one launch in four with
    the other core busy). Dropping the wrapper first, then a barrier (the GIL is released while it
    waits, so those threads finish), then destroying the group leaves nothing to wait for.
    synchronize=False skips the barrier (a rank that failed must not wait for the others)."""
    if env.distributed and dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()
