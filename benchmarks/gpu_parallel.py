"""``parallel_parity`` on the GPUs of one node (one process per GPU, NCCL), and one table of what it measured.

For each ``HANDLER[:LAYERS[:EXPERTS]]`` case (no layers: the tiny replica; with them, ``model-support replica`` at
the handler's reference-config width in bf16) the stage runs alone in a child ``model-support check``, every
layout in fp32 and in bf16 (the GPU's training dtype), while a thread samples each GPU's used memory
(``nvidia-smi``). Also, for the first case's model: the worker under ``torchrun`` (its own launcher), and the same
with a planted failure on rank 1 (the job must end, not hang). Run on the device machine from the repository root
(docs/gpu-validation.md for the wheels):

    PYTHONPATH=/tmp/ms:/tmp/site python3 -m benchmarks.gpu_parallel --out $OUT --case qwen3 --case qwen3-moe

With ``--sharded CASE@LAYOUT``: ``check CASE --parallel LAYOUT`` over the Megatron stages (the model under test
sharded across the GPUs), each stage's numbers and seconds, each GPU's peak memory.

Writes ``OUT/gpu-parallel.json`` (every metric) and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# NVLink multicast stays off in every process this starts (the device machines' rule; the ranks inherit it).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SHOWN = ("logits_max_abs_err", "grad_max_abs_err", "loss_abs_err", "merged_max_abs_err", "router_topk_mismatches")
SHOWN_BF16 = ("logits_rel_l2", "logits_mean_abs_pct", "grad_mean_abs_pct")


def gpu_memory_used() -> dict[int, int] | None:
    """Each GPU's used memory now (MiB, ``nvidia-smi``); None where there is no ``nvidia-smi``."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    except FileNotFoundError:
        return None
    return {int(i): int(mib) for i, mib in (line.split(",") for line in out.strip().splitlines())}


class PeakMemory:
    """The largest used memory (MiB) of each GPU while the context is open, sampled by ``nvidia-smi``."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s, self.peak, self._stop = every_s, {}, threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            used = gpu_memory_used()
            if used is None:  # no nvidia-smi: no GPU to watch
                return
            for index, mib in used.items():
                self.peak[index] = max(self.peak.get(index, 0), mib)
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakMemory:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _run(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            code = subprocess.run(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
                env={**os.environ, **NO_MULTICAST},
            ).returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.monotonic() - start


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "model_support.core.cli", *args]


def check_case(case: str, layouts: str | None, out: Path, log: Path, timeout: float) -> dict[str, Any]:
    """``parallel_parity`` alone on one case's model; its metrics, seconds and per-GPU peak memory. A case may name
    its own layouts after ``@``."""
    case, _, own = case.partition("@")
    layouts = own or layouts
    work = out / case.replace(":", "-")
    target = model_of(case, work, log, timeout)
    report = work / "report.json"
    cmd = _cli("check", *target, "-s", "parallel_parity", "--alone", "--json", str(report), "-v")
    cmd += ["--layouts", layouts] if layouts else []
    with PeakMemory() as memory:
        code, seconds = _run(cmd, log, timeout)
    result: dict[str, Any] = {"case": case, "exit": code, "seconds": round(seconds, 1), "peak_mib": memory.peak}
    if report.exists():
        (verdict,) = json.loads(report.read_text())["results"]
        result |= {"status": verdict["status"], "summary": verdict["summary"], "metrics": verdict["metrics"]}
        result["details"] = verdict["details"]
    return result


MEGATRON_STAGES = "hf_parity,lora_coverage,lora_gradients,packed_position_ids,shared_prefix,trainability"
SHARDED_SHOWN = {
    "hf_parity": ("rel_l2", "long_rel_l2"),
    "lora_coverage": ("adapter_logits_rel_l2", "lora_modules"),
    "lora_gradients": ("long_grad_rel_l2", "packed_grad_rel_l2"),
    "packed_position_ids": ("logits_rel_l2", "grad_mean_abs_pct"),
    "shared_prefix": ("logits_rel_l2", "grad_mean_abs_pct", "short_prompt_grad_mean_abs_pct"),
    "trainability": ("loss_ratio", "steps"),
}


def model_of(case: str, work: Path, log: Path, timeout: float) -> list[str]:
    """The check's target for ``HANDLER[:LAYERS[:EXPERTS]]``: the tiny replica, or a bf16 replica at the handler's
    reference width (built once)."""
    handler, *rest = case.split(":")
    if not rest:
        return [handler, "--tiny"]
    model = work / "model"
    extra = ["--experts", rest[1]] if len(rest) > 1 else []
    if not model.exists():
        _run(_cli("replica", handler, str(model), "--layers", rest[0], "--dtype", "bf16", *extra), log, timeout)
    return [str(model)]


def sharded_case(spec: str, out: Path, log: Path, timeout: float) -> dict[str, Any]:
    """``check MODEL --parallel LAYOUT`` over the Megatron stages (``CASE@LAYOUT[/STAGES]``): each stage's status,
    seconds and numbers, and each GPU's peak memory."""
    case, _, rest = spec.partition("@")
    layout, _, stages = rest.partition("/")
    work = out / case.replace(":", "-")
    target = model_of(case, work, log, timeout)
    report = work / f"sharded-{layout}.json"
    cmd = _cli("check", *target, "--parallel", layout, "--json", str(report), "-v")
    for stage in (stages or MEGATRON_STAGES).split(","):
        cmd += ["-s", stage]
    with PeakMemory() as memory:
        code, seconds = _run(cmd, log, timeout)
    result: dict[str, Any] = {"case": case, "layout": layout, "exit": code, "seconds": round(seconds, 1)}
    result["peak_mib"] = memory.peak
    if report.exists():
        result["stages"] = json.loads(report.read_text())["results"]
    return result


def sharded_table(results: list[dict[str, Any]]) -> str:
    lines = ["| case | layout | stage | status | numbers | s |", "| --- | --- | --- | --- | --- | ---: |"]
    for r in results:
        peak = " / ".join(str(v) for _, v in sorted(r["peak_mib"].items()))
        lines.append(
            f"| {r['case']} | {r['layout']} | (whole check) | exit {r['exit']} | peak MiB {peak} | {r['seconds']} |"
        )
        for stage in r.get("stages", []):
            if stage["stage"] not in SHARDED_SHOWN:
                continue
            shown = ", ".join(
                f"{k} {stage['metrics'][k]:.3g}" for k in SHARDED_SHOWN[stage["stage"]] if k in stage["metrics"]
            )
            lines.append(
                f"| | | {stage['stage']} | {stage['status']} | {shown or stage['summary']} | {stage['duration_s']} |"
            )
    return "\n".join(lines)


def torchrun_case(handler: str, runs: str, out: Path, log: Path, timeout: float) -> dict[str, Any]:
    """The worker's ``runs`` under torchrun on the tiny replica, then the same with rank 1 raising in its first
    model-parallel step: the job must end (exit non-zero) with rank 1's error written."""
    model = out / f"torchrun-{handler}" / "model"
    _run(_cli("tiny", handler, str(model)), log, timeout)
    found = {}
    for name, extra in (("clean", []), ("one-rank-raises", ["--mutation", "one-rank-raises"])):
        results = out / f"torchrun-{handler}" / name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += ["-m", "model_support.validation.parallel_worker", str(results), str(model), handler]
        cmd += [runs, *extra]
        code, seconds = _run(cmd, log, timeout)
        files = sorted(p.name for p in results.glob("*")) if results.exists() else []
        errors = {p.name: p.read_text().splitlines()[0] for p in results.glob("*.error")} if results.exists() else {}
        found[name] = {"exit": code, "seconds": round(seconds, 1), "files": files, "errors": errors}
    return found


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| case | layout | fp32: "
        + ", ".join(SHOWN)
        + " | bf16: "
        + ", ".join(SHOWN_BF16)
        + " (limit) | s | peak MiB/GPU |",
        "| --- | --- | --- | --- | ---: | --- |",
    ]
    for r in results:
        metrics = r.get("metrics", {})
        layouts = [k.removesuffix(".logits_max_abs_err") for k in metrics if k.endswith(".logits_max_abs_err")]
        peak = " / ".join(str(v) for _, v in sorted(r["peak_mib"].items()))
        if not layouts:
            lines.append(
                f"| {r['case']} | - | {r.get('summary', 'exit ' + str(r['exit']))} | | {r['seconds']} | {peak} |"
            )
        if "fp32.noise.logits_max_abs" in metrics:  # the fp32 maxima's calibration (parallel_parity.fp32_noise)
            noise = ", ".join(f"{k} {metrics[f'fp32.noise.{k}']:.3g}" for k in ("logits_max_abs", "logprobs_max_abs"))
            lines.append(f"| {r['case']} | (transformers' fp32 from single) | {noise} | | | |")
        for name in layouts:
            fp32 = ", ".join(f"{metrics.get(f'{name}.{k}', '-'):.3g}" for k in SHOWN)
            fp32 += f", log-probs {metrics.get(f'{name}.logprobs_max_abs_err', float('nan')):.3g}"
            bf16 = ", ".join(
                f"{metrics[f'{name}.bf16.{k}']:.3g} ({metrics.get(f'bf16.noise.{k}', 0) * 2:.3g})"
                for k in SHOWN_BF16
                if f"{name}.bf16.{k}" in metrics
            )
            lines.append(f"| {r['case']} | {name} | {fp32} | {bf16 or '-'} | {r['seconds']} | {peak} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", action="append", default=[], help="HANDLER[:LAYERS[:EXPERTS]][@LAYOUTS]")
    parser.add_argument("--layouts", help="check --layouts for every case (default: the stage's)")
    parser.add_argument(
        "--torchrun", help="HANDLER:RUNS, e.g. qwen3-moe:single,ep2,ep2.bf16: the worker under torchrun"
    )
    parser.add_argument(
        "--sharded",
        action="append",
        default=[],
        help="CASE@LAYOUT[/STAGES]: check CASE --parallel LAYOUT over the Megatron stages (or STAGES)",
    )
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "gpu-parallel.log"
    results, record = [], {}
    for case in args.case:
        results.append(check_case(case, args.layouts, args.out, log, args.timeout))
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("metrics", "details")}), flush=True)
    record["checks"] = results
    sharded = []
    for spec in args.sharded:
        sharded.append(sharded_case(spec, args.out, log, args.timeout))
        print(json.dumps({k: v for k, v in sharded[-1].items() if k != "stages"}), flush=True)
        (args.out / "gpu-parallel.json").write_text(json.dumps(record | {"sharded": sharded}, indent=1))
    record["sharded"] = sharded
    if args.torchrun:
        handler, _, runs = args.torchrun.partition(":")
        record["torchrun"] = torchrun_case(handler, runs, args.out, log, args.timeout)
        print(json.dumps(record["torchrun"], indent=1), flush=True)
    (args.out / "gpu-parallel.json").write_text(json.dumps(record, indent=1))
    print(table(results))
    print(sharded_table(sharded))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
