"""Where the host's time goes in one fla-hybrid fwd+bwd: cProfile over shared-prefix and naive packing.

Run like ``gdn_benchmark.py`` (CUDA, project importable), as ``python -m benchmarks.gdn_host_profile``.
For each case (G=8 completions of 512 tokens over a 2048-token prompt, 16 heads x 128, bf16) it
prints the wall clock of ``--steps`` fwd+bwd steps under cProfile and the Python functions with
the most own and cumulative time: what the host does while the GPU waits.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from benchmarks.gdn_benchmark import DEVICE, shared_prefix_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="fla-hybrid")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    shared, naive = shared_prefix_steps(args.backend)
    for name, step in (("shared prefix", shared), ("naive packing", naive)):
        for _ in range(3):
            step()
        torch.cuda.synchronize(DEVICE)
        start = time.perf_counter()
        with cProfile.Profile() as prof:
            for _ in range(args.steps):
                step()
            torch.cuda.synchronize(DEVICE)
        wall = (time.perf_counter() - start) / args.steps * 1000
        print(f"\n== {name}: {wall:.2f} ms per fwd+bwd step (wall, under cProfile)", flush=True)
        stats = pstats.Stats(prof).sort_stats("tottime")
        stats.print_stats(25)
        stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
