"""Stage `parallel_parity`: every parallel layout trains the single-rank model, to round-off."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from math import inf
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from model_support.core.parallel import ParallelLayout
from model_support.validation.context import CheckContext
from model_support.validation.megatron_session import HF_REFERENCES
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
# How often the stage looks for a finished run while the job runs.
FOLLOW_POLL_S = 0.5


class _JobEnded(Exception):
    """The parallel job ended (its exit status) or went silent (None) before the run it was following finished."""

    def __init__(self, exit_code: int | None) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code


def default_layouts(moe: bool) -> tuple[str, ...]:
    return MOE_LAYOUTS if moe else DENSE_LAYOUTS


def cpu_ranks() -> int:
    """The most gloo ranks the job starts on this machine's CPUs: one process each (a typo such as cp512 must not
    start 512), and at least the four the default layouts need."""
    return max(4, os.cpu_count() or 1)


def unfit(layout: ParallelLayout, num_layers: int) -> str | None:
    """Why the model cannot be split in ``layout`` at all (None: it can)."""
    chunks = layout.pipeline_parallel * layout.virtual_pipeline
    if num_layers % chunks:
        return f"its {num_layers} layers do not split into {chunks} pipeline chunks"
    return None


def _model_parallel(run: str) -> int:
    name = run.partition(".")[0]
    return 1 if name == "single" else ParallelLayout.parse(name).model_parallel


def _error_line(out: Path, layout: str) -> str:
    """The worker's one-line error for ``layout``: the first rank's to fail ("" when none wrote one)."""
    errors = sorted(out.glob(f"{layout}.rank*.error"), key=lambda path: path.stat().st_mtime_ns)
    return errors[0].read_text().splitlines()[0] if errors else ""


class ParallelParityStage(Stage):
    """The handler's model in each parallel layout against the same model on one rank (the oracle, fp32), in one job of
    ranks forked from one process (:mod:`model_support.validation.parallel_worker`, started while the stages before this
    one run; gloo on the CPU): the same canonical random LoRA, the same tokens (rows across every length-dependent
    structure of the model, as in ``hf_parity``, rounded up to a multiple of every split). Per layout: the logits
    (max-abs and mean-abs-percent of the oracle's), the loss, every LoRA gradient (through one SGD step, exported
    through the handler's codec: max-abs and mean-abs-percent of the oracle's update), the whole model's LoRA gradient
    norm ``api.lora_grad_norm`` (relative), each router's top-k expert sets (identical), the PEFT adapter exported
    before the step (bit for bit), the merged HF weights exported after it (max-abs, every tensor present), the logits
    of a shared-prefix row (a prompt and its completions; not under context parallelism), the fresh adapter
    ``api.apply_lora`` draws (bit for bit: its seed makes it canonical), and the trainer's scoring calls
    ``api.token_logprobs`` (a row across the model's length structures) and ``api.group_logprobs`` (max-abs, and every
    rank's rows within that of rank 0's, the first pipeline stage included), and ``api.token_logprobs`` under
    ``api.lora_disabled`` (the reference policy: the oracle's, and the same layout's with every LoRA B zeroed). The
    forward and backward run through megatron-core's own schedules (1F1B, interleaved over virtual stages) in two
    micro-batches. The fp32 maxima of the forward (logits, the shared-prefix row, the log-probs) are held to the larger
    of their fixed limit and twice how far transformers' fp32 model lands from the single-rank model on its step rows
    (``fp32.noise.*``; its adapter merged, an MoE model's routing replayed): two correct fp32 implementations differ
    by their reductions' round-off, which grows with the model's width. Layouts come from ``check --layouts``
    (default: tp2, tp2-sp, pp2, pp2-vp2, cp2, tp2-pp2; MoE: ep2, etp2, tp2-sp, pp2, pp2-vp2, cp2, tp2-sp-ep2,
    ep2-pp2); a layout the handler refuses
    (``RuntimePolicy.parallel_limits``) or the model cannot be split into (layers per pipeline chunk) is named with its
    reason instead. A tiny replica keeps the fewest layers that hold every layer kind (CI checks every family this way),
    so ``pp2-vp2`` (four chunks) is checked on the four-layer GDN replicas and named as not checked on two-layer ones;
    ``model-support tiny --layers 4`` builds one deep enough.

    On a node with GPUs the job runs one process per GPU (NCCL), each rank on the GPU its ``LOCAL_RANK`` names, and a
    layout needing more GPUs than the node has is named as not checked; without GPUs (or with
    ``CUDA_VISIBLE_DEVICES=``) every layout runs on the CPU (gloo). When the check trains in bf16 (a GPU's default,
    or ``check --dtype bf16``) every layout also runs in bf16 against the single-rank model in bf16: logits (relative
    L2, mean-abs-percent) and the LoRA update held to twice the single-rank model's own distance from its fp32 run
    (the rounding of a correct bf16 run; a layout only reorders its reductions), the fresh adapters bit for bit, and
    two exact counts in every run: parameters or LoRA gradients held in a dtype the single-rank model does not hold
    them in, and fp32 LoRA gradients whose every value is a bf16 value (reduced or accumulated in bf16). Merged
    weights of a bf16 checkpoint are compared beyond one rounding the other way
    (:func:`model_support.core.megatron.compare.beyond_rounding`).

    Nothing hangs: the first rank to raise writes its error and ends the job (the launcher ends the others within
    seconds, as torchrun's agent does); the stage names that rank's error line for the layout and runs the layouts
    left in a new job. Every collective runs under a timeout (``parallel_worker --collective-timeout``)."""

    name = "parallel_parity"
    title = "Tensor, sequence, pipeline, context and expert parallel layouts train like the single-rank model."
    order = 62
    requires = ("lora_coverage",)
    packages = MEGATRON_PACKAGES
    needs = (HF_REFERENCES,)
    provides = (JOB,)
    # fp32 on both sides: a layout that drops a reduction or mis-slices a shard is off by O(1). The maxima of the
    # forward (logits, log-probs) are raised where the model's own fp32 round-off is larger (FP32_CALIBRATED).
    thresholds: ClassVar[dict[str, float]] = {
        "logits_max_abs_err": 1e-4,
        "logits_mean_abs_pct": 0.01,
        "loss_abs_err": 1e-5,
        "grad_max_abs_err": 1e-5,
        "grad_mean_abs_pct": 0.01,
        # api.lora_grad_norm, relative: a replica counted twice or a shard left out is off by O(1)
        "grad_norm_rel_err": 1e-5,
        "router_topk_mismatches": 0,
        "adapter_mismatches": 0,
        # beyond one rounding of base + LoRA the other way in the checkpoint's dtype (bf16 / fp16 checkpoints)
        "merged_max_abs_err": 1e-5,
        "shared_row_logits_max_abs_err": 1e-4,
        "logprobs_max_abs_err": 1e-4,
        "logprobs_rank_spread": 1e-4,
        # api.lora_disabled against the same layout with every LoRA B zeroed: the base model, or LoRA left on
        "reference_logprobs_err": 1e-4,
        "merged_mismatches": 0,
        "dtype_mismatches": 0,
        # An fp32 LoRA gradient holding bf16 values only was reduced or accumulated in bf16 (any layout, the oracle's
        # data-parallel replicas included).
        "grads_rounded_to_bf16": 0,
        "layouts_failed": 0,
    }
    # Seconds the job may go without finishing a run before it is stopped (a hang past the collectives' own timeout).
    # Per run, not per job: on a fresh GPU a Gated DeltaNet family's runs autotune their kernels for minutes each.
    run_timeout_s = 900

    def _layouts(self, ctx: CheckContext) -> tuple[list[str], list[str]]:
        """(the layouts to check, a details line for each asked-for layout that cannot be)."""
        details: list[str] = []
        layouts: list[str] = []
        for name in ctx.layouts or default_layouts(ctx.layout.moe is not None):
            layout = ParallelLayout.parse(name)
            refused = ctx.spec.runtime.refused(layout)
            cannot = unfit(layout, ctx.layout.num_layers)
            needs, gpus = layout.model_parallel, torch.cuda.device_count()
            if gpus and needs > gpus:  # one process per GPU; CPU ranks at a GPU model's width would take hours
                details.append(
                    f"{name}: not checked, it needs {needs} GPUs and the node has {gpus} (with CUDA_VISIBLE_DEVICES= "
                    "every layout runs on the CPU)"
                )
            elif not gpus and needs > cpu_ranks():
                details.append(
                    f"{name}: not checked, it needs {needs} ranks and this machine runs at most {cpu_ranks()} on its "
                    "CPUs (one process a rank)"
                )
            elif refused:  # the family's declared limit: training there is refused, so there is nothing to compare
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
            self._start(ctx, self._runs(ctx, layouts))

    def _start(self, ctx: CheckContext, runs: list[str]) -> ManagedProcess:
        """The job over ``runs`` (see :meth:`_runs`), under the launcher, kept in the run state: the job and its
        workers die with this process however it ends."""
        from model_support.core.serving.process import ManagedProcess
        from model_support.validation.selftest import active_mutation

        world = max(_model_parallel(run) for run in runs)
        cmd = [sys.executable, "-m", "model_support.validation.parallel_worker", f"--world={world}"]
        cmd += [str(self._out(ctx)), str(ctx.model_dir), ctx.spec.name, ",".join(runs)]
        mutation = active_mutation()
        if mutation is not None:  # `model-support selftest` injects its bug into the workers too
            cmd += ["--mutation", mutation]
        # One process per GPU: _layouts keeps only the layouts the node's GPUs hold (all of them on the CPU, gloo).
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        job = ManagedProcess(Path(sys.executable), cmd, env=env, log_path=ctx.workdir / "parallel-parity.log").start()
        ctx.state.set(JOB, job)
        return job

    def _wait_for_runs(self, ctx: CheckContext, runs: list[str]) -> tuple[int | None, bool]:
        """Wait for the job; when a run's failure ended it (the worker's ranks stop at the first error, so no peer
        waits on a collective forever), start the runs it left in a new job, once per failed run, all within
        ``run_timeout_s`` of each other. Returns (the last job's exit status, whether the time ran out).

        A rank that died without writing its error (a signal: gloo aborts on mismatched tensors) is named by the
        launcher (``job.failure``): that line becomes the rank's error for the run it failed in."""
        from model_support.validation.ranks import FAILURE_FILE

        out = self._out(ctx)
        job = ctx.state.find(JOB) or self._start(ctx, runs)  # prepare may not have started it
        for _ in range(len(runs)):
            try:
                exit_code = self._follow(job, runs, out)
            finally:
                ctx.state.drop(JOB)
            if exit_code is None:
                return None, True
            left = [n for n in runs if not (out / f"{n}.safetensors").exists()]
            failure = out / FAILURE_FILE
            if failure.exists() and left:
                first = json.loads(failure.read_text())
                failed = next((n for n in left if any(out.glob(f"{n}.rank*.error"))), left[0])
                own = out / f"{failed}.rank{first['rank']}.error"
                if not own.exists():
                    own.write_text(f"{first['line']}\n")
                    # the first to fail: older than the errors of the ranks that only saw it go
                    oldest = min(p.stat().st_mtime_ns for p in out.glob(f"{failed}.rank*.error"))
                    os.utime(own, ns=(oldest - 1, oldest - 1))
                failure.unlink()
            left = [n for n in left if not _error_line(out, n)]
            if exit_code == 0 or not left or not (out / "single.safetensors").exists():
                return exit_code, False
            job = self._start(ctx, left)
        return exit_code, False

    def _follow(self, job: ManagedProcess, runs: list[str], out: Path) -> int | None:
        """Show each run as a step while the job runs it (the worker runs them in order, writing ``<run>.safetensors``
        as each ends); the job's exit status, or None when it finished no run for ``run_timeout_s`` (then stopped by
        the caller's run state)."""
        from model_support.core import progress

        for name in runs:
            if (out / f"{name}.safetensors").exists():
                continue
            try:
                with progress.step(name):  # its end line says "failed after" when the job ends without it
                    deadline = time.monotonic() + self.run_timeout_s
                    while not (out / f"{name}.safetensors").exists():
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise _JobEnded(None)
                        exit_code = job.wait(min(left, FOLLOW_POLL_S))
                        if exit_code is not None and not (out / f"{name}.safetensors").exists():
                            raise _JobEnded(exit_code)
            except _JobEnded as ended:
                return ended.exit_code
        return job.wait(self.run_timeout_s)

    @staticmethod
    def _out(ctx: CheckContext) -> Path:
        return ctx.workdir / "parallel-parity"

    @staticmethod
    def _bf16(ctx: CheckContext) -> bool:
        """Whether the check trains in bf16 (``check --dtype``, else the device's: bf16 on a GPU): then every layout
        also runs in bf16, against the single-rank model in bf16."""
        return ctx.training_dtype == "bf16"

    def _runs(self, ctx: CheckContext, layouts: list[str]) -> list[str]:
        """The job's runs: the oracle and every layout in fp32, then (bf16 checks) the same in bf16."""
        fp32 = ["single", *layouts]
        return fp32 + [f"{name}.bf16" for name in fp32] * self._bf16(ctx)

    def run(self, ctx: CheckContext) -> StageResult:
        from safetensors import safe_open

        from model_support.validation.megatron_session import crossing
        from model_support.validation.parallel_worker import LR, ORACLE_ADAPTER

        layouts, details = self._layouts(ctx)
        if not layouts:
            return self.skipped(f"no layout asked for can be checked: {'; '.join(details)}")
        world = max(ParallelLayout.parse(name).model_parallel for name in layouts)
        out, log = self._out(ctx), ctx.workdir / "parallel-parity.log"
        gpus = torch.cuda.device_count()
        exit_code, timed_out = self._wait_for_runs(ctx, self._runs(ctx, layouts))
        if timed_out:
            done = sum((out / f"{n}.safetensors").exists() for n in self._runs(ctx, layouts))
            return self.failed(
                f"the parallel job finished no run in {self.run_timeout_s} s ({done} of "
                f"{len(self._runs(ctx, layouts))} runs done; stopped); see {log}"
            )

        def results(run: str) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]] | None:
            """A run's results but the oracle's merged weights (each layout's run measured itself against them)."""
            path = out / f"{run}.safetensors"
            if not path.exists():
                return None
            with safe_open(str(path), "pt") as f:
                dtypes = json.loads((f.metadata() or {}).get("dtypes", "{}"))
                kept = [k for k in f.keys() if not k.startswith("merged.")]  # noqa: SIM118 (safe_open has no __iter__)
                return {k: f.get_tensor(k) for k in kept}, dtypes

        oracle = results("single")
        if oracle is None:
            error = _error_line(out, "single")
            return self.failed(
                f"the single-rank oracle did not run (exit {exit_code}{': ' + error if error else ''}); see {log}"
            )
        device = "CPU (gloo)" if not gpus else f"{world} GPUs (NCCL)"
        details.insert(
            0, f"world size {world} on {device}; the ranks not in a layout's model-parallel groups are data parallel"
        )
        thresholds = dict(self.thresholds)
        worst: dict[str, float] = dict.fromkeys(thresholds, 0.0)
        # The step's rows cross every length-dependent structure of the model (parallel_worker._sequence_length).
        row_shape = tuple(oracle[0]["logits"].shape[:2])
        metrics: dict[str, float | int | str] = {
            "layouts": len(layouts),
            "world_size": world,
            "row_tokens": row_shape[1],
        }
        details.insert(1, f"step rows: {row_shape[0]} x {row_shape[1]} tokens")
        found, limits, missed = crossing(ctx, row_shape[1], prefix="step_row_")
        metrics |= found
        thresholds |= limits
        worst |= {key: float(value) for key, value in found.items()}
        details += missed
        worst["grads_rounded_to_bf16"] = float(oracle[0]["grads_rounded_to_bf16"])
        second = transformers_logits(ctx, oracle[0], out / ORACLE_ADAPTER)  # the second fp32 implementation
        noise = fp32_noise(oracle[0], second)
        for key, source in FP32_CALIBRATED.items():
            thresholds[key] = max(thresholds[key], 2 * noise[source])
        metrics |= {f"fp32.noise.{k}": v for k, v in noise.items()}
        details.append(
            "fp32: maxima held to the larger of their fixed limit and twice how far transformers' fp32 model lands "
            "from the single-rank model on its rows: " + ", ".join(f"{k} {v:.3g}" for k, v in noise.items())
        )
        failed = 0
        passes = [("", oracle, lambda result: compare(oracle[0], result, LR))]
        if self._bf16(ctx):
            oracle_bf16 = results("single.bf16")
            if oracle_bf16 is None:
                error = _error_line(out, "single.bf16")
                details.append(f"single.bf16: did not run ({error or f'exit {exit_code}'})")
                failed += len(layouts)
            else:
                # How far the single-rank model lands from itself in fp32 when it runs in bf16: the rounding of a
                # correct bf16 run. A layout only reorders that run's reductions, so it lands within twice that
                # of the single-rank bf16 model (both are within it of the fp32 function).
                noise = compare_bf16(oracle[0], oracle_bf16[0], LR)
                for key in BF16_CALIBRATED:
                    thresholds[f"bf16.{key}"] = 2 * noise[key]
                    worst[f"bf16.{key}"] = 0.0
                    metrics[f"bf16.noise.{key}"] = noise[key]
                for key in BF16_EXACT:
                    thresholds[f"bf16.{key}"] = 0
                    worst[f"bf16.{key}"] = 0.0
                worst["bf16.grads_rounded_to_bf16"] = float(oracle_bf16[0]["grads_rounded_to_bf16"])
                details.append(
                    "bf16: each layout against the single-rank bf16 model, limits twice that model's distance from "
                    "its fp32 run: " + ", ".join(f"{k} {v:.3g}" for k, v in noise.items() if k in BF16_CALIBRATED)
                )
                passes.append(("bf16.", oracle_bf16, lambda result: compare_bf16(oracle_bf16[0], result, LR)))
        for prefix, reference, distances in passes:
            for name in layouts:
                run = name + (".bf16" if prefix else "")
                result = results(run)
                if result is None:
                    error = _error_line(out, run)
                    details.append(f"{run}: did not run ({error or f'exit {exit_code}'})")
                    failed += 1
                    continue
                numbers = distances(result[0])
                if not prefix:  # not judged: where the layout lands from the second fp32 implementation
                    metrics[f"{run}.transformers_logits_max_abs"] = (
                        (result[0]["logits"].to(second.device) - second).abs().max().item()
                    )
                numbers["dtype_mismatches"], first = dtype_mismatches(reference[1], result[1])
                if first:
                    details.append(f"{run}: {first}")
                details.append(f"{run}: " + ", ".join(f"{k} {v:.3g}" for k, v in numbers.items()))
                if not prefix and ParallelLayout.parse(name).context_parallel > 1:
                    details.append(
                        f"{name}: no shared-prefix row (packed rows under context parallelism need THD attention)"
                    )
                for key, value in numbers.items():
                    metrics[f"{run}.{key}"] = value
                    worst[prefix + key] = max(worst.get(prefix + key, 0.0), value)
        worst["layouts_failed"] = failed
        metrics |= worst
        summary = f"{len(layouts) - failed}/{len(layouts)} layouts ({', '.join(layouts)}) match the single-rank model"
        if len(passes) > 1:
            summary += " in fp32 and in bf16"
        return self.judge(metrics, thresholds, summary, details, ctx=ctx)


# fp32 maxima held to at least twice transformers' fp32 distance from the single-rank model (:func:`fp32_noise`).
FP32_CALIBRATED = {
    "logits_max_abs_err": "logits_max_abs",
    "shared_row_logits_max_abs_err": "logits_max_abs",
    "logprobs_max_abs_err": "logprobs_max_abs",
}


def transformers_logits(ctx: CheckContext, oracle: dict[str, torch.Tensor], adapter: Path) -> torch.Tensor:
    """transformers' fp32 model's logits of the oracle's step rows, with the oracle's adapter (before the step)
    merged and, in an MoE model, the oracle's expert choices replayed (so a near tie both implementations may break
    either way is not counted as their round-off)."""
    from model_support.core.megatron.hf_reference import adapter_deltas
    from model_support.validation.megatron_session import hf_reference

    routers: dict[int, list[str]] = {}
    for key in oracle:
        # topk.decoder.layers.<layer>.<...>.<micro-batch>: the decoder's routers, which transformers runs (not MTP's)
        layer = re.match(r"topk\.decoder\.layers\.(\d+)\.", key)
        if layer:
            routers.setdefault(int(layer[1]), []).append(key)
    # One [rows, S, k] record per micro-batch (one row each, in order) -> [B * S, k], the rows one after another.
    replay = [
        torch.cat([oracle[k] for k in sorted(keys, key=lambda k: int(k.rpartition(".")[2]))]).flatten(0, 1)
        for _, keys in sorted(routers.items())
    ]
    ref = hf_reference(ctx).forward(oracle["tokens"], adapter=adapter_deltas(adapter), replay=replay or None)
    return ref.logits


def fp32_noise(oracle: dict[str, torch.Tensor], reference: torch.Tensor) -> dict[str, float]:
    """How far transformers' fp32 model (``reference``: :func:`transformers_logits`) lands from the single-rank
    model on its step rows, in the statistics the layouts are judged by: logits, and log-softmax rows (every
    position's whole distribution, as the scoring calls return them), max abs. Two correct fp32 implementations of
    one model differ by their reductions' round-off, which grows with the model's width (the fixed 1e-4 is that of
    the tiny replicas); a layout only reorders some of the single-rank model's reductions, so it lands within twice
    that of the single-rank model, while a layout that drops a reduction or mis-slices a shard is off by O(1)."""
    ours = oracle["logits"].to(reference.device)
    # One row at a time: a real-width row's log-softmax in float64 is hundreds of megabytes.
    logprobs = max(
        (torch.log_softmax(mine.double(), -1) - torch.log_softmax(theirs.double(), -1)).abs().max().item()
        for mine, theirs in zip(ours, reference, strict=True)
    )
    return {"logits_max_abs": (ours - reference).abs().max().item(), "logprobs_max_abs": logprobs}


# The bf16 comparison: distances held to twice the single-rank model's own bf16 rounding, and exact counts.
BF16_CALIBRATED = ("logits_rel_l2", "logits_mean_abs_pct", "grad_mean_abs_pct")
BF16_EXACT = ("adapter_mismatches", "dtype_mismatches", "grads_rounded_to_bf16")


def dtype_mismatches(oracle: dict[str, list[str]], other: dict[str, list[str]]) -> tuple[int, str]:
    """(how many parameters and LoRA gradients some rank of the layout holds in a dtype the single-rank model does not
    hold them in, a details line naming the first one)."""
    wrong = sorted(name for name, dtypes in other.items() if name in oracle and dtypes != oracle[name])
    if not wrong:
        return 0, ""
    return len(wrong), f"{wrong[0]} is {'/'.join(other[wrong[0]])} on some rank, {oracle[wrong[0]][0]} single-rank"


def compare_bf16(oracle: dict[str, torch.Tensor], other: dict[str, torch.Tensor], lr: float) -> dict[str, float]:
    """One run's distances from another's where bf16 rounding makes them differ (logits, the step's LoRA update),
    and the counts that must be exact in any dtype (the adapters before the step, bf16-valued gradients)."""
    logits_err = other["logits"] - oracle["logits"]
    update, update_err = _update_and_error(oracle, other)
    return {
        "logits_rel_l2": (logits_err.norm() / oracle["logits"].norm()).item(),
        "logits_mean_abs_pct": 100 * logits_err.abs().mean().item() / oracle["logits"].abs().mean().item(),
        "grad_mean_abs_pct": 100 * update_err.abs().mean().item() / max(update.abs().mean().item(), 1e-30),
        "adapter_mismatches": _adapter_mismatches(oracle, other),
        "grads_rounded_to_bf16": float(other["grads_rounded_to_bf16"]),
    }


def _update_and_error(oracle: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(the oracle's SGD update of every LoRA tensor, how far the other run's lands from the oracle's), flat."""
    after = sorted(k for k in oracle if k.startswith("after."))
    # An SGD step moved each LoRA tensor by -lr * grad: the difference of the updates is the gradients' times lr.
    update = torch.cat([(oracle[k] - oracle[k.replace("after.", "before.")]).flatten() for k in after])
    update_err = torch.cat([(other[k] - oracle[k]).flatten() if k in other else oracle[k].flatten() for k in after])
    return update, update_err


def _adapter_mismatches(oracle: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> int:
    """The adapter exported right after apply_lora (``fresh.``) and with the random LoRA loaded (``before.``): every
    tensor bit for bit."""
    before = sorted(k for k in oracle if k.startswith(("fresh.", "before.")))
    mismatched = sum(1 for k in before if k not in other or not torch.equal(other[k], oracle[k]))
    return mismatched + sum(1 for k in other if k.startswith(("fresh.", "before.")) and k not in oracle)


def compare(oracle: dict[str, torch.Tensor], other: dict[str, torch.Tensor], lr: float) -> dict[str, float]:
    """The distances of one layout's results from the single-rank oracle's (see :class:`ParallelParityStage`)."""
    logits_err = (other["logits"] - oracle["logits"]).abs()
    update, update_err = _update_and_error(oracle, other)
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
        "grad_norm_rel_err": ((other["grad_norm"] - oracle["grad_norm"]).abs() / oracle["grad_norm"]).item(),
        "router_topk_mismatches": topk_mismatches,
        "adapter_mismatches": _adapter_mismatches(oracle, other),
        # measured by the layout's own run against the oracle's file (merged_distance): no run but the oracle's
        # keeps the whole merged model
        "merged_max_abs_err": other["merged_max_abs_err"].item() if "merged_max_abs_err" in other else inf,
        # A layout that runs no shared-prefix row (context parallel) has nothing to compare.
        "shared_row_logits_max_abs_err": (other["shared_logits"] - oracle["shared_logits"]).abs().max().item()
        if "shared_logits" in other
        else 0.0,
        "merged_mismatches": int(other["merged_mismatches"].item()) if "merged_mismatches" in other else 1,
        "logprobs_max_abs_err": _logprobs_err(oracle, other),
        "logprobs_rank_spread": other["logprobs_rank_spread"].item() if "logprobs_rank_spread" in other else inf,
        "reference_logprobs_err": other["reference_logprobs_err"].item() if "reference_logprobs_err" in other else inf,
        "grads_rounded_to_bf16": float(other["grads_rounded_to_bf16"]),
    }


def _logprobs_err(oracle: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    """Max-abs distance of the layout's ``api.token_logprobs`` / ``api.group_logprobs`` rows (and the former under
    ``api.lora_disabled``) from the oracle's
    (infinite when a row is missing or has another shape)."""
    keys = [k for k in oracle if k.startswith(("token_logprobs.", "group_logprobs.", "reference_logprobs."))]
    if not keys or any(k not in other or other[k].shape != oracle[k].shape for k in keys):
        return inf
    return max((other[k] - oracle[k]).abs().max().item() for k in keys)
