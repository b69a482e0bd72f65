"""Progress of long steps: a check's model build and stages, the vLLM runtime install, a vLLM server start.

On a terminal a running step is a spinner line with its elapsed time (a step inside another, such as a server start
inside a stage, adds a line under it), gone when the step ends. Anywhere else (a CI log, a pipe) a step prints one
line when it starts and one when it ends, nothing in between. Steps show nothing until a command turns the display
on with :func:`shown_on`, so a trainer or a test calling the same code gets no output from them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn


class _Display:
    """The console the steps report to, the indents of the steps running, and the spinners on a terminal."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.indents: list[int] = []
        self.spinners: Progress | None = None

    def line(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def begin(self, text: str) -> TaskID | None:
        if not self.console.is_terminal:
            self.line(f"{text} ...")
            return None
        if self.spinners is None:
            # Transient: when the last step ends its lines are erased, and what follows prints where they were.
            # What others write to stderr meanwhile prints above the spinners; stdout (the report) is left alone.
            self.spinners = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
                redirect_stdout=False,
            )
            self.spinners.start()
        return self.spinners.add_task(escape(text))

    def end(self, task: TaskID | None) -> None:
        if task is None or self.spinners is None:
            return
        self.spinners.remove_task(task)
        if not self.spinners.tasks:
            self.spinners.stop()
            self.spinners = None
        else:
            self.spinners.refresh()  # the step's end line must not print above a stale copy of its spinner


_display: _Display | None = None


@contextmanager
def shown_on(console: Console) -> Iterator[None]:
    """Show the steps that run inside the block on ``console`` (a command's stderr console)."""
    global _display
    previous, _display = _display, _Display(console)
    try:
        yield
    finally:
        _display = previous


@contextmanager
def silenced() -> Iterator[None]:
    """Show nothing of the steps inside the block (a rank of ``check --parallel``: the check's process shows its
    results)."""
    global _display
    previous, _display = _display, None
    try:
        yield
    finally:
        _display = previous


@contextmanager
def step(what: str, *, indent: int | None = None, end_line: bool = True) -> Iterator[None]:
    """Show ``what`` while the block runs (nothing unless inside :func:`shown_on`).

    ``indent``: spaces before its lines; by default two more than the step it runs inside, none for an outermost one.
    ``end_line``: when it ends, print ``"<what>: done in 3.2 s"`` (``failed after`` when the block raised an error,
    ``stopped after`` when a signal or Ctrl-C ended it); a caller that prints the outcome itself (the check's line
    per finished stage) turns it off.
    """
    display = _display
    if display is None:
        yield
        return
    if indent is None:
        indent = display.indents[-1] + 2 if display.indents else 0
    text = " " * indent + what
    display.indents.append(indent)
    start = time.monotonic()
    task = display.begin(text)
    outcome = "stopped after"
    try:
        yield
        outcome = "done in"
    except Exception:
        outcome = "failed after"
        raise
    finally:
        display.indents.pop()
        display.end(task)
        if end_line:
            display.line(f"{text}: {outcome} {time.monotonic() - start:.1f} s")
