"""The example third-party plugin (plugins/model-support-llama), installed the way a user installs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli, run_plugin_tests, within_thresholds
from tests.megatron.conftest import MEGATRON_STAGES

PLUGIN = Path(__file__).parents[2] / "plugins" / "model-support-llama"


@pytest.fixture(scope="module")
def site(installed_plugin) -> Path:
    return installed_plugin(PLUGIN)[1]


def test_llama_is_listed_from_its_own_distribution(site: Path):
    result = run_cli("show", "LlamaForCausalLM", "--json", site=site)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["name"] == "llama"
    assert data["plugin"] == {"name": "llama", "distribution": "model-support-llama", "version": "0.1.0"}
    assert Path(data["reference_config"]).name == "llama-3.2-1b.json"
    assert Path(data["reference_config"]).is_relative_to(site)


@pytest.mark.slow
def test_check_tiny_on_llama_passes_every_stage_of_one_process(one_process_check):
    check = one_process_check(PLUGIN)
    assert check.returncode == 0, check.output
    assert check.report["handler"] == "llama" and check.report["handler_origin"] == "model-support-llama 0.1.0"
    results = check.results
    assert results["architecture"]["metrics"] == {
        "layers": 2,
        "gdn_layers": 0,
        "attention_layers": 2,
        "experts": 0,
        "lora_targets": 7,
    }
    for stage in MEGATRON_STAGES:
        assert results[stage]["status"] == "pass" and within_thresholds(results[stage]), results[stage]


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_whole_check_on_llama_splits_every_default_layout(default_check):
    results = default_check(PLUGIN).results
    # No q/k norm: the local spec keeps megatron-core's identity placeholders under tensor + sequence parallelism.
    summary = results["parallel_parity"]["summary"]
    assert summary.startswith("5/5 layouts (tp2, tp2-sp, pp2, cp2, tp2-pp2)"), summary


def test_the_plugins_own_tests_pass(installed_plugin):
    result = run_plugin_tests(*installed_plugin(PLUGIN))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout
