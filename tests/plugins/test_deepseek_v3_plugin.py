"""The DeepSeek-V3 plugin (plugins/model-support-deepseek-v3), installed the way a user installs it: every stage of
`check deepseek-v3 --tiny` (the parallel and serving ones in the exhaustive tier), its own tests, and a wrong
declaration failing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import run_cli, run_plugin_tests, within_thresholds
from tests.plugins.conftest import ONE_PROCESS_STAGES

pytestmark = pytest.mark.slow

PLUGIN = Path(__file__).parents[2] / "plugins" / "model-support-deepseek-v3"
SERVING_STAGES = (
    "native_vllm_lora",
    "merged_serving",
    "chat_template_rollout",
    "train_inference_mismatch",
    "staleness_boundary",
    "rl_trainability",
)
NO_MLA_LORA = "merged-only: vLLM applies no LoRA to MLA's kv_b_proj"


def test_check_tiny_on_deepseek_v3_passes_every_stage_of_one_process(one_process_check):
    check = one_process_check(PLUGIN)
    assert check.returncode == 0, check.output
    report = check.report
    assert report["handler"] == "deepseek-v3" and report["handler_origin"] == "model-support-deepseek-v3 0.1.0"
    results = check.results
    assert list(results) == list(ONE_PROCESS_STAGES)
    for verdict in results.values():
        assert verdict["status"] == "pass" and within_thresholds(verdict), verdict
    assert results["architecture"]["metrics"] == {
        "layers": 2,
        "gdn_layers": 0,
        "attention_layers": 2,
        "experts": 4,
        "lora_targets": 8,
    }
    parity = results["hf_parity"]["metrics"]
    # One MoE layer after the dense one, its routing agreed token for token; MTP not built (runtime policy).
    assert (parity["router_layers"], parity["router_flips"], parity["mtp_layers_built"]) == (1, 0, 0)
    assert parity["rel_l2"] < 1e-5
    assert results["lora_coverage"]["metrics"]["peft_tensors"] == 56


@pytest.mark.exhaustive
def test_the_whole_check_on_deepseek_v3_splits_and_serves_it(default_check):
    from model_support.validation.serving_session import backend

    check = default_check(PLUGIN)
    assert check.returncode == 0, check.output
    results = check.results
    assert list(results) == [*ONE_PROCESS_STAGES, "parallel_parity", *SERVING_STAGES]
    # Expert (and expert tensor), pipeline and context parallel are checked (multi-latent attention under context
    # parallelism included); tensor parallel is refused by the handler, and the stage says why.
    parity = results["parallel_parity"]
    assert parity["summary"].startswith("5/5 layouts (ep2, etp2, pp2, cp2, ep2-pp2)"), parity["summary"]
    assert any("tp2-sp: not checked, the handler refuses it (tensor parallel: megatron-core 0.19.2" in d
               for d in parity["details"])  # fmt: skip

    unavailable = backend().unavailable_reason()
    if unavailable is not None:
        for stage in SERVING_STAGES:
            assert results[stage]["status"] == "skip", results[stage]
        return
    native = results["native_vllm_lora"]
    assert native["status"] == "skip" and native["summary"].startswith(NO_MLA_LORA), native
    merged = results["merged_serving"]
    assert merged["status"] == "pass" and within_thresholds(merged), merged
    assert merged["metrics"]["serving_dtype"] == "bfloat16"
    assert results["chat_template_rollout"]["status"] == "pass", results["chat_template_rollout"]
    mismatch = results["train_inference_mismatch"]
    assert mismatch["status"] == "pass" and within_thresholds(mismatch), mismatch
    boundary = results["staleness_boundary"]  # merged weights pushed inside a generation (no MLA LoRA to swap)
    assert boundary["status"] == "pass" and within_thresholds(boundary), boundary
    assert boundary["metrics"]["modes"] == "merged"
    rl = results["rl_trainability"]
    assert rl["status"] == "pass" and within_thresholds(rl), rl


def test_declaring_standard_attention_targets_fails_architecture(tmp_path: Path, install_copy):
    # The mistake of declaring DeepSeek-V3 like a Qwen: q/k/v_proj do not exist under multi-latent attention.
    broken = tmp_path / PLUGIN.name
    shutil.copytree(PLUGIN, broken, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*"))
    handler = broken / "src" / "model_support_deepseek_v3" / "handler.py"
    source = handler.read_text()
    assert "lora_targets=MLA + " in source
    handler.write_text(source.replace("lora_targets=MLA + ", "lora_targets=targets.ATTENTION + "))
    _, site = install_copy(broken)
    report_path = tmp_path / "broken.json"
    result = run_cli("check", "deepseek-v3", "--tiny", "-s", "architecture", "--json", str(report_path), site=site)
    assert result.returncode != 0
    architecture = {r["stage"]: r for r in json.loads(report_path.read_text())["results"]}["architecture"]
    assert architecture["status"] == "fail"
    assert "target modules missing from DeepseekV3ForCausalLM" in architecture["summary"]
    assert "k_proj" in architecture["summary"] and "v_proj" in architecture["summary"]


def test_the_plugins_own_tests_pass(installed_plugin):
    result = run_plugin_tests(*installed_plugin(PLUGIN))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout  # two tests + the stage test for architecture and its prerequisite
