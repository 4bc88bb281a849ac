"""Multi-process data parallelism through `torchrun` (DDP or FSDP2; gloo on CPU, nccl on CUDA).

    torchrun --nproc_per_node=2 -m attnlab.train configs/tiny.toml
    torchrun --nproc_per_node=2 -m attnlab.train configs/tiny.toml run.parallel=fsdp

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; `init_distributed` reads them and joins
the process group (a plain `python` run is world size 1 and touches nothing). Every rank
builds the same model from the same seed, reads its own shard of each global batch, and
DDP averages gradients, so a run on N ranks follows the single-process run with the
same global batch (`train.batch_size`) up to floating-point summation order.

With `run.parallel = "fsdp"` each decoder block and the model itself are `fully_shard`ed (FSDP2):
every rank keeps 1/N of each parameter, its gradient and its optimizer state, gathers a block's
weights just before the block runs and reduce-scatters its gradients after. Checkpoints gather the
full weights and optimizer state on rank 0 and are written in the single-process format, so a run
checkpointed under FSDP resumes under DDP or in one process and the other way round.
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


def wrap_model(model: torch.nn.Module, env: DistEnv, find_unused_parameters: bool = False,
               parallel: str = "ddp") -> torch.nn.Module:
    """In a distributed run: parallel='ddp' wraps the model in DDP (parameters broadcast from rank 0);
    'fsdp' shards it in place with FSDP2's `fully_shard`, each of `model.blocks` a unit of its own,
    and returns the model itself (build the optimizer afterwards: it must hold the sharded
    parameters). A single process gets the model back unchanged.

    find_unused_parameters (DDP): set it when some parameter takes no part in the loss (DDP would
    otherwise wait for its gradient forever); it costs a graph traversal per step. FSDP needs no such
    flag: a parameter without a gradient reduces as zeros."""
    if parallel not in ("ddp", "fsdp"):
        raise ValueError(f"parallel must be 'ddp' or 'fsdp', got {parallel!r}")
    if not env.distributed:
        return model
    cuda = next(model.parameters()).is_cuda
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda" if cuda else "cpu", (env.world_size,))
        for block in getattr(model, "blocks", ()):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    ids = [env.local_rank] if cuda else None
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=find_unused_parameters)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` was sharded by FSDP2 (`wrap_model(..., parallel='fsdp')`)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def _without_gradient_sync(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def no_sync(model: torch.nn.Module, skip: bool):
    """Skip the gradient all-reduce (DDP) or reduce-scatter (FSDP) on accumulation micro-steps that are
    not the last one."""
    if skip and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if skip and is_sharded(model):
        return _without_gradient_sync(model)
    return contextlib.nullcontext()


def local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of `t`'s value: a sharded (DTensor) result, such as FSDP's gradient norm, gathered."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def gather_state(model: torch.nn.Module, optimizer, replica: torch.nn.Module):
    """(module, optimizer state) to checkpoint. Unsharded: (model, optimizer) as they are. Sharded
    (every rank must call it: the weights are gathered): on rank 0 `replica`, an unsharded CPU copy of
    the model's architecture, loaded with the full weights, and the full optimizer state keyed by
    parameter index as `optimizer.state_dict()` of an unsharded run keys it; on other ranks
    (None, None)."""
    if not is_sharded(model):
        return model, optimizer
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(model, options=_full_options())
    state = get_optimizer_state_dict(model, optimizer, options=_full_options()) if optimizer is not None else None
    if not weights:  # not rank 0
        return None, None
    replica.load_state_dict(weights)
    if state is None:
        return replica, None
    names = [n for g in state["param_groups"] for n in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    return replica, {"state": {index[n]: v for n, v in state["state"].items()},
                     "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]}


def scatter_state(model: torch.nn.Module, optimizer, weights: dict, state: dict | None) -> None:
    """Load full `weights` (a state dict) and optimizer `state` (keyed by parameter index, as
    `gather_state` gives it) into a sharded model and its optimizer; every rank calls it with the same
    full state (each keeps its own shard)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, weights, options=options)
    if optimizer is None or state is None:
        return
    name = {id(p): n for n, p in model.named_parameters()}
    names = [name[id(p)] for g in optimizer.param_groups for p in g["params"]]
    by_name = {"state": {names[int(i)]: v for i, v in state["state"].items()},
               "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=options)


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


def load_into(model: torch.nn.Module, optimizer, path, device, replica: torch.nn.Module | None = None) -> dict:
    """Load checkpoint folder `path` into `model` (and `optimizer`, unless None); returns its JSON
    state. A sharded model reads the full state through `replica` (its unsharded CPU copy) on every
    rank, each keeping its own shard."""
    from .checkpoint import load_checkpoint, optimizer_state

    if not is_sharded(model):
        return load_checkpoint(path, model, optimizer, device=device)
    state = load_checkpoint(path, replica)
    if optimizer is not None and "optimizer" not in state:
        raise FileNotFoundError(f"checkpoint {str(path)!r} holds no optimizer state")
    scatter_state(model, optimizer, replica.state_dict(), None if optimizer is None else optimizer_state(path, state))
    return state
