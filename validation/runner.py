"""Runs stages in order: prerequisites first, dependents of a failure skipped with the reason."""

from __future__ import annotations

import math
import platform
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

from model_support.core import progress, timing
from model_support.core.errors import ModelSupportError
from model_support.core.precision import exact_fp32, settled_fla_kernels
from model_support.validation.context import CheckContext
from model_support.validation.memory import MemoryProbe
from model_support.validation.stage import Stage, StageResult, Status
from model_support.validation.state import UndeclaredResourceError

REPORTED_PACKAGES = ("model-support", "torch", "transformers", "megatron-core", "megatron-bridge", "peft")


class UnknownStageError(ModelSupportError):
    pass


@dataclass
class Report:
    target: str
    handler: str
    handler_origin: str
    model_dir: str
    tiny: bool
    layout: str
    results: list[StageResult] = field(default_factory=list)
    started: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    environment: dict[str, str] = field(default_factory=dict)
    # Known third-party warnings hidden from the terminal during the run (core/quiet.py): message pattern -> count.
    suppressed_warnings: dict[str, int] = field(default_factory=dict)

    @property
    def failed(self) -> list[StageResult]:
        return [r for r in self.results if r.status is Status.FAIL]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def counts(self) -> dict[str, int]:
        return {s.value: sum(r.status is s for r in self.results) for s in Status}

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "handler": self.handler,
            "handler_origin": self.handler_origin,
            "model_dir": self.model_dir,
            "tiny": self.tiny,
            "layout": self.layout,
            "started": self.started,
            "environment": self.environment,
            "counts": self.counts(),
            "results": [r.to_dict() for r in self.results],
            "suppressed_warnings": self.suppressed_warnings,
        }


def environment() -> dict[str, str]:
    env = {"python": platform.python_version(), "platform": platform.platform()}
    for dist in REPORTED_PACKAGES:
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return env


def plan(
    available: Sequence[type[Stage]], selected: Sequence[str] | None = None, alone: bool = False
) -> list[type[Stage]]:
    """The stages to run, in pipeline order: the selected ones plus everything they require (``alone``: the selected
    ones only; what they need is built on first use and their prerequisites' verdicts are not checked)."""
    by_name = {s.name: s for s in available}
    if not selected:
        wanted = set(by_name)
    else:
        unknown = [n for n in selected if n not in by_name]
        if unknown:
            raise UnknownStageError(f"unknown stage(s) {', '.join(unknown)}; available: {', '.join(sorted(by_name))}")
        if alone:
            return sorted((by_name[n] for n in set(selected)), key=lambda s: (s.order, s.name))
        wanted = set()
        todo = list(selected)
        while todo:
            name = todo.pop()
            if name in wanted:
                continue
            wanted.add(name)
            for req in by_name[name].requires:
                if req not in by_name:
                    raise UnknownStageError(f"stage {name!r} requires {req!r}, which no plugin provides")
                todo.append(req)
    return sorted((by_name[n] for n in wanted), key=lambda s: (s.order, s.name))


def _not_applicable(stage: Stage, ctx: CheckContext) -> str | None:
    """Why ``stage`` cannot run on this model here: a check with the model sharded runs only stages that can read it
    so, a package it imports is missing, or its own skip reason."""
    if ctx.parallel is not None and not type(stage).sharded:
        return (
            "check --parallel runs the stages that use the sharded Megatron model (and their prerequisites); "
            "check without --parallel runs this one"
        )
    for requirement in type(stage).packages:
        reason = requirement.missing_reason()
        if reason:
            return reason
    return stage.skip_reason(ctx)


class RankStageError(Exception):
    """A stage raised in a rank of ``check --parallel`` (the cause: its error); the rank's job ends."""

    def __init__(self, stage: str) -> None:
        super().__init__(f"stage {stage!r} raised")
        self.stage = stage


class StageTimeoutError(Exception):
    """A stage's run went past its time limit (raised in it by :func:`time_limit`)."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`StageTimeoutError` in the block once it has run ``seconds`` (a SIGALRM timer: the main thread
    only, where the CLI and pytest run stages; a long call into C ends first). None or 0: no limit; elsewhere than
    the main thread, or where the caller runs an alarm of its own (pytest-timeout's), none either: the process has
    one such timer, and the caller's is left alone."""
    theirs = signal.getitimer(signal.ITIMER_REAL)[0] > 0 or signal.getsignal(signal.SIGALRM) not in (
        signal.SIG_DFL,
        signal.SIG_IGN,
        None,
    )
    if not seconds or threading.current_thread() is not threading.main_thread() or theirs:
        yield
        return

    def expired(_signum: int, _frame: object) -> None:
        raise StageTimeoutError

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _run_one(
    stage: Stage, ctx: CheckContext, done: dict[str, StageResult], planned: set[str], misdeclared: dict[str, str]
) -> StageResult:
    if stage.name in misdeclared:  # its prepare used a resource it does not declare: a bug in the stage
        return stage.failed(misdeclared[stage.name])
    unchecked = [req for req in type(stage).requires if req not in planned]
    for req in type(stage).requires:
        prior = done.get(req)
        if req in unchecked:  # run alone (plan(alone=True)): said in the result's details
            continue
        if prior is None or prior.status is not Status.PASS:
            state = "did not run" if prior is None else f"{prior.status}ed".replace("skiped", "skipped")
            return stage.skipped(f"requires stage {req!r}, which {state}")
    reason = _not_applicable(stage, ctx)
    if reason:
        return stage.skipped(reason)
    limit = ctx.stage_timeout_s if ctx.stage_timeout_s is not None else type(stage).time_limit_s
    try:
        with ctx.state.acting(type(stage), "run"), time_limit(limit):
            result = stage.run(ctx)
        if unchecked:
            result.details.append(f"run alone: prerequisite stage(s) {', '.join(unchecked)} not run")
    except (Exception, SystemExit) as exc:
        if ctx.parallel is not None:  # its peers may wait in a collective this rank will not join: the job ends
            raise RankStageError(stage.name) from exc
        return _raised(stage, exc, limit)
    nonfinite = sorted(k for k, v in result.metrics.items() if isinstance(v, float) and not math.isfinite(v))
    if nonfinite and result.status is Status.PASS:
        return stage.failed(
            f"{', '.join(nonfinite)} not finite: a number the stage measured is NaN or infinite",
            metrics=result.metrics,
            thresholds=result.thresholds,
            details=result.details,
        )
    return result


def _raised(stage: Stage, exc: BaseException, limit: float) -> StageResult:
    """The failed result of a stage whose run raised ``exc``."""
    trace = traceback.format_exc().rstrip().splitlines()[-12:]
    if isinstance(exc, StageTimeoutError):
        return stage.failed(
            f"ran past its time limit of {limit:g} s (the stage's time_limit_s; check --stage-timeout sets another)",
            details=trace,
        )
    if isinstance(exc, ModelSupportError):  # our own errors already say what is wrong and what to do
        return stage.failed(str(exc))
    if isinstance(exc, SystemExit):  # a stage ending the process would end the check with no report, and exit 0
        return stage.failed(
            f"called sys.exit({exc.code!r}) ({type(stage).__module__}); a stage reports through its result",
            details=trace,
        )
    return stage.failed(f"raised {type(exc).__name__}: {exc}", details=trace)


def stage_origins(ctx: CheckContext) -> dict[str, str]:
    """Stage name -> the distribution and plugin that registered it (none for a registry built by hand)."""
    from model_support.validation.stage_registry import load_stages

    registered = load_stages(ctx.registry).stages if ctx.registry is not None else []
    return {s.stage.name: f"{s.plugin.distribution} (plugin {s.plugin.name!r})" for s in registered}


def new_report(ctx: CheckContext) -> Report:
    """The report of a run on ``ctx``, with no result yet."""
    layout = ctx.layout.describe()
    if ctx.parallel is not None:
        layout += f"; sharded {ctx.parallel.name} over {ctx.parallel.model_parallel} ranks"
    return Report(
        target=ctx.target,
        handler=ctx.spec.name,
        handler_origin=ctx.handler.origin,
        model_dir=str(ctx.model_dir),
        tiny=ctx.tiny,
        layout=layout,
        environment=environment(),
    )


def run_checks(
    ctx: CheckContext,
    stages: Sequence[type[Stage]],
    on_result: Callable[[StageResult], None] | None = None,
) -> Report:
    """Run ``stages`` (already planned) against ``ctx`` and collect a report.

    Every stage, also one that skips or fails, is timed and its peak memory measured (``MemoryProbe``). Each stage
    is a progress step while it runs (``core/progress.py``: shown by the ``check`` command); ``on_result`` gets its
    result when it ends.
    """
    report = new_report(ctx)
    done: dict[str, StageResult] = {}
    planned = {stage.name for stage in stages}
    misdeclared: dict[str, str] = {}  # stage -> the declaration error its prepare raised
    origins = stage_origins(ctx)
    try:
        # An fp32 check is held to fixed fp32 tolerances: no TF32 on the GPU (bf16 keeps the trainer's math). A
        # verdict does not depend on which tile setting a kernel runs: on a GPU, fla's kernels take the shipped
        # settings for shapes they hold none for instead of autotuning each (minutes on a fresh GPU).
        with exact_fp32(ctx.dtype == "fp32"), settled_fla_kernels(ctx.workdir / "fla-configs"):
            for index, stage_cls in enumerate(stages):
                # Before each stage, the stages still to run may start background work (again: what an earlier
                # stage built, such as a trained adapter, may let them start more).
                _prepare(ctx, stages[index:], misdeclared)
                # Indented like the check's line per finished stage, which also says how it ended.
                with progress.step(stage_cls.name, indent=2, end_line=False), MemoryProbe() as memory:
                    with timing.measuring() as clock:
                        start = time.perf_counter()
                        result = _run_one(stage_cls(), ctx, done, planned, misdeclared)
                        result.duration_s = time.perf_counter() - start
                    result.time_split = clock.split(result.duration_s)
                memory.record(result)
                result.built = {name: origin.to_dict() for name, origin in ctx.state.built_by(stage_cls.name).items()}
                result.origin = origins.get(stage_cls.name, f"module {stage_cls.__module__}")
                done[stage_cls.name] = result
                report.results.append(result)
                if on_result is not None:
                    on_result(result)
    finally:
        # The run owns its servers and background jobs (also those of a stage that never ran, since a prerequisite
        # failed): an in-process run must not leave them behind.
        ctx.state.close()
    return report


def _prepare(ctx: CheckContext, stages: Sequence[type[Stage]], misdeclared: dict[str, str]) -> None:
    """Let each of ``stages`` that applies start its slow background work (``Stage.prepare``). A use of a resource
    the stage does not declare is kept in ``misdeclared``, and fails the stage where it runs."""
    for stage_cls in stages:
        stage = stage_cls()
        if not _not_applicable(stage, ctx):
            try:
                with ctx.state.acting(stage_cls, "prepare"):
                    stage.prepare(ctx)
            except UndeclaredResourceError as exc:
                misdeclared.setdefault(stage_cls.name, str(exc))
            except ModelSupportError:  # raised again, and reported, where the stage's run waits for that work
                continue
