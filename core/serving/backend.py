"""Serving backends behind one small interface, collected from plugins.

A plugin adds an engine (SGLang, Megatron Inference, ...) by returning objects with this shape from the
``model_support_serving_backends`` hook; the project's own plugin returns :class:`VllmBackend`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
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

    @property
    def headers(self) -> dict[str, str]:
        """What a raw HTTP request to the server must carry (its owner's key)."""
        ...

    def wait_ready(self) -> Server:
        """Block until the server answers (at once when it already did); raise if it died or never came up."""
        ...

    def start_in_background(self) -> Server:
        """Wait for the server in the background (:meth:`wait_ready` then waits for that)."""
        ...

    def completion(self, prompt: list[int], *, model: str | None = None, **params: Any) -> dict[str, Any]:
        """The first choice of a ``/v1/completions`` request for a token-id prompt (``token_ids``, ``logprobs``,
        ``prompt_logprobs``); ``model`` defaults to :attr:`served_name`, ``params`` are the request's fields."""
        ...

    def choices(self, prompt: list[int], *, model: str | None = None, **params: Any) -> list[dict[str, Any]]:
        """Every choice of one ``/v1/completions`` request (``n`` samples of one prompt), in index order."""
        ...

    def choices_many(
        self, prompts: list[list[int]], *, model: str | None = None, **params: Any
    ) -> list[list[dict[str, Any]]]:
        """:meth:`choices` of every prompt, the requests sent concurrently; the results in prompt order."""
        ...

    def stream(self, prompt: list[int], *, model: str | None = None, **params: Any) -> Iterator[dict[str, Any]]:
        """A streamed ``/v1/completions`` request: each chunk's choice (new ``token_ids``, ``text``, ``logprobs``)."""
        ...

    def chat(self, messages: list[dict[str, str]], *, model: str | None = None, **params: Any) -> dict[str, Any]:
        """The whole answer of a ``/v1/chat/completions`` request (``choices``, the rendered ``prompt_token_ids``)."""
        ...

    def models(self) -> list[str]:
        """The model names the server answers to (``/v1/models``): the served name, loaded LoRA adapters."""
        ...

    def load_lora(self, name: str, path: Path) -> None:
        """Load the PEFT adapter in ``path``, served as model ``name`` from then on."""
        ...

    def unload_lora(self, name: str) -> None:
        """Unload the adapter served as ``name``."""
        ...

    def reload_weights(self, weights_dir: Path) -> None: ...

    def update_weights(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> str:
        """Apply one step of HF-named weight buckets in place once the last has arrived; returns the new name."""
        ...

    def update_adapter(self, adapter_dir: Path, name: str | None = None) -> str:
        """Hot-swap the LoRA adapter ``name`` (default ``<model>-lora``; ``name@N`` -> ``@N+1``), the others served
        beside it untouched; returns the new adapter's served name."""
        ...

    def remove_adapter(self, name: str | None = None) -> None:
        """Unload the adapter ``name`` (default ``<model>-lora``) :meth:`update_adapter` serves, if any."""
        ...

    def pause(self) -> None:
        """Stop scheduling; requests in flight wait where they are."""
        ...

    def resume(self) -> None: ...

    def sleep(self, level: int = 1) -> None:
        """Give the server's GPU memory back to a trainer on the same GPU (level 1: weights to host memory, KV cache
        dropped; level 2: both dropped); ``wake_up`` takes it back. Servers started with sleep mode only."""

    def wake_up(self) -> None: ...

    def generate(self, prompt: list[int], *, model: str | None = None, **sampling: Any) -> list[dict[str, Any]]:
        """Sample from token ids; each choice carries the policy version of every token (``policy_epochs``) and
        ``policy_epoch``, ``kv_cache_epoch``, ``num_evictions``."""
        ...

    def generate_many(
        self, prompts: list[list[int]], *, model: str | None = None, **sampling: Any
    ) -> list[list[dict[str, Any]]]:
        """:meth:`generate` of every prompt, the requests in flight together; each prompt's choices, in order."""
        ...

    async def agenerate_many(
        self, prompts: list[list[int]], *, model: str | None = None, **sampling: Any
    ) -> list[list[dict[str, Any]]]:
        """:meth:`generate_many` in the caller's event loop."""
        ...

    def rename(self, name: str) -> None: ...

    def prefix_cache_hits(self) -> int | None:
        """The prompt tokens read from the prefix cache since the server started; None where it reports none."""
        ...

    def generated_tokens(self) -> int | None:
        """The tokens sampled since the server started, every request together; None where it reports none."""
        ...

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
    """Every backend the installed plugins provide, by name. Two plugins providing one name is an error naming both
    distributions: a plugin cannot replace the ``vllm`` backend (and what it serves) by loading first."""
    from model_support.core.plugin_loading import load_plugins

    loaded = load_plugins(env)
    found: dict[str, tuple[ServingBackend, str]] = {}
    for impl in loaded.manager.hook.model_support_serving_backends.get_hookimpls():
        info = loaded.plugins.get(impl.plugin_name)
        owner = f"{info.distribution if info else '?'} (plugin {impl.plugin_name!r})"
        for backend in impl.function() or ():
            if not isinstance(backend, ServingBackend):
                continue
            if backend.name in found:
                raise ServingError(
                    f"serving backend {backend.name!r} is provided by both {found[backend.name][1]} and {owner}: a "
                    "backend name belongs to one plugin; uninstall one"
                )
            found[backend.name] = (backend, owner)
    return {name: backend for name, (backend, _) in found.items()}


def get_backend(name: str = "vllm", env: dict[str, str] | None = None) -> ServingBackend:
    backends = serving_backends(env)
    if name not in backends:
        raise ServingError(f"no serving backend {name!r} (installed: {', '.join(sorted(backends)) or 'none'})")
    return backends[name]
