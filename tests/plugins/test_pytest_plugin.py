"""The pytest11 plugin, as a handler author's CI runs it: pytest in a subprocess on real test files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from model_support.core.registry import load_registry
from model_support.handlers.configs import CONFIGS
from model_support.validation.runner import plan
from model_support.validation.stage_registry import load_stages

EXTRA_STAGE = Path(__file__).parent / "fixtures" / "ms-extra-stage"

AUTHOR_TESTS = """
import json
from pathlib import Path

import pytest

MOE_CONFIG = Path(__file__).with_name("moe.qwen3") / "config.json"


def test_check_passes(model_support_check):
    report = model_support_check("qwen3", tiny=True, stages=["chat_turn"])
    assert [r.stage for r in report.results] == ["dependencies", "architecture", "chat_turn"]
    # each result names who registered its stage
    assert report.results[0].origin == "model-support (plugin 'builtin')"
    assert report.results[-1].origin.startswith("model-support-extra-stage (plugin ")


def test_check_fails_with_the_stage_report(model_support_check):
    model_support_check(MOE_CONFIG, tiny=True)


def test_check_of_an_unknown_target_fails_with_the_error(model_support_check):
    model_support_check("no-such-family", tiny=True)


@pytest.mark.model_support("qwen3", MOE_CONFIG, tiny=True)
def test_stage(model_support_stage):
    model_support_stage.check()
"""


def run_pytest(directory: Path, *args: str, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", str(directory), *args],
        cwd=directory,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def junit_cases(path: Path) -> dict[str, ET.Element]:
    return {case.get("name"): case for case in ET.parse(path).getroot().iter("testcase")}


@pytest.fixture(scope="module")
def site(install_copy) -> Path:
    """A third-party plugin that adds the stage `chat_turn` (requires architecture), pip-installed."""
    return install_copy(EXTRA_STAGE)[1]


@pytest.fixture(scope="module")
def author_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A handler author's test directory: the tests above plus a Qwen3 config that wrongly says MoE."""
    project = tmp_path_factory.mktemp("author")
    (project / "test_author.py").write_text(AUTHOR_TESTS)
    config = json.loads((CONFIGS / "qwen3-0.6b.json").read_text())
    config.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)
    (project / "moe.qwen3").mkdir()
    (project / "moe.qwen3" / "config.json").write_text(json.dumps(config))
    return project


def test_one_test_per_registered_stage_per_target_including_third_party_stages(
    author_project: Path, site: Path, monkeypatch: pytest.MonkeyPatch
):
    result = run_pytest(author_project, "--collect-only", "-k", "test_stage", site=site)
    assert result.returncode == 0, result.stdout + result.stderr
    collected = [line.split("::")[1] for line in result.stdout.splitlines() if "::test_stage[" in line]
    # The stages come from the registry that the installed plugins build, not from a list in the pytest plugin.
    builtin = {s.stage.name for s in load_stages(load_registry()).stages}
    monkeypatch.syspath_prepend(str(site))
    stages = [s.name for s in plan(load_stages(load_registry()).classes())]
    assert set(stages) == builtin | {"chat_turn"}
    assert collected == [f"test_stage[{label}-{stage}]" for label in ("qwen3", "moe.qwen3") for stage in stages]


def test_stage_outcomes_and_failure_reports(author_project: Path, site: Path, tmp_path: Path):
    junit = tmp_path / "junit.xml"
    reports = tmp_path / "reports"
    result = run_pytest(
        author_project,
        "--model-support-stage",
        "chat_turn",
        "--model-support-reports",
        str(reports),
        f"--junitxml={junit}",
        site=site,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    cases = junit_cases(junit)
    outcome = {
        name: (
            "failure" if case.find("failure") is not None else "skipped" if case.find("skipped") is not None else "pass"
        )
        for name, case in cases.items()
    }
    assert outcome == {
        "test_check_passes": "pass",
        "test_check_fails_with_the_stage_report": "failure",
        "test_check_of_an_unknown_target_fails_with_the_error": "failure",
        "test_stage[qwen3-dependencies]": "pass",
        "test_stage[qwen3-architecture]": "pass",
        "test_stage[qwen3-chat_turn]": "pass",
        "test_stage[moe.qwen3-dependencies]": "pass",
        "test_stage[moe.qwen3-architecture]": "failure",
        "test_stage[moe.qwen3-chat_turn]": "skipped",
    }
    report = cases["test_check_fails_with_the_stage_report"].find("failure").text
    assert "model-support stage(s) failed: architecture" in report
    assert "handler declares dense but the config has 4 experts" in report
    assert "experts=4" in report and "chat_turn" in report
    assert "requires stage 'architecture', which failed" in report
    stage_failure = cases["test_stage[moe.qwen3-architecture]"].find("failure").text
    assert stage_failure.startswith("stage architecture failed: handler declares dense but the config has 4 experts")
    skipped = cases["test_stage[moe.qwen3-chat_turn]"].find("skipped").get("message")
    assert "chat_turn: requires stage 'architecture', which failed" in skipped
    unknown = cases["test_check_of_an_unknown_target_fails_with_the_error"].find("failure").text
    assert unknown.startswith("model-support cannot check 'no-such-family': ")
    assert unknown.endswith("is neither a directory, a config.json, nor a hub id (org/name)")
    # One run per target, shared by every test that asks for it (the unknown target has no report).
    assert sorted(p.name for p in reports.iterdir()) == [
        "moe.qwen3-1.json",
        "moe.qwen3-1.md",
        "qwen3-0.json",
        "qwen3-0.md",
    ]
    qwen3 = json.loads((reports / "qwen3-0.json").read_text())
    assert [r["status"] for r in qwen3["results"]] == ["pass", "pass", "pass"]
    assert qwen3["results"][2]["metrics"]["tokens"] > 0


def test_targets_come_from_the_marker_or_the_ini_option(tmp_path: Path, site: Path):
    (tmp_path / "test_no_target.py").write_text("def test_stage(model_support_stage):\n    pass\n")
    result = run_pytest(tmp_path, site=site)
    assert result.returncode == 2
    assert "test_no_target.py::test_stage uses model_support_stage but names no target: mark it with" in result.stdout
    assert "Traceback" not in result.stdout
    # The ini option names the targets instead of a marker.
    (tmp_path / "pytest.ini").write_text("[pytest]\nmodel_support_targets =\n    qwen3\n    qwen3-moe\n")
    collected = run_pytest(tmp_path, "--collect-only", "--model-support-stage", "architecture", site=site)
    assert collected.returncode == 0, collected.stdout + collected.stderr
    ids = [line.split("::")[1] for line in collected.stdout.splitlines() if "::test_stage[" in line]
    assert ids == [f"test_stage[{t}-{s}]" for t in ("qwen3", "qwen3-moe") for s in ("dependencies", "architecture")]
    alone = run_pytest(
        tmp_path, "--collect-only", "--model-support-stage", "architecture", "--model-support-alone", site=site
    )
    ids = [line.split("::")[1] for line in alone.stdout.splitlines() if "::test_stage[" in line]
    assert ids == ["test_stage[qwen3-architecture]", "test_stage[qwen3-moe-architecture]"], alone.stdout
