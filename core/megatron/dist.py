"""torch.distributed and Megatron parallel state: gloo on CPU, NCCL on GPU."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def init_parallel(tensor_parallel: int = 1) -> None:
    """Initialise the process group (once) and Megatron's model-parallel groups for ``tensor_parallel``.

    Under a launcher (torchrun) the usual RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables are
    used. A world of one (no launcher) needs no rendezvous: it gets an in-process store, so it binds no
    port and leaves nothing in the environment for child processes to inherit (a child that reused a
    parent's MASTER_PORT would fail with EADDRINUSE). Calling again with another tensor-parallel size
    rebuilds the Megatron groups.
    """
    from megatron.core import parallel_state

    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if world == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world)
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == tensor_parallel:
            return
        parallel_state.destroy_model_parallel()
    if dist.get_world_size() % tensor_parallel:
        raise ValueError(f"world size {dist.get_world_size()} is not a multiple of tensor parallel {tensor_parallel}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    from megatron.core import tensor_parallel as mtp

    if torch.cuda.is_available():
        mtp.model_parallel_cuda_manual_seed(1234)
