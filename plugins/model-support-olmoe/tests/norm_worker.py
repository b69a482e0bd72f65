"""Worker of test_olmoe's tensor-parallel test: run under ``torchrun --nproc_per_node 2`` (gloo on CPU).

Every rank holds its heads' slice of one query, its slice of the norm weight, and its slice of an upstream
gradient; rank 0 writes the gathered output and input / weight gradients to ``<out>``.
"""

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from model_support.core.megatron.dist import ParallelLayout, init_parallel
from safetensors.torch import save_file

from model_support_olmoe.megatron import ProjectionRMSNorm

HEADS, HEAD_DIM = 4, 8


def main(out: str) -> None:
    init_parallel(ParallelLayout(tensor_parallel=int(os.environ["WORLD_SIZE"])))
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, HEADS, HEAD_DIM, generator=generator)
    weight = torch.randn(HEADS * HEAD_DIM, generator=generator)
    upstream = torch.randn(3, 2, HEADS, HEAD_DIM, generator=generator)
    local = HEADS // world
    heads = slice(rank * local, (rank + 1) * local)
    norm = ProjectionRMSNorm(SimpleNamespace(params_dtype=torch.float32), HEAD_DIM, eps=1e-5, heads=HEADS)
    with torch.no_grad():
        norm.weight.copy_(weight.view(HEADS, HEAD_DIM)[heads].flatten())
    x_local = x[:, :, heads].clone().requires_grad_()
    y = norm(x_local)
    y.backward(upstream[:, :, heads])
    parts = {"y": y.detach(), "x_grad": x_local.grad, "w_grad": norm.weight.grad.view(local, HEAD_DIM)}
    gathered = {}
    for name, part in parts.items():
        pieces = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(pieces, part.contiguous())
        gathered[name] = torch.cat(pieces, dim=-2).contiguous()
    if rank == 0:
        save_file(gathered, out)
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
