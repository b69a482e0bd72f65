"""Tests of the OLMoE handler, through model-support's pytest plugin fixtures."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_support.core.registry import load_registry
from model_support.core.spec import LoraTarget, TargetScope
from model_support.core.tiny import build_tiny
from safetensors.torch import load_file
from transformers import AutoConfig, OlmoeConfig
from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

from model_support_olmoe.handler import OLMOE, REFERENCE_CONFIG

NORM_WORKER = Path(__file__).with_name("norm_worker.py")


def test_the_installed_plugin_registers_the_handler():
    registry = load_registry()
    entry = registry.for_architecture("OlmoeForCausalLM")
    assert entry.spec == OLMOE
    assert (entry.plugin.name, entry.plugin.distribution) == ("olmoe", "model-support-olmoe")


def test_reference_config_has_the_published_olmoe_1b_7b_shapes():
    config = OlmoeConfig(**json.loads(REFERENCE_CONFIG.read_text()))
    layout = OLMOE.layout(config)
    assert (layout.num_layers, layout.gdn_layers, layout.moe.dense_layers) == (16, (), ())
    assert (layout.moe.num_experts, layout.moe.top_k, layout.moe.expert_intermediate_size) == (64, 8, 1024)
    assert not layout.moe.has_shared_expert
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (2048, 16, 16)
    assert (config.vocab_size, config.norm_topk_prob, config.clip_qkv) == (50304, False, None)
    assert OLMOE.config_problems(config) == []


def test_the_q_k_norm_split_over_two_ranks_is_olmoes_norm_over_the_whole_projection(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "tp2.safetensors"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([*cmd, str(NORM_WORKER), str(out)], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = load_file(str(out))
    # The same draws as the worker's, through transformers' OlmoeRMSNorm over heads * head_dim.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 4, 8, generator=generator).requires_grad_()
    norm = OlmoeRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=generator))
    upstream = torch.randn(3, 2, 4, 8, generator=generator)
    y = norm(x.flatten(-2)).view_as(x)
    y.backward(upstream)
    assert (got["y"] - y).abs().max() < 1e-5
    assert (got["x_grad"] - x.grad).abs().max() < 1e-5
    assert (got["w_grad"].flatten() - norm.weight.grad).abs().max() < 1e-5


def _architecture(spec, model_dir: Path, tmp_path: Path):
    from model_support.validation.context import CheckContext
    from model_support.validation.runner import plan, run_checks
    from model_support.validation.stage_registry import load_stages

    registry = load_registry()
    handler = dataclasses.replace(registry.get("olmoe"), spec=spec)
    config = AutoConfig.from_pretrained(model_dir)
    ctx = CheckContext(
        target="broken-olmoe", model_dir=model_dir, handler=handler, config=config,
        layout=spec.layout(config), registry=registry, workdir=tmp_path, tiny=True,
    )  # fmt: skip
    report = run_checks(ctx, plan(load_stages(registry).classes(), ["architecture"]))
    return {r.stage: r for r in report.results}["architecture"]


@pytest.fixture(scope="module")
def tiny_olmoe(tmp_path_factory) -> Path:
    return build_tiny(json.loads(REFERENCE_CONFIG.read_text()), tmp_path_factory.mktemp("tiny"), seed=0, spec=OLMOE)


def test_expert_targets_the_checkpoint_does_not_name_fail_architecture(tiny_olmoe, tmp_path):
    # Mixtral's expert names: OLMoE's checkpoint has gate_proj / up_proj / down_proj per expert.
    wrong = (
        LoraTarget("linear_fc1", ("w1", "w3"), TargetScope.EXPERT),
        LoraTarget("linear_fc2", ("w2",), TargetScope.EXPERT),
    )
    result = _architecture(
        dataclasses.replace(OLMOE, lora_targets=OLMOE.targets(TargetScope.ATTENTION) + wrong), tiny_olmoe, tmp_path
    )
    assert result.status.value == "fail", result.summary
    assert "target modules missing from OlmoeForCausalLM: expert:w1, expert:w3, expert:w2" in result.summary
    assert "the checkpoint names no module for expert:w1" in result.summary


def test_a_config_with_renormalised_routing_fails_architecture(tiny_olmoe, tmp_path):
    model_dir = tmp_path / "renormalised"
    model_dir.mkdir()
    raw = json.loads((tiny_olmoe / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "norm_topk_prob": True}))
    result = _architecture(OLMOE, model_dir, tmp_path)
    assert result.status.value == "fail"
    assert result.summary == (
        "config sets norm_topk_prob=True, the handler supports only False: megatron-bridge's OlMoEBridge does not "
        "renormalise the top-k routing weights"
    )


@pytest.mark.model_support("olmoe", tiny=True)
def test_stage(model_support_stage):
    model_support_stage.check()
