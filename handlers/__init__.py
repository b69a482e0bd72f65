"""Built-in handlers. They reach the registry through the project's own ``model_support`` entry
point (``model_support.plugins.builtin``), exactly like a third-party plugin."""

from model_support.handlers.qwen3 import QWEN3, QWEN3_MOE
from model_support.handlers.qwen3_5 import QWEN3_5, QWEN3_5_MOE

BUILTIN_HANDLERS = (QWEN3, QWEN3_MOE, QWEN3_5, QWEN3_5_MOE)
# Each declaration as this package was imported with it, before any plugin could reach it: a plugin that edits one
# in place (a tolerance in its dict, a frozen field through object.__setattr__) is caught by changed_declarations.
_AS_IMPORTED = {spec.name: repr(spec) for spec in BUILTIN_HANDLERS}


def changed_declarations() -> list[str]:
    """The built-in handlers whose declaration differs from the one this package was imported with."""
    return [spec.name for spec in BUILTIN_HANDLERS if repr(spec) != _AS_IMPORTED[spec.name]]


__all__ = ["BUILTIN_HANDLERS", "QWEN3", "QWEN3_5", "QWEN3_5_MOE", "QWEN3_MOE", "changed_declarations"]
