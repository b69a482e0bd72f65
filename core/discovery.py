"""From what the user typed (a directory, a config.json, or a hub id in the local HF cache) to
exactly one handler. Nothing here reaches the network."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_support.core.config_check import check_config
from model_support.core.errors import (
    ConfigError,
    HandlerConflictError,
    ModelNotFoundError,
    UnknownArchitectureError,
)
from model_support.core.model_files import check_support_files
from model_support.core.registry import ADD_HANDLER_HINT, RegisteredHandler, Registry

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """A located model: the directory holding config.json, and that config as JSON."""

    target: str
    directory: Path
    raw_config: dict[str, Any]
    config_file: Path

    @property
    def architectures(self) -> list[str]:
        return list(self.raw_config.get("architectures") or [])

    @property
    def model_type(self) -> str | None:
        return self.raw_config.get("model_type")


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except HFValidationError as exc:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path and not a valid hub id ({str(exc).splitlines()[0]}); "
            "pass a model directory, a config.json or an org/name hub id"
        ) from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path and is not in the local Hugging Face cache ({HF_HUB_CACHE}); "
            f"download it where there is network (`hf download {repo_id}`) or pass a local directory"
        ) from None


def locate(target: str) -> ModelSource:
    """Find config.json for ``target``, read it and check it (:func:`~model_support.core.config_check.check_config`).

    The directory is made absolute here, so nothing downstream (a child process in another working
    directory, e.g. vLLM) can take a relative path for a hub id.
    """
    path = Path(target).expanduser().absolute()
    if os.path.lexists(path) and not path.exists():
        raise ModelNotFoundError(
            f"{target!r} is a symbolic link that leads nowhere (broken, or a loop); point at the model directory itself"
        )
    if path.is_file() and path.name.endswith(".json"):
        directory, config_file = path.parent, path
    elif path.is_dir():
        directory, config_file = path, path / "config.json"
    elif _HUB_ID.match(target) and not path.exists():
        directory = _from_hf_cache(target)
        config_file = directory / "config.json"
    else:
        raise ModelNotFoundError(f"{target!r} is neither a directory, a config.json, nor a hub id (org/name)")
    if not config_file.exists():
        raise ModelNotFoundError(f"{directory} has no config.json; point at a Hugging Face model directory")
    check_support_files(directory)  # before any is read: a FIFO would block, a symlink out would be followed
    raw = _json_object(config_file)
    for side_file in _SIDE_FILES:  # read by transformers and vLLM later, where a broken one would fail a stage
        if (directory / side_file).exists():
            _json_object(directory / side_file)
    check_config(raw, str(config_file))
    return ModelSource(target, directory, raw, config_file)


def source_for(target: str, registry: Registry, tiny: bool) -> ModelSource:
    """Locate ``target``; under ``--tiny`` a handler name or architecture uses its reference config."""
    try:
        return locate(target)
    except ModelNotFoundError:
        if target not in registry.handlers and target not in registry.claims:
            raise
        if not tiny:
            raise ModelNotFoundError(
                f"{target!r} names a handler, not a model: pass --tiny to check a tiny replica of its reference "
                "config, or pass a model directory"
            ) from None
    spec = registry.get(target).spec
    if spec.reference_config is None:
        raise ModelNotFoundError(f"handler {spec.name!r} ships no reference config; pass a model directory")
    return locate(str(spec.reference_config))


# The checkpoint's JSON files besides its config that the stages' libraries read.
_SIDE_FILES = ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json")


def _json_object(path: Path) -> dict[str, Any]:
    """``path`` read as a JSON object, or a one-line :class:`ConfigError` naming the file."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ConfigError(f"{path} nests its JSON too deeply to read; re-download or fix the file") from None
    except (OSError, ValueError) as exc:  # ValueError: invalid JSON or not UTF-8
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{path} is not readable JSON ({reason}); re-download or fix the file") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return raw


def resolve_handler(source: ModelSource, registry: Registry) -> RegisteredHandler:
    """The one handler for this config: by its architectures, else by its model_type. A config naming several
    architectures must have them all claimed by one handler: transformers and vLLM build the first, the bridge may
    read another, so a stray second name would be checked as a model nobody builds."""
    claimed = [arch for arch in source.architectures if arch in registry.claims]
    if claimed:
        handler = registry.for_architecture(claimed[0])
        stray = [a for a in source.architectures if a not in handler.spec.architectures]
        if stray:
            raise UnknownArchitectureError(
                f"{source.config_file} names architectures {', '.join(source.architectures)}, and handler "
                f"{handler.spec.name} claims only {', '.join(handler.spec.architectures)}: a checkpoint is one model; "
                f"remove {', '.join(stray)} from `architectures`"
            )
        return handler
    by_type = [h for h in registry.handlers.values() if source.model_type in h.spec.model_types]
    if len(by_type) == 1:
        return by_type[0]
    if len(by_type) > 1:
        names = " and ".join(h.label() for h in by_type)
        raise HandlerConflictError(
            f"model_type {source.model_type!r} is claimed by {names}; the config names no architecture "
            "that settles it; add `architectures` to config.json or uninstall one handler"
        )
    what = ", ".join(source.architectures) or "no architectures"
    supported = ", ".join(registry.supported_architectures()) or "none"
    raise UnknownArchitectureError(
        f"{source.target}: unsupported model ({what}, model_type {source.model_type!r}); "
        f"supported architectures: {supported}; {ADD_HANDLER_HINT}"
    )


def load_config(source: ModelSource) -> Any:
    """The transformers config object of a located model."""
    from transformers import AutoConfig

    try:
        # The file the user named (it may not be called config.json), not the directory's config.json.
        return AutoConfig.from_pretrained(source.config_file, local_files_only=True)
    except Exception as exc:  # transformers' own validation errors have no common base class
        import transformers

        raise ConfigError(
            f"transformers {transformers.__version__} cannot load {source.config_file} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]}); check the file or upgrade transformers"
        ) from None
