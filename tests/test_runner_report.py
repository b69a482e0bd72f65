"""The staged runner and its reports, with small real stages."""

from __future__ import annotations

import io
import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from rich.console import Console

from model_support.core.layout import ModelLayout
from model_support.core.precision import TRITON_FP32_DEFAULT
from model_support.core.registry import load_registry
from model_support.validation.context import CheckContext
from model_support.validation.report import render_terminal, to_json, to_junit, to_markdown
from model_support.validation.runner import Report, UnknownStageError, plan, run_checks
from model_support.validation.stage import Requirement, Stage, StageResult, Status


class Measure(Stage):
    name = "measure"
    title = "An error below its threshold passes."
    order = 1
    error: ClassVar[float] = 1e-6

    def run(self, ctx: CheckContext) -> StageResult:
        return self.judge({"max_abs_err": self.error}, {"max_abs_err": 1e-5}, "within tolerance")


class TooFar(Measure):
    name = "too_far"
    order = 2
    error = 0.25


class AfterFailure(Stage):
    name = "after_failure"
    title = "Needs too_far."
    order = 3
    requires = ("too_far",)

    def run(self, ctx: CheckContext) -> StageResult:
        raise AssertionError("must not run")


class Crashes(Stage):
    name = "crashes"
    title = "Raises."
    order = 4

    def run(self, ctx: CheckContext) -> StageResult:
        return {}["missing"]


class NeedsAbsentPackage(Stage):
    name = "needs_absent"
    title = "Needs a package that is not installed."
    order = 5
    packages = (Requirement("surely_not_installed_pkg", "surely-not-installed", extra="megatron"),)

    def run(self, ctx: CheckContext) -> StageResult:
        raise AssertionError("must not run")


class NotApplicable(Stage):
    name = "not_applicable"
    title = "Only for GDN models."
    order = 6

    def skip_reason(self, ctx: CheckContext) -> str | None:
        return None if ctx.layout.gdn_layers else "the model has no GDN layers"

    def run(self, ctx: CheckContext) -> StageResult:
        return self.passed("ran")


ALL = [NotApplicable, Crashes, AfterFailure, TooFar, Measure, NeedsAbsentPackage]

MIB = 1024 * 1024


class Idle(Stage):
    name = "idle"
    title = "Allocates nothing."
    order = 1

    def run(self, ctx: CheckContext) -> StageResult:
        return self.passed("nothing allocated")


class HostHeavy(Stage):
    name = "host_heavy"
    title = "Holds 256 MiB of host memory while it runs."
    order = 2

    def run(self, ctx: CheckContext) -> StageResult:
        block = np.ones(256 * MIB // 8)  # every page written, so all of it is resident
        return self.passed(f"held {block.nbytes // MIB} MiB")


class IdleAgain(Idle):
    name = "idle_again"
    order = 3


class GpuHeavy(Stage):
    name = "gpu_heavy"
    title = "Holds 256 MiB on the GPU while it runs."
    order = 2

    def run(self, ctx: CheckContext) -> StageResult:
        block = torch.ones(256 * MIB // 4, device="cuda")
        return self.passed(f"held {block.nbytes // MIB} MiB")


def terminal_text(report: Report) -> str:
    console = Console(file=io.StringIO(), width=200, record=True)
    render_terminal(report, console)
    return console.export_text()


@pytest.fixture
def ctx(tmp_path: Path) -> CheckContext:
    registry = load_registry(env={})
    layout = ModelLayout(num_layers=2, layer_types=("full_attention",) * 2, moe=None, mtp_layers=0)
    return CheckContext("tiny", tmp_path, registry.get("qwen3"), None, layout, registry, tmp_path)


def test_plan_orders_stages_and_pulls_in_prerequisites():
    assert [s.name for s in plan(ALL)] == [
        "measure", "too_far", "after_failure", "crashes", "needs_absent", "not_applicable",
    ]  # fmt: skip
    assert [s.name for s in plan(ALL, ["after_failure"])] == ["too_far", "after_failure"]
    with pytest.raises(UnknownStageError, match=r"unknown stage\(s\) nope; available: after_failure, crashes"):
        plan(ALL, ["nope"])


def test_results_pass_fail_and_skip_with_reasons(ctx):
    seen: list[str] = []
    report = run_checks(ctx, plan(ALL), on_result=lambda r: seen.append(r.stage))
    by = {r.stage: r for r in report.results}
    assert seen == [r.stage for r in report.results]
    assert by["measure"].status is Status.PASS
    assert by["too_far"].status is Status.FAIL
    assert by["too_far"].summary == "max_abs_err=0.25 > 1e-05"
    assert by["after_failure"].status is Status.SKIP
    assert by["after_failure"].summary == "requires stage 'too_far', which failed"
    assert by["crashes"].status is Status.FAIL
    assert by["crashes"].summary == "raised KeyError: 'missing'"
    assert any("KeyError" in line for line in by["crashes"].details)
    assert by["needs_absent"].summary == (
        "surely-not-installed is not installed (pip install 'model-support[megatron]')"
    )
    assert by["not_applicable"].summary == "the model has no GDN layers"
    assert report.counts() == {"pass": 1, "fail": 2, "skip": 3}
    assert report.exit_code == 1
    assert all(r.peak_host_mib > 0 for r in report.results)  # skipped and failed stages are measured too
    assert run_checks(ctx, plan(ALL, ["measure"])).exit_code == 0


def test_reports_carry_every_result(ctx):
    report = run_checks(ctx, plan(ALL))
    data = json.loads(to_json(report))
    assert data["handler"] == "qwen3"
    assert data["counts"] == {"pass": 1, "fail": 2, "skip": 3}
    assert data["results"][1]["metrics"] == {"max_abs_err": 0.25}
    assert data["results"][1]["thresholds"] == {"max_abs_err": 1e-5}
    assert "torch" in data["environment"]

    markdown = to_markdown(report)
    assert "| too_far | FAIL |" in markdown
    assert "max_abs_err=0.25 (<= 1e-05)" in markdown
    assert markdown.rstrip().endswith("1 passed, 2 failed, 3 skipped")

    suite = ET.fromstring(to_junit(report)).find("testsuite")
    assert suite.get("tests") == "6" and suite.get("failures") == "2" and suite.get("skipped") == "3"
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert cases["too_far"].find("failure").get("message") == "max_abs_err=0.25 > 1e-05"
    assert cases["after_failure"].find("skipped").get("message") == "requires stage 'too_far', which failed"
    assert cases["measure"].find("failure") is None


@pytest.mark.skipif(sys.platform != "linux", reason="per-stage host peaks need /proc/self/clear_refs")
def test_each_stage_reports_its_own_host_peak(ctx):
    idle, heavy, again = run_checks(ctx, plan([Idle, HostHeavy, IdleAgain])).results
    assert [r.peak_host_lifetime for r in (idle, heavy, again)] == [False, False, False]
    assert heavy.peak_host_mib >= idle.peak_host_mib + 200
    # The high-water mark is reset per stage: the stage after the heavy one does not inherit its peak.
    assert again.peak_host_mib < heavy.peak_host_mib - 200


def test_reports_carry_peak_memory(ctx):
    report = run_checks(ctx, plan([Idle, HostHeavy, IdleAgain]))
    heavy = report.results[1]

    result = json.loads(to_json(report))["results"][1]
    assert result["stage"] == "host_heavy"
    assert result["peak_host_mib"] == round(heavy.peak_host_mib, 1) > 256
    assert result["peak_host_lifetime"] is heavy.peak_host_lifetime

    row = next(line for line in to_markdown(report).splitlines() if line.startswith("| host_heavy |"))
    assert f"| {heavy.peak_host_mib:.0f} MiB" in row
    assert f"{heavy.peak_host_mib:.0f} MiB" in terminal_text(report)

    suite = ET.fromstring(to_junit(report)).find("testsuite")
    case = next(c for c in suite.findall("testcase") if c.get("name") == "host_heavy")
    properties = {p.get("name"): p.get("value") for p in case.find("properties").findall("property")}
    assert float(properties["peak_host_mib"]) == round(heavy.peak_host_mib, 1)
    assert properties["peak_host_lifetime"] == json.dumps(heavy.peak_host_lifetime)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_without_cuda_there_is_no_gpu_column(ctx):
    report = run_checks(ctx, plan([Idle, HostHeavy]))
    assert [r.peak_gpu_mib for r in report.results] == [None, None]
    assert [r.peak_gpu_reserved_mib for r in report.results] == [None, None]
    assert json.loads(to_json(report))["results"][0]["peak_gpu_mib"] is None
    text = terminal_text(report)
    assert "host peak" in text and "gpu peak" not in text
    assert "| host peak |" in to_markdown(report) and "gpu peak" not in to_markdown(report)
    assert "peak_gpu_mib" not in to_junit(report)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_each_stage_reports_its_own_gpu_peak(ctx):
    report = run_checks(ctx, plan([Idle, GpuHeavy, IdleAgain]))
    _, heavy, again = report.results
    assert heavy.peak_gpu_mib >= 256 and heavy.peak_gpu_reserved_mib >= 256
    assert again.peak_gpu_mib < heavy.peak_gpu_mib - 200  # reset after gpu_heavy, whose tensor is freed
    assert f"{heavy.peak_gpu_mib:.0f} MiB" in terminal_text(report)
    assert "gpu peak" in to_markdown(report)
    assert "peak_gpu_mib" in to_junit(report)


def test_a_process_lifetime_host_peak_is_marked(ctx):
    report = run_checks(ctx, plan([Idle, HostHeavy]))
    report.results[0].peak_host_lifetime = True  # what MemoryProbe records where the reset is refused
    idle = report.results[0]
    assert f"{idle.peak_host_mib:.0f} MiB*" in terminal_text(report)
    assert "host peak of the whole process so far" in terminal_text(report)
    markdown = to_markdown(report)
    assert f"| {idle.peak_host_mib:.0f} MiB* |" in markdown
    assert "\\* host peak of the whole process so far" in markdown
    assert json.loads(to_json(report))["results"][0]["peak_host_lifetime"] is True


class QuotesPackages(Stage):
    name = "quotes_packages"
    title = "Skips with an install hint in square brackets."
    order = 1

    def run(self, ctx: CheckContext) -> StageResult:
        return self.skipped("megatron-core is not installed (pip install 'model-support[megatron]')")


def test_terminal_report_prints_summaries_as_written(ctx: CheckContext) -> None:
    """A summary is text, not rich markup: an extra in square brackets is shown, not swallowed."""
    report = run_checks(ctx, [QuotesPackages])
    assert "pip install 'model-support[megatron]'" in terminal_text(report)


class _Thresholded(Stage):
    name = "thresholded"
    title = "a metric within its limit"
    order = 1

    def run(self, ctx: CheckContext) -> StageResult:
        return self.judge({"err": 0.3, "other": 0.0}, {"err": 0.1, "other": 0.0}, "err within its limit", ctx=ctx)


def test_a_handler_tolerance_replaces_the_stage_limit_and_says_so(ctx: CheckContext) -> None:
    import dataclasses

    from model_support.core.spec import RuntimePolicy

    assert _Thresholded().run(ctx).summary == "err=0.3 > 0.1"
    policy = RuntimePolicy(
        tolerances={"thresholded.err": 0.5, "other_stage.err": 0.0}, tolerance_reason="the kernel rounds in bf16"
    )
    spec = dataclasses.replace(ctx.handler.spec, runtime=policy)
    loosened = dataclasses.replace(ctx, handler=dataclasses.replace(ctx.handler, spec=spec))
    result = _Thresholded().run(loosened)
    assert (result.status, result.thresholds) == (Status.PASS, {"err": 0.5, "other": 0.0})
    assert result.summary == "err within its limit (handler tolerance: err <= 0.5)"
    assert result.details == ["handler tolerance err <= 0.5 (stage default 0.1): the kernel rounds in bf16"]


def test_a_handler_tolerance_needs_a_reason_and_a_stage_metric_key() -> None:
    import dataclasses

    from model_support.core.spec import RuntimePolicy, SpecError
    from model_support.handlers.qwen3 import QWEN3

    with pytest.raises(SpecError, match="tolerances need a tolerance_reason"):
        dataclasses.replace(QWEN3, runtime=RuntimePolicy(tolerances={"merged_serving.err": 1.0}))
    with pytest.raises(SpecError, match=r"tolerances are keyed 'stage\.metric'"):
        dataclasses.replace(QWEN3, runtime=RuntimePolicy(tolerances={"err": 1.0}, tolerance_reason="why"))


class SeesPrecision(Stage):
    name = "sees_precision"
    title = "Reports the float32 dot precision Triton would compile with."
    order = 1

    def run(self, ctx: CheckContext) -> StageResult:
        default = os.environ.get(TRITON_FP32_DEFAULT, "tf32")
        return StageResult(self.name, Status.PASS, default, metrics={"triton_fp32": default})


@pytest.mark.parametrize(("dtype", "expected"), [("fp32", "ieee"), ("bf16", "tf32"), (None, "tf32")])
def test_an_fp32_check_runs_its_stages_without_tf32(ctx, monkeypatch, dtype, expected):
    monkeypatch.delenv(TRITON_FP32_DEFAULT, raising=False)
    ctx.dtype = dtype
    report = run_checks(ctx, [SeesPrecision])
    assert report.results[0].metrics["triton_fp32"] == expected
    assert TRITON_FP32_DEFAULT not in os.environ


class Exits(Stage):
    name = "exits"
    title = "Calls sys.exit(0) in its run."
    order = 5

    def run(self, ctx: CheckContext) -> StageResult:
        raise SystemExit(0)


def test_a_stage_that_exits_the_process_fails_and_the_check_goes_on(ctx):
    report = run_checks(ctx, plan([Exits, Idle]))
    results = {r.stage: r for r in report.results}
    exits, idle = results["exits"], results["idle"]
    assert exits.status is Status.FAIL and report.exit_code == 1
    assert exits.summary == f"called sys.exit(0) ({__name__}); a stage reports through its result"
    assert idle.status is Status.PASS  # the stages after it still ran


class Sleeps(Stage):
    name = "sleeps"
    title = "Never ends by itself."
    order = 6
    time_limit_s = 0.5

    def run(self, ctx: CheckContext) -> StageResult:
        while True:  # bounded by the stage's time limit, which is what is tested
            time.sleep(0.05)


def test_a_stage_past_its_time_limit_fails_and_the_check_goes_on(ctx):
    report = run_checks(ctx, plan([Sleeps, Idle]))
    results = {r.stage: r for r in report.results}
    assert results["sleeps"].status is Status.FAIL
    assert results["sleeps"].summary.startswith("ran past its time limit of 0.5 s (the stage's time_limit_s;")
    assert results["idle"].status is Status.PASS
    import signal

    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # no timer left behind


def test_a_callers_own_alarm_is_left_alone(ctx):
    """Where the caller runs an alarm of its own (pytest-timeout's signal method), the stage gets no limit of ours
    and the caller's timer and handler are as they were."""
    import signal

    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: fired.append(signum))
    signal.setitimer(signal.ITIMER_REAL, 60.0)
    try:
        report = run_checks(ctx, plan([Idle]))
        assert report.results[0].status is Status.PASS
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < remaining <= 60.0 and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
