"""`model-support check <handler> --tiny` runs the Megatron stages for real and each passes with numbers."""

from __future__ import annotations

import pytest

from model_support.validation.stage import Status
from tests.conftest import HANDLER_NAMES

pytestmark = pytest.mark.slow


def _result(report, stage: str):
    return {r.stage: r for r in report.results}[stage]


@pytest.mark.parametrize("handler", HANDLER_NAMES)
def test_hf_parity(megatron_report, handler: str) -> None:
    result = _result(megatron_report(handler), "hf_parity")
    assert result.status is Status.PASS, result.summary
    assert result.metrics["max_abs_err"] < 1e-4
    assert result.metrics["rel_err"] < 1e-4
    # ... and on a row across every GDN chunk boundary (Qwen3.5) or one chunk and a token.
    assert result.metrics["long_tokens"] == (193 if handler.startswith("qwen3.5") else 65)
    assert result.metrics["long_max_abs_err"] < 1e-4 and result.metrics["long_rel_err"] < 1e-4
    assert result.metrics["mapped_params"] > 10
    # Qwen3.5 replicas declare one MTP layer (text_config.mtp_num_hidden_layers); training builds none.
    assert result.metrics["config_mtp_layers"] == (1 if handler.startswith("qwen3.5") else 0)
    assert result.metrics["mtp_layers_built"] == 0


@pytest.mark.parametrize("handler", HANDLER_NAMES)
def test_lora_coverage(megatron_report, handler: str) -> None:
    result = _result(megatron_report(handler), "lora_coverage")
    assert result.status is Status.PASS, result.summary
    m = result.metrics
    assert m["missing_lora_modules"] == 0 and m["zero_grad_params"] == 0 and m["trainable_base_params"] == 0
    assert m["codec_layout_err"] == 0.0
    assert m["roundtrip_mismatches"] == 0
    assert m["lora_params"] == 2 * m["lora_modules"]
    # The adapter changes the output by far more than the tolerance it is matched within.
    assert m["adapter_effect_rel_l2"] > 0.5 and m["adapter_logits_max_abs_err"] < 1e-4
    # apply_lora's fresh adapter changes nothing (fp32: bit for bit); train mode computes what eval mode does.
    assert m["fresh_lora_logits_max_abs_err"] == 0.0 and m["train_mode_logits_max_abs_err"] <= 1e-6


def test_lora_module_counts(megatron_report) -> None:
    """Tiny replicas: 2 layers (Qwen3), 4 layers = 3 GDN + 1 attention (Qwen3.5); 4 experts."""
    counts = {h: _result(megatron_report(h), "lora_coverage").metrics["lora_modules"] for h in HANDLER_NAMES}
    assert counts == {"qwen3": 2 * 4, "qwen3-moe": 2 * (2 + 2 * 4), "qwen3.5": 2 + 6 + 8, "qwen3.5-moe": 2 + 6 + 32 + 8}


@pytest.mark.parametrize("handler", HANDLER_NAMES)
def test_packed_position_ids(megatron_report, handler: str) -> None:
    result = _result(megatron_report(handler), "packed_position_ids")
    assert result.status is Status.PASS, result.summary
    m = result.metrics
    assert m["logits_max_abs_err"] < 1e-4 and m["grad_max_rel_err"] < 1e-4
    assert m["leak_control_rel_l2"] > 1e-3
    assert m["lengths"] == ("7+193+12+5" if handler.startswith("qwen3.5") else "7+65+12+5")
    if handler.startswith("qwen3.5"):
        assert m["gdn_layers"] == 3 and m["attention_layers"] == 1


@pytest.mark.parametrize("handler", HANDLER_NAMES)
def test_shared_prefix(megatron_report, handler: str) -> None:
    """The prompt once, three completions: the unshared rows' logits, loss and gradients; the control differs."""
    result = _result(megatron_report(handler), "shared_prefix")
    assert result.status is Status.PASS, result.summary
    m = result.metrics
    # The prompt is a long row: three GDN chunks and a token on a GDN model, one chunk and a token otherwise.
    prompt = 193 if handler.startswith("qwen3.5") else 65
    assert m["prompt_tokens"] == prompt
    assert (m["tokens"], m["unshared_tokens"]) == (prompt + 6 + 70 + 7, 3 * prompt + 6 + 70 + 7)
    assert m["logits_max_abs_err"] < 1e-4 and m["grad_max_rel_err"] < 1e-4 and m["loss_rel_err"] < 1e-4
    assert m["control_rel_l2"] > 1e-3
    # The trainer's GRPO scoring call equals its per-sequence one.
    assert m["api_group_logprobs_max_abs_err"] < 1e-4


@pytest.mark.parametrize("handler", HANDLER_NAMES)
def test_trainability(megatron_report, handler: str) -> None:
    result = _result(megatron_report(handler), "trainability")
    assert result.status is Status.PASS, result.summary
    m = result.metrics
    assert m["loss_ratio"] <= 0.5
    assert m["base_params_changed"] == 0
    assert m["final_accuracy"] == 1.0


@pytest.mark.parametrize("handler", HANDLER_NAMES)
def test_lora_gradients(megatron_report, handler: str) -> None:
    """The loss and every LoRA factor's gradient against the fp32 transformers model with the same adapter."""
    report = megatron_report(handler)
    result = _result(report, "lora_gradients")
    assert result.status is Status.PASS, result.summary
    m = result.metrics
    length = 193 if handler.startswith("qwen3.5") else 65
    assert m["long_tokens"] == m["packed_tokens"] == length and m["packed_sequences"] == 3
    # Every factor, A and B, of every LoRA module, in both cases.
    modules = _result(report, "lora_coverage").metrics["lora_modules"]
    assert m["long_factors"] == m["packed_factors"] == 2 * modules
    for case in ("long", "packed"):
        assert m[f"{case}_loss_rel_err"] < 1e-4 and m[f"{case}_grad_worst_factor_rel_err"] < 1e-4
    assert m["adapter_effect_loss_rel_l2"] > 1e-2


def test_lora_gradients_catches_a_detached_lora_input(tmp_path) -> None:
    """A LoRA branch fed x.detach() computes the same loss; only the gradient comparison sees it."""
    from model_support.validation.pytest_plugin import CheckRequest, run_check
    from model_support.validation.selftest import injected

    with injected("lora-input-detached"):
        report = run_check(CheckRequest(target="qwen3", tiny=True, stages=("lora_gradients",)), tmp_path)
    result = _result(report, "lora_gradients")
    assert _result(report, "lora_coverage").status is Status.PASS
    assert result.status is Status.FAIL
    m = result.metrics
    assert m["long_loss_rel_err"] < 1e-4  # the forward is unchanged
    assert m["long_grad_worst_factor_rel_err"] > 0.1 and m["packed_grad_worst_factor_rel_err"] > 0.1
    assert "long_grad_worst_factor_rel_err=" in result.summary


def test_the_report_says_which_stage_built_what(megatron_report) -> None:
    """Each run-state resource is credited to the stage that first read it (built) or wrote it (provided)."""
    report = megatron_report("qwen3")
    built = {r.stage: {name: (o["phase"], o["provided"]) for name, o in r.built.items()} for r in report.results}
    assert built["hf_parity"] == {
        "training_model": ("run", False),
        "hf_references": ("run", False),
        "reference_lowp_error": ("run", True),
    }
    assert built["lora_coverage"] == {"lora": ("run", False), "trained_adapter": ("run", True)}
    assert built["trainability"] == {"chat_renderer": ("prepare", False), "tokenizer": ("run", False)}
    assert built["lora_gradients"] == {"reference_lowp_grad_error": ("run", True)}
    assert built["packed_position_ids"] == built["shared_prefix"] == {}


def test_a_stage_run_alone_builds_exactly_its_inputs(tiny_model_dir, tmp_path) -> None:
    """``check -s packed_position_ids --alone``: its prerequisites do not run, it builds the model and LoRA it
    reads and the reference rounding measures hf_parity and lora_gradients would have provided (None in fp32, which
    reads no reference), and nothing else."""
    from transformers import AutoConfig

    from model_support.core.registry import load_registry
    from model_support.validation.context import CheckContext
    from model_support.validation.runner import plan, run_checks
    from model_support.validation.stage_registry import load_stages

    registry = load_registry()
    handler, model_dir = registry.get("qwen3"), tiny_model_dir("qwen3")
    config = AutoConfig.from_pretrained(model_dir)
    ctx = CheckContext("qwen3", model_dir, handler, config, handler.spec.layout(config), registry, tmp_path, tiny=True)
    (result,) = run_checks(ctx, plan(load_stages(registry).classes(), ["packed_position_ids"], alone=True)).results
    assert result.status is Status.PASS, result.summary
    inputs = {"training_model", "lora", "reference_lowp_error", "reference_lowp_grad_error"}
    assert set(result.built) == inputs
    assert {r.name for r in ctx.state.origins} == inputs
    assert result.details[-1] == "run alone: prerequisite stage(s) hf_parity not run"
