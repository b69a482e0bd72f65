"""`model-support new-handler`: generate a plugin, pip-install it, see it listed, run its own tests."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from model_support.core.cli import app, main
from model_support.core.spec import HandlerSpec, TargetScope, Topology
from model_support.handlers.qwen3_5 import QWEN3_5_MOE
from model_support.plugins.new_handler import NewHandlerError, generate, template_context
from tests.helpers import pip_install_target, run_cli

QWEN2_CONFIG = Path(__file__).parent / "fixtures" / "qwen2.5-0.5b.json"


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("generated")
    result = CliRunner().invoke(
        app,
        ["new-handler", "--config", str(QWEN2_CONFIG), "--no-input", "--output-dir", str(out),
         "--description", "Qwen2 / Qwen2.5 dense decoder.", "--author", "A. Author"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    package = out / "model-support-qwen2"
    assert result.stdout.splitlines()[0] == f"created {package}"
    return package


@pytest.fixture(scope="module")
def site(generated: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install_target(generated, tmp_path_factory.mktemp("site"))


def load_handler(package: Path) -> HandlerSpec:
    """Import the generated declaration straight from its file."""
    path = next((package / "src").glob("*/handler.py"))
    spec = importlib.util.spec_from_file_location(f"generated_{package.name.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HANDLER


def test_generated_package_declares_the_family_from_its_config(generated: Path):
    handler = load_handler(generated)
    assert (handler.name, handler.architectures, handler.model_types) == ("qwen2", ("Qwen2ForCausalLM",), ("qwen2",))
    assert handler.topology is Topology.DENSE and not handler.linear_attention
    assert handler.hf_target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert handler.megatron_target_modules == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert [(d.package, d.minimum) for d in handler.dependencies] == [("transformers", "4.40.1")]
    assert handler.codec is not None and handler.codec.name == "qwen2"
    # The real config ships unchanged as the reference config; the tiny fixture is the shrunk replica config.
    assert json.loads(handler.reference_config.read_text()) == json.loads(QWEN2_CONFIG.read_text())
    tiny = json.loads((generated / "tests" / "fixtures" / "tiny-config.json").read_text())
    assert (tiny["architectures"], tiny["hidden_size"], tiny["num_hidden_layers"]) == (["Qwen2ForCausalLM"], 64, 2)
    # Qwen2 has no head_dim: hidden / heads becomes 32 (vLLM's CPU attention minimum), GQA stays GQA (14:2 -> 2:1).
    assert (tiny["vocab_size"], tiny["num_attention_heads"], tiny["num_key_value_heads"]) == (512, 2, 1)
    pyproject = (generated / "pyproject.toml").read_text()
    assert '[project.entry-points.model_support]\n"qwen2" = "model_support_qwen2"' in pyproject
    assert 'authors = [{ name = "A. Author" }]' in pyproject


def test_installed_generated_plugin_is_listed(site: Path):
    result = run_cli("list", "--json", site=site)
    assert result.returncode == 0, result.stderr
    rows = {row["handler"]: row for row in json.loads(result.stdout)}
    assert rows["qwen2"] == {
        "handler": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "plugin": "qwen2",
        "distribution": "model-support-qwen2",
        "version": "0.1.0",
        "vllm_lora": "native",
    }
    assert {"qwen3", "qwen3.5"} <= set(rows)


def test_generated_plugins_own_tests_pass(generated: Path, site: Path, tmp_path: Path):
    junit = tmp_path / "junit.xml"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--model-support-stage", "architecture",
         f"--junitxml={junit}"],
        cwd=generated, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(site)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors"), suite.get("skipped")) == (
        "6",
        "0",
        "0",
        "0",
    )
    names = {case.get("name") for case in suite.iter("testcase")}
    assert {"test_stage[qwen2-dependencies]", "test_stage[qwen2-architecture]"} <= names


def test_gdn_moe_config_gives_the_builtin_qwen3_5_moe_declaration(tmp_path: Path):
    # From nothing but the Qwen3.5-35B-A3B config.json, the template writes what the built-in handler declares.
    context = template_context(str(QWEN3_5_MOE.reference_config), name="q35moe")
    assert (context["topology"], context["linear_attention"]) == ("moe", True)
    # The targets are read off megatron-bridge's Qwen35MoEBridge mappings, and they are the standard ones.
    assert context["_lora_targets"] == (
        "targets.ATTENTION + targets.GATED_DELTANET + targets.EXPERTS + targets.SHARED_EXPERT"
    )
    # The shared expert's sigmoid gate is a linear the bridge maps as a gate weight, not as a LoRA-able linear.
    assert context["_targets_note"] == (
        "Derived from megatron-bridge's Qwen35MoEBridge mappings. Not mapped by it (no LoRA here): shared_expert_gate."
    )
    assert context["disable_mtp_for_training"] is True and context["vllm_lora_native"] is True
    handler = load_handler(generate(context, tmp_path))
    assert handler.lora_targets == QWEN3_5_MOE.lora_targets
    assert (handler.topology, handler.linear_attention, handler.runtime) == (
        QWEN3_5_MOE.topology,
        QWEN3_5_MOE.linear_attention,
        QWEN3_5_MOE.runtime,
    )
    assert handler.architectures == QWEN3_5_MOE.architectures[:1]
    tiny = json.loads((tmp_path / "model-support-q35moe" / "tests" / "fixtures" / "tiny-config.json").read_text())
    assert tiny["text_config"]["num_experts"] == 4 and tiny["text_config"]["layer_types"][-1] == "full_attention"


def test_targets_the_standard_tuples_lack_come_from_the_bridge_and_unmapped_linears_are_named(tmp_path: Path):
    """DeepSeek-V3's latent attention has linears no standard tuple names: the bridge's mappings give them."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2)
    config.architectures = ["DeepseekV3ForCausalLM"]
    path = tmp_path / "deepseek.json"
    path.write_text(config.to_json_string())
    context = template_context(str(path), name="dsv3")
    handler = load_handler(generate(context, tmp_path))
    attention = {(t.megatron, t.hf) for t in handler.targets(TargetScope.ATTENTION)}
    assert attention == {
        ("linear_q_down_proj", ("q_a_proj",)),
        ("linear_q_up_proj", ("q_b_proj",)),
        ("linear_kv_down_proj", ("kv_a_proj_with_mqa",)),
        ("linear_kv_up_proj", ("kv_b_proj",)),
        ("linear_proj", ("o_proj",)),
    }
    assert {t.megatron for t in handler.targets(TargetScope.EXPERT)} == {"linear_fc1", "linear_fc2"}
    assert "Derived from megatron-bridge's DeepSeekV3Bridge mappings." in context["_targets_note"]


def test_without_a_bridge_the_declaration_says_its_targets_are_not_derived(tmp_path: Path):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=2)
    config.architectures = ["GPT2LMHeadModel"]
    path = tmp_path / "gpt2.json"
    path.write_text(config.to_json_string())
    context = template_context(str(path), name="gpt2")
    assert context["_targets_note"].startswith("Not derived from a bridge: megatron-bridge has no bridge for")
    source = (generate(context, tmp_path) / "src" / "model_support_gpt2" / "handler.py").read_text()
    assert "Not derived from a bridge" in source and "could not read" in source


def test_bad_input_is_a_one_line_error(
    tmp_path: Path, generated: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    with pytest.raises(NewHandlerError, match=r"^handler name 'My Family' must be lower-case letters"):
        template_context(str(QWEN2_CONFIG), name="My Family")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    with pytest.raises(NewHandlerError, match=r"config\.json must name `architectures` and `model_type`$"):
        template_context(str(tmp_path / "config.json"))
    # Through the real entry point: a one-line error and exit status 2.
    monkeypatch.setattr(
        sys,
        "argv",
        ["model-support", "new-handler", "-c", str(QWEN2_CONFIG), "--no-input", "-o", str(generated.parent)],
    )
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("error: ") and len(stderr.strip().splitlines()) == 1
    assert stderr.rstrip().endswith("pass --overwrite or choose another --output-dir")


def test_an_already_claimed_architecture_is_a_warning(tmp_path: Path):
    config = QWEN3_5_MOE.reference_config.parent / "qwen3-0.6b.json"
    result = CliRunner().invoke(
        app, ["new-handler", "-c", str(config), "--no-input", "-o", str(tmp_path), "--name", "my-qwen3"]
    )
    assert result.exit_code == 0, result.output
    assert "warning: Qwen3ForCausalLM is already claimed by handler 'qwen3' (model-support 0.1.0)" in result.stderr
    assert (tmp_path / "model-support-my-qwen3" / "src" / "model_support_my_qwen3" / "handler.py").is_file()


def test_interactive_prompts_offer_what_the_config_says(tmp_path: Path):
    # 15 prompts; answer the first (handler name) and accept the config-derived default for the rest.
    result = CliRunner().invoke(
        app, ["new-handler", "-c", str(QWEN2_CONFIG), "-o", str(tmp_path)], input="my-q2\n" + "\n" * 14
    )
    assert result.exit_code == 0, result.output
    for prompt in ("handler_name (qwen2)", "architecture (Qwen2ForCausalLM)", "transformers_floor (4.40.1)"):
        assert prompt in result.output
    assert "package_name (model_support_my_q2)" in result.output
    handler = load_handler(tmp_path / "model-support-my-q2")
    assert (handler.name, handler.architectures, handler.topology) == ("my-q2", ("Qwen2ForCausalLM",), Topology.DENSE)
