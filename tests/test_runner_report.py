"""The staged runner and its reports, with small real stages."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import ClassVar

import pytest

from model_support.core.layout import ModelLayout
from model_support.core.registry import load_registry
from model_support.validation.context import CheckContext
from model_support.validation.report import to_json, to_junit, to_markdown
from model_support.validation.runner import UnknownStageError, plan, run_checks
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
