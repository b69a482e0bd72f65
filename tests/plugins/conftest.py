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


@dataclass(frozen=True)
class PluginCheck:
    """One ``model-support check <plugin> --tiny`` (default stages and layouts) of an installed plugin copy."""

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
def default_check(install_copy, tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], PluginCheck]:
    """``default_check(plugin_dir)``: the plugin's default ``check --tiny``, run once per session and shared by the
    test that every shipped plugin passes it and the plugin's own tests of its numbers."""
    done: dict[Path, PluginCheck] = {}

    def check(plugin_dir: Path) -> PluginCheck:
        if plugin_dir not in done:
            source, site = install_copy(plugin_dir)
            # A shipped plugin registers one handler, under its entry-point name.
            entry_points = tomllib.loads((plugin_dir / "pyproject.toml").read_text())["project"]["entry-points"]
            (handler,) = entry_points["model_support"]
            workdir = tmp_path_factory.mktemp(f"{handler}-check")
            report_path = workdir / "report.json"
            args = ("check", handler, "--tiny", "--workdir", str(workdir), "--json", str(report_path))
            result = run_cli(*args, site=site)
            report = json.loads(report_path.read_text()) if report_path.exists() else {"results": []}
            done[plugin_dir] = PluginCheck(
                source, site, workdir, result.returncode, result.stdout[-4000:] + result.stderr[-4000:], report
            )
        return done[plugin_dir]

    return check
