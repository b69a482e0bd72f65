"""Fixtures for the plugin-author tests."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import pip_install_target


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
