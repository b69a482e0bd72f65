"""Shared fixtures: tiny random replicas of each built-in handler's reference architecture; how the suite is spread
over pytest-xdist's workers (the README's ``-n 2``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
GROUPS_FILE = "model_support_test_groups"  # the workers' input naming the file they write the groups to


def _worker_group(item: pytest.Item) -> str | None:
    """The group of a test that shares a costly session resource (None: any worker may run it)."""
    if "default_check" in item.fixturenames:  # one `check --tiny` per plugin, shared by that plugin's tests
        # (a parameter `plugin`, or the test module's PLUGIN: the plugin's directory)
        params = getattr(item, "callspec", None)
        plugin = params.params["plugin"] if params and "plugin" in params.params else item.module.PLUGIN
        return f"check-{Path(plugin).name}"
    return next((group for name, group in SHARED_ON_ONE_WORKER.items() if name in item.fixturenames), None)


# The files of the suite's longest tests (`pytest --durations`: 2 to 10 minutes each on 2 cores), started first.
LONGEST = ("tests/test_selftest.py", "tests/plugins/test_", "tests/serving/test_stages.py")


def _start_order(item: pytest.Item) -> tuple[int, bool]:
    """(which of :data:`LONGEST` the test's file is, in that order, else after them; whether it is not slow)."""
    slow = item.get_closest_marker("slow") is not None
    longest = next((i for i, prefix in enumerate(LONGEST) if slow and item.nodeid.startswith(prefix)), len(LONGEST))
    return longest, not slow


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first, then the other slow ones (a stable sort: :func:`_start_order`), so that the workers,
    handed tests in this order, end together rather than one starting a long test as the other runs out. Under
    pytest-xdist a worker writes each grouped test's group (:func:`_worker_group`) where the controller's scheduler
    reads it."""
    items.sort(key=_start_order)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and GROUPS_FILE in workerinput:
        groups = {item.nodeid: group for item in items if (group := _worker_group(item)) is not None}
        target = Path(workerinput[GROUPS_FILE])
        partial = target.with_name(f"{target.name}.{workerinput['workerid']}")
        partial.write_text(json.dumps(groups))
        partial.replace(target)  # every worker collects the same tests: whichever lands last, the file is whole


# pytest-xdist's own `--dist loadgroup` groups by a suffix it writes into each node id, which pytest >= 9.2 no longer
# keeps (pytest-xdist issue 1386): the workers hand the groups over in a file instead.
@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput[GROUPS_FILE] = str(_groups_file(node.config))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n N``'s default distribution (``--dist load``) with the groups kept; another ``--dist`` as asked."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedResourceScheduling(LoadScopeScheduling):
        """pytest-xdist's scope scheduling with a test's scope its group where it has one, else the test itself:
        the tests sharing a costly resource run on one worker, the others one at a time on any, in the order
        collected (:func:`_start_order`; not xdist's largest scope first)."""

        groups: dict[str, str] | None = None

        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once the workers have collected (scheduling starts after that)
                self.groups = json.loads(_groups_file(self.config).read_text())
            return self.groups.get(nodeid, nodeid)

    return SharedResourceScheduling(config, log)


def _groups_file(config: pytest.Config) -> Path:
    return config._tmp_path_factory.getbasetemp() / "test-groups.json"
