"""The `architecture` stage against megatron-bridge's mappings and the checkpoint's tensor shapes: target names, the
coverage of every mapped LoRA linear (or its declared exclusion), MoE sizes; no Megatron model is built."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import transformers

from model_support.core import targets
from model_support.core.checkpoint import TextCheckpoint
from model_support.core.layout import text_config
from model_support.core.plugin_loading import PluginInfo
from model_support.core.registry import RegisteredHandler, Registry
from model_support.core.spec import HandlerSpec, LoraExclusion, LoraTarget, SpecError, TargetScope
from model_support.core.validate import (
    build_meta_model,
    checkpoint_modules,
    checkpoint_size_problems,
    stored_names,
    uncovered_targets,
)
from model_support.handlers import QWEN3, QWEN3_5, QWEN3_5_MOE, QWEN3_MOE
from model_support.validation.context import CheckContext
from model_support.validation.stage import StageResult
from model_support.validation.stages.architecture import ArchitectureStage

DEEPSEEK_SRC = Path(__file__).parents[1] / "plugins" / "model-support-deepseek-v3" / "src"


def _context(spec: HandlerSpec, model_dir: Path, workdir: Path) -> CheckContext:
    config = transformers.AutoConfig.from_pretrained(model_dir)
    return CheckContext(
        target=str(model_dir),
        model_dir=model_dir,
        handler=RegisteredHandler(spec, PluginInfo("test", "test", "0")),
        config=config,
        layout=spec.layout(config),
        registry=Registry(),
        workdir=workdir,
    )


def _architecture(spec: HandlerSpec, model_dir: Path, workdir: Path) -> StageResult:
    return ArchitectureStage().run(_context(spec, model_dir, workdir))


def _bridge_checks(spec: HandlerSpec, model_dir: Path, workdir: Path) -> tuple[list[str], list[str]]:
    """(problems, details) of the stage's checks against the bridge's mappings and the checkpoint's shapes alone."""
    ctx = _context(spec, model_dir, workdir)
    return ArchitectureStage._bridge_checks(ctx, stored_names(build_meta_model(ctx.config)))


def _without(spec: HandlerSpec, megatron: str, scope: TargetScope, **changes) -> HandlerSpec:
    kept = tuple(t for t in spec.lora_targets if (t.megatron, t.scope) != (megatron, scope))
    return replace(spec, lora_targets=kept, **changes)


def _edited_config(model_dir: Path, out: Path, **fields) -> Path:
    """A copy of a tiny replica whose config.json sets ``fields`` in its text config."""
    shutil.copytree(model_dir, out)
    raw = json.loads((model_dir / "config.json").read_text())
    (raw.get("text_config") or raw).update(fields)
    (out / "config.json").write_text(json.dumps(raw))
    return out


def test_a_target_naming_other_hf_modules_than_the_bridge_mapping_fails(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3")
    clean = _architecture(QWEN3, model_dir, tmp_path)
    assert clean.status == "pass", clean.summary
    assert "every LoRA linear Qwen3Bridge maps in this model is targeted or excluded (4)" in clean.details
    fc1 = LoraTarget("linear_fc1", ("gate_proj",), TargetScope.MLP)
    gate_only = replace(QWEN3, lora_targets=(*targets.ATTENTION, fc1, targets.DENSE_MLP[1]))
    result = _architecture(gate_only, model_dir, tmp_path)
    assert result.status == "fail"
    assert result.summary == (
        "LoRA target mlp:linear_fc1 declares HF modules gate_proj, but Qwen3Bridge's GatedMLPMapping of linear_fc1 "
        "reads gate_proj, up_proj"
    )
    renamed = replace(
        QWEN3, lora_targets=(*targets.ATTENTION[:1], LoraTarget("linear_o", ("o_proj",), TargetScope.ATTENTION))
    )
    result = _architecture(replace(renamed, lora_targets=renamed.lora_targets + targets.DENSE_MLP), model_dir, tmp_path)
    assert "LoRA target attention:linear_o: Qwen3Bridge maps no attention linear named linear_o (its attention " in (
        result.summary
    )


def test_an_architecture_no_bridge_maps_fails_naming_how_to_register_one(tiny_model_dir, tmp_path):
    """A checkpoint whose architecture megatron-bridge maps no bridge for: nothing of the Megatron side can be built,
    and the stage says so (it used to pass, with a details line that the targets were not checked)."""
    ctx = _context(QWEN3, tiny_model_dir("qwen3"), tmp_path)
    stored = stored_names(build_meta_model(ctx.config))
    ctx.config.architectures = ["Qwen3UnbridgedForCausalLM"]
    problems, details = ArchitectureStage._bridge_checks(ctx, stored)
    assert details == []
    (problem,) = problems
    assert problem.startswith("megatron-bridge has no bridge for Qwen3UnbridgedForCausalLM: ")
    assert problem.endswith(
        'the plugin registers one with the model_support_megatron_bridges hook (docs/adding-a-model.md, "A family '
        'megatron-bridge lacks")'
    )


def test_a_mapped_linear_neither_targeted_nor_excluded_fails_and_an_exclusion_is_reported(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3.5")
    no_in_proj = _without(QWEN3_5, "in_proj", TargetScope.GDN)
    result = _architecture(no_in_proj, model_dir, tmp_path)
    assert result.status == "fail"
    assert result.summary == (
        "Qwen35Bridge maps gdn linear in_proj (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) of this model, which the "
        "handler neither targets nor lists in lora_exclusions (with the reason it is not trained)"
    )
    why = "the family trains the GDN output projection only"
    excluded = replace(no_in_proj, lora_exclusions=(LoraExclusion("in_proj", TargetScope.GDN, why),))
    result = _architecture(excluded, model_dir, tmp_path)
    assert result.status == "pass", result.summary
    assert f"not trained (lora_exclusions): gdn:in_proj: {why}" in result.details
    unknown = replace(QWEN3_5, lora_exclusions=(LoraExclusion("linear_kv_down_proj", TargetScope.ATTENTION, why),))
    result = _architecture(unknown, model_dir, tmp_path)
    assert result.status == "fail"
    assert result.summary == "lora exclusion attention:linear_kv_down_proj: Qwen35Bridge maps no such linear"


def test_the_dense_mlp_of_the_first_layers_of_an_moe_model_must_be_targeted(monkeypatch, tmp_path):
    from model_support.core.tiny import build_tiny

    monkeypatch.syspath_prepend(str(DEEPSEEK_SRC))
    from model_support_deepseek_v3.handler import DEEPSEEK_V3

    raw = json.loads(DEEPSEEK_V3.reference_config.read_text())
    model_dir = build_tiny(raw, tmp_path / "tiny", spec=DEEPSEEK_V3)
    # The stage's other checks (rope scaling the build does not implement) are not this test's.
    problems, details = _bridge_checks(DEEPSEEK_V3, model_dir, tmp_path)
    assert problems == []
    assert "every LoRA linear DeepSeekV3Bridge maps in this model is targeted or excluded (11)" in details
    assert (
        "MoE sizes match the checkpoint's tensor shapes: 4 experts of width 32 in 1 layer(s), dense layers [0], "
        "shared expert of width 32"
    ) in details
    no_dense = replace(
        DEEPSEEK_V3, lora_targets=tuple(t for t in DEEPSEEK_V3.lora_targets if t.scope is not TargetScope.MLP)
    )
    problems, _ = _bridge_checks(no_dense, model_dir, tmp_path)
    assert problems == [
        f"DeepSeekV3Bridge maps mlp linear {linear} of this model, which the handler neither targets nor lists in "
        "lora_exclusions (with the reason it is not trained)"
        for linear in ("linear_fc2 (down_proj)", "linear_fc1 (gate_proj, up_proj)")
    ]
    fields = replace(DEEPSEEK_V3.config_fields, dense_layers=None)
    problems, _ = _bridge_checks(replace(DEEPSEEK_V3, config_fields=fields), model_dir, tmp_path)
    assert problems == [
        "dense layers: config_fields.dense_layers (None) gives [], the checkpoint has no routed experts "
        "(model.layers.*.mlp.experts.*.down_proj.weight) in layers [0]"
    ]


def _doubled(text) -> int:
    return 2 * text.shared_expert_intermediate_size


def test_moe_sizes_derived_from_the_config_must_match_the_checkpoint_shapes(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("qwen3.5-moe")
    clean = _architecture(QWEN3_5_MOE, model_dir, tmp_path)
    assert clean.status == "pass", clean.summary
    assert (
        "MoE sizes match the checkpoint's tensor shapes: 4 experts of width 32 in 4 layer(s), dense layers [], "
        "shared expert of width 32"
    ) in clean.details
    doubled = replace(
        QWEN3_5_MOE, config_fields=replace(QWEN3_5_MOE.config_fields, shared_expert_intermediate_size=_doubled)
    )
    result = _architecture(doubled, model_dir, tmp_path)
    assert result.status == "fail"
    assert result.summary == (
        "shared-expert width: config_fields.shared_expert_intermediate_size (_doubled) gives 64, the checkpoint's "
        "model.layers.0.mlp.shared_expert.down_proj.weight is [64, 32] (width 32)"
    )
    wider = _edited_config(model_dir, tmp_path / "wider", num_experts=8, moe_intermediate_size=48)
    result = _architecture(QWEN3_5_MOE, wider, tmp_path)
    assert result.status == "fail"
    assert (
        "expert count: config num_experts (config_fields.experts) = 8, the checkpoint holds 4 experts in layer 0 "
        "(model.layers.0.mlp.experts.0.down_proj.weight ...)"
    ) in result.summary
    assert (
        "expert width: config moe_intermediate_size (config_fields.expert_intermediate_size) = 48, the checkpoint's "
        "model.layers.0.mlp.experts.0.down_proj.weight is [64, 32] (width 32)"
    ) in result.summary


def test_dense_layers_the_config_declares_must_hold_no_experts_in_the_checkpoint(tiny_model_dir, tmp_path):
    model_dir = _edited_config(tiny_model_dir("qwen3-moe"), tmp_path / "mlp-only", mlp_only_layers=[1])
    result = _architecture(QWEN3_MOE, model_dir, tmp_path)
    assert result.status == "fail"
    assert (
        "dense layers: config_fields.dense_layers (_dense_layers) gives [1], the checkpoint has no routed experts "
        "(model.layers.*.mlp.experts.*.down_proj.weight) in layers []"
    ) in result.summary


def test_stacked_expert_tensors_count_experts_by_their_first_dimension(tiny_model_dir, tmp_path):
    """A checkpoint storing each layer's experts as one stacked tensor (transformers 5's fused experts) is read through
    the bridge's mappings of that layout."""
    import torch
    from safetensors.torch import load_file, save_file

    from model_support.core.bridge_linears import bridge_linears

    source = tiny_model_dir("qwen3.5-moe")
    tensors = load_file(str(source / "model.safetensors"))
    stacked: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            stacked[name] = tensor
        elif tail.startswith("0."):
            proj = tail.split(".")[1]
            count = sum(1 for n in tensors if n.startswith(f"{head}.mlp.experts.") and n.endswith(f".{proj}.weight"))
            parts = [tensors[f"{head}.mlp.experts.{e}.{proj}.weight"] for e in range(count)]
            stacked[f"{head}.mlp.experts.{proj}"] = torch.stack(parts[:3])  # a checkpoint of 3 experts, not 4
    out = tmp_path / "stacked"
    out.mkdir()
    save_file(stacked, str(out / "model.safetensors"))
    config = transformers.AutoConfig.from_pretrained(source)
    layout = QWEN3_5_MOE.layout(config)
    checkpoint = TextCheckpoint(out)
    _, linears = bridge_linears(config, layout, checkpoint)
    problems, _ = checkpoint_size_problems(QWEN3_5_MOE, config, layout, linears, checkpoint)
    assert problems == [
        "expert count: config num_experts (config_fields.experts) = 4, the checkpoint holds 3 experts in layer 0 "
        "(model.layers.0.mlp.experts.down_proj ...)"
    ]


def test_an_expert_width_is_read_whichever_way_the_experts_are_stacked(tiny_model_dir, tmp_path):
    """gpt-oss stores its down projections as [experts, width, hidden], transformers' other fused experts as
    [experts, hidden, width]: the width is the dimension that is not the hidden size."""
    import torch
    from safetensors.torch import load_file, save_file

    from model_support.core.bridge_linears import bridge_linears

    source = tiny_model_dir("qwen3.5-moe")
    config = transformers.AutoConfig.from_pretrained(source)
    layout = QWEN3_5_MOE.layout(config)
    tensors = load_file(str(source / "model.safetensors"))
    stacked: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            stacked[name] = tensor
        elif tail.startswith("0."):  # [experts, 2 x width, hidden] and [experts, width, hidden], as gpt-oss stores
            per_expert = [f"{head}.mlp.experts.{e}" for e in range(layout.moe.num_experts)]
            gate_up = [
                torch.cat([tensors[f"{e}.gate_proj.weight"], tensors[f"{e}.up_proj.weight"]]) for e in per_expert
            ]
            stacked[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
            stacked[f"{head}.mlp.experts.down_proj"] = torch.stack(
                [tensors[f"{e}.down_proj.weight"].T for e in per_expert]
            )
    out = tmp_path / "stacked"
    out.mkdir()
    save_file(stacked, str(out / "model.safetensors"))
    checkpoint = TextCheckpoint(out)
    _, linears = bridge_linears(config, layout, checkpoint)
    down = next(n for n in checkpoint.get_all_keys() if n.endswith("mlp.experts.down_proj"))
    assert checkpoint.shape(down)[1:] == (layout.moe.expert_intermediate_size, text_config(config).hidden_size)
    # The declared per-expert targets are found in the stacked tensors' names.
    names = checkpoint.get_all_keys()
    assert uncovered_targets(QWEN3_5_MOE, checkpoint_modules(names), names) == []
    problems, details = checkpoint_size_problems(QWEN3_5_MOE, config, layout, linears, checkpoint)
    assert problems == [] and details[0].startswith("MoE sizes match the checkpoint's tensor shapes: 4 experts")
    narrow = replace(
        QWEN3_5_MOE, config_fields=replace(QWEN3_5_MOE.config_fields, expert_intermediate_size="hidden_size")
    )
    problems, _ = checkpoint_size_problems(narrow, config, narrow.layout(config), linears, checkpoint)
    assert problems[0].startswith("expert width: config hidden_size (config_fields.expert_intermediate_size) = 64,")


@pytest.mark.parametrize(
    ("exclusion", "message"),
    [
        (LoraExclusion("out_proj", TargetScope.GDN, " "), "lora exclusion 'out_proj' (gdn) needs a reason"),
        (LoraExclusion("router", TargetScope.EXPERT, "x"), "lora exclusion 'router' (expert): not a LoRA linear"),
        (LoraExclusion("in_proj", TargetScope.GDN, "x"), "lora exclusion 'in_proj' (gdn) is also a LoRA target"),
    ],
)
def test_exclusions_are_validated_with_the_declaration(exclusion: LoraExclusion, message: str):
    spec = _without(QWEN3_5, "out_proj", TargetScope.GDN)
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        replace(spec, lora_exclusions=(exclusion,))
    twice = LoraExclusion("out_proj", TargetScope.GDN, "x")
    with pytest.raises(SpecError, match=r"lora exclusion 'out_proj' \(gdn\) declared twice"):
        replace(spec, lora_exclusions=(twice, twice))


def test_show_prints_the_exclusions(monkeypatch):
    from typer.testing import CliRunner

    from model_support.core import cli

    why = "the family trains the GDN input projections only"
    spec = replace(
        _without(QWEN3_5, "out_proj", TargetScope.GDN),
        lora_exclusions=(LoraExclusion("out_proj", TargetScope.GDN, why),),
    )
    registry = Registry(handlers={spec.name: RegisteredHandler(spec, PluginInfo("test", "test", "0"))})
    monkeypatch.setattr(cli, "_registry", lambda *args, **kwargs: registry)
    monkeypatch.setattr(cli.console, "width", 200)
    text = CliRunner().invoke(cli.app, ["show", "qwen3.5"])
    assert text.exit_code == 0, text.output
    assert "LoRA exclusions (mapped linears left untrained)" in text.output
    assert f"│ gdn   │ out_proj │ {why} │" in text.output
    data = json.loads(CliRunner().invoke(cli.app, ["show", "qwen3.5", "--json"]).output)
    assert data["lora_exclusions"] == [{"megatron": "out_proj", "scope": "gdn", "reason": why}]


def test_every_builtin_declaration_covers_what_its_bridge_maps(tiny_model_dir, tmp_path):
    for spec in (QWEN3_MOE, QWEN3_5):
        result = _architecture(spec, tiny_model_dir(spec.name), tmp_path)
        assert result.status == "pass", (spec.name, result.summary)


def test_targets_are_checked_against_the_names_a_checkpoint_stores_not_the_in_memory_modules():
    """transformers >= 5 fuses Mixtral's experts in memory (mlp.experts.gate_up_proj); its checkpoints, PEFT adapters
    and vLLM keep block_sparse_moe.experts.<e>.w1 / w3 / w2: the names transformers' own conversion saves."""
    from model_support.core.validate import missing_targets

    config = transformers.MixtralConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=16, num_local_experts=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=64, architectures=["MixtralForCausalLM"],
    )  # fmt: skip
    model = build_meta_model(config)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())
    names = stored_names(model)
    assert {"model.layers.0.block_sparse_moe.experts.1.w3", "model.layers.0.block_sparse_moe.gate"} <= names[0]
    stored = (LoraTarget("linear_fc1", ("w1", "w3"), TargetScope.EXPERT),)
    in_memory = (LoraTarget("linear_fc1", ("gate_up_proj",), TargetScope.EXPERT),)
    spec = replace(QWEN3_MOE, lora_targets=targets.ATTENTION + stored)
    assert missing_targets(spec, names) == []
    assert missing_targets(replace(spec, lora_targets=targets.ATTENTION + in_memory), names) == ["expert:gate_up_proj"]
    assert missing_targets(replace(spec, lora_targets=targets.ATTENTION + targets.EXPERTS), names) == [
        "expert:gate_proj", "expert:up_proj", "expert:down_proj",
    ]  # fmt: skip
