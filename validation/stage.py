"""A validation stage: one small class with one job, and the result it reports."""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar

from model_support.validation.state import Resource

if TYPE_CHECKING:
    from model_support.validation.context import CheckContext


class Status(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


@dataclass
class StageResult:
    """What a stage found. ``metrics`` are measured numbers, ``thresholds`` the limits they were held to.

    The runner adds this process's peak memory while the stage ran, in MiB (``None``: not measured; see
    ``validation/memory.py``): ``peak_gpu_mib`` / ``peak_gpu_reserved_mib`` allocated / reserved by
    torch's CUDA allocator, ``peak_host_mib`` the resident set, which is the process's peak so far
    rather than the stage's where ``peak_host_lifetime`` is set. Child processes are not counted. ``time_split``
    says where ``duration_s`` went (``core/timing.py``): seconds building the model, in the oracle, autotuning
    kernels, waiting for a server to start, and the rest (``comparison``). ``built`` names the run-state resources
    the stage built or provided (``validation/state.py``): where (its ``prepare`` or ``run``) and the seconds each
    took; a resource another stage built first is not rebuilt, and is not listed here.
    """

    stage: str
    status: Status
    summary: str
    metrics: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, float] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    time_split: dict[str, float] = field(default_factory=dict)
    peak_gpu_mib: float | None = None
    peak_gpu_reserved_mib: float | None = None
    peak_host_mib: float | None = None
    peak_host_lifetime: bool = False
    built: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The distribution (and plugin) that registered the stage: "model-support (plugin 'builtin')" for the project's.
    origin: str = ""

    def to_dict(self) -> dict[str, Any]:
        peaks = {
            "peak_gpu_mib": self.peak_gpu_mib,
            "peak_gpu_reserved_mib": self.peak_gpu_reserved_mib,
            "peak_host_mib": self.peak_host_mib,
        }
        return {
            "stage": self.stage,
            "status": str(self.status),
            "summary": self.summary,
            "metrics": self.metrics,
            "thresholds": self.thresholds,
            "details": self.details,
            "duration_s": round(self.duration_s, 3),
            "time_split_s": self.time_split,
            **{key: None if mib is None else round(mib, 1) for key, mib in peaks.items()},
            "peak_host_lifetime": self.peak_host_lifetime,
            "built": self.built,
            "origin": self.origin,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageResult:
        """The result :meth:`to_dict` wrote (a rank of ``check --parallel`` hands its results over so)."""
        known = {f.name for f in fields(cls)}
        data = {**data, "status": Status(data["status"]), "time_split": data["time_split_s"]}
        return cls(**{key: value for key, value in data.items() if key in known})


@dataclass(frozen=True)
class Requirement:
    """A Python package a stage imports: the import name, the distribution, and the extra that installs it."""

    module: str
    distribution: str
    extra: str | None = None

    def missing_reason(self) -> str | None:
        if importlib.util.find_spec(self.module) is not None:
            return None
        how = f"pip install 'model-support[{self.extra}]'" if self.extra else f"pip install {self.distribution}"
        return f"{self.distribution} is not installed ({how})"


class Stage(ABC):
    """Base class of every validation stage.

    Subclasses set ``name`` (CLI name), ``title`` (what passing proves, one line), ``order``
    (position in the pipeline), ``requires`` (stages that must pass first: their verdicts, not their data),
    ``packages`` (imports it needs; a missing one skips the stage with an install hint), ``needs`` and ``provides``
    (the run-state resources it reads, built on first use, and those it writes: ``validation/state.py``; using
    one it does not declare is an error), ``time_limit_s`` (its ``run`` fails past it; ``check --stage-timeout``
    overrides every stage's), ``sharded`` (it runs in every rank of ``check --parallel``: each rank calls it alike,
    and it reads the sharded model only through what gathers across ranks), and implement ``run``.
    """

    name: ClassVar[str]
    title: ClassVar[str]
    order: ClassVar[int]
    requires: ClassVar[tuple[str, ...]] = ()
    packages: ClassVar[tuple[Requirement, ...]] = ()
    needs: ClassVar[tuple[Resource[Any], ...]] = ()
    provides: ClassVar[tuple[Resource[Any], ...]] = ()
    # Long enough for a real-width stage on a fresh GPU (the slowest measured: hf_parity, 376 s with autotuning).
    time_limit_s: ClassVar[float] = 3600.0
    sharded: ClassVar[bool] = False

    def skip_reason(self, ctx: CheckContext) -> str | None:
        """Why this stage does not apply to the model at hand (``None``: it applies)."""
        return None

    def prepare(self, ctx: CheckContext) -> None:
        """Start, in the background, slow work ``run`` will wait for (a server's start), so that it overlaps the
        stages before this one. Called for every planned stage that applies before each stage runs, until this one
        runs (what an earlier stage built may let it start more), so it starts each thing at most once; whatever
        fails here fails again, and is reported, where ``run`` waits for it."""
        return None

    @abstractmethod
    def run(self, ctx: CheckContext) -> StageResult: ...

    # Small constructors so stages read as what they conclude.
    def passed(self, summary: str, **kw: Any) -> StageResult:
        return StageResult(self.name, Status.PASS, summary, **kw)

    def failed(self, summary: str, **kw: Any) -> StageResult:
        return StageResult(self.name, Status.FAIL, summary, **kw)

    def skipped(self, summary: str, **kw: Any) -> StageResult:
        return StageResult(self.name, Status.SKIP, summary, **kw)

    def blind(self, metric: str, value: float, floor: float, why: str, **kw: Any) -> StageResult | None:
        """A failure when the control ``metric`` is below ``floor`` (NaN included): the comparison could not see the
        bug it is there for, so its pass would prove nothing (``why`` says which). None when the control holds."""
        if value >= floor:
            return None
        return self.failed(f"{metric}={value:.3g} < {floor}: {why}", **kw)

    def judge(
        self,
        metrics: dict[str, Any],
        thresholds: dict[str, float],
        ok_summary: str,
        details: list[str] | None = None,
        ctx: CheckContext | None = None,
    ) -> StageResult:
        """Pass when every metric named in ``thresholds`` is at most its threshold, else fail naming them.

        With ``ctx``, the handler's declared tolerances for this stage (``RuntimePolicy.tolerances``) replace the
        stage's, and a details line names each one, the stage's own limit and the handler's reason.
        """
        details = list(details or [])
        loosened: list[str] = []
        if ctx is not None:
            thresholds = dict(thresholds)
            policy = ctx.spec.runtime
            for key, limit in policy.tolerances.items():
                stage, _, metric = key.partition(".")
                if stage == self.name and metric in thresholds:
                    details.append(
                        f"handler tolerance {metric} <= {limit:g} (stage default {thresholds[metric]:g}): "
                        f"{policy.tolerance_reason}"
                    )
                    thresholds[metric] = limit
                    loosened.append(f"{metric} <= {limit:g}")
        if loosened:  # visible in the one-line summary too, not only in the details
            ok_summary += f" (handler tolerance: {', '.join(loosened)})"
        over = [k for k, limit in thresholds.items() if not float(metrics[k]) <= limit]
        if over:
            summary = "; ".join(f"{k}={float(metrics[k]):.3g} > {thresholds[k]:.3g}" for k in over)
            return self.failed(summary, metrics=metrics, thresholds=thresholds, details=details)
        return self.passed(ok_summary, metrics=metrics, thresholds=thresholds, details=details)
