"""`model-support new-handler`: generate a plugin, pip-install it, see it listed, run its own tests."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from packaging.requirements import Requirement
from typer.testing import CliRunner

from model_support.core.cli import app, main
from model_support.core.discovery import load_config, locate
from model_support.core.layout import ConfigFields
from model_support.core.spec import HandlerSpec, TargetScope, Topology
from model_support.handlers.configs import CONFIGS
from model_support.handlers.qwen3_5 import QWEN3_5_MOE
from model_support.plugins.new_handler import LayoutOptions, NewHandlerError, generate, template_context
from tests.helpers import pip_install_target, run_cli

FIXTURES = Path(__file__).parent / "fixtures"
QWEN2_CONFIG = FIXTURES / "qwen2.5-0.5b.json"
# Published configs whose layout fields have other names than transformers' common ones.
MIXTRAL = FIXTURES / "mixtral-8x7b.json"  # mistralai/Mixtral-8x7B-v0.1: no megatron-bridge bridge
GLM = FIXTURES / "glm-4.5-air.json"  # zai-org/GLM-4.5-Air
GPT_OSS = FIXTURES / "gpt-oss-20b.json"  # openai/gpt-oss-20b
ROOT = Path(__file__).parents[2]


def pyproject_transformers_floor() -> str:
    """The transformers floor pyproject.toml states."""
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(Requirement(r).specifier for r in requirements if Requirement(r).name == "transformers")
    return next(s.version for s in spec if s.operator == ">=")


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
    # The oldest releases model-support tests (not the release that saved the config, 4.40.1).
    assert [(d.package, d.minimum, d.extra) for d in handler.dependencies] == [
        ("transformers", pyproject_transformers_floor(), None),
        ("megatron-core", "0.19.2", "megatron"),
        ("megatron-bridge", "0.6.2", "megatron"),
    ]
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
    floor = f"transformers_floor ({pyproject_transformers_floor()})"
    for prompt in ("handler_name (qwen2)", "architecture (Qwen2ForCausalLM)", floor):
        assert prompt in result.output
    assert "package_name (model_support_my_q2)" in result.output
    handler = load_handler(tmp_path / "model-support-my-q2")
    assert (handler.name, handler.architectures, handler.topology) == ("my-q2", ("Qwen2ForCausalLM",), Topology.DENSE)


def _gpt2_config(directory: Path) -> Path:
    """A family megatron-bridge has no bridge for (nor does it come close: no experts, fused attention)."""
    from transformers import GPT2Config

    config = GPT2Config(n_layer=2)
    config.architectures = ["GPT2LMHeadModel"]
    path = directory / "gpt2.json"
    path.write_text(config.to_json_string())
    return path


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """{handler name: (config, generated package)} for the shipped Qwen3 config, Mixtral, GLM-4.5-Air, gpt-oss and
    GPT-2 (no bridge), each generated from its config.json alone."""
    out = tmp_path_factory.mktemp("families")
    configs = {
        "new-qwen3": CONFIGS / "qwen3-0.6b.json",
        "new-mixtral": MIXTRAL,
        "new-glm4-moe": GLM,
        "new-gpt-oss": GPT_OSS,
        "new-gpt2": _gpt2_config(out),
    }
    return {name: (config, generate(template_context(str(config), name=name), out)) for name, config in configs.items()}


@pytest.fixture
def import_handler(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], Any]]:
    """Import a generated package's ``handler`` module the way an installed plugin is: by name, off sys.path."""
    imported: list[str] = []

    def load(package: Path) -> Any:
        name = next((package / "src").iterdir()).name
        monkeypatch.syspath_prepend(str(package / "src"))
        imported.append(name)
        return importlib.import_module(f"{name}.handler")

    yield load
    for name in imported:
        for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[module]


def bridge_numbers(config: Any) -> tuple[int, int, int, int, tuple[int, ...]]:
    """(experts, top-k, expert width, shared expert width, dense layers) of the Megatron model megatron-bridge
    builds for ``config``."""
    from model_support.core.megatron.builder import family_bridge

    bridge, tcfg = family_bridge(config)
    provider = bridge.provider_bridge(SimpleNamespace(config=tcfg, generation_config=None))
    freq = provider.moe_layer_freq
    assert isinstance(freq, list) or freq == 1, freq  # these families: a 0/1 list, or every layer MoE
    dense = tuple(i for i, moe in enumerate(freq) if not moe) if isinstance(freq, list) else ()
    return (
        provider.num_moe_experts,
        provider.moe_router_topk,
        provider.moe_ffn_hidden_size,
        provider.moe_shared_expert_intermediate_size or 0,
        dense,
    )


@pytest.mark.parametrize(
    ("name", "numbers", "bridge"),
    [
        # Experts in num_local_experts, as wide as intermediate_size; megatron-bridge has no Mixtral bridge.
        ("new-mixtral", (8, 2, 14336, 0, ()), None),
        # n_routed_experts, one shared expert of moe_intermediate_size (n_shared_experts), first layer dense.
        ("new-glm4-moe", (128, 8, 1408, 1408, (0,)), "GLM45Bridge"),
        # num_local_experts as wide as intermediate_size; sliding_attention layers.
        ("new-gpt-oss", (32, 4, 2880, 0, ()), "GPTOSSBridge"),
    ],
)
def test_moe_configs_with_their_own_field_names_need_no_edit(
    families: dict[str, tuple[Path, Path]], import_handler: Any, name: str, numbers: tuple, bridge: str | None
):
    config_path, package = families[name]
    handler = import_handler(package).HANDLER
    config = load_config(locate(str(config_path)))
    layout = handler.layout(config)
    moe = layout.moe
    assert handler.topology is Topology.MOE
    got = (moe.num_experts, moe.top_k, moe.expert_intermediate_size, moe.shared_expert_intermediate_size)
    assert (*got, moe.dense_layers) == numbers
    # Every layer is a layer kind model-support builds: gpt-oss's sliding-window layers are full attention.
    assert layout.layer_types == ("full_attention",) * config.num_hidden_layers
    source = next((package / "src").glob("*/handler.py")).read_text()
    if bridge:
        assert bridge_numbers(config) == numbers
        assert f"checked against the Megatron model megatron-bridge's {bridge} builds" in source
    else:
        assert "not checked against a bridge" in source


def test_the_declaration_holds_exactly_what_differs_from_the_defaults(
    families: dict[str, tuple[Path, Path]], import_handler: Any
):
    def fields(name: str) -> ConfigFields:
        return import_handler(families[name][1]).HANDLER.config_fields

    # num_local_experts is one of the default expert fields; the expert width is not moe_intermediate_size.
    assert fields("new-mixtral") == ConfigFields(expert_intermediate_size="intermediate_size")
    assert fields("new-gpt-oss") == ConfigFields(
        expert_intermediate_size="intermediate_size",
        layer_kinds={"sliding_attention": "full_attention", "full_attention": "full_attention"},
    )
    glm = fields("new-glm4-moe")
    assert glm.experts == ("n_routed_experts",)
    assert (glm.experts_per_token, glm.expert_intermediate_size) == ("num_experts_per_tok", "moe_intermediate_size")
    # Small named functions of the config, read from its own fields.
    source = (families["new-glm4-moe"][1] / "src" / "model_support_new_glm4_moe" / "handler.py").read_text()
    assert "    return cfg.n_shared_experts * cfg.moe_intermediate_size\n" in source
    assert "    return range(cfg.first_k_dense_replace)\n" in source
    # Targets no standard tuple holds are a named constant, one entry a line, in Megatron order, within 120 columns.
    gpt_oss = (families["new-gpt-oss"][1] / "src" / "model_support_new_gpt_oss" / "handler.py").read_text()
    assert "    lora_targets=targets.ATTENTION + EXPERT_TARGETS,\n" in gpt_oss
    assert '    LoraTarget("linear_fc1", ("gate_up_proj",), TargetScope.EXPERT),\n' in gpt_oss
    assert gpt_oss.index('"linear_fc1"') < gpt_oss.index('"linear_fc2"')
    assert max(len(line) for line in gpt_oss.splitlines()) <= 120
    # Qwen3 keeps its layout under transformers' common names: nothing to declare.
    assert fields("new-qwen3") == ConfigFields()
    qwen3 = (families["new-qwen3"][1] / "src" / "model_support_new_qwen3" / "handler.py").read_text()
    assert "config_fields=" not in qwen3


@pytest.mark.parametrize("name", ["new-qwen3", "new-mixtral", "new-glm4-moe", "new-gpt-oss", "new-gpt2"])
def test_every_generated_python_file_parses(families: dict[str, tuple[Path, Path]], name: str):
    package = families[name][1]
    files = sorted(package.rglob("*.py"))
    assert [f.name for f in files] == ["__init__.py", "handler.py", "test_handler.py"]
    for path in files:
        ast.parse(path.read_text(), filename=str(path))


def test_a_bridge_error_becomes_comment_lines(families: dict[str, tuple[Path, Path]]):
    # megatron-bridge's message lists every architecture it supports over many lines: one line of it is kept.
    source = (families["new-gpt2"][1] / "src" / "model_support_new_gpt2" / "handler.py").read_text()
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if "Not derived from a bridge" in line)
    end = next(i for i, line in enumerate(lines) if line.startswith("    lora_targets="))
    assert all(line.startswith("    # ") for line in lines[start:end]) and end - start == 2
    assert " ".join(line.removeprefix("    # ") for line in lines[start:end]) == (
        "Not derived from a bridge: megatron-bridge has no bridge for GPT2LMHeadModel. Check these names against the "
        "checkpoint."
    )
    assert "Currently supported architectures" not in source


def _variant(tmp_path: Path, base: Path, **changes: Any) -> Path:
    raw = json.loads(base.read_text())
    raw.update(changes)
    path = tmp_path / base.name
    path.write_text(json.dumps(raw))
    return path


def _refusal(config: Path, **kwargs: Any) -> str:
    """The one-line error template_context refuses ``config`` with."""
    with pytest.raises(NewHandlerError) as error:
        template_context(str(config), **kwargs)
    return str(error.value)


def test_errors_name_the_configs_own_fields_and_the_option_that_settles_them(tmp_path: Path):
    # GLM45Bridge builds one shared expert of moe_intermediate_size whatever n_shared_experts says.
    two_shared = _variant(tmp_path, GLM, n_shared_experts=2)
    message = _refusal(two_shared, name="glm2")
    assert "megatron-bridge's GLM45Bridge builds a shared expert 1408 wide" in message
    assert "the config sets none of shared_expert_intermediate_size" in message
    assert "the config sets n_shared_experts=2 (routed experts moe_intermediate_size=1408)" in message
    assert "pass --shared-expert-width-field NAME" in message and "or --shared-experts-field NAME" in message
    # The option settles it, and the declaration says so.
    context = template_context(
        str(two_shared), name="glm2", options=LayoutOptions(shared_expert_width="moe_intermediate_size")
    )
    assert 'shared_expert_intermediate_size="moe_intermediate_size"' in context["_config_fields"]
    # An option the bridge contradicts is refused with both numbers.
    with pytest.raises(NewHandlerError, match=r"GLM45Bridge builds: experts 8 \(bridge: 128\); fix the field options$"):
        template_context(str(GLM), name="glm", options=LayoutOptions(experts="num_experts_per_tok"))
    # Without a bridge, two expert counts: the error names both and the option.
    two_counts = _variant(tmp_path, MIXTRAL, n_routed_experts=16)
    with pytest.raises(NewHandlerError, match=r"num_local_experts=8, n_routed_experts=16: which is the expert count\? "
                       r"pass --experts-field NAME\)$"):  # fmt: skip
        template_context(str(two_counts), name="mixtral")
    with pytest.raises(
        NewHandlerError, match=r"--dense-layers-field first_k_dense_replace: .*the config has no experts"
    ):
        template_context(str(QWEN2_CONFIG), options=LayoutOptions(dense_layers="first_k_dense_replace"))


def test_layer_kind_option_through_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    kinds = ["chunked_attention", "full_attention"] * 12
    chunked = _variant(tmp_path, GPT_OSS, layer_types=kinds)
    with pytest.raises(NewHandlerError, match=r"pass --layer-kind chunked_attention=full_attention \(or"):
        template_context(str(chunked), name="chunky")
    result = CliRunner().invoke(
        app,
        ["new-handler", "-c", str(chunked), "--no-input", "-o", str(tmp_path), "--name", "chunky",
         "--layer-kind", "chunked_attention=full_attention", "--expert-width-field", "intermediate_size"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    source = (tmp_path / "model-support-chunky" / "src" / "model_support_chunky" / "handler.py").read_text()
    assert 'layer_kinds={"chunked_attention": "full_attention", "full_attention": "full_attention"}' in source
    ast.parse(source)
    # A malformed value is a one-line error.
    monkeypatch.setattr(sys, "argv", ["model-support", "new-handler", "-c", str(chunked), "--layer-kind", "chunked"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --layer-kind 'chunked': write it KIND=AS, e.g. sliding_attention=full_attention"
    )


def test_without_a_bridge_experts_are_named_as_the_checkpoint_stores_them(
    families: dict[str, tuple[Path, Path]], import_handler: Any
):
    """No bridge maps Mixtral: its expert targets come from transformers' own checkpoint conversion (w1 and w3 into
    the fused gate_up_proj, w2 into down_proj), the names its checkpoints, PEFT adapters and vLLM use."""
    from model_support.core.validate import build_meta_model, missing_targets, stored_names

    config_path, package = families["new-mixtral"]
    handler = import_handler(package).HANDLER
    experts = [t for t in handler.lora_targets if t.scope is TargetScope.EXPERT]
    assert [(t.megatron, t.hf) for t in experts] == [("linear_fc1", ("w1", "w3")), ("linear_fc2", ("w2",))]
    assert missing_targets(handler, stored_names(build_meta_model(load_config(locate(str(config_path)))))) == []


def test_a_handler_that_would_not_load_is_not_written(tmp_path: Path):
    """Layers declared Gated DeltaNet in a model whose bridge maps no GDN projection: the declaration the config
    gives is written nowhere, and the error names why it does not load."""
    config = json.loads(QWEN2_CONFIG.read_text())
    config["layer_types"] = ["mamba"] * config["num_hidden_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    context = template_context(
        str(path), name="hybrid", options=LayoutOptions(layer_kinds={"mamba": "linear_attention"})
    )
    out = tmp_path / "out"
    with pytest.raises(NewHandlerError, match=r"^the handler it would write does not load \(.*SpecError: .*GDN"):
        generate(context, out)
    assert not out.exists()


def test_a_bridge_that_needs_a_missing_package_is_named_as_such(monkeypatch: pytest.MonkeyPatch):
    """megatron-bridge installed, the family's bridge importing a package this machine lacks (Nemotron-H's needs
    mamba_ssm): the error names that package, not model-support's megatron extra."""
    from model_support.core.megatron import builder
    from model_support.plugins.bridge_targets import BridgeTargetsError
    from model_support.plugins.new_handler import bridge_layout

    def lacks_mamba(_config: Any) -> Any:
        raise ModuleNotFoundError("No module named 'mamba_ssm'", name="mamba_ssm")

    monkeypatch.setattr(builder, "family_bridge", lacks_mamba)
    config = SimpleNamespace(architectures=["NemotronHForCausalLM"])
    with pytest.raises(BridgeTargetsError) as error:
        bridge_layout(config)
    assert str(error.value) == (
        "megatron-bridge's bridge for NemotronHForCausalLM does not import here (No module named 'mamba_ssm'): "
        "install mamba_ssm to read the Megatron model it builds"
    )


def test_one_run_names_everything_the_config_leaves_open(tmp_path: Path):
    """A layer kind model-support does not know and two expert counts: both questions in one line, each with the
    option that settles it; answering both goes through."""
    config = _variant(tmp_path, MIXTRAL, layer_types=["chunked_attention"] * 32, n_routed_experts=16)
    message = _refusal(config, name="chunky")
    assert "cannot read the layer layout (2 things the config leaves open: (1) the config's layer_types has " in message
    assert "pass --layer-kind chunked_attention=full_attention (or =linear_attention)" in message
    assert "; (2) the config sets num_local_experts=8, n_routed_experts=16: which is the expert count? " in message
    assert message.endswith("pass --experts-field NAME)") and "\n" not in message
    options = LayoutOptions(layer_kinds={"chunked_attention": "full_attention"}, experts="num_local_experts")
    fields = template_context(str(config), name="chunky", options=options)["_config_fields"]
    assert '"chunked_attention": "full_attention"' in fields
