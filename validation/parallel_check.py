"""``check --parallel LAYOUT``: the stages that use the Megatron model, with the model sharded in LAYOUT across one
process per GPU (gloo ranks on a CPU), forked from the check's process (:mod:`model_support.validation.ranks`).

Every rank runs the same stages on the same inputs (the ranks outside the layout's model-parallel groups are data
parallel). The stages read the model only through what gathers across ranks (logits whole on every rank, canonical
LoRA tensors and gradients, counts and errors over every rank's modules), so every rank computes the whole model's
numbers, held to the same tolerances as the single-process check. Rank 0 hands each result to the check's process as
it ends (``ranks/results.jsonl``), which shows and reports it. A stage that raises on any rank ends the job (a peer
may wait in a collective the failed rank never joins): the check fails that stage with the first rank's error line
and skips the stages left.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from model_support.core.errors import ModelSupportError
from model_support.core.parallel import ParallelLayout
from model_support.core.spec import HandlerSpec
from model_support.validation import ranks
from model_support.validation.context import CheckContext
from model_support.validation.stage import Stage, StageResult

if TYPE_CHECKING:
    from model_support.validation.runner import Report

RESULTS = "results.jsonl"
# The kinds of parallelism the stages' forwards see whole logits through on every rank (``forward.logits``);
# pipeline stages and context-parallel shards would each hold a part of every forward.
SHARDS = ("tensor_parallel", "expert_parallel", "expert_tensor_parallel")
# A collective's peers may be a whole real-width layer apart: a rank streams the fp32 reference while another waits.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# The share of a GPU the estimate (memory_per_rank) may take: the rest is the CUDA context, NCCL's buffers and the
# caching allocator's slack.
MEMORY_SHARE = 0.9
# How many fp32 copies of the long row's logits the Megatron stages hold at once on the busiest rank (the model's,
# the oracle's, their log-softmax and gradients, the comparison's blocks): the peaks of `check --parallel ep4` at
# 4096 tokens less the other terms of memory_per_rank were 11.2 (Qwen3-30B-A3B width, 4 layers), 11.8 (its 48
# layers) and 12.2 (GLM-4.5-Air width, 4 layers) such copies (docs/gpu-validation.md).
LOGIT_COPIES = 13


class ParallelCheckError(ModelSupportError):
    """``check --parallel`` cannot run the layout here."""


def gpu_memory() -> list[int]:
    """Each GPU's total memory in bytes, from ``nvidia-smi`` (torch's own query would start CUDA in this process,
    which then cannot fork ranks); empty without a GPU."""
    if not torch.cuda.is_available():
        return []
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [int(line) * 2**20 for line in out.split()]


def weights_per_rank(ctx: CheckContext, layout: ParallelLayout) -> int:
    """Bytes of the checkpoint's weights each rank holds in ``layout``, in the check's dtype: expert tensors split
    over expert (x expert tensor) parallel ranks, the other matrices over tensor-parallel ranks, vectors whole."""
    from model_support.core.checkpoint import stored_tensors

    bits = 32 if ctx.training_dtype == "fp32" else 16
    total = 0.0
    for name, (_path, shape, _dtype) in stored_tensors(ctx.model_dir).items():
        numel = math.prod(shape)
        if ".experts." in name:
            numel /= layout.expert_parallel * layout.expert_tensor_parallel
        elif len(shape) > 1:
            numel /= layout.tensor_parallel
        total += numel * bits / 8
    return int(total)


def memory_per_rank(ctx: CheckContext, layout: ParallelLayout) -> dict[str, int]:
    """Bytes the busiest rank holds at its peak in ``layout``, by part: the sharded weights
    (:func:`weights_per_rank`); the fp32 oracle's largest decoder layer, and its embedding and head, which it holds
    whole while it streams; ``LOGIT_COPIES`` fp32 copies of the long row's logits."""
    from model_support.core.checkpoint import TextCheckpoint
    from model_support.core.layout import REAL_WIDTH_LONG_ROW, long_row_length, text_config

    # The oracle's view of the checkpoint (hf_reference.StreamedReference): its text tensors, by decoder layer.
    checkpoint = TextCheckpoint(ctx.model_dir)
    per_layer: dict[int, int] = {}
    outside = 0
    for name in checkpoint.get_all_keys():
        shape, layer = checkpoint.shape(name), checkpoint.layer_of(name)
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0) + math.prod(shape)
        elif len(shape) > 1:
            outside += math.prod(shape)
    row = long_row_length(ctx.config, ctx.layout, floor=REAL_WIDTH_LONG_ROW)
    return {
        "weights": weights_per_rank(ctx, layout),
        "the oracle's fp32 layer": 4 * max(per_layer.values(), default=0),
        "its embedding and head": 4 * outside,
        f"{LOGIT_COPIES} copies of a {row}-token row's logits": LOGIT_COPIES
        * 4
        * row
        * int(text_config(ctx.config).vocab_size),
    }


def refuse_layout(spec: HandlerSpec, layout: ParallelLayout) -> None:
    """A :class:`ParallelCheckError` line when ``check --parallel`` cannot run ``layout`` here: under another
    launcher, a kind of parallelism the stages do not shard, a handler's refusal, more ranks than GPUs (or CPU
    ranks)."""
    from model_support.validation.stages.parallel_parity import cpu_ranks

    if "WORLD_SIZE" in os.environ:
        raise ParallelCheckError(
            "check --parallel starts its own ranks, one per GPU: run it once, not under torchrun or another launcher"
        )
    other = [kind.replace("_", " ") for kind in layout.used() if kind not in SHARDS]
    if other or layout.model_parallel == 1:
        raise ParallelCheckError(
            f"--parallel {layout.name}: check --parallel shards the model in tensor and expert parallel layouts "
            f"(tpN, epN, etpN, e.g. tp2, ep4, ep2-etp2){'; it uses ' + ', '.join(other) if other else ''}. "
            "parallel_parity checks every layout against the single-rank model (--layouts)"
        )
    refused = spec.runtime.refused(layout)
    if refused:
        raise ParallelCheckError(f"{spec.name} cannot train in {layout.name}: {refused}")
    world, memory = layout.model_parallel, gpu_memory()
    if memory and world > len(memory):
        raise ParallelCheckError(f"--parallel {layout.name} needs {world} GPUs and this node has {len(memory)}")
    if not memory and world > cpu_ranks():
        raise ParallelCheckError(
            f"--parallel {layout.name} needs {world} ranks and this machine runs at most {cpu_ranks()} on its CPUs"
        )


def refuse_memory(ctx: CheckContext, layout: ParallelLayout) -> None:
    """A :class:`ParallelCheckError` line, before anything is built, when the busiest rank's estimate
    (:func:`memory_per_rank`) takes more than ``MEMORY_SHARE`` of the smallest GPU the layout runs on."""
    memory = gpu_memory()[: layout.model_parallel]
    if not memory:
        return
    parts, have = memory_per_rank(ctx, layout), min(memory)
    need = sum(parts.values())
    if need > MEMORY_SHARE * have:
        shown = ", ".join(f"{part} {size / 2**30:.1f}" for part, size in parts.items())
        raise ParallelCheckError(
            f"--parallel {layout.name}: each GPU would need about {need / 2**30:.1f} GiB ({shown}), more than "
            f"{MEMORY_SHARE:.0%} of its {have / 2**30:.1f} GiB: shard it over more GPUs (a larger tp or ep)"
        )


def run_sharded(
    ctx: CheckContext,
    stages: Sequence[type[Stage]],
    on_result: Callable[[StageResult], None],
    prefer: Mapping[str, str] | None = None,
) -> Report:
    """Run ``stages`` in the ranks of ``ctx.parallel`` (which the caller has held to :func:`refuse_layout` and
    :func:`refuse_memory`): the run's report, each result given to ``on_result`` as rank 0 hands it over.
    ``prefer``: the check's handler preferences (architecture -> handler).

    The ranks are forked by a new process (``python -m model_support.validation.parallel_check``), which builds the
    run's context again from ``ranks/job.json`` and computes nothing before it forks: a fork of a process whose
    OpenMP threads have run (this one built a tiny replica) deadlocks in its first parallel tensor operation. The
    job dies with this process however it ends."""
    from model_support.core.serving.process import ManagedProcess
    from model_support.validation.runner import new_report
    from model_support.validation.selftest import active_mutation

    assert ctx.parallel is not None
    jobdir = (ctx.workdir / "ranks").absolute()
    jobdir.mkdir(parents=True, exist_ok=True)
    job = {
        "target": ctx.target,
        "model_dir": str(ctx.model_dir.absolute()),
        "handler": ctx.spec.name,
        "prefer": dict(prefer or {}),
        "workdir": str(ctx.workdir.absolute()),
        "tiny": ctx.tiny,
        "seed": ctx.seed,
        "dtype": ctx.dtype,
        "stage_timeout_s": ctx.stage_timeout_s,
        "parallel": ctx.parallel.name,
        "stages": [stage.name for stage in stages],
        "mutation": active_mutation(),  # `model-support selftest` injects its bug into the ranks too
    }
    (jobdir / "job.json").write_text(json.dumps(job))
    report = new_report(ctx)
    results = report.results
    path = jobdir / RESULTS

    def collect() -> None:
        # Whole lines only: rank 0 may be writing the next one.
        lines = path.read_text().split("\n")[:-1] if path.exists() else []
        for line in lines[len(results) :]:
            results.append(StageResult.from_dict(json.loads(line)))
            on_result(results[-1])

    cmd = [sys.executable, "-m", "model_support.validation.parallel_check", str(jobdir)]
    # One process per GPU, or per CPU rank: a rank's own OpenMP threads would only compete with its peers'.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = ManagedProcess(Path(sys.executable), cmd, env=env, log_path=ctx.workdir / "ranks.log").start()
    try:
        while (code := process.wait(1.0)) is None:
            collect()
    finally:
        process.stop()
    collect()
    if code != 0 or len(results) < len(stages):
        for result in _ended(stages[len(results) :], jobdir, code, ctx.parallel.model_parallel):
            results.append(result)
            on_result(result)
    return report


def _ended(left: Sequence[type[Stage]], jobdir: Path, code: int, world: int) -> list[StageResult]:
    """The results of the stages a failed job did not finish: the one it ended in fails with the first rank's error
    line (the launcher's, for a rank that died of a signal without a word), the ones after it are skipped."""
    if not left:
        return []
    errors = sorted(jobdir.glob("*.rank*.error"), key=lambda p: p.stat().st_mtime_ns)
    failure = jobdir / ranks.FAILURE_FILE
    if errors:
        rank = errors[0].name.rsplit(".rank", 1)[1].removesuffix(".error")
        line = f"rank {rank} raised {errors[0].read_text().splitlines()[0]}"
    elif failure.exists():
        line = json.loads(failure.read_text())["line"]
    else:
        line = f"the ranks' job exited with status {code} before the stage ended"
    failed = left[0]().failed(
        f"{line} (the job of {world} ranks ended; each failed rank's error and traceback: {jobdir}/*.error, the "
        f"job's log: {jobdir.parent / 'ranks.log'})"
    )
    return [failed, *(cls().skipped(f"the ranks' job ended in stage {left[0].name!r}") for cls in left[1:])]


def _rank(ctx: CheckContext, stages: Sequence[type[Stage]], jobdir: Path) -> None:
    """One rank's check: every stage in turn, rank 0 writing each result for the check's process."""
    from model_support.core import progress
    from model_support.core.megatron.dist import init_parallel
    from model_support.validation.runner import RankStageError, run_checks

    rank = int(os.environ["RANK"])
    path = jobdir / RESULTS

    def hand_over(result: StageResult) -> None:
        if rank == 0:
            with path.open("a") as out:
                out.write(json.dumps(result.to_dict()) + "\n")

    with progress.silenced():
        try:
            # The groups first, with a bounded wait: a rank that dies leaves no peer waiting for ever.
            init_parallel(ctx.parallel, timeout=COLLECTIVE_TIMEOUT)
            run_checks(ctx, stages, on_result=hand_over)
        except RankStageError as exc:
            ranks.fail(jobdir / f"{exc.stage}.rank{rank}.error", exc.__cause__ or exc)
        except BaseException as exc:  # outside any stage (the process group's start): named as the first stage's
            ranks.fail(jobdir / f"{stages[0].name}.rank{rank}.error", exc)
    # A finished rank leaves without interpreter shutdown: its CUDA and process-group teardown can wait on peers.
    os._exit(0)


def main(jobdir: Path) -> None:
    """The job ``run_sharded`` starts: the run's context built again from ``jobdir/job.json``, then one forked rank
    per process of the layout; exit status 1 when a rank failed."""
    import contextlib

    from model_support.core.discovery import load_config, locate
    from model_support.core.registry import load_registry
    from model_support.validation.selftest import injected
    from model_support.validation.stage_registry import load_stages

    job = json.loads((jobdir / "job.json").read_text())
    registry = load_registry(prefer=job["prefer"])
    by_name = {cls.name: cls for cls in load_stages(registry).classes()}
    handler = registry.get(job["handler"])
    config = load_config(locate(job["model_dir"]))
    ctx = CheckContext(
        target=job["target"],
        model_dir=Path(job["model_dir"]),
        handler=handler,
        config=config,
        layout=handler.spec.layout(config),
        registry=registry,
        workdir=Path(job["workdir"]),
        tiny=job["tiny"],
        seed=job["seed"],
        dtype=job["dtype"],
        stage_timeout_s=job["stage_timeout_s"],
        parallel=ParallelLayout.parse(job["parallel"]),
    )
    stages = [by_name[name] for name in job["stages"]]
    with injected(job["mutation"]) if job["mutation"] else contextlib.nullcontext():
        try:
            ranks.launch(ctx.parallel.model_parallel, _rank, (ctx, stages, jobdir), jobdir)
        except ranks.JobFailed as exc:
            print(f"parallel_check: the job ended: {exc.line}")
            sys.exit(1)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
