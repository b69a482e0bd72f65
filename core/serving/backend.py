"""Serving backends behind one small interface, collected from plugins.

A plugin adds an engine (SGLang, Megatron Inference, ...) by returning objects with this shape from the
``model_support_serving_backends`` hook; the project's own plugin returns :class:`VllmBackend`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from model_support.core.serving.errors import ServingError

if TYPE_CHECKING:
    import torch


@runtime_checkable
class Server(Protocol):
    """A running OpenAI-compatible server for one model."""

    served_name: str

    @property
    def pid(self) -> int: ...

    def wait_ready(self) -> Server:
        """Block until the server answers (at once when it already did); raise if it died or never came up."""
        ...

    def start_in_background(self) -> Server:
        """Wait for the server in the background (:meth:`wait_ready` then waits for that)."""
        ...

    def completion(self, prompt: list[int], *, model: str | None = None, **params: Any) -> dict[str, Any]: ...

    def choices(self, prompt: list[int], *, model: str | None = None, **params: Any) -> list[dict[str, Any]]: ...

    def chat(self, messages: list[dict[str, str]], **params: Any) -> dict[str, Any]: ...

    def models(self) -> list[str]: ...

    def load_lora(self, name: str, path: Path) -> None: ...

    def unload_lora(self, name: str) -> None: ...

    def reload_weights(self, weights_dir: Path) -> None: ...

    def update_weights(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> str:
        """Apply one step of HF-named weight buckets in place once the last has arrived; returns the new name."""
        ...

    def rename(self, name: str) -> None: ...

    def root_cause(self) -> str: ...

    def stop(self) -> None: ...


@runtime_checkable
class ServingBackend(Protocol):
    """Starts servers. ``unavailable_reason`` is ``None`` when the engine can run here."""

    name: str

    def unavailable_reason(self) -> str | None: ...

    def version(self) -> str: ...

    def serve(self, model_dir: Path, served_name: str, options: Any, log_path: Path, *, wait: bool = True) -> Server:
        """Start a server; with ``wait=False`` return once its process runs and its start is awaited in the
        background (``Server.start_in_background``; ``Server.wait_ready`` waits for it), so that the caller can do
        other work meanwhile."""
        ...


def serving_backends(env: dict[str, str] | None = None) -> dict[str, ServingBackend]:
    """Every backend the installed plugins provide, by name (the first plugin to claim a name wins)."""
    from model_support.plugins.manager import load_plugins

    found: dict[str, ServingBackend] = {}
    for provided in load_plugins(env).manager.hook.model_support_serving_backends():
        for backend in provided:
            if isinstance(backend, ServingBackend):
                found.setdefault(backend.name, backend)
    return found


def get_backend(name: str = "vllm", env: dict[str, str] | None = None) -> ServingBackend:
    backends = serving_backends(env)
    if name not in backends:
        raise ServingError(f"no serving backend {name!r} (installed: {', '.join(sorted(backends)) or 'none'})")
    return backends[name]
