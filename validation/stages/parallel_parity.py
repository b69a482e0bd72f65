"""Stage `parallel_parity`: every parallel layout trains the single-rank model, to round-off."""

from __future__ import annotations

import os
import sys
from math import inf
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from model_support.core.parallel import ParallelLayout
from model_support.validation.context import CheckContext
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES
from model_support.validation.state import Resource, stop_value

if TYPE_CHECKING:
    from model_support.core.serving.process import ManagedProcess


JOB: Resource[ManagedProcess] = Resource(
    "parallel_job",
    "parallel_parity's ranks and single-rank oracle, one job started by its prepare while earlier stages run",
    stop=stop_value,
)

# Layouts checked when the run names none, on world sizes 2 and 4: tensor (with and without sequence parallel),
# pipeline (with virtual stages), context parallel, and tensor x pipeline for every family; for MoE also expert
# parallel alone, with tensor + sequence parallel and with pipeline parallel, and expert tensor parallel
# (megatron-core needs sequence parallel for an MoE model at tensor parallel > 1).
DENSE_LAYOUTS = ("tp2", "tp2-sp", "pp2", "pp2-vp2", "cp2", "tp2-pp2")
MOE_LAYOUTS = ("ep2", "etp2", "tp2-sp", "pp2", "pp2-vp2", "cp2", "tp2-sp-ep2", "ep2-pp2")


def default_layouts(moe: bool) -> tuple[str, ...]:
    return MOE_LAYOUTS if moe else DENSE_LAYOUTS


def unfit(layout: ParallelLayout, num_layers: int) -> str | None:
    """Why the model cannot be split in ``layout`` at all (None: it can)."""
    chunks = layout.pipeline_parallel * layout.virtual_pipeline
    if num_layers % chunks:
        return f"its {num_layers} layers do not split into {chunks} pipeline chunks"
    return None


def _error_line(out: Path, layout: str) -> str:
    """The worker's one-line error for ``layout``: the first rank's to fail ("" when none wrote one)."""
    errors = sorted(out.glob(f"{layout}.rank*.error"), key=lambda path: path.stat().st_mtime_ns)
    return errors[0].read_text().splitlines()[0] if errors else ""


class ParallelParityStage(Stage):
    """The handler's model in each parallel layout against the same model on one rank (the oracle, fp32), in one
    job of ranks forked from one process (:mod:`model_support.validation.parallel_worker`, started while the stages
    before this one run; gloo on the CPU): the same canonical random
    LoRA, the same tokens (rows across every length-dependent structure of the model, as in ``hf_parity``, rounded
    up to a multiple of every split). Per layout: the logits (max-abs and mean-abs-percent of the oracle's), the
    loss, every LoRA gradient (through one SGD step, exported through the handler's codec: max-abs and
    mean-abs-percent of the oracle's update), each router's top-k expert sets (identical), the PEFT adapter exported
    before the step (bit for bit), the merged HF weights exported after it (max-abs, every tensor present), the
    logits of a shared-prefix row (a prompt and its completions; not under context parallelism), the fresh adapter
    ``api.apply_lora`` draws (bit for bit: its seed makes it canonical), and the trainer's scoring calls
    ``api.token_logprobs`` (a row across the model's length structures) and ``api.group_logprobs`` (max-abs, and
    every rank's rows within that of rank 0's, the first pipeline stage included). The forward and backward run
    through megatron-core's own schedules (1F1B, interleaved over virtual stages) in two micro-batches. Layouts come
    from ``check --layouts`` (default: tp2, tp2-sp, pp2, pp2-vp2, cp2, tp2-pp2; MoE: ep2, etp2, tp2-sp, pp2,
    pp2-vp2, cp2, tp2-sp-ep2, ep2-pp2); a layout the handler refuses (``RuntimePolicy.parallel_limits``) or the
    model cannot be split into (layers per pipeline chunk) is named with its reason instead. A tiny replica keeps
    the fewest layers that hold every layer kind (CI checks every family this way), so ``pp2-vp2`` (four chunks) is
    checked on the four-layer GDN replicas and named as not checked on two-layer ones; ``model-support tiny
    --layers 4`` builds one deep enough. With as many GPUs as the largest layout needs the job runs one process per
    GPU (NCCL), else on the CPU (gloo)."""

    name = "parallel_parity"
    title = "Tensor, sequence, pipeline, context and expert parallel layouts train like the single-rank model."
    order = 62
    requires = ("lora_coverage",)
    packages = MEGATRON_PACKAGES
    provides = (JOB,)
    # fp32 on both sides: a layout that drops a reduction or mis-slices a shard is off by O(1).
    thresholds: ClassVar[dict[str, float]] = {
        "logits_max_abs_err": 1e-4,
        "logits_mean_abs_pct": 0.01,
        "loss_abs_err": 1e-5,
        "grad_max_abs_err": 1e-5,
        "grad_mean_abs_pct": 0.01,
        "router_topk_mismatches": 0,
        "adapter_mismatches": 0,
        "merged_max_abs_err": 1e-5,
        "shared_row_logits_max_abs_err": 1e-4,
        "logprobs_max_abs_err": 1e-4,
        "logprobs_rank_spread": 1e-4,
        "merged_mismatches": 0,
        "layouts_failed": 0,
    }
    timeout_s = 900

    def _layouts(self, ctx: CheckContext) -> tuple[list[str], list[str]]:
        """(the layouts to check, a details line for each asked-for layout that cannot be)."""
        details: list[str] = []
        layouts: list[str] = []
        for name in ctx.layouts or default_layouts(ctx.layout.moe is not None):
            refused = ctx.spec.runtime.refused(ParallelLayout.parse(name))
            cannot = unfit(ParallelLayout.parse(name), ctx.layout.num_layers)
            if refused:  # the family's declared limit: training there is refused, so there is nothing to compare
                details.append(f"{name}: not checked, the handler refuses it ({refused})")
            elif cannot:
                details.append(f"{name}: not checked, the model cannot be split so ({cannot})")
            else:
                layouts.append(name)
        return layouts, details

    def prepare(self, ctx: CheckContext) -> None:
        """Start the job: it reads only the checkpoint, so it runs while the stages before this one do."""
        layouts, _ = self._layouts(ctx)
        if layouts and ctx.state.find(JOB) is None:
            self._start(ctx, layouts)

    def _start(self, ctx: CheckContext, layouts: list[str]) -> ManagedProcess:
        """The job over ``layouts`` (and the single-rank oracle), under the launcher, kept in the run state: the job
        and its workers die with this process however it ends."""
        from model_support.core.serving.process import ManagedProcess
        from model_support.validation.selftest import active_mutation

        world = max(ParallelLayout.parse(name).model_parallel for name in layouts)
        cmd = [sys.executable, "-m", "model_support.validation.parallel_worker", f"--world={world}"]
        cmd += [str(self._out(ctx)), str(ctx.model_dir), ctx.spec.name, ",".join(("single", *layouts))]
        mutation = active_mutation()
        if mutation is not None:  # `model-support selftest` injects its bug into the workers too
            cmd += ["--mutation", mutation]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if torch.cuda.device_count() < world:  # one process per GPU, or all on the CPU (gloo)
            env["CUDA_VISIBLE_DEVICES"] = ""
        job = ManagedProcess(Path(sys.executable), cmd, env=env, log_path=ctx.workdir / "parallel-parity.log").start()
        ctx.state.set(JOB, job)
        return job

    @staticmethod
    def _out(ctx: CheckContext) -> Path:
        return ctx.workdir / "parallel-parity"

    def run(self, ctx: CheckContext) -> StageResult:
        from safetensors.torch import load_file

        from model_support.validation.parallel_worker import LR

        layouts, details = self._layouts(ctx)
        if not layouts:
            return self.skipped(f"no layout asked for can be checked: {'; '.join(details)}")
        world = max(ParallelLayout.parse(name).model_parallel for name in layouts)
        out, log = self._out(ctx), ctx.workdir / "parallel-parity.log"
        gpus = torch.cuda.device_count()
        job = ctx.state.find(JOB) or self._start(ctx, layouts)  # prepare may not have started it
        try:
            exit_code = job.wait(self.timeout_s)
        finally:
            ctx.state.drop(JOB)
        if exit_code is None:
            return self.failed(f"the parallel job did not finish in {self.timeout_s} s (stopped); see {log}")
        oracle_file = out / "single.safetensors"
        if not oracle_file.exists():
            error = _error_line(out, "single")
            return self.failed(
                f"the single-rank oracle did not run (exit {exit_code}{': ' + error if error else ''}); see {log}"
            )
        oracle = load_file(str(oracle_file))
        device = "CPU (gloo)" if gpus < world else f"{world} GPUs (NCCL)"
        details.insert(
            0, f"world size {world} on {device}; the ranks not in a layout's model-parallel groups are data parallel"
        )
        worst: dict[str, float] = dict.fromkeys(self.thresholds, 0.0)
        # The step's rows cross every length-dependent structure of the model (parallel_worker._sequence_length).
        row_shape = tuple(oracle["logits"].shape[:2])
        metrics: dict[str, float | int | str] = {
            "layouts": len(layouts),
            "world_size": world,
            "row_tokens": row_shape[1],
        }
        details.insert(1, f"step rows: {row_shape[0]} x {row_shape[1]} tokens")
        failed = 0
        for name in layouts:
            result = out / f"{name}.safetensors"
            if not result.exists():
                error = _error_line(out, name)
                details.append(f"{name}: did not run ({error or f'exit {exit_code}'})")
                failed += 1
                continue
            numbers = compare(oracle, load_file(str(result)), LR)
            details.append(f"{name}: " + ", ".join(f"{k} {v:.3g}" for k, v in numbers.items()))
            if ParallelLayout.parse(name).context_parallel > 1:
                details.append(
                    f"{name}: no shared-prefix row (packed rows under context parallelism need THD attention)"
                )
            for key, value in numbers.items():
                metrics[f"{name}.{key}"] = value
                worst[key] = max(worst[key], value)
        worst["layouts_failed"] = failed
        metrics |= worst
        summary = f"{len(layouts) - failed}/{len(layouts)} layouts ({', '.join(layouts)}) match the single-rank model"
        return self.judge(metrics, dict(self.thresholds), summary, details, ctx=ctx)


def compare(oracle: dict[str, torch.Tensor], other: dict[str, torch.Tensor], lr: float) -> dict[str, float]:
    """The distances of one layout's results from the single-rank oracle's (see :class:`ParallelParityStage`)."""
    logits_err = (other["logits"] - oracle["logits"]).abs()
    # The adapter exported right after apply_lora (``fresh.``) and with the random LoRA loaded (``before.``).
    before = sorted(k for k in oracle if k.startswith(("fresh.", "before.")))
    after = sorted(k for k in oracle if k.startswith("after."))
    mismatched = sum(1 for k in before if k not in other or not torch.equal(other[k], oracle[k]))
    mismatched += sum(1 for k in other if k.startswith(("fresh.", "before.")) and k not in oracle)
    # An SGD step moved each LoRA tensor by -lr * grad: the difference of the updates is the gradients' times lr.
    update = torch.cat([(oracle[k] - oracle[k.replace("after.", "before.")]).flatten() for k in after])
    update_err = torch.cat([(other[k] - oracle[k]).flatten() if k in other else oracle[k].flatten() for k in after])
    merged = sorted(k for k in oracle if k.startswith("merged."))
    merged_mismatches = sum(1 for k in merged if k not in other or other[k].shape != oracle[k].shape)
    merged_mismatches += sum(1 for k in other if k.startswith("merged.") and k not in oracle)
    merged_err = max(
        (
            (other[k].float() - oracle[k].float()).abs().max().item()
            for k in merged
            if k in other and other[k].shape == oracle[k].shape
        ),
        default=0.0,
    )
    topk = sorted(k for k in oracle if k.startswith("topk."))
    topk_mismatches = sum(
        int((other[k] != oracle[k]).any(-1).sum())
        if k in other and other[k].shape == oracle[k].shape
        else len(oracle[k])
        for k in topk
    )
    return {
        "logits_max_abs_err": logits_err.max().item(),
        "logits_mean_abs_pct": 100 * logits_err.mean().item() / oracle["logits"].abs().mean().item(),
        "loss_abs_err": (other["loss"] - oracle["loss"]).abs().item(),
        "grad_max_abs_err": update_err.abs().max().item() / lr,
        "grad_mean_abs_pct": 100 * update_err.abs().mean().item() / max(update.abs().mean().item(), 1e-30),
        "router_topk_mismatches": topk_mismatches,
        "adapter_mismatches": mismatched,
        "merged_max_abs_err": merged_err,
        # A layout that runs no shared-prefix row (context parallel) has nothing to compare.
        "shared_row_logits_max_abs_err": (other["shared_logits"] - oracle["shared_logits"]).abs().max().item()
        if "shared_logits" in other
        else 0.0,
        "merged_mismatches": merged_mismatches,
        "logprobs_max_abs_err": _logprobs_err(oracle, other),
        "logprobs_rank_spread": other["logprobs_rank_spread"].item() if "logprobs_rank_spread" in other else inf,
    }


def _logprobs_err(oracle: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    """Max-abs distance of the layout's ``api.token_logprobs`` / ``api.group_logprobs`` rows from the oracle's
    (infinite when a row is missing or has another shape)."""
    keys = [k for k in oracle if k.startswith(("token_logprobs.", "group_logprobs."))]
    if not keys or any(k not in other or other[k].shape != oracle[k].shape for k in keys):
        return inf
    return max((other[k] - oracle[k]).abs().max().item() for k in keys)
