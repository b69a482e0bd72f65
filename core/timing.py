"""Where a stage's time goes: named phases, each second counted once.

A check's stage is timed as a whole; inside it, :func:`phase` marks work of a kind that makes checks slow for a
known reason: building the model under test (``build``), the transformers oracle (``oracle``), Triton's autotuning
of GPU kernels (``autotune``, every candidate setting compiled and timed), Triton's compilation of a kernel for new
shapes or flags outside autotuning (``compile``; a binary in Triton's cache costs almost none) and a server's start
(``server_start``).
Phases nest exclusively: the oracle's own model build inside ``oracle`` counts as ``build`` and leaves ``oracle``
while it runs. What no phase claims is the stage's own work, reported as ``comparison``. Outside a
:func:`measuring` block :func:`phase` costs nothing and records nothing, so library code (the training-time API,
the oracle) marks its phases unconditionally.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

PHASES = ("build", "oracle", "autotune", "compile", "server_start")
REST = "comparison"


class PhaseClock:
    """Seconds per phase, exclusive: entering a phase pauses the one around it."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._stack: list[list[Any]] = []  # [name, running since]

    def _charge_top(self, now: float) -> None:
        if self._stack:
            name, since = self._stack[-1]
            self.totals[name] = self.totals.get(name, 0.0) + now - since

    def current(self) -> str | None:
        """The innermost phase running now."""
        return self._stack[-1][0] if self._stack else None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        now = time.perf_counter()
        self._charge_top(now)
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = time.perf_counter()
            self._charge_top(now)
            self._stack.pop()
            if self._stack:
                self._stack[-1][1] = now

    def split(self, total_s: float) -> dict[str, float]:
        """Each phase's seconds (those that ran), and the rest of ``total_s`` as ``comparison``."""
        split = {name: round(self.totals[name], 3) for name in PHASES if name in self.totals}
        split.update({name: round(s, 3) for name, s in self.totals.items() if name not in split})
        split[REST] = round(max(0.0, total_s - sum(self.totals.values())), 3)
        return split


_clock: PhaseClock | None = None


@contextmanager
def measuring() -> Iterator[PhaseClock]:
    """Count :func:`phase` blocks (and Triton's autotuning and compilation, where Triton is loaded) into a new
    clock."""
    global _clock
    outer, _clock = _clock, PhaseClock()
    _watch_triton()
    try:
        yield _clock
    finally:
        _clock = outer


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the block's seconds as ``name`` in the running :func:`measuring` clock (none running: no-op)."""
    clock = _clock
    if clock is None:
        yield
        return
    with clock.phase(name):
        yield


@contextmanager
def compiling() -> Iterator[None]:
    """A kernel's compilation: counted as ``compile``, except inside ``autotune`` (whose candidates it compiles)."""
    clock = _clock
    if clock is None or clock.current() == "autotune":
        yield
        return
    with clock.phase("compile"):
        yield


def _watch_triton() -> None:
    """Count each candidate setting Triton's autotuner benchmarks (compiling it included) as ``autotune``, and each
    kernel Triton compiles outside that as ``compile``.

    Wraps ``Autotuner._bench`` and ``JITFunction._do_compile`` once per process: Triton has no hook that reports
    tuning or compilation time (its ``jit_post_compile_hook`` runs after, without the duration), and fla's kernels run
    through both. Only where a GPU is there (Triton neither tunes nor compiles on the CPU); a tuning key found in
    Triton's cache is not benchmarked and costs no ``autotune`` time.
    """
    if "torch" not in sys.modules or not sys.modules["torch"].cuda.is_available():
        return
    if importlib.util.find_spec("triton") is None:
        return
    from triton.runtime import autotuner, jit

    _wrap(autotuner.Autotuner, "_bench", lambda: phase("autotune"))
    _wrap(jit.JITFunction, "_do_compile", compiling)


def _wrap(owner: type, name: str, counted: Any) -> None:
    """``owner.name`` run inside the context ``counted()`` opens (once; nothing where Triton has no such method)."""
    method = getattr(owner, name, None)
    if method is None or getattr(method, "_model_support_timed", False):
        return

    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        with counted():
            return method(self, *args, **kwargs)

    timed._model_support_timed = True  # type: ignore[attr-defined]
    setattr(owner, name, timed)
