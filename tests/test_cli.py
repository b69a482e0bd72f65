"""The model-support command line, run as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from tests.helpers import run_cli


def test_list_shows_builtin_handlers_with_their_plugin():
    result = run_cli("list")
    assert result.returncode == 0, result.stderr
    for name in ("qwen3", "qwen3-moe", "qwen3.5", "qwen3.5-moe"):
        assert f"│ {name} " in result.stdout
    assert "builtin (model-support 0.1.0)" in result.stdout
    assert "native" in result.stdout  # every built-in family is served with native LoRA (docs/serving.md)


def test_show_by_handler_or_architecture():
    by_arch = run_cli("show", "Qwen3_5MoeForConditionalGeneration", "--json")
    assert by_arch.returncode == 0, by_arch.stderr
    data = json.loads(by_arch.stdout)
    assert data["name"] == "qwen3.5-moe"
    assert data["topology"] == "moe" and data["linear_attention"] is True
    assert {"megatron": "in_proj", "hf": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"], "scope": "gdn"} in (
        data["lora_targets"]
    )
    assert data["runtime"]["disable_mtp_for_training"] is True
    assert data["plugin"]["distribution"] == "model-support"
    text = run_cli("show", "qwen3")
    assert "LoRA targets" in text.stdout and "linear_qkv" in text.stdout
    assert "megatron-core >= 0.19.2 [extra megatron]" in text.stdout  # not swallowed as rich markup


def test_show_unknown_is_one_line_error():
    result = run_cli("show", "llama")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: 'llama' is neither a handler nor a claimed architecture (handlers: qwen3, qwen3-moe, qwen3.5, "
        "qwen3.5-moe); add a handler plugin for it (`model-support new-handler`, see docs/adding-a-model.md)"
    ]


def test_check_tiny_writes_every_report_format(tmp_path):
    out = tmp_path / "r"
    result = run_cli(
        "check", "qwen3-moe", "--tiny", "-s", "architecture", "--workdir", str(tmp_path / "w"),
        "--json", str(out / "r.json"), "--markdown", str(out / "r.md"), "--junit", str(out / "r.xml"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed, 0 failed, 0 skipped" in result.stdout
    data = json.loads((out / "r.json").read_text())
    assert data["tiny"] is True and data["handler"] == "qwen3-moe"
    arch = next(r for r in data["results"] if r["stage"] == "architecture")
    assert arch["metrics"]["experts"] == 4
    # The run owned a fresh subdirectory of --workdir, kept and named on exit.
    (run_dir,) = (tmp_path / "w").glob("model-support-run-*")
    assert (run_dir / "tiny-model" / "config.json").is_file()
    assert f"artifacts and logs of this run: {run_dir}" in result.stderr.replace("\n", "")
    assert "| architecture | PASS |" in (out / "r.md").read_text()
    assert ET.parse(out / "r.xml").getroot().find("testsuite").get("failures") == "0"


def test_check_unknown_stage_and_bad_path_are_one_line_errors(tmp_path):
    bad_stage = run_cli("check", "qwen3", "--tiny", "-s", "nope")
    assert bad_stage.returncode == 2
    assert bad_stage.stderr.startswith("error: unknown stage(s) nope; available: ")
    alone = run_cli("check", "qwen3", "--tiny", "--alone")
    assert alone.returncode == 2
    assert alone.stderr == "error: --alone runs the stages named with --stage, and none is named; add --stage NAME\n"
    handler_without_tiny = run_cli("check", "qwen3.5")
    assert handler_without_tiny.returncode == 2
    assert "'qwen3.5' names a handler, not a model: pass --tiny" in handler_without_tiny.stderr
    bad_path = run_cli("check", str(tmp_path / "missing" / "model"))
    assert bad_path.returncode == 2
    assert "is neither a directory, a config.json, nor a hub id" in bad_path.stderr
    assert "Traceback" not in bad_path.stderr


def test_check_fails_with_a_nonzero_exit_when_the_declaration_is_wrong(tmp_path, tiny_model_dir):
    # A Qwen3 checkpoint whose config says MoE: the qwen3 handler claims the architecture but the layout disagrees.
    model = tiny_model_dir("qwen3")
    config = json.loads((model / "config.json").read_text())
    config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = run_cli("check", str(tmp_path), "-s", "architecture", "--json", str(tmp_path / "r.json"))
    assert result.returncode == 1
    arch = json.loads((tmp_path / "r.json").read_text())["results"][1]
    assert arch["status"] == "fail"
    assert arch["summary"] == "handler declares dense but the config has 4 experts"


def test_tiny_command_writes_a_loadable_replica(tmp_path):
    result = run_cli("tiny", "Qwen3ForCausalLM", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["hidden_size"] == 64
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert (
        "chat_template" in (tmp_path / "m" / "tokenizer_config.json").read_text()
        or (tmp_path / "m" / "chat_template.jinja").is_file()
    )


def test_main_gives_the_callers_signal_handlers_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's stop-signal handling lasts as long as its ``main``: a caller (here pytest) keeps its own handlers."""
    import signal
    import sys

    from model_support.core.cli import main
    from model_support.core.interrupt import SIGNALS

    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    monkeypatch.setattr(sys, "argv", ["model-support", "--help"])
    with pytest.raises(SystemExit):
        main()
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before
