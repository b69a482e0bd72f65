"""The handler declaration and the layout derived from configs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import transformers

from model_support.core import targets
from model_support.core.layout import derive_layout, mtp_layers
from model_support.core.spec import (
    ConfigRequirement,
    HandlerSpec,
    LoraTarget,
    RuntimePolicy,
    SpecError,
    TargetScope,
    Topology,
    VllmLora,
)
from model_support.core.validate import (
    build_meta_model,
    layout_problems,
    missing_targets,
    stored_names,
)
from model_support.handlers import QWEN3, QWEN3_5, QWEN3_5_MOE, QWEN3_MOE


def _config(spec: HandlerSpec):
    raw = json.loads(spec.reference_config.read_text())
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)


def test_declaration_is_frozen_and_lists_targets_once():
    with pytest.raises(AttributeError):
        QWEN3.name = "other"  # type: ignore[misc]
    assert QWEN3_5_MOE.hf_target_modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
        "out_proj", "gate_proj", "up_proj", "down_proj",
    )  # fmt: skip
    assert QWEN3.megatron_target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert [t.megatron for t in QWEN3_5.targets(TargetScope.GDN)] == ["in_proj", "out_proj"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "Bad Name"}, "name must be lower-case"),
        ({"architectures": ()}, "claims no architecture"),
        ({"topology": Topology.DENSE}, "expert LoRA targets need topology MOE"),
        ({"linear_attention": False}, "GDN LoRA targets need linear_attention=True"),
        ({"lora_targets": targets.ATTENTION + targets.ATTENTION}, "'linear_qkv' (attention) declared twice"),
        ({"vllm_lora": VllmLora(native=False, reason=" ")}, "a merged-only vLLM LoRA status needs a reason"),
        ({"codec": object()}, "codec does not implement LoraCodec"),
        ({"runtime": RuntimePolicy(cpu_serving_dtype="bfloat16")}, "a cpu_serving_dtype needs a cpu_serving_reason"),
        (
            {"config_requirements": (ConfigRequirement("norm_topk_prob", (True,), " "),)},
            "config_requirements must be ConfigRequirements (with allowed values and a reason) or functions",
        ),
        (
            {"runtime": RuntimePolicy(cpu_serving_dtype="bf16", cpu_serving_reason="x")},
            "cpu_serving_dtype must be bfloat16, float16 or float32, got 'bf16'",
        ),
        ({"config_requirements": ("no_softcapping",)}, "config_requirements must be ConfigRequirements"),
    ],
)
def test_inconsistent_declarations_are_rejected(change, message):
    with pytest.raises(SpecError) as info:
        replace(QWEN3_5_MOE, **change)
    assert str(info.value).startswith(f"handler {change.get('name', 'qwen3.5-moe')!r}: ")
    assert message in str(info.value)


def test_config_requirement_functions_name_what_a_config_asks_that_the_handler_cannot_build():
    def no_sliding_window(text) -> str | None:
        return f"sliding_window {text.sliding_window} is not built" if text.sliding_window else None

    spec = replace(QWEN3, config_requirements=(no_sliding_window,))
    config = _config(QWEN3)
    assert spec.config_problems(config) == [] and QWEN3.config_problems(config) == []
    config.sliding_window = 512
    assert spec.config_problems(config) == ["sliding_window 512 is not built"]


def test_a_lora_target_needs_names():
    with pytest.raises(SpecError, match="needs a Megatron name and at least one HF module name"):
        LoraTarget("linear_qkv", (), TargetScope.ATTENTION)


def test_qwen3_5_layout_from_the_real_config():
    layout = QWEN3_5.layout(_config(QWEN3_5))
    assert layout.num_layers == 64
    assert len(layout.gdn_layers) == 48
    assert layout.attention_layers == tuple(range(3, 64, 4))
    assert layout.moe is None
    assert layout.mtp_layers == 1  # nested under text_config


def test_qwen3_5_moe_layout_has_shared_expert_and_interval_pattern():
    raw = json.loads(QWEN3_5_MOE.reference_config.read_text())
    del raw["text_config"]["layer_types"]  # derived from full_attention_interval instead
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    layout = QWEN3_5_MOE.layout(config)
    assert layout.attention_layers == tuple(range(3, 40, 4))
    assert layout.moe is not None
    assert (layout.moe.num_experts, layout.moe.top_k, layout.moe.shared_expert_intermediate_size) == (256, 8, 512)
    assert (
        layout.describe()
        == "40 layers, 30 GDN + 10 full attention, MoE 256 experts top-8, shared expert, 1 MTP layer(s)"
    )


def test_qwen3_moe_dense_layers_from_sparse_step():
    config = transformers.Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[5])
    assert QWEN3_MOE.layout(config).moe.dense_layers == (0, 2, 4, 5)
    assert derive_layout(config).moe.dense_layers == ()  # a family that declares no dense layers has none


def test_mtp_top_level_field_forms():
    assert mtp_layers(transformers.PretrainedConfig(num_nextn_predict_layers=2)) == 2
    assert mtp_layers(transformers.PretrainedConfig()) == 0


@pytest.mark.parametrize("spec", [QWEN3, QWEN3_MOE, QWEN3_5, QWEN3_5_MOE], ids=lambda s: s.name)
def test_declared_targets_exist_in_a_model_built_from_the_real_config(spec):
    config = _config(spec)
    model = build_meta_model(config)  # meta device: the real 27B/35B shapes cost no memory
    assert missing_targets(spec, stored_names(model)) == []
    assert layout_problems(spec, spec.layout(config)) == []


def test_a_wrong_declaration_is_caught_against_the_model():
    config = _config(QWEN3_5_MOE)
    wrong = replace(
        QWEN3_5_MOE,
        lora_targets=targets.ATTENTION + targets.GATED_DELTANET + targets.EXPERTS,
        topology=Topology.MOE,
    )
    assert layout_problems(wrong, wrong.layout(config)) == ["config has a shared expert the handler does not target"]
    typo = replace(QWEN3, lora_targets=(LoraTarget("linear_qkv", ("qkv_proj",), TargetScope.ATTENTION),))
    assert missing_targets(typo, stored_names(build_meta_model(_config(QWEN3)))) == ["attention:qkv_proj"]
    assert layout_problems(QWEN3, QWEN3_5_MOE.layout(config)) == [
        "handler declares dense but the config has 256 experts",
        "config has 30 linear_attention layers the handler does not declare",
        "config has a shared expert the handler does not target",
    ]


def test_config_requirements_refuse_values_the_build_does_not_implement():
    spec = replace(
        QWEN3_MOE,
        config_requirements=(
            ConfigRequirement("norm_topk_prob", (True,), "the router always renormalises"),
            ConfigRequirement("clip_qkv", (None,), "no clipping"),
        ),
    )
    config = _config(QWEN3_MOE)
    assert config.norm_topk_prob is True
    assert spec.config_problems(config) == []
    config.norm_topk_prob, config.clip_qkv = False, 8.0
    assert spec.config_problems(config) == [
        "config sets norm_topk_prob=False, the handler supports only True: the router always renormalises",
        "config sets clip_qkv=8.0, the handler supports only None: no clipping",
    ]
    assert QWEN3_MOE.config_problems(config) == []
