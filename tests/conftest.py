"""Shared fixtures: tiny random replicas of each built-in handler's reference architecture."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from model_support.handlers import BUILTIN_HANDLERS
from tests.helpers import pip_install_target, run_cli

__all__ = ["pip_install_target", "run_cli"]

HANDLER_NAMES = [h.name for h in BUILTIN_HANDLERS]
EXHAUSTIVE_SKIP = "the exhaustive tier: run with pytest --exhaustive (README, Tests)"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="also run the tests marked exhaustive: every plugin family's parallel layouts and serving stages, the "
        "whole selftest catalogue (hours on 2 CPU cores; CI runs the first tier only)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--exhaustive"):
        return
    for item in items:
        if item.get_closest_marker("exhaustive") is not None:
            item.add_marker(pytest.mark.skip(reason=EXHAUSTIVE_SKIP))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model_dir("qwen3.5")`` -> a saved tiny replica of that handler's reference config.

    Built once per session and handler (seed 0); tests must not modify the directory.
    """
    from model_support.core.tiny import build_tiny

    built: dict[str, Path] = {}
    specs = {h.name: h for h in BUILTIN_HANDLERS}

    def build(handler: str) -> Path:
        if handler not in built:
            raw = json.loads(specs[handler].reference_config.read_text())
            built[handler] = build_tiny(raw, tmp_path_factory.mktemp(f"tiny-{handler}"), seed=0, spec=specs[handler])
        return built[handler]

    return build
