"""Shared fixtures: tiny random replicas of each built-in handler's reference architecture; how the suite is spread
over pytest-xdist's workers (the README's ``-n 2 --dist loadgroup``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from model_support.handlers import BUILTIN_HANDLERS
from tests.helpers import pip_install_target, run_cli

__all__ = ["pip_install_target", "run_cli"]

HANDLER_NAMES = [h.name for h in BUILTIN_HANDLERS]


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


# Session fixtures too costly to build on every pytest-xdist worker: the tests that share one run on one worker.
SHARED_ON_ONE_WORKER = {"qwen3_server": "qwen3-server", "megatron_report": "megatron-report"}


def _worker_group(item: pytest.Item) -> str | None:
    """The xdist group of a test that shares a costly session resource (None: any worker may run it)."""
    if "default_check" in item.fixturenames:  # one `check --tiny` per plugin, shared by that plugin's tests
        # (a parameter `plugin`, or the test module's PLUGIN: the plugin's directory)
        params = getattr(item, "callspec", None)
        plugin = params.params["plugin"] if params and "plugin" in params.params else item.module.PLUGIN
        return f"check-{Path(plugin).name}"
    return next((group for name, group in SHARED_ON_ONE_WORKER.items() if name in item.fixturenames), None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow tests first (a stable sort), so that the workers, handed tests in this order, end together rather than
    one starting a long test as the other runs out; a test sharing a costly session resource grouped by it."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:
        group = _worker_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
