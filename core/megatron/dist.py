"""torch.distributed and Megatron parallel state: gloo on CPU, NCCL on GPU."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from model_support.core.parallel import ParallelLayout, ParallelLayoutError

__all__ = [
    "ParallelLayout",
    "ParallelLayoutError",
    "device",
    "init_parallel",
    "max_over_ranks",
    "my_share",
    "sum_over_ranks",
    "union_over_ranks",
]


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _sharded() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def my_share[T](items: list[T]) -> list[T]:
    """This rank's share of ``items`` (every ``world``-th from its rank), for work the ranks split and then add up
    (:func:`sum_over_ranks`, :func:`union_over_ranks`); all of them in a world of one."""
    if not _sharded():
        return list(items)
    return items[dist.get_rank() :: dist.get_world_size()]


def _every_rank[T](value: T) -> list[T]:
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, value)
    return parts


def union_over_ranks(names: set[str] | list[str]) -> set[str]:
    """The union of every rank's ``names`` (a name of each parameter or module this rank holds: experts differ
    between expert-parallel ranks), on every rank; ``set(names)`` in a world of one."""
    return set().union(*_every_rank(set(names))) if _sharded() else set(names)


def sum_over_ranks(value: int) -> int:
    """The sum of every rank's ``value`` (a count of what this rank holds), on every rank."""
    return sum(_every_rank(value)) if _sharded() else value


def max_over_ranks(value: float) -> float:
    """The largest of every rank's ``value`` (an error over what this rank holds), on every rank."""
    return max(_every_rank(value)) if _sharded() else value


def init_parallel(layout: ParallelLayout | None = None, *, timeout: timedelta | None = None) -> None:
    """Join (or, when nothing is initialised, set up) torch.distributed and Megatron's model-parallel groups.

    Each rank runs on the GPU its ``LOCAL_RANK`` names (set as the current CUDA device before anything is
    allocated). ``timeout`` bounds every collective of the groups set up here (torch's default where None): a
    collective whose peers do not all arrive raises on gloo, and NCCL's watchdog ends the process, instead of
    waiting forever. A caller's own groups keep the timeout the caller gave them.

    A caller that already initialised torch.distributed and megatron-core's parallel state (a trainer) keeps its
    groups: they are used as they are, never torn down, and a layout that disagrees with them is an error.
    Otherwise, under a launcher (torchrun) the usual RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables are
    used. A world of one (no launcher) needs no rendezvous: it gets an in-process store, so it binds no port and
    leaves nothing in the environment for child processes to inherit (a child that reused a parent's MASTER_PORT
    would fail with EADDRINUSE).
    """
    from megatron.core import parallel_state

    layout = layout or ParallelLayout()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if world == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    if parallel_state.model_parallel_is_initialized():
        existing = {
            "tensor_parallel": parallel_state.get_tensor_model_parallel_world_size(),
            "expert_parallel": parallel_state.get_expert_model_parallel_world_size(),
            "expert_tensor_parallel": parallel_state.get_expert_tensor_parallel_world_size(),
            "pipeline_parallel": parallel_state.get_pipeline_model_parallel_world_size(),
            "virtual_pipeline": parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
            "context_parallel": parallel_state.get_context_parallel_world_size(),
        }
        for name, size in existing.items():
            if size != getattr(layout, name):
                raise ParallelLayoutError(
                    f"megatron-core's parallel state is initialised with {name.replace('_', ' ')} {size}, the model "
                    f"asks for {getattr(layout, name)}: build it with {name}={size} (the caller's groups are kept)"
                )
        return
    if dist.get_world_size() % layout.model_parallel:
        raise ParallelLayoutError(
            f"world size {dist.get_world_size()} is not a multiple of the {layout.model_parallel} ranks layout "
            f"{layout.name} needs (tensor x context x pipeline x expert parallel)"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_parallel,
        pipeline_model_parallel_size=layout.pipeline_parallel,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline if layout.virtual_pipeline > 1 else None,
        context_parallel_size=layout.context_parallel,
        expert_model_parallel_size=layout.expert_parallel,
        expert_tensor_parallel_size=layout.expert_tensor_parallel,
        # megatron-core builds a timedelta of these minutes, so a fraction of a minute is kept.
        distributed_timeout_minutes=30 if timeout is None else timeout.total_seconds() / 60,  # type: ignore[arg-type]
    )
    from megatron.core import tensor_parallel as mtp

    if torch.cuda.is_available():
        mtp.model_parallel_cuda_manual_seed(1234)
