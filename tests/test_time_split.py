"""Where a stage's time goes (core/timing.py, the runner's ``time_split``) and background work a stage prepares."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from model_support.core import timing
from model_support.core.layout import ModelLayout
from model_support.core.registry import load_registry
from model_support.core.serving.process import ManagedProcess
from model_support.validation.context import CheckContext
from model_support.validation.runner import plan, run_checks
from model_support.validation.stage import Stage, StageResult
from model_support.validation.state import Resource


class FakeClock:
    """``time.perf_counter`` that moves only when told: phases are measured exactly."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", fake)
    return fake


@pytest.fixture
def ctx(tmp_path: Path) -> CheckContext:
    registry = load_registry(env={})
    layout = ModelLayout(num_layers=2, layer_types=("full_attention",) * 2, moe=None, mtp_layers=0)
    return CheckContext("tiny", tmp_path, registry.get("qwen3"), None, layout, registry, tmp_path)


def test_phases_nest_exclusively(clock: FakeClock) -> None:
    """A phase inside another pauses it: each second is counted once, the rest is the comparison."""
    with timing.measuring() as measured:
        clock.advance(1)
        with timing.phase("oracle"):
            clock.advance(2)
            with timing.phase("build"):  # the oracle's own model build
                clock.advance(4)
            clock.advance(8)
        with timing.phase("oracle"):
            clock.advance(16)
    assert measured.split(total_s=40.0) == {"build": 4.0, "oracle": 26.0, "comparison": 10.0}


def test_compiling_counts_as_compile_except_inside_autotuning(clock: FakeClock) -> None:
    """A kernel compiled for new shapes is its own phase; one compiled as an autotuning candidate is the tuning's."""
    with timing.measuring() as measured:
        with timing.compiling():
            clock.advance(1)
        with timing.phase("autotune"):
            clock.advance(2)
            with timing.compiling():
                clock.advance(4)
        with timing.phase("oracle"), timing.compiling():
            clock.advance(8)
    assert measured.split(total_s=20.0) == {"oracle": 0.0, "autotune": 6.0, "compile": 9.0, "comparison": 5.0}


def test_a_phase_outside_a_measurement_records_nothing(clock: FakeClock) -> None:
    with timing.phase("build"):
        clock.advance(3)
    with timing.measuring() as measured:
        pass
    assert measured.split(total_s=0.0) == {"comparison": 0.0}


class Builds(Stage):
    name = "builds"
    title = "Spends 2 s building and 1 s comparing."
    order = 1
    clock: FakeClock

    def run(self, ctx: CheckContext) -> StageResult:
        with timing.phase("build"):
            self.clock.advance(2)
        self.clock.advance(1)
        return self.passed("built")


def test_the_report_splits_each_stage_time(ctx: CheckContext, clock: FakeClock, monkeypatch) -> None:
    from model_support.validation import runner

    monkeypatch.setattr(runner.time, "perf_counter", clock)
    Builds.clock = clock
    (result,) = run_checks(ctx, plan([Builds])).results
    assert result.duration_s == 3.0
    assert result.to_dict()["time_split_s"] == {"build": 2.0, "comparison": 1.0}


class Fails(Stage):
    name = "fails"
    title = "Fails."
    order = 1

    def run(self, ctx: CheckContext) -> StageResult:
        return self.failed("no")


JOB: Resource[ManagedProcess] = Resource("job", "a long background job", stop=lambda job: job.stop())
STARTED: list[ManagedProcess] = []


class Prepares(Stage):
    """Starts a long background job in ``prepare``, as parallel_parity starts its job and the serving stages their
    server."""

    name = "prepares"
    title = "Needs fails."
    order = 2
    requires = ("fails",)
    provides = (JOB,)

    def prepare(self, ctx: CheckContext) -> None:
        if ctx.state.find(JOB) is None:  # prepare is called again before each stage
            command = [sys.executable, "-c", "import time; time.sleep(600)"]
            job = ManagedProcess(Path(sys.executable), command, env={}, log_path=ctx.workdir / "j.log").start()
            ctx.state.set(JOB, job)
            STARTED.append(job)

    def run(self, ctx: CheckContext) -> StageResult:
        raise AssertionError("must not run: its prerequisite failed")


def test_background_work_of_a_stage_that_never_runs_is_stopped(ctx: CheckContext) -> None:
    report = run_checks(ctx, plan([Fails, Prepares]))
    assert [r.status.value for r in report.results] == ["fail", "skip"]
    (job,) = STARTED
    assert job.returncode() is not None  # started before the first stage, stopped with the run
