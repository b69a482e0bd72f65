"""The Gemma 3 plugin (plugins/model-support-gemma3), installed the way a user installs it: ``check gemma3 --tiny``
(its stages of one process; the whole check in tests/plugins/test_shipped_plugins.py's exhaustive tier), its own
tests, and declarations that get the family wrong failing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_plugin_tests
from tests.megatron.conftest import require_megatron
from tests.plugins.conftest import ONE_PROCESS_STAGES, run_changed

pytestmark = pytest.mark.slow

PLUGIN = Path(__file__).parents[2] / "plugins" / "model-support-gemma3"


@pytest.fixture(scope="module")
def site(installed_plugin) -> Path:
    return installed_plugin(PLUGIN)[1]


@pytest.fixture(scope="module")
def check(one_process_check) -> tuple[dict[str, Any], Path]:
    """(the JSON report of ``check gemma3 --tiny`` over the stages of one process, the tiny model it built)."""
    result = one_process_check(PLUGIN)
    assert result.returncode == 0, result.output
    (model_dir,) = result.workdir.glob("*/tiny-model")
    return result.report, model_dir


def test_check_tiny_on_gemma3_passes_every_stage_of_one_process(check: tuple[dict[str, Any], Path]):
    report, model_dir = check
    assert report["handler"] == "gemma3" and report["handler_origin"] == "model-support-gemma3 0.1.0"
    results = {r["stage"]: r for r in report["results"]}
    assert list(results) == list(ONE_PROCESS_STAGES)
    for stage, verdict in results.items():
        assert verdict["status"] == "pass", verdict
        for key, limit in verdict["thresholds"].items():
            assert float(verdict["metrics"][key]) <= limit, (stage, key)
    assert results["architecture"]["metrics"] == {
        "layers": 6,
        "gdn_layers": 0,
        "attention_layers": 6,
        "experts": 0,
        "lora_targets": 7,
    }
    # The replica keeps one whole 5 sliding : 1 full period, with a window shorter than the test prompts.
    config = json.loads((model_dir / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["sliding_window"] == 4
    assert results["hf_parity"]["metrics"]["tokens"] > config["sliding_window"]
    assert results["lora_coverage"]["metrics"]["lora_modules"] == 24
    assert results["lora_coverage"]["metrics"]["codec_layout_err"] == 0.0


def test_the_plugins_own_tests_pass(installed_plugin):
    result = run_plugin_tests(*installed_plugin(PLUGIN))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout


def full_attention_everywhere(config: Any, vp_stage: int | None = None) -> Any:
    """Gemma 3's layer spec with the sliding window forgotten (a broken family spec)."""
    from model_support_gemma3.layer_spec import gemma3_block_spec

    block = gemma3_block_spec(config, vp_stage)
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention.params["window"] = None
    return block


def _run(site: Path, model_dir: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch, stage: str, **change: Any):
    """The results of ``stage`` (and its prerequisites) on the tiny model, with the handler changed by ``change``."""
    return run_changed(site, model_dir, workdir, monkeypatch, "Gemma3ForCausalLM", stage, **change)


def test_targets_named_as_vllm_packs_them_fail_architecture(check, site, tmp_path, monkeypatch):
    from model_support.core.spec import LoraTarget, TargetScope
    from model_support.validation.stage import Status

    fused = (
        LoraTarget("linear_qkv", ("qkv_proj",), TargetScope.ATTENTION),
        LoraTarget("linear_proj", ("o_proj",), TargetScope.ATTENTION),
    )
    results = _run(site, check[1], tmp_path, monkeypatch, "architecture", lora_targets=fused)
    verdict = results["architecture"]
    assert verdict.status is Status.FAIL
    assert "qkv_proj" in verdict.summary


def test_a_layer_spec_without_the_sliding_window_is_refused_by_name(check, site, tmp_path, monkeypatch):
    """A layer spec that builds no window gives a model that is right only on rows within the window: the build
    refuses it and `architecture` names the field, before any stage could pass it on short rows."""
    from model_support.validation.stage import Status

    require_megatron()

    spec = f"{__name__}:full_attention_everywhere"
    results = _run(site, check[1], tmp_path, monkeypatch, "hf_parity", megatron_layer_spec=spec)
    verdict = results["architecture"]
    assert verdict.status is Status.FAIL, verdict
    assert "config sets sliding_window=4, but the built model's attention ignores it (layer 0: None" in verdict.summary
    assert results["hf_parity"].status is Status.SKIP
