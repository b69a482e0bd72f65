"""Push time and peak extra disk and memory of one weight push into a live vLLM server, per transport.

    python benchmarks/weight_push.py [--config qwen3-0.6b.json] [--dtype bfloat16] [--bucket-mib 128] [--out DIR]

Builds a random replica at the config's real width (all layers), starts one vLLM server on it (the streamed
transport enabled), and pushes the checkpoint's own tensors in buckets (read from its files: the trainer's resident
memory includes the pages read, alike for both), first through the file system
(``ServeOptions.weight_transfer="files"``: the step written as a checkpoint, reloaded from disk), then streamed
(vLLM's weight-transfer routes with the project's local engine, buckets through ``/dev/shm``), ``--repeat`` times
each. A sampling thread records the peak bytes under the staging directory (disk) and under ``/dev/shm`` (memory),
and the peak resident memory of this process (the trainer's side) and of the server's processes, above what they
held before the push. One machine, one run: compare the ratios, not the seconds.
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
    args = parser.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="weight-push-"))
    raw = json.loads((CONFIGS / args.config).read_text())
    model_dir = work / "replica"
    if not (model_dir / "config.json").exists():
        build_replica(raw, model_dir, layers=None, experts=None, dtype=getattr(torch, args.dtype), device="cpu",
                      seed=0, overwrite=False)  # fmt: skip
    size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    options = ServeOptions(dtype=args.dtype, kv_cache_gib=1)
    server = get_backend("vllm").serve(model_dir, "replica@0", options, work / "vllm.log")
    try:
        proc = psutil.Process(server.pid)
        pids = [server.pid, *(c.pid for c in proc.children(recursive=True))]
        staging = work / "replica-weights"
        files = WeightUpdater(server, staging, model_dir, transport="files")
        rows = []
        for transport in ("files", "stream") * args.repeat:
            stream = buckets(base_tensors(model_dir), args.bucket_mib * 1024**2)
            peaks = Peaks(staging, pids)
            peaks.start()
            start = time.perf_counter()
            name = server.update_weights(stream) if transport == "stream" else files.update(stream)
            seconds = time.perf_counter() - start
            peaks.done.set()
            peaks.join()
            rows.append({"transport": transport, "served": name, "seconds": round(seconds, 2)} | peaks.peak)
            print(json.dumps(rows[-1]), flush=True)
        print(json.dumps({"checkpoint_bytes": size, "bucket_mib": args.bucket_mib, "dtype": args.dtype}))
        for transport in ("files", "stream"):
            mine = [r for r in rows if r["transport"] == transport]
            best = min(mine, key=lambda r: r["seconds"])
            print(
                f"{transport}: {best['seconds']:.2f} s (best of {len(mine)}), peak extra disk "
                f"{max(r['disk'] for r in mine) / 2**20:.0f} MiB, /dev/shm {max(r['shm'] for r in mine) / 2**20:.0f} "
                f"MiB, trainer RSS +{max(r['trainer'] for r in mine) / 2**20:.0f} MiB, server RSS "
                f"+{max(r['server'] for r in mine) / 2**20:.0f} MiB"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
