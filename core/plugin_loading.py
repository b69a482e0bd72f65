"""Loads plugins from the ``model_support`` entry-point group into a pluggy plugin manager (the core's hook
specifications, :mod:`model_support.core.hooks`, added; a higher layer adds its own before it calls them).

A plugin that fails to import, or whose module is not a valid plugin, is recorded as broken and
skipped; the others keep working. ``MODEL_SUPPORT_PLUGINS`` (comma-separated entry-point names)
restricts which plugins load. A plugin whose import takes longer than :data:`SLOW_IMPORT_S` is named on stderr
while it loads (``still importing plugin 'x' from distribution y (3 s)``), then every :data:`SLOW_IMPORT_REPEAT_S`:
a plugin that blocks at import hangs every command, and this says which one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from model_support.core import hooks
from model_support.core.errors import ModelSupportError

PLUGINS_ENV = "MODEL_SUPPORT_PLUGINS"
SLOW_IMPORT_S = 3.0
SLOW_IMPORT_REPEAT_S = 10.0


class PluginControlError(ModelSupportError):
    """A plugin control (``MODEL_SUPPORT_PLUGINS``, ``MODEL_SUPPORT_PREFER``, ``--prefer``) names nothing there."""


@dataclass(frozen=True)
class PluginInfo:
    """One loaded plugin: its entry-point name and the distribution that ships it."""

    name: str
    distribution: str
    version: str


@dataclass(frozen=True)
class BrokenPlugin:
    name: str
    distribution: str
    error: str

    def message(self) -> str:
        return f"plugin {self.name!r} ({self.distribution}) skipped: {self.error}"


@dataclass
class LoadedPlugins:
    manager: pluggy.PluginManager
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    broken: list[BrokenPlugin] = field(default_factory=list)
    filtered_out: list[str] = field(default_factory=list)


def hook_results(plugin: PluginInfo, function: Any, what: str, problems: list[str]) -> list[Any] | None:
    """Call one plugin's implementation of a hook that returns a list (``what`` names the call in a problem); None,
    with a line appended to ``problems``, when it raised or returned something else than a list or tuple."""
    try:
        result = function()
    except Exception as exc:
        problems.append(
            f"plugin {plugin.name!r} ({plugin.distribution}) skipped: {what} raised {type(exc).__name__}: {exc}"
        )
        return None
    if not isinstance(result, list | tuple):
        problems.append(
            f"plugin {plugin.name!r} ({plugin.distribution}) skipped: {what} returned "
            f"{type(result).__name__}, expected a list"
        )
        return None
    return list(result)


def allowed_plugins(env: dict[str, str] | None = None) -> set[str] | None:
    """The entry-point names ``MODEL_SUPPORT_PLUGINS`` allows, or ``None`` for all."""
    raw = (env if env is not None else os.environ).get(PLUGINS_ENV, "").strip()
    if not raw:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _distribution(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = ep.dist
    if dist is None:
        return "<unknown distribution>", "?"
    return dist.metadata["Name"], dist.version


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def _named_while_slow(name: str, distribution: str, after_s: float, notice: Callable[[str], None]) -> Iterator[None]:
    """Call ``notice`` with a line naming the plugin if the block is still running after ``after_s`` seconds, and
    again every :data:`SLOW_IMPORT_REPEAT_S` until it ends (a daemon thread: a hung import can still be interrupted)."""
    done = threading.Event()
    start = time.monotonic()

    def watch() -> None:
        wait = after_s
        while not done.wait(wait):
            elapsed = time.monotonic() - start
            notice(f"still importing plugin {name!r} from distribution {distribution} ({elapsed:.0f} s)")
            wait = SLOW_IMPORT_REPEAT_S

    watcher = threading.Thread(target=watch, name=f"plugin-import-{name}", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def load_plugins(
    env: dict[str, str] | None = None,
    *,
    slow_after_s: float = SLOW_IMPORT_S,
    notice: Callable[[str], None] = _to_stderr,
) -> LoadedPlugins:
    """Create a plugin manager with every allowed entry point of group ``model_support`` registered.

    ``notice`` gets the line naming a plugin whose import is still running after ``slow_after_s`` seconds.
    """
    manager = pluggy.PluginManager(hooks.PROJECT)
    manager.add_hookspecs(hooks)
    loaded = LoadedPlugins(manager=manager)
    allowed = allowed_plugins(env)
    seen: set[str] = set()
    for ep in sorted(metadata.entry_points(group=hooks.ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist_name, version = _distribution(ep)
        if ep.name in seen:
            # The same distribution can be visible twice (e.g. an editable and a regular install).
            continue
        seen.add(ep.name)
        if allowed is not None and ep.name not in allowed:
            loaded.filtered_out.append(ep.name)
            continue
        try:
            with _named_while_slow(ep.name, dist_name, slow_after_s, notice):
                plugin = ep.load()
            manager.register(plugin, name=ep.name)
        except Exception as exc:  # a third party's import error must not take the others down
            loaded.broken.append(BrokenPlugin(ep.name, dist_name, f"{type(exc).__name__}: {exc}"))
            continue
        except SystemExit as exc:  # nor its sys.exit: the command would end with that status and no report
            loaded.broken.append(BrokenPlugin(ep.name, dist_name, f"called sys.exit({exc.code!r}) while imported"))
            continue
        loaded.plugins[ep.name] = PluginInfo(ep.name, dist_name, version)
    unknown = sorted(allowed - seen) if allowed is not None else []
    if unknown:
        raise PluginControlError(
            f"{PLUGINS_ENV} names {', '.join(unknown)}, which no installed plugin is; installed plugins: "
            f"{', '.join(sorted(seen)) or 'none'} (entry-point names of group {hooks.ENTRY_POINT_GROUP!r})"
        )
    return loaded
