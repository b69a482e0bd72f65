"""Fixtures for the plugin-author tests."""

from __future__ import annotations

import json
import shutil
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import pip_install_target, run_cli
from tests.megatron.conftest import MEGATRON_STAGES


@pytest.fixture(scope="session")
def install_copy(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], tuple[Path, Path]]:
    """``install_copy(package_dir)`` -> (copy, site): a clean copy of a package, pip-installed into ``site``.

    Building and testing a copy keeps setuptools' build/, egg-info and caches out of the source
    tree (and stale files in them out of the install).
    """

    def install(package_dir: Path) -> tuple[Path, Path]:
        copy = tmp_path_factory.mktemp("src") / package_dir.name
        shutil.copytree(package_dir, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*"))
        return copy, pip_install_target(copy, tmp_path_factory.mktemp("site"))

    return install


PLUGINS = Path(__file__).parents[2] / "plugins"
# Every plugin distribution the project ships: each must pass its whole default check.
SHIPPED = tuple(sorted(PLUGINS.glob("model-support-*")))


# What the first tier checks of every shipped plugin: the stages of one process without a server (the family's Megatron
# model against transformers, its LoRA, packing and training). parallel_parity's ranks and the serving stages' vLLM
# server, about two thirds of a default check's time on 2 CPU cores, run in the exhaustive tier's whole check.
ONE_PROCESS_STAGES = ("dependencies", "architecture", "weights", *MEGATRON_STAGES)


@dataclass(frozen=True)
class PluginCheck:
    """One ``model-support check <plugin> --tiny`` (default layouts) of an installed plugin copy."""

    source: Path  # the installed copy of the plugin's source tree
    site: Path  # where pip installed it
    workdir: Path
    returncode: int
    output: str
    report: dict[str, Any]

    @property
    def results(self) -> dict[str, dict[str, Any]]:
        return {r["stage"]: r for r in self.report["results"]}


@pytest.fixture(scope="session")
def installed_plugin(install_copy) -> Callable[[Path], tuple[Path, Path]]:
    """``installed_plugin(plugin_dir)`` -> (source, site): the plugin's copy, pip-installed once per session."""
    done: dict[Path, tuple[Path, Path]] = {}

    def install(plugin_dir: Path) -> tuple[Path, Path]:
        if plugin_dir not in done:
            done[plugin_dir] = install_copy(plugin_dir)
        return done[plugin_dir]

    return install


def _checks(
    installed_plugin: Callable[[Path], tuple[Path, Path]],
    tmp_path_factory: pytest.TempPathFactory,
    stages: tuple[str, ...],
) -> Callable[[Path], PluginCheck]:
    """``check(plugin_dir)``: the plugin's ``check --tiny`` of ``stages`` (and their prerequisites; none named: the
    default stages), run once per session and shared by the tests that read it."""
    done: dict[Path, PluginCheck] = {}

    def check(plugin_dir: Path) -> PluginCheck:
        if plugin_dir not in done:
            source, site = installed_plugin(plugin_dir)
            # A shipped plugin registers one handler, under its entry-point name.
            entry_points = tomllib.loads((plugin_dir / "pyproject.toml").read_text())["project"]["entry-points"]
            (handler,) = entry_points["model_support"]
            workdir = tmp_path_factory.mktemp(f"{handler}-check")
            report_path = workdir / "report.json"
            selected = [arg for stage in stages for arg in ("-s", stage)]
            args = ("check", handler, "--tiny", *selected, "--workdir", str(workdir), "--json", str(report_path))
            result = run_cli(*args, site=site)
            report = json.loads(report_path.read_text()) if report_path.exists() else {"results": []}
            done[plugin_dir] = PluginCheck(
                source, site, workdir, result.returncode, result.stdout[-4000:] + result.stderr[-4000:], report
            )
        return done[plugin_dir]

    return check


@pytest.fixture(scope="session")
def one_process_check(installed_plugin, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], PluginCheck]:
    """``one_process_check(plugin_dir)``: the plugin's ``check --tiny`` of :data:`ONE_PROCESS_STAGES` (first tier)."""
    return _checks(installed_plugin, tmp_path_factory, ONE_PROCESS_STAGES)


@pytest.fixture(scope="session")
def default_check(installed_plugin, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], PluginCheck]:
    """``default_check(plugin_dir)``: the plugin's whole default ``check --tiny``, every stage and default layout
    (for the exhaustive tier's tests)."""
    return _checks(installed_plugin, tmp_path_factory, ())


def run_changed(
    site: Path,
    model_dir: Path,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    architecture: str,
    stage: str,
    **change: Any,
) -> dict[str, Any]:
    """The results of ``stage`` (and its prerequisites), by stage, on a plugin's tiny model, in this process, with the
    handler registered for ``architecture`` (the plugin installed at ``site``) changed by ``change``."""
    import dataclasses

    from transformers import AutoConfig

    monkeypatch.syspath_prepend(str(site))
    from model_support.core.registry import load_registry
    from model_support.validation.context import CheckContext
    from model_support.validation.runner import plan, run_checks
    from model_support.validation.stage_registry import load_stages

    registry = load_registry()
    good = registry.for_architecture(architecture)
    changed = dataclasses.replace(good, spec=dataclasses.replace(good.spec, **change))
    config = AutoConfig.from_pretrained(model_dir)
    ctx = CheckContext(
        target=f"changed-{good.spec.name}", model_dir=model_dir, handler=changed, config=config,
        layout=changed.spec.layout(config), registry=registry, workdir=workdir, tiny=True,
    )  # fmt: skip
    report = run_checks(ctx, plan(load_stages(registry).classes(), [stage]))
    return {r.stage: r for r in report.results}
