"""The example third-party plugin (plugins/model-support-llama), installed the way a user installs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli, run_plugin_tests, within_thresholds
from tests.megatron.conftest import MEGATRON_STAGES

LLAMA_PLUGIN = Path(__file__).parents[2] / "plugins" / "model-support-llama"


@pytest.fixture(scope="module")
def installed(install_copy) -> tuple[Path, Path]:
    """(a copy of the plugin's source tree, the directory pip installed it into)."""
    return install_copy(LLAMA_PLUGIN)


@pytest.fixture(scope="module")
def site(installed: tuple[Path, Path]) -> Path:
    return installed[1]


def test_llama_is_listed_from_its_own_distribution(site: Path):
    result = run_cli("show", "LlamaForCausalLM", "--json", site=site)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["name"] == "llama"
    assert data["plugin"] == {"name": "llama", "distribution": "model-support-llama", "version": "0.1.0"}
    assert Path(data["reference_config"]).name == "llama-3.2-1b.json"
    assert Path(data["reference_config"]).is_relative_to(site)


def test_check_tiny_on_llama_passes_the_megatron_stages(site: Path, tmp_path: Path):
    # The serving stages (a vLLM server per stage, minutes on CPU) are left to the CI step that runs
    # the whole `model-support check llama --tiny`; every training-side stage runs here.
    report_path = tmp_path / "llama.json"
    selection = [arg for stage in MEGATRON_STAGES for arg in ("-s", stage)]
    result = run_cli("check", "llama", "--tiny", *selection, "--json", str(report_path), site=site)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(report_path.read_text())
    assert report["handler"] == "llama" and report["handler_origin"] == "model-support-llama 0.1.0"
    results = {r["stage"]: r for r in report["results"]}
    assert list(results) == ["dependencies", "architecture", "weights", *MEGATRON_STAGES]
    assert results["dependencies"]["status"] == results["architecture"]["status"] == "pass"
    assert results["architecture"]["metrics"] == {
        "layers": 2,
        "gdn_layers": 0,
        "attention_layers": 2,
        "experts": 0,
        "lora_targets": 7,
    }
    # megatron-bridge maps Llama and the standard codec fits it; without the megatron extra these
    # stages skip naming the missing package.
    for stage in MEGATRON_STAGES:
        verdict = results[stage]
        assert verdict["status"] == "pass" or (
            verdict["status"] == "skip" and "is not installed" in verdict["summary"]
        ), verdict
        if verdict["status"] == "pass":
            assert within_thresholds(verdict)


def test_the_plugins_own_tests_pass(installed: tuple[Path, Path]):
    result = run_plugin_tests(*installed)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout
