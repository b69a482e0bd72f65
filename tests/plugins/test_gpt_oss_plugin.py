"""The gpt-oss plugin (plugins/model-support-gpt-oss): attention sinks, alternating windows, the config's YaRN,
clamped-SwiGLU experts with biases stored as stacked 3-D tensors, whose LoRA is written in PEFT's
``target_parameters`` layout; every stage of the default check, and PEFT itself reading the adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_plugin_tests

pytestmark = pytest.mark.slow
PLUGIN = Path(__file__).parents[2] / "plugins" / "model-support-gpt-oss"


def test_check_tiny_on_gpt_oss_passes_every_stage_of_one_process(one_process_check):
    check = one_process_check(PLUGIN)
    assert check.returncode == 0, check.output
    results = check.results
    assert results["architecture"]["metrics"]["experts"] == 4
    built = "the built Megatron model implements the config's sliding window and rope scaling"
    assert built in results["architecture"]["details"]
    parity = results["hf_parity"]["metrics"]
    # Sinks, windows (the long row crosses one), YaRN, clamped SwiGLU with biases: fp32 round-off.
    assert parity["max_abs_err"] < 1e-5 and parity["long_tokens"] > 48 and parity["router_flips"] == 0
    coverage = results["lora_coverage"]["metrics"]
    assert coverage["codec_layout_err"] == 0 and coverage["roundtrip_mismatches"] == 0
    gradients = results["lora_gradients"]["metrics"]
    assert gradients["long_grad_worst_factor_rel_err"] < 1e-4


@pytest.mark.exhaustive
def test_the_whole_check_on_gpt_oss_splits_every_default_layout(default_check):
    results = default_check(PLUGIN).results
    # megatron-core refuses expert biases under expert tensor parallelism: the handler says so, the stage names it.
    parity = results["parallel_parity"]
    assert parity["summary"].startswith("6/6 layouts"), parity["summary"]
    assert any("etp2: not checked, the handler refuses it" in d for d in parity["details"])


def test_peft_reads_the_exported_adapter_as_the_reference_merges_it(one_process_check):
    """The adapter a trainer exports is PEFT's own layout: PEFT loads it onto transformers' gpt-oss and its merge
    equals the merge the reference computes (attention and stacked experts)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from model_support.core.megatron.hf_reference import adapter_deltas

    check = one_process_check(PLUGIN)
    (adapter,) = check.workdir.glob("*/megatron-lora-adapter")
    (model_dir,) = check.workdir.glob("*/tiny-model")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    merged = dict(PeftModel.from_pretrained(model, adapter).merge_and_unload().named_parameters())
    deltas = adapter_deltas(adapter)
    assert {n for n in deltas if "experts" in n} == {
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    }
    for name, delta in deltas.items():
        torch.testing.assert_close(merged[name] - base[name], delta.on(torch.device("cpu")), rtol=0, atol=1e-6)


def test_the_plugins_own_tests_pass(installed_plugin):
    result = run_plugin_tests(*installed_plugin(PLUGIN))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 passed" in result.stdout  # five tests + the stage test for architecture and its prerequisite
