"""The Mixtral plugin (plugins/model-support-mixtral): megatron-bridge has no Mixtral bridge, so the plugin brings one
through the bridge hook; the checkpoint's expert names (block_sparse_moe.experts.<e>.w1 / w3 / w2), not
transformers' fused in-memory experts, are what the targets, the adapter and the merged export address."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from tests.helpers import run_plugin_tests

pytestmark = pytest.mark.slow
PLUGIN = Path(__file__).parents[2] / "plugins" / "model-support-mixtral"


def test_check_tiny_on_mixtral_passes_every_stage_of_one_process(one_process_check):
    check = one_process_check(PLUGIN)
    assert check.returncode == 0, check.output
    assert check.report["handler_origin"] == "model-support-mixtral 0.1.0"
    results = check.results
    assert results["architecture"]["metrics"] == {
        "layers": 2, "gdn_layers": 0, "attention_layers": 2, "experts": 4, "lora_targets": 7,
    }  # fmt: skip
    parity = results["hf_parity"]["metrics"]
    assert parity["max_abs_err"] < 1e-5 and parity["router_flips"] == 0
    coverage = results["lora_coverage"]["metrics"]
    assert coverage["codec_layout_err"] == 0 and coverage["peft_tensors"] == 64
    # The adapter a trainer writes names the checkpoint's expert modules, as vLLM's Mixtral loads them.
    (adapter,) = check.workdir.glob("*/megatron-lora-adapter/adapter_model.safetensors")
    with safe_open(adapter, "pt") as f:
        names = set(f.keys())
    assert "base_model.model.model.layers.1.block_sparse_moe.experts.3.w3.lora_B.weight" in names
    assert not [n for n in names if ".mlp." in n or "gate_up_proj" in n]


@pytest.mark.exhaustive
def test_the_whole_check_on_mixtral_splits_every_default_layout(default_check):
    results = default_check(PLUGIN).results
    summary = results["parallel_parity"]["summary"]
    assert summary.startswith("7/7 layouts (ep2, etp2, tp2-sp, pp2, cp2, tp2-sp-ep2, ep2-pp2)"), summary


def test_the_plugins_own_tests_pass(installed_plugin):
    result = run_plugin_tests(*installed_plugin(PLUGIN))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 passed" in result.stdout  # six tests + the stage test for architecture and its prerequisite
