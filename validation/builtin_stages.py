"""The built-in validation stages, contributed through the ``model_support_stages`` hook in the name of the project's
own plugin (entry point ``builtin``, ``model_support.plugins.builtin``).

The plugin layer does not import the harness, so that plugin declares the handlers and the serving backend only;
:func:`model_support.validation.stage_registry.load_stages` adds this implementation wherever the ``builtin`` plugin
is loaded, in its place, so ``MODEL_SUPPORT_PLUGINS=builtin`` still means the built-in handlers and stages.
"""

from collections.abc import Sequence

from model_support.core.hooks import hookimpl
from model_support.validation.stage import Stage

# The entry-point name of the project's own plugin (pyproject.toml, [project.entry-points.model_support]).
BUILTIN_PLUGIN = "builtin"


@hookimpl
def model_support_stages() -> Sequence[type[Stage]]:
    # Imported when the stages are asked for: their modules import torch, which `list` and `show` never need.
    from model_support.validation.stages import BUILTIN_STAGES

    return list(BUILTIN_STAGES)
