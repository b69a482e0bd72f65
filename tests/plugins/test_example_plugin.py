"""The example third-party plugin (plugins/model-support-llama), installed the way a user installs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import run_cli

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


def test_check_tiny_runs_every_stage_on_llama(site: Path, tmp_path: Path):
    report_path = tmp_path / "llama.json"
    result = run_cli("check", "llama", "--tiny", "--json", str(report_path), site=site)
    report = json.loads(report_path.read_text())
    status = {r["stage"]: r["status"] for r in report["results"]}
    assert result.returncode == (1 if "fail" in status.values() else 0), result.stdout + result.stderr
    assert report["handler"] == "llama" and report["handler_origin"] == "model-support-llama 0.1.0"
    assert status["dependencies"] == "pass" and status["architecture"] == "pass"
    architecture = next(r for r in report["results"] if r["stage"] == "architecture")
    assert architecture["metrics"] == {
        "layers": 2,
        "gdn_layers": 0,
        "attention_layers": 2,
        "experts": 0,
        "lora_targets": 7,
    }
    # The Megatron stages pass on Llama (megatron-bridge maps it, the standard codec fits), or skip
    # naming the missing package when the megatron extra is not installed.
    for stage in ("hf_parity", "lora_coverage", "packed_position_ids", "trainability"):
        result = next((r for r in report["results"] if r["stage"] == stage), None)
        if result is None:
            continue
        skipped_for_a_package = result["status"] == "skip" and "is not installed" in result["summary"]
        assert result["status"] == "pass" or skipped_for_a_package, result
    # Every registered stage reports, and every verdict says why.
    listed = run_cli("stages", site=site)
    assert all(f"│ {stage} " in listed.stdout for stage in status)
    assert all(r["summary"].strip() for r in report["results"])


def test_the_plugins_own_tests_pass(installed: tuple[Path, Path]):
    source, site = installed
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--model-support-stage", "architecture"],
        cwd=source, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(site)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout
