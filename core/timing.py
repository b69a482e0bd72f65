"""Where a stage's time goes: named phases, each second counted once.

A check's stage is timed as a whole; inside it, :func:`phase` marks work of a kind that makes checks slow for a
known reason: building the model under test (``build``), the transformers oracle (``oracle``), Triton's autotuning
of GPU kernels (``autotune``, every candidate setting compiled and timed) and a server's start (``server_start``).
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

PHASES = ("build", "oracle", "autotune", "server_start")
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
    """Count :func:`phase` blocks (and Triton's autotuning, where Triton is loaded) into a new clock."""
    global _clock
    outer, _clock = _clock, PhaseClock()
    _watch_autotuning()
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


def _watch_autotuning() -> None:
    """Count each candidate setting Triton's autotuner benchmarks (compiling it included) as ``autotune``.

    Wraps ``Autotuner._bench`` once per process: Triton has no hook that reports tuning time, and fla's kernels
    tune through Triton's autotuner. Only where a GPU is there (Triton does not tune on the CPU); a tuning key
    found in Triton's cache is not benchmarked and costs no ``autotune`` time.
    """
    if "torch" not in sys.modules or not sys.modules["torch"].cuda.is_available():
        return
    if importlib.util.find_spec("triton") is None:
        return
    from triton.runtime import autotuner

    bench = autotuner.Autotuner._bench
    if getattr(bench, "_model_support_timed", False):
        return

    @functools.wraps(bench)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        with phase("autotune"):
            return bench(self, *args, **kwargs)

    timed._model_support_timed = True  # type: ignore[attr-defined]
    autotuner.Autotuner._bench = timed
