"""Where the host's time goes in one fla-hybrid fwd+bwd: cProfile over shared-prefix and naive packing.

Run like ``gdn_benchmark.py`` (CUDA, project importable), as ``python -m benchmarks.gdn_host_profile``.
First it prints the host's cost of one launch of a small kernel (a chunk-local cumsum over 16
chunks) as fla's host function issues it and as :class:`model_support.kernels._fla_launch.TunedKernel`
launches fla-hybrid's fused forward start without l2norm (outside a fixed pass). Then, for each case (G=8 completions of
512 tokens over a 2048-token prompt, 16 heads x 128, bf16), how long one fwd+bwd step takes the host
to issue and the GPU to finish (``--trace``: a Chrome trace of each), and the Python functions with
the most own and cumulative time over ``--steps`` steps under cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gdn_benchmark import DEVICE, cu_from_lengths, shared_prefix_steps


def host_us(fn: Callable[[], object], calls: int = 2000) -> float:
    """Microseconds per call of ``fn`` issued back to back: the host's cost where each launch is shorter."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize(DEVICE)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize(DEVICE)
    return (time.perf_counter() - start) / calls * 1e6


def issue_and_wall_ms(step: Callable[[], object], steps: int = 30) -> tuple[float, float]:
    """Median ms of one step from its first call to its return on the host (issue) and to the GPU's end (wall)."""
    issue, wall = [], []
    for _ in range(steps):
        torch.cuda.synchronize(DEVICE)
        start = time.perf_counter()
        step()
        issued = time.perf_counter()
        torch.cuda.synchronize(DEVICE)
        issue.append(issued - start)
        wall.append(time.perf_counter() - start)
    return statistics.median(issue) * 1e3, statistics.median(wall) * 1e3


def export_trace(step: Callable[[], object], path: str) -> None:
    """Chrome trace (host and GPU) of three steps after warm-up."""
    for _ in range(3):
        step()
    torch.cuda.synchronize(DEVICE)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize(DEVICE)
    prof.export_chrome_trace(path)


def launch_cost() -> None:
    from fla.ops.utils.cumsum import chunk_local_cumsum
    from fla.ops.utils.index import prepare_chunk_indices

    from model_support.kernels._fla_hybrid import _index
    from model_support.kernels._gdn_ends import forward_start

    cu = cu_from_lengths([512, 512]).long()
    g = torch.randn(1, 1024, 16, device=DEVICE)
    qk = torch.randn(1, 1024, 16, 128, device=DEVICE)
    index = _index(cu, False)
    chunks = prepare_chunk_indices(cu, 64)
    fla_us = host_us(lambda: chunk_local_cumsum(g, 64, cu_seqlens=cu, chunk_indices=chunks))
    g_out = torch.empty_like(g)
    launch = forward_start(
        qk, qk, g, None, None, None, None, g_out, 1.0, index.cu_seqlens, index.chunk_indices, heads=16, v_heads=16,
        k_dim=128,
    )  # fmt: skip
    ours_us = host_us(launch)
    empty_us = host_us(lambda: torch.empty_like(g))
    print(f"host cost of one chunk-local cumsum: fla {fla_us:.1f} us, fla-hybrid {ours_us:.1f} us", flush=True)
    print(f"(fla's includes its output's allocation; torch.empty_like of it alone: {empty_us:.1f} us)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="fla-hybrid")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trace", help="also write a Chrome trace of each case to TRACE.<case>.json")
    args = parser.parse_args()
    launch_cost()
    shared, naive = shared_prefix_steps(args.backend)
    for name, step in (("shared", shared), ("naive", naive)):
        issue, wall = issue_and_wall_ms(step)
        print(f"\n== {name}: one fwd+bwd step issued in {issue:.3f} ms, done in {wall:.3f} ms", flush=True)
        if args.trace:
            export_trace(step, f"{args.trace}.{name}.json")
        with cProfile.Profile() as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize(DEVICE)
        stats = pstats.Stats(prof).sort_stats("tottime")
        stats.print_stats(25)
        stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
