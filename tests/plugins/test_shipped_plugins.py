"""Every plugin distribution under plugins/ passes its ``check --tiny``: in the first tier every stage of one process
without a server; in the exhaustive tier the whole default check, where every stage and every default layout passes,
or skips because the vLLM on this machine cannot serve the family (vLLM's own reason)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import within_thresholds
from tests.plugins.conftest import ONE_PROCESS_STAGES, SHIPPED

pytestmark = pytest.mark.slow

# Skips that name what vLLM (the CPU build here, or vLLM at all) cannot do; any other skip fails.
VLLM_SKIPS = ("the CPU vLLM build", "merged-only: vLLM ", "vLLM renders ")


def _default_stages() -> list[str]:
    from model_support.core.registry import load_registry
    from model_support.validation.runner import plan
    from model_support.validation.stage_registry import load_stages

    return [s.name for s in plan(load_stages(load_registry()).classes(), None)]


def _vllm_skip(summary: str) -> bool:
    from model_support.validation.serving_session import backend

    return summary.startswith(VLLM_SKIPS) or summary == backend().unavailable_reason()


def test_every_family_of_the_project_ships_as_a_plugin_checked_here():
    assert {p.name for p in SHIPPED} >= {
        "model-support-llama", "model-support-gemma3", "model-support-olmoe", "model-support-deepseek-v3",
        "model-support-glm4-moe", "model-support-mixtral", "model-support-gpt-oss", "model-support-gemma2",
    }  # fmt: skip


IDS = [p.name.removeprefix("model-support-") for p in SHIPPED]


@pytest.mark.parametrize("plugin", SHIPPED, ids=IDS)
def test_every_stage_of_one_process_passes(plugin: Path, one_process_check):
    check = one_process_check(plugin)
    assert check.returncode == 0, check.output
    assert list(check.results) == list(ONE_PROCESS_STAGES)
    for stage, verdict in check.results.items():
        assert verdict["status"] == "pass" and within_thresholds(verdict), (stage, verdict)


@pytest.mark.exhaustive
@pytest.mark.parametrize("plugin", SHIPPED, ids=IDS)
def test_the_default_check_passes(plugin: Path, default_check):
    check = default_check(plugin)
    assert check.returncode == 0, check.output
    assert list(check.results) == _default_stages()
    for stage, verdict in check.results.items():
        if verdict["status"] == "skip":
            assert _vllm_skip(verdict["summary"]), (stage, verdict["summary"])
            continue
        assert verdict["status"] == "pass" and within_thresholds(verdict), (stage, verdict)
