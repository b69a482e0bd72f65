"""Built-in handlers. They reach the registry through the project's own ``model_support`` entry
point (``model_support.plugins.builtin``), exactly like a third-party plugin."""

from model_support.handlers.qwen3 import QWEN3, QWEN3_MOE
from model_support.handlers.qwen3_5 import QWEN3_5, QWEN3_5_MOE

BUILTIN_HANDLERS = (QWEN3, QWEN3_MOE, QWEN3_5, QWEN3_5_MOE)

__all__ = ["BUILTIN_HANDLERS", "QWEN3", "QWEN3_5", "QWEN3_5_MOE", "QWEN3_MOE"]
