"""Validate the built-in handlers on wide random replicas on a GPU, and print one table.

For each ``HANDLER:LAYERS[:EXPERTS]`` case: ``model-support replica`` writes a random bf16 model at the
handler's reference-config width, then ``model-support check`` runs the Megatron stages on it in a
child process (so each check's peak memory is its own). ``--broken-codec HANDLER:LAYERS`` first checks
that replica with a codec that reads Megatron's fused fc1 as [up; gate]: ``lora_coverage`` must fail.

Run on the device machine from the repository root (see docs/gpu-validation.md for the wheels):

    PYTHONPATH=/tmp/ms:/tmp/site python3 -m benchmarks.gpu_validation --out $OUT \\
        --case qwen3:4 --case qwen3-moe:4 --case qwen3.5:4 --case qwen3.5-moe:4 --broken-codec qwen3:4

Serving stages need vLLM, which cannot be carried to the device machine: they are not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MEGATRON_STAGES = (
    "weights",
    "hf_parity",
    "lora_coverage",
    "lora_gradients",
    "packed_position_ids",
    "shared_prefix",
    "trainability",
)
# The numbers each stage's row shows.
KEY_METRICS = {
    "weights": ("tensors", "nonfinite_tensors", "zero_matrices"),
    "hf_parity": (
        "rel_l2",
        "reference_bfloat16_rel_l2",
        "mean_abs_pct",
        "reference_bfloat16_mean_abs_pct",
        "router_flips",
        "router_near_ties",
        "long_tokens",
        "long_rel_l2",
        "long_reference_bfloat16_rel_l2",
        "build_s",
    ),
    "lora_coverage": (
        "codec_layout_err",
        "zero_grad_params",
        "unrouted_experts_run_directly",
        "adapter_logits_rel_l2",
        "reference_bfloat16_rel_l2",
        "adapter_effect_rel_l2",
    ),
    "packed_position_ids": ("logits_rel_l2", "grad_mean_abs_pct", "leak_control_rel_l2"),
    "shared_prefix": ("logits_rel_l2", "loss_rel_err", "grad_mean_abs_pct", "control_rel_l2"),
    "trainability": ("initial_loss", "final_loss", "steps", "peak_lr"),
}


def _cli(*args: str, log: Path, timeout: float) -> int:
    cmd = [sys.executable, "-m", "model_support.core.cli", *args]
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        try:
            return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            f.write(f"timed out after {timeout:.0f} s\n")
            return 124


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def run_case(case: str, work: Path, log: Path, timeout: float, broken: bool = False) -> list[dict[str, Any]]:
    """Build the replica of ``case`` (once) and check it; one row per stage."""
    handler, layers, *experts = case.split(":")
    model_dir = work / case.replace(":", "-")
    rows: list[dict[str, Any]] = []
    if not (model_dir / "config.json").exists():
        start = time.perf_counter()
        args = ["replica", handler, str(model_dir), "--layers", layers, "--dtype", "bf16"]
        if experts:
            args += ["--experts", experts[0]]
        rc = _cli(*args, log=log, timeout=timeout)
        if rc != 0:
            return [{"case": case, "stage": "replica", "status": f"error rc={rc}", "seconds": 0.0}]
        rows.append({"case": case, "stage": "replica", "status": "built", "seconds": time.perf_counter() - start})
    report = work / f"{case.replace(':', '-')}{'-broken' if broken else ''}.json"
    if broken:
        cmd = [sys.executable, "-m", "benchmarks.gpu_validation", "--broken-run", str(model_dir), "--json", str(report)]
        with log.open("a") as f:
            subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    else:
        stages = [a for s in MEGATRON_STAGES for a in ("-s", s)]
        _cli("check", str(model_dir), *stages, "--json", str(report), log=log, timeout=timeout)
    if not report.exists():
        return [*rows, {"case": case, "stage": "check", "status": "no report (see log)", "seconds": 0.0}]
    for result in json.loads(report.read_text())["results"]:
        if result["stage"] not in MEGATRON_STAGES:
            continue
        metrics = result["metrics"]
        rows.append(
            {
                "case": case + (" broken codec" if broken else ""),
                "stage": result["stage"],
                "status": result["status"],
                "seconds": result["duration_s"],
                "peak_gpu_mib": result.get("peak_gpu_mib"),
                "peak_host_mib": result.get("peak_host_mib"),
                "metrics": metrics,
                "thresholds": result["thresholds"],
                "summary": result["summary"],
                "details": result["details"],
            }
        )
    return rows


def broken_run(model_dir: Path, json_out: Path) -> None:
    """Check ``model_dir`` with its handler's codec replaced by one that swaps fc1's gate and up halves."""
    import dataclasses

    import torch
    from transformers import AutoConfig

    from model_support.core.codecs import BridgeLoraCodec
    from model_support.core.discovery import locate, resolve_handler
    from model_support.core.registry import load_registry
    from model_support.validation.context import CheckContext
    from model_support.validation.report import write_reports
    from model_support.validation.runner import plan, run_checks
    from model_support.validation.stage_registry import load_stages

    class SwappedGateUpCodec(BridgeLoraCodec):
        @staticmethod
        def _swap(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = dict(tensors)
            for key in tensors:
                if "gate_proj.lora_B" in key:
                    other = key.replace("gate_proj", "up_proj")
                    out[key], out[other] = tensors[other], tensors[key]
            return out

        def to_peft(self, tensors, config, layout):
            return self._swap(super().to_peft(tensors, config, layout))

        def from_peft(self, tensors, config, layout):
            return super().from_peft(self._swap(dict(tensors)), config, layout)

    registry = load_registry()
    good = resolve_handler(locate(str(model_dir)), registry)
    broken = dataclasses.replace(good, spec=dataclasses.replace(good.spec, codec=SwappedGateUpCodec("broken")))
    config = AutoConfig.from_pretrained(model_dir)
    ctx = CheckContext(
        target=f"{model_dir} (broken codec)",
        model_dir=model_dir,
        handler=broken,
        config=config,
        layout=broken.spec.layout(config),
        registry=registry,
        workdir=model_dir.parent / "broken-work",
    )
    report = run_checks(ctx, plan(load_stages(registry).classes(), ["lora_coverage"]))
    write_reports(report, json_out, None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", action="append", default=[], help="HANDLER:LAYERS[:EXPERTS] (repeatable)")
    parser.add_argument("--broken-codec", action="append", default=[], help="HANDLER:LAYERS to check with a bad codec")
    parser.add_argument("--out", type=Path, default=Path("gpu-validation-out"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/ms-replicas"))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per replica build or check")
    parser.add_argument("--broken-run", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.broken_run:
        broken_run(args.broken_run, args.json)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    log = args.out / "gpu-validation.log"
    rows: list[dict[str, Any]] = []
    jobs = [(case, True) for case in args.broken_codec] + [(case, False) for case in args.case]
    for case, broken in jobs:
        rows += run_case(case, args.work, log, args.timeout, broken=broken)
        (args.out / "gpu-validation.json").write_text(json.dumps(rows, indent=1))
    print("| case | stage | status | s | peak GPU MiB | peak host MiB | metrics |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        shown = KEY_METRICS.get(row["stage"], ())
        metrics = ", ".join(f"{k}={_fmt(v)}" for k, v in row.get("metrics", {}).items() if k in shown)
        print(
            f"| {row['case']} | {row['stage']} | {row['status']} | {row['seconds']:.1f} | "
            f"{_fmt(row.get('peak_gpu_mib'))} | {_fmt(row.get('peak_host_mib'))} | {metrics} |"
        )


if __name__ == "__main__":
    main()
