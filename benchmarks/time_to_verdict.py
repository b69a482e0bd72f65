"""Time to a verdict: how long ``model-support check`` takes from start to report, and where the time goes.

``gpu DIR...``: the Megatron stages (``benchmarks.gpu_validation.MEGATRON_STAGES``, or ``--stages``; ``--stages ""``:
the whole default check) on each replica, in a child process, in three runs: *before* (an empty Triton cache and
``MODEL_SUPPORT_TUNED_KERNELS=0``: every kernel autotunes, as a fresh GPU did before ``kernels/tuning.py``), *cold*
(an empty Triton cache seeded with the shipped settings) and *warm* (the cold run's cache again). ``--runs`` picks
some of them; ``--harvest DIR`` merges the autotuning results of the *before* and *cold* runs into
``DIR/sm<CC>.json`` (the file ``kernels/tuning.py`` ships). Each check's output and JSON report go to
``--out``/<replica>-<run>.log and .json.

``cpu [HANDLER...]``: the whole default ``check HANDLER --tiny`` of each built-in handler (default: all of them).

Each run's wall time (the child's start to its exit: start-up, imports and the tiny build included) and, summed over
its stages, the JSON report's time split (build, oracle, autotune, compile, server start, comparison) are printed as a
Markdown table and written to ``--out``/time_to_verdict.json. Run from the repository root; on the device machine
with the wheels of docs/gpu-validation.md on ``PYTHONPATH``:

    PYTHONPATH=/tmp/ms:/tmp/site python3 -m benchmarks.time_to_verdict gpu /tmp/r/q35 --out $OUT --harvest kernels/tuned
    python -m benchmarks.time_to_verdict cpu --out /tmp/ttv
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_validation import MEGATRON_STAGES

PHASES = ("build", "oracle", "autotune", "compile", "server_start", "comparison")
RUNS = ("before", "cold", "warm")


def run_check(
    target: str, args: list[str], env: dict[str, str], report: Path, log: Path, limit_s: float | None = None
) -> dict[str, Any]:
    """One ``check`` in a child process (stopped after ``limit_s``), its output in ``log``: its wall time, exit
    code, and its stages' summed time split (its JSON report kept at ``report``)."""
    cmd = [sys.executable, "-m", "model_support.core.cli", "check", target, "--json", str(report), *args]
    start = time.perf_counter()
    with log.open("w") as out:
        try:
            proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=limit_s)
        except subprocess.TimeoutExpired:
            return {"target": target, "wall_s": round(time.perf_counter() - start, 1), "error": f"over {limit_s} s"}
    wall = time.perf_counter() - start
    row: dict[str, Any] = {"target": target, "wall_s": round(wall, 1), "exit": proc.returncode}
    if not report.exists():
        row["error"] = (log.read_text().strip().splitlines() or ["no report"])[-1]
        return row
    results = json.loads(report.read_text())["results"]
    split = dict.fromkeys(PHASES, 0.0)
    for result in results:
        for phase, seconds in result.get("time_split_s", {}).items():
            split[phase] = split.get(phase, 0.0) + seconds
    row["split_s"] = {k: round(v, 1) for k, v in split.items()}
    row["stages"] = {r["stage"]: (r["status"], round(r["duration_s"], 1)) for r in results}
    row["failed"] = [r["stage"] for r in results if r["status"] == "fail"]
    return row


def gpu(
    dirs: list[str],
    runs: list[str],
    stages: list[str],
    harvest: Path | None,
    work: Path,
    logs: Path,
    limit_s: float | None,
) -> list[dict[str, Any]]:
    from model_support.kernels import tuning

    rows = []
    stage_args = [arg for stage in stages for arg in ("-s", stage)]
    for target in dirs:
        name = Path(target).name
        seeded_cache = work / f"{name}-triton-seeded"
        for run in runs:
            cache = work / f"{name}-triton-before" if run == "before" else seeded_cache
            env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
            if run == "before":
                env["MODEL_SUPPORT_TUNED_KERNELS"] = "0"
            row = run_check(target, stage_args, env, logs / f"{name}-{run}.json", logs / f"{name}-{run}.log", limit_s)
            row["run"] = run
            if run != "warm" and harvest is not None and cache.exists():
                row["harvested"] = merge_harvest(harvest, tuning.harvest(cache), target)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def merge_harvest(out_dir: Path, entries: dict[str, Any], source: str) -> int:
    """Add ``entries`` to this GPU's shipped file in ``out_dir``; returns how many were new."""
    from importlib import metadata

    import torch

    from model_support.kernels import tuning

    capability = torch.cuda.get_device_capability()
    path = out_dir / tuning.tuned_file_name(capability)
    shipped = json.loads(path.read_text()) if path.exists() else {"entries": {}, "sources": []}
    new = {k: v for k, v in entries.items() if k not in shipped["entries"]}
    shipped["gpu"] = torch.cuda.get_device_name()
    shipped["capability"] = list(capability)
    shipped["versions"] = {
        dist: metadata.version(dist) for dist in ("triton", "torch", "flash-linear-attention", "model-support")
    }
    config = json.loads((Path(source) / "config.json").read_text())
    shipped["sources"] = sorted({*shipped["sources"], f"{config.get('architectures', ['?'])[0]} replica"})
    shipped["entries"] = dict(sorted({**shipped["entries"], **new}.items()))
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(shipped, indent=1) + "\n")
    return len(new)


def cpu(handlers: list[str], work: Path, logs: Path) -> list[dict[str, Any]]:
    if not handlers:
        from model_support.core.registry import load_registry

        registry = load_registry()
        handlers = sorted(h.spec.name for h in registry.handlers.values() if h.plugin.name == "builtin")
    rows = []
    for handler in handlers:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        row = run_check(handler, ["--tiny"], env, logs / f"{handler}.json", logs / f"{handler}-cpu.log")
        row["run"] = "cpu"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| target | run | wall s | " + " | ".join(f"{p} s" for p in PHASES) + " | failed |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in PHASES) + " | --- |",
    ]
    for row in rows:
        split = row.get("split_s", {})
        cells = " | ".join(f"{split.get(p, 0.0):.1f}" for p in PHASES)
        failed = ", ".join(row.get("failed", [])) or row.get("error", "")
        lines.append(f"| {Path(row['target']).name} | {row['run']} | {row['wall_s']:.1f} | {cells} | {failed} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="time_to_verdict")
    sub = parser.add_subparsers(dest="mode", required=True)
    on_gpu = sub.add_parser("gpu")
    on_gpu.add_argument("dirs", nargs="+")
    on_gpu.add_argument("--runs", default=",".join(RUNS))
    on_gpu.add_argument(
        "--stages",
        default=",".join(MEGATRON_STAGES),
        help="comma-separated (and their prerequisites); empty: the whole default check",
    )
    on_gpu.add_argument("--harvest", type=Path)
    on_gpu.add_argument("--limit-s", type=float, help="stop a check after this long (what it tuned is harvested)")
    on_cpu = sub.add_parser("cpu")
    on_cpu.add_argument("handlers", nargs="*")
    for mode in (on_gpu, on_cpu):
        mode.add_argument("--out", type=Path, default=None)
        mode.add_argument(
            "--work", type=Path, help="the runs' Triton caches (kept: a later call's warm run finds the cold one's)"
        )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        logs = args.out or work
        logs.mkdir(parents=True, exist_ok=True)
        if args.mode == "gpu":
            runs = [r for r in args.runs.split(",") if r]
            unknown = sorted(set(runs) - set(RUNS))
            if unknown:
                parser.error(f"unknown run(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
            stages = [s for s in args.stages.split(",") if s]
            rows = gpu(args.dirs, runs, stages, args.harvest, work, logs, args.limit_s)
        else:
            rows = cpu(args.handlers, work, logs)
    print(table(rows))
    if args.out is not None:
        (args.out / "time_to_verdict.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
