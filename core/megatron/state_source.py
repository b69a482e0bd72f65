"""What a megatron-bridge model bridge receives as ``hf_pretrained``, over a :class:`TextCheckpoint`.

A bridge reads the config and the state through megatron-bridge's own ``StateDict`` query accessor
(``state[name]``, globs, regexes, ``state.source.has_glob`` / ``get_all_keys``); here that accessor runs
over the checkpoint's text-model tensors, so a family's bridge needs no subclass to read them.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from model_support.core.megatron.imports import import_bridge

if TYPE_CHECKING:
    from model_support.core.checkpoint import TextCheckpoint


def hf_pretrained(config: Any, checkpoint: TextCheckpoint | None = None) -> SimpleNamespace:
    """The ``hf_pretrained`` of a bridge: ``config`` (the text config) and, with a checkpoint, its ``state``.

    Without a checkpoint a bridge that picks mappings by the checkpoint's keys takes its default.
    """
    shim = SimpleNamespace(config=config, generation_config=None)
    if checkpoint is not None:
        import_bridge()
        from megatron.bridge.models.hf_pretrained.state import StateDict, StateSource

        keys = checkpoint.get_all_keys()  # one list: StateDict looks names up in it

        class CheckpointSource(StateSource):
            """megatron-bridge's state-source protocol over the checkpoint's text-model names."""

            def get_all_keys(self) -> list[str]:
                return keys

            def load_tensors(self, keys: list[str]) -> dict[str, Any]:
                return dict(checkpoint.read_named(keys))

        shim.state = StateDict(CheckpointSource())
    return shim
