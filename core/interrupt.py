"""SIGINT, SIGTERM and SIGHUP end a command the same way: its children are killed at once, and an exception unwinds
the command, so its ``finally`` blocks stop what it started and remove its run directory before it exits.

Installed by the CLI's ``main`` (:func:`installed`); code used as a library keeps Python's own signal handling (its
children die with it all the same: see :mod:`model_support.core.serving.launcher`).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from model_support.core.serving.process import stop_all_now

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """A stop signal arrived. A ``BaseException`` like ``KeyboardInterrupt``, so that the ``except Exception``
    blocks that turn a stage's error into a failed stage let it through; not a ``KeyboardInterrupt``, which Typer
    turns into a silent exit."""

    def __init__(self, signum: int) -> None:
        self.signal = signal.Signals(signum)
        super().__init__(f"interrupted by {self.signal.name}")

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, as a shell reports a process the signal killed (130 for SIGINT)."""
        return 128 + self.signal.value


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # A second signal must not cut the first one's cleanup short: from now on they are ignored.
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    stop_all_now()
    raise Interrupted(signum)


@contextmanager
def installed() -> Iterator[None]:
    """Inside the block each stop signal raises :class:`Interrupted` in the main thread; a signal this process was
    started with ignored (``nohup``, a background job's SIGINT) stays ignored. The handlers the process had come
    back after it (a caller of the CLI's ``main``, such as a test, keeps its own)."""
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
