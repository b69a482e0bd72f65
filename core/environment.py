"""Environment variables set for a block and put back after it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """Within the block each named variable is set (a string) or unset (None); on leaving, each is as it was before
    the block, whatever the block did to it. Other variables are left alone (``unittest.mock.patch.dict`` would put
    back the whole environment, undoing what the block set for its own reasons)."""
    saved = {name: os.environ.get(name) for name in values}
    _apply(values)
    try:
        yield
    finally:
        _apply(saved)


def _apply(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
