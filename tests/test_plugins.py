"""Plugin loading with real third-party packages pip-installed next to the project."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_support.core.errors import HandlerConflictError, UnknownArchitectureError
from model_support.core.plugin_loading import load_plugins
from model_support.core.registry import load_registry
from model_support.validation.stage_registry import StageClashError, load_stages
from tests.helpers import pip_install_target, run_cli

FIXTURES = Path(__file__).parent / "fixtures" / "plugins"
BUILTIN = {"qwen3", "qwen3-moe", "qwen3.5", "qwen3.5-moe"}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with four real third-party plugin distributions installed by pip."""
    target = tmp_path_factory.mktemp("site")
    for name in ("ms-broken", "ms-garbage", "ms-dupe", "ms-exiting"):
        pip_install_target(FIXTURES / name, target)
    return target


@pytest.fixture
def with_site(site: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(site))
    return site


def test_builtins_register_through_the_projects_own_entry_point():
    registry = load_registry(env={})
    assert set(registry.handlers) == BUILTIN
    assert {h.plugin.name for h in registry.handlers.values()} == {"builtin"}
    assert {h.plugin.distribution for h in registry.handlers.values()} == {"model-support"}
    assert registry.problems == []
    stages = load_stages(registry)
    assert [s.stage.name for s in stages.stages][:2] == ["dependencies", "architecture"]
    # The built-in stages come from the harness in the name of the same plugin (the plugin layer cannot import it).
    assert {s.plugin.name for s in stages.stages} == {"builtin"}
    assert {s.plugin.distribution for s in stages.stages} == {"model-support"}
    assert stages.problems == []


def test_broken_and_garbage_plugins_are_reported_by_name_and_skipped(with_site: Path):
    registry = load_registry(env={})
    problems = "\n".join([*registry.problems, *load_stages(registry).problems])
    assert "plugin 'broken' (model-support-broken) skipped: ModuleNotFoundError" in problems
    assert "a_dependency_that_is_not_installed" in problems
    assert "plugin 'exiting' (model-support-exiting) skipped: called sys.exit(0) while imported" in problems
    assert "plugin 'garbage' (model-support-garbage) returned a str that is not a HandlerSpec" in problems
    assert "plugin 'garbage' (model-support-garbage) returned a int that is not a HandlerSpec" in problems
    assert "plugin 'garbage' (model-support-garbage) returned <class 'object'>, not a Stage class" in problems
    # The healthy plugins keep working.
    assert BUILTIN | {"qwen3-alt"} == set(registry.handlers)
    assert registry.get("qwen3.5").spec.name == "qwen3.5"


def test_duplicate_claim_is_an_error_naming_both_distributions(with_site: Path):
    registry = load_registry(env={})
    assert set(registry.conflicts()) == {"Qwen3ForCausalLM"}
    with pytest.raises(HandlerConflictError) as info:
        registry.for_architecture("Qwen3ForCausalLM")
    message = str(info.value)
    assert "handler 'qwen3' (model-support 0.1.0)" in message
    assert "handler 'qwen3-alt' (model-support-qwen3-alt 1.2.3)" in message
    assert "MODEL_SUPPORT_PREFER=Qwen3ForCausalLM=" in message
    # Unrelated architectures still resolve.
    assert registry.for_architecture("Qwen3MoeForCausalLM").spec.name == "qwen3-moe"


@pytest.mark.parametrize(
    ("env", "prefer", "winner"),
    [
        ({"MODEL_SUPPORT_PREFER": "Qwen3ForCausalLM=qwen3-alt"}, None, "qwen3-alt"),
        ({"MODEL_SUPPORT_PREFER": "qwen3"}, None, "qwen3"),
        ({"MODEL_SUPPORT_PREFER": "qwen3"}, {"Qwen3ForCausalLM": "qwen3-alt"}, "qwen3-alt"),
    ],
)
def test_explicit_override_settles_a_conflict(with_site: Path, env, prefer, winner):
    registry = load_registry(env=env, prefer=prefer)
    assert registry.conflicts() == {}
    assert registry.for_architecture("Qwen3ForCausalLM").spec.name == winner


def test_environment_variable_restricts_which_plugins_load(with_site: Path):
    loaded = load_plugins(env={"MODEL_SUPPORT_PLUGINS": "builtin, qwen3-alt"})
    assert set(loaded.plugins) == {"builtin", "qwen3-alt"}
    assert sorted(loaded.filtered_out) == ["broken", "exiting", "garbage"]
    assert loaded.broken == []
    only_third_party = load_registry(env={"MODEL_SUPPORT_PLUGINS": "qwen3-alt"})
    assert set(only_third_party.handlers) == {"qwen3-alt"}
    assert load_stages(only_third_party).stages == []  # the built-in stages come with the builtin plugin only
    with pytest.raises(UnknownArchitectureError, match="no handler claims architecture 'Qwen3_5ForCausalLM'"):
        only_third_party.for_architecture("Qwen3_5ForCausalLM")


def test_cli_lists_third_party_handlers_and_warns_about_broken_ones(site: Path):
    result = run_cli("list", "--json", site=site)
    assert result.returncode == 0, result.stderr
    rows = {r["handler"]: r for r in json.loads(result.stdout)}
    assert rows["qwen3-alt"]["distribution"] == "model-support-qwen3-alt"
    assert rows["qwen3-alt"]["version"] == "1.2.3"
    assert rows["qwen3-alt"]["vllm_lora"] == "merged-only"
    assert rows["qwen3.5"]["distribution"] == "model-support"
    assert "plugin 'broken' (model-support-broken) skipped" in result.stderr
    assert "architecture Qwen3ForCausalLM is claimed by" in result.stderr


def test_cli_check_on_a_conflicted_architecture_is_a_one_line_error(site: Path, tiny_model_dir):
    model = tiny_model_dir("qwen3")
    result = run_cli("check", str(model), site=site, env={"MODEL_SUPPORT_PLUGINS": "builtin,qwen3-alt"})
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1
    assert "model-support-qwen3-alt 1.2.3" in error_lines[0]
    assert "Traceback" not in result.stderr
    settled = run_cli(
        "check",
        str(model),
        "--prefer",
        "Qwen3ForCausalLM=qwen3-alt",
        "-s",
        "architecture",
        site=site,
        env={"MODEL_SUPPORT_PLUGINS": "builtin,qwen3-alt"},
    )
    assert settled.returncode == 0, settled.stdout + settled.stderr
    assert "with handler qwen3-alt (model-support-qwen3-alt 1.2.3)" in settled.stderr


def test_the_harness_collects_stages_in_plugin_order_with_the_builtin_ones_in_the_builtin_plugins_place():
    """The core's plugin manager knows no stage hook: the harness adds it, and the built-in stages stand where the
    `builtin` plugin is loaded; an implementation that takes arguments is named and left out."""
    import types

    import pluggy

    from model_support.core import hooks
    from model_support.core.plugin_loading import LoadedPlugins, PluginInfo
    from model_support.core.registry import Registry
    from model_support.plugins import builtin, hookimpl
    from model_support.validation.stage import Stage

    def plugin(name: str, *stage_names: str, takes_an_argument: bool = False) -> types.ModuleType:
        stages = [type(n, (Stage,), {"name": n, "title": n, "order": 1, "run": None}) for n in stage_names]
        module = types.ModuleType(name)
        if takes_an_argument:
            module.model_support_stages = hookimpl(lambda ctx: stages)
        else:
            module.model_support_stages = hookimpl(lambda: stages)
        return module

    manager = pluggy.PluginManager(hooks.PROJECT)
    manager.add_hookspecs(hooks)
    loaded = LoadedPlugins(manager)
    for name, module in [
        ("alpha", plugin("alpha", "a1")),
        ("bad", plugin("bad", "b1", takes_an_argument=True)),
        ("builtin", builtin),
        ("zeta", plugin("zeta", "z1")),
    ]:
        manager.register(module, name=name)
        loaded.plugins[name] = PluginInfo(name, f"dist-{name}", "1")
    assert not manager.hook.model_support_stages.has_spec()
    registry = Registry.from_plugins(loaded)
    for _ in range(2):  # the same answer however often it is asked
        found = load_stages(registry)
        names = [(s.stage.name, s.plugin.name) for s in found.stages]
        assert names[:3] == [("a1", "alpha"), ("dependencies", "builtin"), ("architecture", "builtin")]
        assert names[-1] == ("z1", "zeta")
        assert found.problems == [
            "plugin 'bad' (dist-bad) skipped: model_support_stages takes ctx, the hook passes no arguments",
        ]
    assert manager.hook.model_support_stages.has_spec()
    # A stage named as a built-in one, from a plugin loaded before the built-ins or after them: an error naming both.
    for name in ("aaa", "zzz"):
        clash = pluggy.PluginManager(hooks.PROJECT)
        clash.add_hookspecs(hooks)
        clashing = LoadedPlugins(clash)
        for plugin_name, module in sorted([(name, plugin(name, "weights")), ("builtin", builtin)]):
            clash.register(module, name=plugin_name)
            clashing.plugins[plugin_name] = PluginInfo(plugin_name, f"dist-{plugin_name}", "1")
        with pytest.raises(StageClashError) as caught:
            load_stages(Registry.from_plugins(clashing))
        first, second = sorted([name, "builtin"])
        assert str(caught.value) == (
            f"stage 'weights' is declared by both dist-{first} (plugin {first!r}) and dist-{second} (plugin "
            f"{second!r}): a stage name belongs to one plugin; rename the plugin's stage or uninstall one"
        )


def test_a_plugin_cannot_replace_a_serving_backend(monkeypatch: pytest.MonkeyPatch):
    """Two plugins providing the ``vllm`` backend: an error naming both, not the first one loaded silently."""
    import types

    import pluggy

    from model_support.core import hooks, plugin_loading
    from model_support.core.plugin_loading import LoadedPlugins, PluginInfo
    from model_support.core.serving.backend import serving_backends
    from model_support.core.serving.errors import ServingError
    from model_support.core.serving.vllm_backend import VllmBackend
    from model_support.plugins import builtin, hookimpl

    impostor = types.ModuleType("impostor")
    impostor.model_support_serving_backends = hookimpl(lambda: [VllmBackend()])
    manager = pluggy.PluginManager(hooks.PROJECT)
    manager.add_hookspecs(hooks)
    loaded = LoadedPlugins(manager)
    for name, module in [("aaa-impostor", impostor), ("builtin", builtin)]:
        manager.register(module, name=name)
        loaded.plugins[name] = PluginInfo(name, f"dist-{name}", "1")
    monkeypatch.setattr(plugin_loading, "load_plugins", lambda env=None: loaded)
    with pytest.raises(ServingError) as caught:
        serving_backends()
    assert "serving backend 'vllm' is provided by both dist-" in str(caught.value)
    assert "dist-aaa-impostor (plugin 'aaa-impostor')" in str(caught.value)
    assert "dist-builtin (plugin 'builtin')" in str(caught.value)


def test_a_built_in_declaration_edited_in_place_is_not_registered_as_the_projects():
    """A plugin that loosens a built-in handler's tolerance in place (its dict) at import: the built-ins are refused
    with a line saying so, not registered and shown as ``builtin`` with the loosened limit."""
    from model_support.handlers import QWEN3

    tolerances = QWEN3.runtime.tolerances
    assert isinstance(tolerances, dict)
    tolerances["hf_parity.rel_l2"] = 1.0  # what such a plugin does when imported
    try:
        registry = load_registry(env={})
        assert "qwen3" not in registry.handlers
        assert any(
            "plugin 'builtin' (model-support) skipped: model_support_handlers() raised HandlerConflictError: the "
            "built-in declaration of qwen3 was changed in this process after it was imported" in problem
            for problem in registry.problems
        ), registry.problems
    finally:
        del tolerances["hf_parity.rel_l2"]
    assert "qwen3" in load_registry(env={}).handlers
