"""From what the user typed to exactly one handler, offline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from model_support.core.discovery import load_config, locate, resolve_handler
from model_support.core.errors import ConfigError, ModelNotFoundError, UnknownArchitectureError
from model_support.core.registry import load_registry
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def registry():
    return load_registry(env={})


def _write(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    ("arch", "model_type", "handler"),
    [
        ("Qwen3ForCausalLM", "qwen3", "qwen3"),
        ("Qwen3MoeForCausalLM", "qwen3_moe", "qwen3-moe"),
        ("Qwen3_5ForConditionalGeneration", "qwen3_5", "qwen3.5"),
        ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", "qwen3.5-moe"),
    ],
)
def test_directory_and_config_file_resolve_to_one_handler(tmp_path, registry, arch, model_type, handler):
    directory = _write(tmp_path / "m", {"architectures": [arch], "model_type": model_type})
    assert resolve_handler(locate(str(directory)), registry).spec.name == handler
    assert resolve_handler(locate(str(directory / "config.json")), registry).spec.name == handler


def test_model_type_is_the_fallback_when_architectures_are_unknown(tmp_path, registry):
    directory = _write(tmp_path / "m", {"architectures": ["Qwen3ForTokenClassification"], "model_type": "qwen3"})
    assert resolve_handler(locate(str(directory)), registry).spec.name == "qwen3"


def test_unknown_architecture_lists_what_is_supported_and_how_to_add_it(tmp_path, registry):
    directory = _write(tmp_path / "llama", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(UnknownArchitectureError) as info:
        resolve_handler(locate(str(directory)), registry)
    message = str(info.value)
    assert "unsupported model (LlamaForCausalLM, model_type 'llama')" in message
    assert "Qwen3ForCausalLM" in message and "Qwen3_5MoeForConditionalGeneration" in message
    assert "model-support new-handler" in message


def test_missing_and_corrupt_inputs_are_clear_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"neither a directory, a config\.json, nor a hub id"):
        locate(str(tmp_path / "nope" / "deeper"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"has no config\.json"):
        locate(str(tmp_path / "empty"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not readable JSON"):
        locate(str(tmp_path / "bad"))
    unknown_type = _write(tmp_path / "odd", {"architectures": ["Qwen3ForCausalLM"], "model_type": "no_such_type"})
    with pytest.raises(ConfigError, match=r"cannot load .*config\.json"):
        load_config(locate(str(unknown_type)))


def _fake_hf_cache(cache: Path, repo_id: str, model_dir: Path) -> None:
    """Lay out a Hugging Face hub cache entry the way `hf download` leaves it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)


def test_hub_id_resolves_from_the_local_cache_and_not_the_network(tmp_path, tiny_model_dir):
    cache = tmp_path / "hub"
    _fake_hf_cache(cache, "acme/tiny-qwen3.5", tiny_model_dir("qwen3.5"))
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    found = run_cli("check", "acme/tiny-qwen3.5", "-s", "architecture", env=env)
    assert found.returncode == 0, found.stdout + found.stderr
    assert "with handler qwen3.5" in found.stderr
    missing = run_cli("check", "acme/not-downloaded", env=env)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error: 'acme/not-downloaded' is not a local path and is not in the local Hugging Face cache ({cache}); "
        "download it where there is network (`hf download acme/not-downloaded`) or pass a local directory"
    ]
