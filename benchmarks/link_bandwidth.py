"""What the link between two devices moves: broadcast and all-reduce bandwidth over one process group.

    python -m benchmarks.link_bandwidth [--devices 0,1] [--mib 128] [--repeat 5]

Two processes, one per device (``cpu`` for both: gloo on the CPU; GPU indices: NCCL), one process group. Each
collective runs once to warm up and then ``--repeat`` times on a ``--mib`` buffer, each time synchronised; the
fastest run gives the bandwidth. Broadcast from rank 0: bytes / s, what a weight push's ``collective`` transport
moves per bucket (``benchmarks.weight_push`` sets its GB/s beside it). All-reduce: the algorithm bandwidth (bytes /
s) and nccl-tests' bus bandwidth, ``2 (n - 1) / n`` times that (the same for two ranks). Run it with the
environment the trainer runs in (``NCCL_NVLS_ENABLE=0`` and the other multicast switches where the machine needs
them): NCCL picks its transport from it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model_support.core.serving.process import free_port


def _rank(rank: int, devices: list[str], port: int, nbytes: int, repeat: int, out: str) -> None:
    device = torch.device("cpu" if devices[rank] == "cpu" else f"cuda:{devices[rank]}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=len(devices),
        device_id=device if device.type == "cuda" else None,
    )
    try:
        buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

        def best(op) -> float:
            times = []
            for _ in range(repeat + 1):  # the first run warms up (connections, NCCL's channels)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()
                start = time.perf_counter()
                op()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            return min(times[1:])

        broadcast = best(lambda: dist.broadcast(buffer, src=0))
        all_reduce = best(lambda: dist.all_reduce(buffer))
        if rank == 0:
            n, size = len(devices), buffer.numel() * 4
            algbw = size / all_reduce
            Path(out).write_text(
                json.dumps(
                    {
                        "devices": devices,
                        "backend": dist.get_backend(),
                        "bytes": size,
                        "broadcast_s": broadcast,
                        "broadcast_gb_s": size / broadcast / 1e9,
                        "all_reduce_s": all_reduce,
                        "all_reduce_algbw_gb_s": algbw / 1e9,
                        "all_reduce_busbw_gb_s": 2 * (n - 1) / n * algbw / 1e9,
                    }
                )
            )
    finally:
        dist.destroy_process_group()


def measure(devices: list[str], mib: int = 128, repeat: int = 5) -> dict:
    """Broadcast and all-reduce bandwidth between ``devices`` (GPU indices, or ``cpu`` for each rank)."""
    with tempfile.TemporaryDirectory(prefix="link-") as tmp:
        out = Path(tmp) / "link.json"
        mp.spawn(_rank, args=(devices, free_port(), mib * 2**20, repeat, str(out)), nprocs=len(devices))
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="0,1", help="one per rank: GPU indices, or cpu")
    parser.add_argument("--mib", type=int, default=128, help="the buffer (a push's default bucket: 128 MiB)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(measure(args.devices.split(","), args.mib, args.repeat)))


if __name__ == "__main__":
    main()
