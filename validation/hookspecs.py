"""The hook the validation harness calls on plugins: ``model_support_stages``.

The core's plugin manager knows only the core's hooks (:mod:`model_support.core.hooks`); the harness adds this
specification to it (:func:`model_support.validation.stage_registry.load_stages`) before it calls the hook. Plugins
mark their implementation with ``model_support.plugins.hookimpl``, like every other hook.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from model_support.core.hooks import hookspec

if TYPE_CHECKING:
    from model_support.validation.stage import Stage


@hookspec
def model_support_stages() -> Sequence[type[Stage]]:
    """Return validation stage classes this plugin adds to ``model-support check``."""
