"""Importing megatron-bridge where transformer-engine is absent (CPU machines).

megatron-bridge 0.6.2 imports ``transformer_engine.pytorch`` at module level in ``peft/lora_layers.py``
(for its fused LoRA path and ``isinstance`` checks) even though conversion with the local spec never
uses it. When transformer-engine is not installed, :func:`import_bridge` first imports megatron-core
and megatron.training for real (so their own ``HAVE_TE`` probes see the truth), then imports
megatron-bridge while a placeholder ``transformer_engine`` package is visible, and removes the
placeholder again. The placeholder's classes cannot be instantiated, so an ``isinstance`` check against
them is always ``False`` and any attempt to use them fails loudly.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from functools import cache
from typing import Any

from model_support.core.errors import ModelSupportError

_PLACEHOLDER = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")


class MegatronUnavailableError(ModelSupportError):
    """megatron-core or megatron-bridge is missing or does not import."""


class _AbsentTE:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "transformer-engine is not installed; model-support builds Megatron models with the local spec"
        )


def _placeholder_modules() -> dict[str, types.ModuleType]:
    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_ops = types.ModuleType("transformer_engine.pytorch.ops")
    te_pt.Linear = type("Linear", (_AbsentTE,), {})
    te_pt.LayerNormLinear = type("LayerNormLinear", (_AbsentTE,), {})
    te_ops.Sequential = type("Sequential", (_AbsentTE,), {})
    te_pt.ops = te_ops
    te.pytorch = te_pt
    return dict(zip(_PLACEHOLDER, (te, te_pt, te_ops), strict=True))


@cache
def import_bridge() -> types.ModuleType:
    """Import and return ``megatron.bridge`` (with the placeholder above when transformer-engine is absent)."""
    for name in ("megatron.core", "megatron.bridge"):
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise MegatronUnavailableError(f"{name} is not installed (pip install 'model-support[megatron]')")
    # megatron-bridge logs (INFO, with tracebacks) every optional symbol it fails to import; expected here.
    previous = logging.root.manager.disable
    logging.disable(logging.INFO)
    try:
        bridge = _import_bridge()
    finally:
        logging.disable(previous)
    _register_plugin_bridges()
    return bridge


def _register_plugin_bridges() -> None:
    """Call every plugin's ``model_support_megatron_bridges`` registrars (a failure names the plugin)."""
    from model_support.core.plugin_loading import load_plugins

    loaded = load_plugins()
    for impl in loaded.manager.hook.model_support_megatron_bridges.get_hookimpls():
        try:
            for register in impl.function():
                register()
        except Exception as exc:  # a third party's registration code: any error, reported as one line
            raise MegatronUnavailableError(
                f"plugin {impl.plugin_name!r} failed to register its megatron-bridge bridge "
                f"({type(exc).__name__}: {exc}); fix or uninstall the plugin"
            ) from None


def _import_bridge() -> types.ModuleType:
    import megatron.core
    import megatron.training

    if importlib.util.find_spec("transformer_engine") is not None:
        import megatron.bridge

        return megatron.bridge
    sys.modules.update(_placeholder_modules())
    try:
        import megatron.bridge
    finally:
        for name in _PLACEHOLDER:
            sys.modules.pop(name, None)
    return megatron.bridge
