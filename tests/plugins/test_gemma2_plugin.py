"""The Gemma 2 plugin (plugins/model-support-gemma2), installed the way a user installs it: ``check gemma2 --tiny``
(its stages of one process; the whole check in tests/plugins/test_shipped_plugins.py's exhaustive tier), its own
tests, and a Megatron model that leaves out either logit soft-cap failing ``hf_parity``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_plugin_tests
from tests.megatron.conftest import require_megatron
from tests.plugins.conftest import ONE_PROCESS_STAGES, run_changed

pytestmark = pytest.mark.slow

PLUGIN = Path(__file__).parents[2] / "plugins" / "model-support-gemma2"


@pytest.fixture(scope="module")
def site(installed_plugin) -> Path:
    return installed_plugin(PLUGIN)[1]


@pytest.fixture(scope="module")
def check(one_process_check) -> tuple[dict[str, Any], Path]:
    """(the JSON report of ``check gemma2 --tiny`` over the stages of one process, the tiny model it built)."""
    result = one_process_check(PLUGIN)
    assert result.returncode == 0, result.output
    (model_dir,) = result.workdir.glob("*/tiny-model")
    return result.report, model_dir


def test_check_tiny_on_gemma2_passes_every_stage_of_one_process(check: tuple[dict[str, Any], Path]):
    report, model_dir = check
    assert report["handler"] == "gemma2" and report["handler_origin"] == "model-support-gemma2 0.1.0"
    results = {r["stage"]: r for r in report["results"]}
    assert list(results) == list(ONE_PROCESS_STAGES)
    for stage, verdict in results.items():
        assert verdict["status"] == "pass", verdict
        for key, limit in verdict["thresholds"].items():
            assert float(verdict["metrics"][key]) <= limit, (stage, key)
    # One sliding and one full layer, a window shorter than the test prompts, caps the tiny model's scores reach.
    config = json.loads((model_dir / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert (config["sliding_window"], config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (
        4,
        0.5,
        1.0,
    )
    assert results["hf_parity"]["metrics"]["tokens"] > config["sliding_window"]
    assert results["lora_coverage"]["metrics"]["lora_modules"] == 8
    assert results["lora_coverage"]["metrics"]["codec_layout_err"] == 0.0


def test_the_plugins_own_tests_pass(installed_plugin):
    result = run_plugin_tests(*installed_plugin(PLUGIN))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout


def uncapped_attention(config: Any, vp_stage: int | None = None) -> Any:
    """Gemma 2's layer spec with the attention scores' soft-cap forgotten (a broken family spec)."""
    from model_support_gemma2.layer_spec import gemma2_block_spec

    block = gemma2_block_spec(config, vp_stage)
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention.params["softcap"] = None
    return block


def _hf_parity(site: Path, model_dir: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch, **change: Any):
    """``hf_parity``'s verdict on the tiny model, with the handler changed by ``change``."""
    return run_changed(site, model_dir, workdir, monkeypatch, "Gemma2ForCausalLM", "hf_parity", **change)["hf_parity"]


def test_attention_scores_left_uncapped_fail_hf_parity(check, site, tmp_path, monkeypatch):
    from model_support.validation.stage import Status

    require_megatron()
    verdict = _hf_parity(site, check[1], tmp_path, monkeypatch, megatron_layer_spec=f"{__name__}:uncapped_attention")
    assert verdict.status is Status.FAIL, verdict
    assert verdict.metrics["rel_err"] > 100 * verdict.thresholds["rel_err"], (verdict.metrics, verdict.thresholds)


def test_final_logits_left_uncapped_fail_hf_parity(check, site, tmp_path, monkeypatch):
    """The final cap is the bridge provider's (its output layer's ``logit_softcapping``): without it, fails."""
    from megatron.bridge.models.gemma import gemma2_provider

    from model_support.validation.stage import Status

    require_megatron()
    monkeypatch.setattr(gemma2_provider, "logit_softcapping", lambda logits, scale: logits)
    verdict = _hf_parity(site, check[1], tmp_path, monkeypatch)
    assert verdict.status is Status.FAIL, verdict
    assert verdict.metrics["rel_err"] > 100 * verdict.thresholds["rel_err"], (verdict.metrics, verdict.thresholds)
