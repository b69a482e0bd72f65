"""Push time and peak extra disk and memory of one weight push into a live vLLM server, per transport.

    python benchmarks/weight_push.py [--config qwen3-0.6b.json] [--dtype bfloat16] [--bucket-mib 128] [--out DIR]
        [--transports files,stream,collective,ipc] [--trainer-device cuda --server-gpus 1] [--layers N]

Builds a random replica at the config's real width (all layers), starts one vLLM server on it (the streamed
transport enabled), and pushes the checkpoint's own tensors in buckets (read from its files: the trainer's resident
memory includes the pages read, alike for both), first through the file system
(``ServeOptions.weight_transfer="files"``: the step written as a checkpoint, reloaded from disk), then streamed
(vLLM's weight-transfer routes with the project's local engine, buckets through ``/dev/shm``), ``--repeat`` times
each, then (``collective``) broadcast over a process group with the server's worker (gloo on the CPU build, NCCL
between GPUs), and (``ipc``, a server on the trainer's own GPU: ``--trainer-device cuda`` without
``--server-gpus``) handed over as CUDA IPC handles of the trainer's GPU memory. A sampling thread records the peak
bytes under the staging directory (disk) and under ``/dev/shm`` (memory), the peak resident memory of this process (the
trainer's side) and of the server's processes, and each GPU's used memory (``nvidia-smi``), above what they held before
the push. With ``--trainer-device cuda`` the buckets are on this process's GPU before the push starts (as a live model's
merged weights are) and the server runs on ``--server-gpus``: the trainer's GPU to the server's; the link between the
two is measured first (``benchmarks.link_bandwidth``: broadcast and all-reduce of one bucket over NCCL), and each
transport's GB/s is set beside its broadcast. One machine, one run: compare the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from benchmarks.gpu_parallel import PeakMemory, gpu_memory_used
from benchmarks.link_bandwidth import measure
from model_support.core.replica import build_replica
from model_support.core.serving.backend import get_backend
from model_support.core.serving.export import base_tensors, buckets
from model_support.core.serving.options import ServeOptions
from model_support.core.serving.update import WeightUpdater, memory_dir
from model_support.handlers.configs import CONFIGS


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def _rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += psutil.Process(pid).memory_info().rss
    return total


class Peaks(threading.Thread):
    """Samples disk under ``staging``, memory under /dev/shm and resident memory until stopped."""

    def __init__(self, staging: Path, server_pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.staging, self.server_pids = staging, server_pids
        self.shm = memory_dir()
        self.base = {
            "disk": _tree_bytes(staging),  # the files transport keeps the loaded step until the next one
            "trainer": psutil.Process().memory_info().rss,
            "server": _rss(server_pids),
        }
        self.peak = {"disk": 0, "shm": 0, "trainer": 0, "server": 0}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            now = {
                "disk": _tree_bytes(self.staging) - self.base["disk"],
                "shm": sum(_tree_bytes(p) for p in self.shm.glob("push-*")) if self.shm else 0,
                "trainer": psutil.Process().memory_info().rss - self.base["trainer"],
                "server": _rss(self.server_pids) - self.base["server"],
            }
            self.peak = {k: max(self.peak[k], v) for k, v in now.items()}
            self.done.wait(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="qwen3-0.6b.json")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bucket-mib", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--transports", default="files,stream,collective")
    parser.add_argument("--trainer-device", default="cpu", help="where the buckets are before the push (cuda: GPU)")
    parser.add_argument("--server-gpus", default=None, help="the server's CUDA_VISIBLE_DEVICES")
    parser.add_argument("--layers", type=int, default=None, help="a replica of this many layers (default: all)")
    args = parser.parse_args()
    transports = args.transports.split(",")
    work = Path(args.out or tempfile.mkdtemp(prefix="weight-push-"))
    raw = json.loads((CONFIGS / args.config).read_text())
    model_dir = work / "replica"
    if not (model_dir / "config.json").exists():
        build_replica(raw, model_dir, layers=args.layers, experts=None, dtype=getattr(torch, args.dtype),
                      device="auto", seed=0, overwrite=False)  # fmt: skip
    size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    link = None
    if args.server_gpus and args.trainer_device != "cpu":  # before the server holds any of the GPU
        trainer_gpu = str(torch.device(args.trainer_device).index or 0)
        link = measure([trainer_gpu, args.server_gpus.split(",")[0]], mib=args.bucket_mib)
        print(json.dumps({"link": link}), flush=True)
    options = ServeOptions(dtype=args.dtype, kv_cache_gib=1, gpus=args.server_gpus, gpu_memory_utilization=0.5)
    server = get_backend("vllm").serve(model_dir, "replica@0", options, work / "vllm.log")
    try:
        proc = psutil.Process(server.pid)
        pids = [server.pid, *(c.pid for c in proc.children(recursive=True))]
        staging = work / "replica-weights"
        backend = "nccl" if server.on_gpu else "gloo"
        updaters = {
            "files": WeightUpdater(server, staging, model_dir, transport="files").update,
            "stream": server.update_weights,
            "collective": WeightUpdater(server, staging, model_dir, transport="collective", backend=backend).update,
            "ipc": WeightUpdater(server, staging, model_dir, transport="ipc", backend=backend).update,
        }
        rows = []
        for transport in transports * args.repeat:
            stream = buckets(base_tensors(model_dir), args.bucket_mib * 1024**2)
            if args.trainer_device != "cpu":  # on the trainer's GPU before the push, as a live model's weights are
                stream = [{k: v.to(args.trainer_device) for k, v in bucket.items()} for bucket in stream]
            peaks = Peaks(staging, pids)
            before = gpu_memory_used() or {}
            with PeakMemory(every_s=0.05) as gpu:
                peaks.start()
                start = time.perf_counter()
                name = updaters[transport](stream)
                seconds = time.perf_counter() - start
                peaks.done.set()
                peaks.join()
            del stream
            gpu_extra = {f"gpu{i}": (mib - before.get(i, mib)) * 2**20 for i, mib in gpu.peak.items()}
            rows.append({"transport": transport, "served": name, "seconds": seconds} | peaks.peak | gpu_extra)
            print(json.dumps(rows[-1]), flush=True)
        print(json.dumps({"checkpoint_bytes": size, "bucket_mib": args.bucket_mib, "dtype": args.dtype}))
        if link is not None:
            print(
                f"link GPU {link['devices'][0]} -> GPU {link['devices'][1]} ({link['backend']}, {args.bucket_mib} "
                f"MiB): broadcast {link['broadcast_gb_s']:.1f} GB/s, all-reduce bus bandwidth "
                f"{link['all_reduce_busbw_gb_s']:.1f} GB/s"
            )
        for transport in dict.fromkeys(transports):
            mine = [r for r in rows if r["transport"] == transport]
            best = min(mine, key=lambda r: r["seconds"])
            rate = size / best["seconds"] / 1e9
            against = "" if link is None else f" ({rate / link['broadcast_gb_s']:.2f} of the link's broadcast)"
            print(
                f"{transport}: {best['seconds']:.2f} s (best of {len(mine)}), {rate:.1f} GB/s{against}, peak extra "
                f"disk {max(r['disk'] for r in mine) / 2**20:.0f} MiB, /dev/shm "
                f"{max(r['shm'] for r in mine) / 2**20:.0f} MiB, trainer RSS "
                f"+{max(r['trainer'] for r in mine) / 2**20:.0f} MiB, server RSS "
                f"+{max(r['server'] for r in mine) / 2**20:.0f} MiB"
                + "".join(
                    f", {key} +{max(r[key] for r in mine) / 2**20:.0f} MiB"
                    for key in sorted(mine[0])
                    if key.startswith("gpu")
                )
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
