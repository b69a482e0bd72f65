"""The files of a model directory a check reads besides the weights (config, tokenizer, chat template), held to
the directory: each a regular file inside it (a symlink out of it, a FIFO that would block the reader, or a device,
is refused), and a file a tokenizer config names by path the same.

Its own module (no torch), below ``discovery.py``, which checks them before reading any, and ``checkpoint.py``,
which holds the weight files to the same roots.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from model_support.core.errors import ConfigError

# Read by transformers' config, tokenizer and chat-template loaders, and by vLLM's.
SUPPORT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "preprocessor_config.json",
)
# tokenizer_config.json entries that name a file to read
_PATH_ENTRIES = ("tokenizer_file", "vocab_file", "merges_file", "chat_template_file")


def allowed_roots(model_dir: Path) -> list[Path]:
    """Where a file of ``model_dir`` may resolve to: the directory, and for a Hugging Face cache snapshot
    (``<repo>/snapshots/<revision>``, whose files link to ``<repo>/blobs``) its repository's blobs."""
    root = model_dir.resolve()
    return [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]


def _inside(model_dir: Path, path: Path) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(root) for root in allowed_roots(model_dir))


def check_file(model_dir: Path, path: Path, error: type[Exception] = ConfigError) -> None:
    """``path`` (named as a file of ``model_dir``) must resolve inside it and be a regular file (``os.stat``: a FIFO
    is found without opening it, which would block)."""
    if not _inside(model_dir, path):
        resolved = path.resolve()
        raise error(f"{path} is a symlink to {resolved}, outside {model_dir}; copy the file into the model directory")
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise error(f"{path} is {kind}, not a file; replace it with the file it should be")


def check_support_files(model_dir: Path) -> None:
    """Every :data:`SUPPORT_FILES` entry present in ``model_dir``, and every file its ``tokenizer_config.json``
    names by path, checked by :func:`check_file` (one-line :class:`ConfigError` naming the file)."""
    for name in SUPPORT_FILES:
        path = model_dir / name
        if path.is_symlink() or path.exists():
            check_file(model_dir, path)
    config = model_dir / "tokenizer_config.json"
    if not config.exists():
        return
    try:
        entries = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # discovery names an unreadable side file itself
    for key in _PATH_ENTRIES:
        value = entries.get(key) if isinstance(entries, dict) else None
        if not isinstance(value, str) or not value:
            continue
        named = model_dir / value  # an absolute value replaces the directory
        if not _inside(model_dir, named):
            raise ConfigError(
                f"{config} names {key} {value!r}, a file outside {model_dir}; tokenizer files must be in the model "
                "directory"
            )
        if named.exists():
            check_file(model_dir, named)
