"""The GLM-4.5 MoE plugin (plugins/model-support-glm4-moe): a declaration only, megatron-bridge's GLM45Bridge as it
ships (it reads the checkpoint through the state source's ``has_glob``), every stage of the default check."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_plugin_tests

pytestmark = pytest.mark.slow
PLUGIN = Path(__file__).parents[2] / "plugins" / "model-support-glm4-moe"


def test_check_tiny_on_glm4_moe_passes_every_stage_of_one_process(one_process_check):
    check = one_process_check(PLUGIN)
    assert check.returncode == 0, check.output
    assert check.report["handler_origin"] == "model-support-glm4-moe 0.1.0"
    results = check.results
    assert results["architecture"]["metrics"] == {
        "layers": 2, "gdn_layers": 0, "attention_layers": 2, "experts": 4, "lora_targets": 7,
    }  # fmt: skip
    assert any("dense layers [0], shared expert of width" in d for d in results["architecture"]["details"])
    parity = results["hf_parity"]["metrics"]
    # q/k/v bias, half-width rotary, the sigmoid router with its correction bias: fp32 round-off; MTP not built.
    assert parity["max_abs_err"] < 1e-5 and parity["router_flips"] == 0 and parity["mtp_layers_built"] == 0
    coverage = results["lora_coverage"]["metrics"]
    assert coverage["codec_layout_err"] == 0 and coverage["peft_tensors"] == 52


@pytest.mark.exhaustive
def test_the_whole_check_on_glm4_moe_splits_every_default_layout(default_check):
    results = default_check(PLUGIN).results
    summary = results["parallel_parity"]["summary"]
    assert summary.startswith("7/7 layouts (ep2, etp2, tp2-sp, pp2, cp2, tp2-sp-ep2, ep2-pp2)"), summary


def test_the_plugins_own_tests_pass(installed_plugin):
    result = run_plugin_tests(*installed_plugin(PLUGIN))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout  # four tests + the stage test for architecture and its prerequisite
