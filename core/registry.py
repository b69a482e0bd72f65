"""The handler registry: every handler the installed plugins declare, and who claims what.

It holds handlers only. The plugins it was built from stay loaded (:attr:`Registry.loaded`) for the hooks a higher
layer calls itself: the validation harness collects the plugins' stages from them
(:mod:`model_support.validation.stage_registry`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from model_support.core.errors import HandlerConflictError, UnknownArchitectureError
from model_support.core.plugin_loading import LoadedPlugins, PluginControlError, PluginInfo, hook_results, load_plugins
from model_support.core.spec import HandlerSpec

PREFER_ENV = "MODEL_SUPPORT_PREFER"
ADD_HANDLER_HINT = "add a handler plugin for it (`model-support new-handler`, see docs/adding-a-model.md)"


@dataclass(frozen=True)
class RegisteredHandler:
    spec: HandlerSpec
    plugin: PluginInfo

    @property
    def origin(self) -> str:
        return f"{self.plugin.distribution} {self.plugin.version}"

    def label(self) -> str:
        return f"handler {self.spec.name!r} ({self.origin})"


def parse_preferences(raw: str) -> dict[str, str]:
    """Parse ``MODEL_SUPPORT_PREFER``: comma-separated ``handler`` or ``Architecture=handler``.

    A bare handler name wins every conflict it is part of (key ``"*"`` entries are stored as
    ``{"*handler": handler}``).
    """
    prefs: dict[str, str] = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if sep:
            prefs[key.strip()] = value.strip()
        else:
            prefs[f"*{part}"] = part
    return prefs


@dataclass
class Registry:
    handlers: dict[str, RegisteredHandler] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    claims: dict[str, list[RegisteredHandler]] = field(default_factory=dict)
    preferences: dict[str, str] = field(default_factory=dict)
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    # The plugins the registry was built from (None: built by hand), for the hooks other layers call on them.
    loaded: LoadedPlugins | None = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ building
    @classmethod
    def from_plugins(cls, loaded: LoadedPlugins, preferences: Mapping[str, str] | None = None) -> Registry:
        """The handlers the ``loaded`` plugins declare. The stage hooks are not called here (stage modules import
        torch, and stages are the validation harness's), so ``list`` and ``show`` stay fast."""
        reg = cls(preferences=dict(preferences or {}), plugins=dict(loaded.plugins), loaded=loaded)
        reg.problems.extend(b.message() for b in loaded.broken)
        for impl in loaded.manager.hook.model_support_handlers.get_hookimpls():
            reg._add_handlers(loaded.plugins[impl.plugin_name], impl.function)
        return reg

    def _add_handlers(self, plugin: PluginInfo, function: Any) -> None:
        specs = hook_results(plugin, function, "model_support_handlers()", self.problems)
        if specs is None:
            return
        for spec in specs:
            if not isinstance(spec, HandlerSpec):
                self.problems.append(
                    f"plugin {plugin.name!r} ({plugin.distribution}) returned a {type(spec).__name__} "
                    "that is not a HandlerSpec; skipped it"
                )
                continue
            entry = RegisteredHandler(spec, plugin)
            existing = self.handlers.get(spec.name)
            if existing is not None:
                self.problems.append(
                    f"handler name {spec.name!r} is declared by both {existing.origin} and {entry.origin}; "
                    f"kept the first, rename one of them"
                )
                continue
            self.handlers[spec.name] = entry
            for arch in spec.architectures:
                self.claims.setdefault(arch, []).append(entry)

    # ------------------------------------------------------------------ queries
    def conflicts(self) -> dict[str, list[RegisteredHandler]]:
        """Architectures claimed by more than one handler and not settled by a preference."""
        return {
            arch: claimants
            for arch, claimants in self.claims.items()
            if len(claimants) > 1 and self._preferred(arch, claimants) is None
        }

    def _preferred(self, arch: str, claimants: list[RegisteredHandler]) -> RegisteredHandler | None:
        """An ``ARCH=HANDLER`` preference wins over a bare ``HANDLER`` one."""
        wanted = self.preferences.get(arch)
        by_arch = [c for c in claimants if c.spec.name == wanted]
        bare = [c for c in claimants if f"*{c.spec.name}" in self.preferences]
        return (by_arch or bare or [None])[0]

    def supported_architectures(self) -> list[str]:
        return sorted(self.claims)

    def for_architecture(self, arch: str) -> RegisteredHandler:
        claimants = self.claims.get(arch)
        if not claimants:
            supported = ", ".join(self.supported_architectures()) or "none"
            raise UnknownArchitectureError(
                f"no handler claims architecture {arch!r} (supported: {supported}); {ADD_HANDLER_HINT}"
            )
        if len(claimants) == 1:
            return claimants[0]
        chosen = self._preferred(arch, claimants)
        if chosen is None:
            names = " and ".join(c.label() for c in claimants)
            raise HandlerConflictError(
                f"architecture {arch!r} is claimed by {names}; choose one with "
                f"{PREFER_ENV}={arch}={claimants[-1].spec.name} (or `--prefer`), or uninstall one"
            )
        return chosen

    def check_preferences(self, preferences: Mapping[str, str], source: str) -> None:
        """Every handler and architecture a preference names must exist (``source`` names it in the error)."""
        for key, handler in preferences.items():
            if handler not in self.handlers:
                known = ", ".join(sorted(self.handlers)) or "none"
                raise PluginControlError(
                    f"{source} names handler {handler}, which is not installed; installed handlers: {known}"
                )
            if not key.startswith("*") and key not in self.claims:
                raise PluginControlError(
                    f"{source} names architecture {key}, which no installed handler claims; "
                    f"claimed: {', '.join(sorted(self.claims)) or 'none'}"
                )
            if not key.startswith("*") and handler not in (c.spec.name for c in self.claims[key]):
                raise PluginControlError(
                    f"{source} prefers handler {handler} for {key}, which it does not claim; "
                    f"claimed by: {', '.join(c.spec.name for c in self.claims[key])}"
                )

    def get(self, name_or_arch: str) -> RegisteredHandler:
        """A handler by its name or by an architecture it claims."""
        if name_or_arch in self.handlers:
            return self.handlers[name_or_arch]
        if name_or_arch in self.claims:
            return self.for_architecture(name_or_arch)
        known = ", ".join(sorted(self.handlers)) or "none"
        raise UnknownArchitectureError(
            f"{name_or_arch!r} is neither a handler nor a claimed architecture (handlers: {known}); {ADD_HANDLER_HINT}"
        )


def load_registry(env: Mapping[str, str] | None = None, prefer: Mapping[str, str] | None = None) -> Registry:
    """Load every allowed plugin and build the registry of their handlers (the validation stages:
    ``model_support.validation.stage_registry.load_stages``).

    Preferences come from ``MODEL_SUPPORT_PREFER`` and, taking precedence, ``prefer``.
    """
    environ = dict(env if env is not None else os.environ)
    from_env = parse_preferences(environ.get(PREFER_ENV, ""))
    registry = Registry.from_plugins(load_plugins(environ), {**from_env, **(prefer or {})})
    registry.check_preferences(from_env, PREFER_ENV)
    registry.check_preferences(prefer or {}, "--prefer")
    return registry
