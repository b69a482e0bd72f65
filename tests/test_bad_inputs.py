"""Bad input gets one line naming what is wrong and what to do, exit status 2, and nothing half-written.

A regression suite: each case is a mistake a user made, with the exit code and the message it must get.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_support.core.discovery import locate
from model_support.core.errors import ConfigError, ModelNotFoundError
from model_support.handlers.configs import CONFIGS
from tests.helpers import held_by_another_process, run_cli

QWEN3 = json.loads((CONFIGS / "qwen3-0.6b.json").read_text())
QWEN35_MOE = json.loads((CONFIGS / "qwen3.5-35b-a3b.json").read_text())


def _one_line_error(result) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def _write_config(tmp_path: Path, config: dict | str | bytes, name: str = "config.json") -> Path:
    path = tmp_path / name
    if isinstance(config, bytes):
        path.write_bytes(config)
    else:
        path.write_text(config if isinstance(config, str) else json.dumps(config))
    return path


def _with(base: dict, **changes) -> dict:
    out = json.loads(json.dumps(base))
    text = out.get("text_config", out)
    for key, value in changes.items():
        text[key] = value
    return out


CONFIG_CASES = {
    "negative layers": (_with(QWEN3, num_hidden_layers=-2), "`num_hidden_layers` is -2; it must be between 1 and 1024"),
    "a billion layers": (
        _with(QWEN3, num_hidden_layers=1_000_000_000),
        "`num_hidden_layers` is 1000000000; it must be between 1 and 1024",
    ),
    "layers as a string": (_with(QWEN3, num_hidden_layers="28"), "`num_hidden_layers` must be an integer, got '28'"),
    "heads not divisible": (
        _with(QWEN3, num_key_value_heads=5),
        "`num_attention_heads` (16) is not a multiple of `num_key_value_heads` (5)",
    ),
    "layer_types too short": (
        _with(QWEN35_MOE, layer_types=["linear_attention"] * 3),
        "`layer_types` lists 3 layers but `num_hidden_layers` is 40",
    ),
    "layer_types not strings": (_with(QWEN35_MOE, layer_types=[1] * 40), "`layer_types` must be a list of strings"),
    "architectures as a string": (
        {**QWEN3, "architectures": "Qwen3ForCausalLM"},
        "`architectures` must be a non-empty list of class names",
    ),
    "architectures empty": ({**QWEN3, "architectures": []}, "`architectures` must be a non-empty list of class names"),
    "top-k above the experts": (
        _with(QWEN35_MOE, num_experts_per_tok=300),
        "`num_experts_per_tok` (300) is larger than the number of experts (256)",
    ),
    "vocab absurd": (_with(QWEN3, vocab_size=10**12), "`vocab_size` is 1000000000000"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_mistakes_are_caught_before_transformers_sees_them(tmp_path: Path, case: str) -> None:
    config, message = CONFIG_CASES[case]
    path = _write_config(tmp_path, config)
    with pytest.raises(ConfigError) as err:
        locate(str(path))
    assert message in str(err.value)
    assert str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_non_utf8_and_non_object_configs(tmp_path: Path) -> None:
    bad = _write_config(tmp_path, b"\xff\xfe{not json", "a.json")
    with pytest.raises(ConfigError, match="is not readable JSON"):
        locate(str(bad))
    listed = _write_config(tmp_path, "[1, 2]", "b.json")
    with pytest.raises(ConfigError, match="does not hold a JSON object"):
        locate(str(listed))


@pytest.mark.parametrize("target", ["org/..", "org--x/name", "a/" + "b" * 200, "org/na me"])
def test_hub_id_shaped_strings_that_are_no_hub_ids(target: str) -> None:
    with pytest.raises(ModelNotFoundError) as err:
        locate(target)
    assert target in str(err.value)


def test_located_directory_is_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative model path is resolved before anything hands it to a child process (e.g. vLLM)."""
    (tmp_path / "base").mkdir()
    _write_config(tmp_path / "base", QWEN3)
    monkeypatch.chdir(tmp_path)
    source = locate("base")
    assert source.directory.is_absolute()
    assert source.directory == tmp_path / "base"


def test_check_reports_a_config_mistake_in_one_line(tmp_path: Path) -> None:
    path = _write_config(tmp_path, _with(QWEN3, num_hidden_layers="many"))
    line = _one_line_error(run_cli("check", str(path), "-s", "architecture"))
    assert "`num_hidden_layers` must be an integer, got 'many'" in line


def test_tiny_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    line = _one_line_error(run_cli("tiny", "qwen3", str(out)))
    assert "exists and is not an empty directory; pass --overwrite" in line
    assert (out / "config.json").read_text() == "{}"
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_report_paths_are_checked_before_any_stage_runs(tmp_path: Path) -> None:
    line = _one_line_error(run_cli("check", "qwen3", "--tiny", "--json", str(tmp_path), "-s", "architecture"))
    assert f"--json {tmp_path}: is a directory" in line
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    nested = blocker / "report.md"
    line = _one_line_error(run_cli("check", "qwen3", "--tiny", "--markdown", str(nested), "-s", "architecture"))
    assert f"--markdown {nested}: {blocker} is a file, not a directory" in line
    line = _one_line_error(run_cli("check", "qwen3", "--tiny", "--junit", "/proc/x.xml", "-s", "architecture"))
    assert "--junit /proc/x.xml: /proc is not writable" in line


def test_a_report_path_that_is_an_input_or_named_twice_is_refused_before_the_run(tmp_path: Path) -> None:
    path = _write_config(tmp_path, QWEN3)
    before = path.read_bytes()
    line = _one_line_error(run_cli("check", str(path), "--json", str(path), "-s", "architecture"))
    assert f"--json {path}: is a file of the model directory being checked ({tmp_path}); write reports" in line
    assert path.read_bytes() == before
    report = tmp_path.parent / f"{tmp_path.name}-report"
    line = _one_line_error(
        run_cli("check", "qwen3", "--tiny", "--json", str(report), "--junit", str(report), "-s", "architecture")
    )
    assert f"--json and --junit both name {report}; give each report its own file" in line
    assert not report.exists()


def test_workdir_that_is_a_file(tmp_path: Path) -> None:
    file = tmp_path / "work"
    file.write_text("x")
    line = _one_line_error(run_cli("check", "qwen3", "--tiny", "--workdir", str(file), "-s", "architecture"))
    assert f"--workdir {file}: is a file" in line


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MODEL_SUPPORT_PLUGINS": "bultin"}, "MODEL_SUPPORT_PLUGINS names bultin, which no installed plugin is"),
        ({"MODEL_SUPPORT_PREFER": "Qwen3ForCausalLM=nobody"}, "MODEL_SUPPORT_PREFER names handler nobody"),
        ({"MODEL_SUPPORT_PREFER": "qwen9"}, "MODEL_SUPPORT_PREFER names handler qwen9"),
    ],
)
def test_plugin_controls_with_unknown_names(env: dict[str, str], message: str) -> None:
    line = _one_line_error(run_cli("list", env=env))
    assert message in line


def test_prefer_option_with_an_unknown_handler() -> None:
    line = _one_line_error(run_cli("check", "qwen3", "--tiny", "--prefer", "nobody", "-s", "architecture"))
    assert "--prefer names handler nobody" in line


def _tiny_copy(tiny_model_dir, handler: str, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / handler
    shutil.copytree(tiny_model_dir(handler), out)
    return out


def _edit_weights(model_dir: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_nan_embedding_rows_fail_the_weights_stage_by_name(tiny_model_dir, tmp_path: Path) -> None:
    """20% NaN rows in the embedding: random tokens would miss them; the streamed check does not."""
    model_dir = _tiny_copy(tiny_model_dir, "qwen3", tmp_path)

    def poison(tensors: dict) -> None:
        embed = tensors["model.embed_tokens.weight"]
        embed[: embed.shape[0] // 5] = float("nan")

    _edit_weights(model_dir, poison)
    report = tmp_path / "report.json"
    result = run_cli("check", str(model_dir), "-s", "hf_parity", "--json", str(report))
    assert result.returncode == 1, result.stderr
    results = {r["stage"]: r for r in json.loads(report.read_text())["results"]}
    weights = results["weights"]
    assert weights["status"] == "fail"
    assert weights["metrics"]["nonfinite_tensors"] == 1
    assert any("model.embed_tokens.weight" in d and "not finite" in d for d in weights["details"])
    assert results["hf_parity"]["status"] == "skip"
    assert "requires stage 'weights', which failed" in results["hf_parity"]["summary"]


def test_an_all_zero_weight_matrix_fails_the_weights_stage(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = _tiny_copy(tiny_model_dir, "qwen3", tmp_path)
    _edit_weights(model_dir, lambda t: t["model.layers.1.mlp.down_proj.weight"].zero_())
    report = tmp_path / "report.json"
    result = run_cli("check", str(model_dir), "-s", "weights", "--json", str(report))
    assert result.returncode == 1
    weights = {r["stage"]: r for r in json.loads(report.read_text())["results"]}["weights"]
    assert weights["summary"] == "zero_matrices=1 > 0"
    assert weights["details"] == ["all zeros: model.layers.1.mlp.down_proj.weight in model.safetensors"]


def test_moe_config_without_expert_sizes_is_a_config_error() -> None:
    """A family whose config class has no expert-size field (transformers gives Qwen's a default)."""
    from types import SimpleNamespace

    from model_support.core.layout import ConfigFields, derive_layout

    config = SimpleNamespace(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)
    with pytest.raises(
        ConfigError, match=r"no moe_intermediate_size, which an MoE config \(8 experts in num_local_experts\) needs"
    ):
        derive_layout(config)
    olmoe_like = ConfigFields(expert_intermediate_size="intermediate_size")
    config.intermediate_size = 1024
    assert derive_layout(config, olmoe_like).moe.expert_intermediate_size == 1024


def test_tiny_into_an_unwritable_place(tmp_path: Path) -> None:
    line = _one_line_error(run_cli("tiny", "qwen3", "/proc/model-support-test"))
    assert "cannot write in /proc" in line


@pytest.mark.parametrize(
    ("message", "status", "words"),
    [
        ("vLLM exited while starting: OSError: Can't load tokenizer for '/m' (log: /w/vllm.log)", "fail", "failed"),
        ("vLLM /v1/completions answered 500: NaN in logits; server log: ValueError: nan (log: /w/l)", "fail", "failed"),
        ("vLLM exited while starting: ValueError: Model architectures ['FooForCausalLM'] are not supported for now.",
         "skip", "has no implementation"),
        ("vLLM /v1/completions answered 500: x; server log: AttributeError: module 'triton.language' has no "
         "attribute 'float32' (log: /w/l)", "skip", "fused-MoE LoRA needs Triton"),
    ],
)  # fmt: skip
def test_only_named_build_gaps_make_a_serving_error_a_skip(tiny_model_dir, message: str, status: str, words: str):
    """A serving error is a failure unless vLLM says the build cannot run the model (registry, named CPU gap)."""
    from transformers import AutoConfig

    from model_support.core.serving.errors import ServerError
    from model_support.core.serving.runtime import RuntimeMissingError, load_runtime
    from model_support.validation.stages.merged_serving import MergedServingStage, cannot_serve

    try:
        runtime = load_runtime()
    except RuntimeMissingError as exc:
        pytest.skip(str(exc))
    if runtime.flavor != "cpu" and "triton" in message:
        pytest.skip("the Triton gap is a CPU-build gap")
    ctx = type("Ctx", (), {"config": AutoConfig.from_pretrained(tiny_model_dir("qwen3"))})()
    result = cannot_serve(MergedServingStage(), ctx, ServerError(message))
    assert str(result.status) == status
    assert words in result.summary and message in result.summary


@pytest.mark.slow
def test_a_model_without_tokenizer_fails_serving_and_keeps_the_log(tiny_model_dir, tmp_path: Path) -> None:
    """Before: any vLLM failure on the CPU build was a skip, and the log was deleted with the temp dir."""
    model_dir = _tiny_copy(tiny_model_dir, "qwen3", tmp_path)
    for tokenizer_file in model_dir.glob("tokenizer*.json"):
        tokenizer_file.unlink()
    report = tmp_path / "report.json"
    result = run_cli("check", str(model_dir), "-s", "merged_serving", "--json", str(report))
    if "serving runtime" in result.stdout and "skip" in result.stdout:
        pytest.skip("no vLLM runtime installed")
    assert result.returncode == 1, result.stdout + result.stderr
    serving = {r["stage"]: r for r in json.loads(report.read_text())["results"]}["merged_serving"]
    assert serving["status"] == "fail"
    assert "failed serving Qwen3ForCausalLM" in serving["summary"]
    log = Path(serving["summary"].rsplit("(log: ", 1)[1].split(")")[0])
    assert log.is_file() and log.stat().st_size > 0
    assert "artifacts and logs of this run:" in result.stderr


def test_workdir_is_reusable_and_runs_never_share_files(tmp_path: Path) -> None:

    work = tmp_path / "w"
    first = run_cli("check", "qwen3", "--tiny", "-s", "dependencies", "--workdir", str(work))
    second = run_cli("check", "qwen3", "--tiny", "-s", "dependencies", "--workdir", str(work))
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    runs = sorted(work.glob("model-support-run-*"))
    assert len(runs) == 2 and all((r / "tiny-model" / "config.json").is_file() for r in runs)
    # A run that was killed leaves its directory with a lock file nobody holds; the next run removes it. One whose
    # lock is held (a live run, in this PID namespace or another: here a process that holds it) is left alone.
    crashed = work / "model-support-run-20260101-000000-1-x"
    crashed.mkdir()
    (crashed / ".owner-lock").write_text("1\n")
    live = work / "model-support-run-20260101-000000-2-y"
    with held_by_another_process(live):
        assert run_cli("check", "qwen3", "--tiny", "-s", "dependencies", "--workdir", str(work)).returncode == 0
        assert not crashed.exists()
        assert live.exists()
    assert len(list(work.glob("model-support-run-*"))) == 4


def test_model_type_that_contradicts_the_architecture_fails_architecture(tmp_path: Path) -> None:
    path = _write_config(tmp_path, {**QWEN3, "model_type": "qwen3_moe"})
    report = tmp_path / "r.json"
    result = run_cli("check", str(path), "-s", "architecture", "--json", str(report))
    assert result.returncode == 1, result.stderr
    arch = {r["stage"]: r for r in json.loads(report.read_text())["results"]}["architecture"]
    assert arch["status"] == "fail"
    assert arch["summary"].startswith("model_type 'qwen3_moe' contradicts Qwen3ForCausalLM, whose handler qwen3")


def test_a_tensor_of_the_wrong_shape_is_named(tiny_model_dir, tmp_path: Path) -> None:
    import torch

    model_dir = _tiny_copy(tiny_model_dir, "qwen3", tmp_path)
    key = "model.layers.0.self_attn.k_proj.weight"
    _edit_weights(model_dir, lambda t: t.__setitem__(key, torch.zeros(t[key].shape[0] + 8, t[key].shape[1]) + 0.01))
    report = tmp_path / "r.json"
    result = run_cli("check", str(model_dir), "-s", "architecture", "--json", str(report), "--workdir", str(tmp_path))
    assert result.returncode == 1, result.stderr
    found = {r["stage"]: r for r in json.loads(report.read_text())["results"]}["architecture"]
    assert found["status"] == "fail"
    assert found["summary"] == (
        f"{key} in model.safetensors is [72, 64], the config implies [64, 64]: the checkpoint does not match its "
        "config.json"
    )


def test_a_config_file_with_another_name_is_the_one_loaded(tmp_path: Path) -> None:
    """`check dir/other-name.json` reads that file, not dir/config.json (before: "cannot load dir/config.json")."""
    from model_support.core.discovery import load_config

    _write_config(tmp_path, _with(QWEN3, num_hidden_layers=3), "other-name.json")
    source = locate(str(tmp_path / "other-name.json"))
    assert load_config(source).num_hidden_layers == 3
    _write_config(tmp_path, {**QWEN3, "num_attention_heads": None}, "broken.json")
    with pytest.raises(ConfigError, match=r"cannot load .*broken\.json \(StrictDataclass"):
        load_config(locate(str(tmp_path / "broken.json")))


def test_targets_the_checkpoint_does_not_name_fail_instead_of_passing(tiny_model_dir, tmp_path: Path) -> None:
    """Before: experts named w1/w3/w2 on disk passed `architecture` (transformers' fused experts matched the
    standard names) and the serving stages' adapter silently covered no expert."""
    import re

    from safetensors.torch import load_file, save_file

    model_dir = _tiny_copy(tiny_model_dir, "qwen3-moe", tmp_path)
    path = model_dir / "model.safetensors"
    renames = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    tensors = {
        re.sub(r"(experts\.\d+\.)(\w+)", lambda m: m.group(1) + renames.get(m.group(2), m.group(2)), key): value
        for key, value in load_file(str(path)).items()
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    report = tmp_path / "r.json"
    result = run_cli("check", str(model_dir), "-s", "architecture", "-s", "merged_serving", "--json", str(report))
    assert result.returncode == 1, result.stderr
    results = {r["stage"]: r for r in json.loads(report.read_text())["results"]}
    arch = results["architecture"]
    assert arch["status"] == "fail"
    assert (
        "the checkpoint names no module for expert:gate_proj, expert:up_proj, expert:down_proj "
        "(found under those scopes: expert: w1, w2, w3)"
    ) in arch["summary"]
    serving = results["merged_serving"]
    if serving["status"] != "skip":  # skipped only where no vLLM runtime is installed
        # The policy comes from the Megatron model, which the bridge cannot fill from those names.
        assert serving["status"] == "fail"
        assert "have no bridge mapping" in serving["summary"]
        assert "checkpoint lacks model.layers.0.mlp.experts.0." in serving["summary"]


def test_a_config_nested_too_deeply_is_a_config_error(tmp_path: Path) -> None:
    text = json.dumps(QWEN3)[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = _write_config(tmp_path, text)
    with pytest.raises(ConfigError, match="nests its JSON too deeply to read"):
        locate(str(path))


def test_a_symlink_loop_is_named_as_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").symlink_to(tmp_path / "missing")
    monkeypatch.chdir(tmp_path)
    for target in ("a", "org/name"):  # "org/name" has a hub id's shape
        with pytest.raises(ModelNotFoundError, match="is a symbolic link that leads nowhere"):
            locate(target)


@pytest.mark.parametrize("side_file", ["generation_config.json", "tokenizer_config.json"])
def test_an_unreadable_json_file_beside_the_config_is_named(tmp_path: Path, side_file: str) -> None:
    _write_config(tmp_path, QWEN3)
    (tmp_path / side_file).write_text('{"bos_token_id": 1,')
    with pytest.raises(ConfigError) as err:
        locate(str(tmp_path))
    assert str(err.value).startswith(f"{tmp_path / side_file} is not readable JSON")


def test_an_architecture_no_handler_builds_beside_a_claimed_one(tmp_path: Path) -> None:
    """transformers builds the first architecture, a bridge may read another: a second one nobody claims is refused,
    whichever comes first."""
    from model_support.core.discovery import resolve_handler
    from model_support.core.errors import UnknownArchitectureError
    from model_support.core.registry import load_registry

    registry = load_registry()
    for names in (["Qwen3ForCausalLM", "FooBarForCausalLM"], ["FooBarForCausalLM", "Qwen3ForCausalLM"]):
        path = _write_config(tmp_path, {**QWEN3, "architectures": names})
        with pytest.raises(UnknownArchitectureError) as err:
            resolve_handler(locate(str(path)), registry)
        assert "handler qwen3 claims only Qwen3ForCausalLM" in str(err.value)
        assert str(err.value).endswith("remove FooBarForCausalLM from `architectures`")


def test_prefer_names_a_handler_for_an_architecture_it_does_not_claim() -> None:
    line = _one_line_error(
        run_cli("check", "qwen3", "--tiny", "-s", "dependencies", "--prefer", "Qwen3ForCausalLM=qwen3.5")
    )
    assert line.endswith(
        "--prefer prefers handler qwen3.5 for Qwen3ForCausalLM, which it does not claim; claimed by: qwen3"
    )


def test_auto_map_remote_code_does_not_change_the_bridge(tiny_model_dir) -> None:
    """A config's auto_map names remote code, never run: the bridge of the built-in class is the one used."""
    from transformers import AutoConfig

    from model_support.core.megatron.builder import family_bridge

    config = AutoConfig.from_pretrained(tiny_model_dir("qwen3"))
    config.auto_map = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    bridge, _ = family_bridge(config)
    assert type(bridge).__name__ == "Qwen3Bridge"
    assert config.auto_map  # the caller's config is left as it was


def test_a_model_dir_without_tokenizer_files_is_named(tiny_model_dir, tmp_path: Path) -> None:
    """transformers builds an empty tokenizer of the family's class when the files are missing."""
    from model_support.core.errors import ModelSupportError
    from model_support.validation.context import CheckContext
    from model_support.validation.state import RunState

    model_dir = _tiny_copy(tiny_model_dir, "qwen3", tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model_dir / name).unlink()
    ctx = CheckContext.__new__(CheckContext)
    ctx.model_dir = model_dir
    ctx.state = RunState(ctx)
    with pytest.raises(ModelSupportError, match=r"^no tokenizer files in .*: transformers' Qwen2Tokenizer from it has"):
        ctx.tokenizer()


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x", "did not render 1 "),
        ('{% for i in range(100000) %}{{ "y" * 100 }}{% endfor %}', "a prompt rendered to 10000000 characters"),
        ('{{ "x" * 30000000000 }}', "failed to render: MemoryError"),
        ("{{ raise_exception('no system role') }}", "failed to render: "),
    ],
    ids=["endless loops", "huge prompt", "huge string", "template raises"],
)
def test_a_chat_template_renders_under_limits(
    tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, template: str, message: str
) -> None:
    from model_support.core.errors import ModelSupportError
    from model_support.validation import context
    from model_support.validation.context import CheckContext
    from model_support.validation.state import RunState

    model_dir = _tiny_copy(tiny_model_dir, "qwen3", tmp_path)
    (model_dir / "chat_template.jinja").write_text(template)
    monkeypatch.setattr(context, "CHAT_RENDER_LIMIT_S", 20)  # the loops would take hours at any limit
    ctx = CheckContext.__new__(CheckContext)
    ctx.model_dir = model_dir
    ctx.state = RunState(ctx)
    try:
        with pytest.raises(ModelSupportError) as err:
            ctx.chat_prompts([[{"role": "user", "content": "hi"}]])
        assert message in str(err.value) and "\n" not in str(err.value)
        # The renderer is whole again for the next request: a template that renders still does.
        (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
        if message.startswith("a prompt rendered"):  # the child lives on and keeps its template
            return
        assert ctx.chat_prompts([[{"role": "user", "content": "hi"}]]) == ["hi!"]
    finally:
        ctx.state.close()


def test_a_chat_template_renders_as_the_tokenizer_does(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    from model_support.validation.context import CheckContext
    from model_support.validation.state import RunState

    ctx = CheckContext.__new__(CheckContext)
    ctx.model_dir = tiny_model_dir("qwen3")
    ctx.state = RunState(ctx)
    chats = [[{"role": "user", "content": "Is fire cold?"}], [{"role": "system", "content": "Be brief."}]]
    tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)
    expected = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    try:
        assert ctx.chat_prompts(chats) == expected
        assert ctx.chat_prompts(chats[1:]) == expected[1:]  # the same child answers a second request
    finally:
        ctx.state.close()


def test_tiny_where_writing_fails_leaves_nothing(tmp_path: Path) -> None:
    """A write that fails midway (here a file size limit, as a full disk fails it) is one line and no half replica."""
    import os
    import resource
    import signal
    import subprocess
    import sys

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of the signal killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    out = tmp_path / "replica"
    result = subprocess.run(
        [sys.executable, "-m", "model_support.core.cli", "tiny", "qwen3", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        preexec_fn=small_files,
        timeout=900,
    )
    line = _one_line_error(result)
    assert line.startswith(f"error: cannot write {out} (") and "File too large" in line
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_seed_out_of_range_is_refused_before_anything_runs() -> None:
    result = run_cli("check", "qwen3", "--tiny", "--seed", str(2**40))
    assert result.returncode == 2 and "Invalid value for '--seed'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bare_prefer_that_claims_nothing_of_the_model(tmp_path: Path) -> None:
    line = _one_line_error(run_cli("check", "qwen3", "--tiny", "-s", "dependencies", "--prefer", "qwen3.5"))
    assert line.startswith("error: --prefer qwen3.5: handler qwen3.5 claims Qwen3_5ForConditionalGeneration")
    assert line.endswith("(Qwen3ForCausalLM); drop it or name a handler that does")


def test_a_config_transformers_rejects_leaves_no_run_directory(tmp_path: Path) -> None:
    """transformers' own validation runs before a run directory is made (--workdir would keep it)."""
    config = _write_config(tmp_path, _with(QWEN3, rope_parameters={"rope_type": "yarn"}))  # YaRN needs a factor
    work = tmp_path / "work"
    line = _one_line_error(run_cli("check", str(config), "-s", "architecture", "--workdir", str(work)))
    assert "cannot load" in line
    assert not work.exists() or not any(work.iterdir())


def test_a_support_file_out_of_the_model_directory_is_refused_before_it_is_read(tmp_path: Path) -> None:
    import os

    model = tmp_path / "model"
    model.mkdir()
    _write_config(model, QWEN3)
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's private key")
    (model / "chat_template.jinja").symlink_to(secret)
    line = _one_line_error(run_cli("check", str(model), "-s", "architecture"))
    assert f"{model / 'chat_template.jinja'} is a symlink to {secret}, outside {model}" in line
    (model / "chat_template.jinja").unlink()
    _write_config(model, {"tokenizer_file": str(secret)}, "tokenizer_config.json")
    line = _one_line_error(run_cli("check", str(model), "-s", "architecture"))
    assert f"names tokenizer_file '{secret}', a file outside {model}; tokenizer files must be in the model" in line
    _write_config(model, {"tokenizer_file": "../secret.txt"}, "tokenizer_config.json")
    assert "a file outside" in _one_line_error(run_cli("check", str(model), "-s", "architecture"))
    (model / "tokenizer_config.json").unlink()
    os.mkfifo(model / "tokenizer_config.json")  # reading it would block the check forever
    line = _one_line_error(run_cli("check", str(model), "-s", "architecture"))
    assert f"{model / 'tokenizer_config.json'} is a FIFO, not a file" in line


def test_an_error_naming_a_path_with_markup_is_printed_as_written(tmp_path: Path) -> None:
    odd = tmp_path / "run[/]s[bold]"
    line = _one_line_error(run_cli("check", str(odd)))
    assert f"{odd}" in line and "neither a directory" in line


def test_the_chat_renderers_memory_limit_leaves_out_its_libraries(
    tiny_model_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The renderer's limit holds a template's memory, not the address space of the libraries it imports: under a
    2 GiB limit (less than torch's libraries map here) a template still renders and a huge string still fails."""
    from model_support.core.errors import ModelSupportError
    from model_support.validation import context
    from model_support.validation.context import CheckContext
    from model_support.validation.state import RunState

    model_dir = _tiny_copy(tiny_model_dir, "qwen3", tmp_path)
    monkeypatch.setattr(context, "CHAT_RENDER_MAX_BYTES", 2 * 2**30)
    ctx = CheckContext.__new__(CheckContext)
    ctx.model_dir = model_dir
    ctx.state = RunState(ctx)
    try:
        (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
        assert ctx.chat_prompts([[{"role": "user", "content": "hi"}]]) == ["hi!"]
        ctx.state.close()
        ctx.state = RunState(ctx)
        (model_dir / "chat_template.jinja").write_text('{{ "x" * 3000000000 }}')
        with pytest.raises(ModelSupportError, match="failed to render: MemoryError"):
            ctx.chat_prompts([[{"role": "user", "content": "hi"}]])
    finally:
        ctx.state.close()
