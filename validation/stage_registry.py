"""The validation stages the installed plugins declare through ``model_support_stages``, collected from the plugins
a handler registry was built from.

The core's registry holds handlers only and never calls this hook: the stage modules import torch (``list`` and
``show`` must not), and stages are the harness's. :func:`load_stages` adds the hook's specification
(:mod:`model_support.validation.hookspecs`) to the registry's plugin manager, calls every plugin's implementation
in the order the plugins were loaded, the project's own stages (:mod:`model_support.validation.builtin_stages`) in
the place of the ``builtin`` plugin. Two stages of one name are an error naming both plugins' distributions: a
plugin cannot replace a built-in stage's verdict (or another plugin's) by loading first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pluggy

from model_support.core.errors import ModelSupportError
from model_support.core.plugin_loading import LoadedPlugins, PluginInfo, hook_results
from model_support.validation import builtin_stages, hookspecs
from model_support.validation.stage import Stage

if TYPE_CHECKING:
    from pluggy import HookImpl

    from model_support.core.registry import Registry


class StageClashError(ModelSupportError):
    """Two plugins declare a stage of the same name."""


@dataclass(frozen=True)
class RegisteredStage:
    stage: type[Stage]
    plugin: PluginInfo


@dataclass
class StageRegistry:
    """The registered stages, in the order their plugins declare them, and what was wrong with the declarations."""

    stages: list[RegisteredStage] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def classes(self) -> list[type[Stage]]:
        return [s.stage for s in self.stages]

    def _add(self, plugin: PluginInfo, function: Any) -> None:
        stages = hook_results(plugin, function, "model_support_stages()", self.problems)
        for stage in stages or ():
            if not (isinstance(stage, type) and issubclass(stage, Stage)):
                self.problems.append(
                    f"plugin {plugin.name!r} ({plugin.distribution}) returned {stage!r}, not a Stage class; skipped it"
                )
                continue
            taken = next((s for s in self.stages if s.stage.name == stage.name), None)
            if taken is not None:  # whichever loaded first, neither may silently replace the other's verdict
                raise StageClashError(
                    f"stage {stage.name!r} is declared by both {taken.plugin.distribution} (plugin "
                    f"{taken.plugin.name!r}) and {plugin.distribution} (plugin {plugin.name!r}): a stage name belongs "
                    "to one plugin; rename the plugin's stage or uninstall one"
                )
            self.stages.append(RegisteredStage(stage, plugin))


def _stage_hook(loaded: LoadedPlugins, problems: list[str]) -> list[HookImpl]:
    """The plugins' implementations of the stage hook, its specification added to the plugin manager (once).

    Without the specification at load time pluggy registered them unchecked: one that takes arguments (the hook
    passes none) is reported and left out here, every time, as a plugin whose hooks pluggy refused at load would
    have been."""
    manager = loaded.manager
    caller = getattr(manager.hook, "model_support_stages", None)
    impls = caller.get_hookimpls() if caller is not None else []
    for impl in impls:
        if impl.argnames:
            info = loaded.plugins.get(impl.plugin_name)
            problems.append(
                f"plugin {impl.plugin_name!r} ({info.distribution if info else '?'}) skipped: model_support_stages "
                f"takes {', '.join(impl.argnames)}, the hook passes no arguments"
            )
    if caller is None or not caller.has_spec():
        try:
            manager.add_hookspecs(hookspecs)
        except pluggy.PluginValidationError as exc:
            if not any(i.argnames for i in impls):  # those are reported above
                problems.append(f"model_support_stages: {type(exc).__name__}: {exc}")
    return [impl for impl in impls if not impl.argnames]


def _implementations(loaded: LoadedPlugins, impls: list[HookImpl]) -> list[tuple[PluginInfo, Callable[[], Any]]]:
    """(plugin, implementation) of every ``model_support_stages``, in pluggy's order (the order the plugins were
    loaded), the built-in stages where the ``builtin`` plugin's own implementation would stand."""
    found = [(loaded.plugins[impl.plugin_name], impl.function) for impl in impls]
    if builtin_stages.BUILTIN_PLUGIN in loaded.plugins:
        order = list(loaded.plugins)
        builtin = order.index(builtin_stages.BUILTIN_PLUGIN)
        # pluggy lists the trylast implementations, then the others in registration order, then the tryfirst ones.
        at = next(
            (
                i
                for i, impl in enumerate(impls)
                if not impl.trylast and (impl.tryfirst or order.index(impl.plugin_name) > builtin)
            ),
            len(impls),
        )
        found.insert(at, (loaded.plugins[builtin_stages.BUILTIN_PLUGIN], builtin_stages.model_support_stages))
    return found


def load_stages(registry: Registry) -> StageRegistry:
    """The stages of the plugins ``registry`` was built from (none for a registry built by hand)."""
    found = StageRegistry()
    loaded = registry.loaded
    if loaded is None:
        return found
    for plugin, function in _implementations(loaded, _stage_hook(loaded, found.problems)):
        found._add(plugin, function)
    return found
