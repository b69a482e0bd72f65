"""Runs ``model-support selftest``: the clean runs, then each mutation of :mod:`model_support.validation.selftest`'s
catalogue injected, each through an in-process ``check --tiny --stage S --alone`` of the stage that must catch it
(alone: the verdict is that stage's own, and its prerequisites, which other runs check, are not run again).

Apart from the catalogue because the stages read which mutation is injected (``selftest.active_mutation``) and this
runs the stages: the catalogue stays below the stages, the runner above them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_support.core.errors import ModelSupportError
from model_support.validation import selftest


@dataclass(frozen=True)
class Outcome:
    """A mutation's (or a clean run's) result: ``ok`` when the stage failed under the bug (passed when clean)."""

    name: str
    bug: str
    handler: str
    stage: str
    status: str
    summary: str
    ok: bool


def _stage_result(
    handler: str,
    stage: str,
    workdir: Path,
    layouts: tuple[str, ...],
    dtype: str | None,
    parallel: str | None = None,
) -> Any:
    """``stage`` run alone (no prerequisites) on ``handler``'s tiny replica, under ``layouts``, in ``dtype``, the
    model sharded in ``parallel`` (None: one process)."""
    from model_support.validation.pytest_plugin import CheckRequest, run_check

    request = CheckRequest(
        target=handler, tiny=True, stages=(stage,), layouts=layouts, alone=True, dtype=dtype, parallel=parallel
    )
    (result,) = run_check(request, workdir).results
    return result


def run_selftest(
    workdir: Path,
    names: Sequence[str] | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
    *,
    clean_runs: bool = True,
) -> list[Outcome]:
    """Clean runs (unless ``clean_runs`` is false: a caller that has seen those stages pass clean elsewhere), then
    every selected mutation (all when ``names`` is empty), in catalogue order."""
    from model_support.validation.serving_session import backend

    chosen = [m for m in selftest.MUTATIONS if not names or m.name in names]
    unknown = sorted(set(names or ()) - {m.name for m in selftest.MUTATIONS})
    if unknown:
        raise ModelSupportError(
            f"unknown mutation(s) {', '.join(unknown)}; known: {', '.join(m.name for m in selftest.MUTATIONS)}"
        )
    no_server = backend().unavailable_reason()
    outcomes: list[Outcome] = []

    def record(outcome: Outcome) -> None:
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)

    # One clean run per (handler, stage, dtype), as its mutations run (that stage alone: it builds its own inputs,
    # e.g. the random adapter where no lora_coverage ran), under every layout they run in (the default where one
    # names none).
    clean: dict[tuple[str, str, str | None, str | None], tuple[str, ...] | None] = {}
    for m in chosen if clean_runs else ():
        if not (m.needs_server and no_server):
            key = (m.handler, m.stage, m.dtype, m.parallel)
            before = clean.get(key, ())
            clean[key] = None if before is None or not m.layouts else (*before, *m.layouts)
    for (handler, stage, dtype, parallel), layouts in clean.items():
        asked = tuple(dict.fromkeys(layouts or ()))
        name = f"clean-{handler}-{stage}" + (f"-{dtype}" if dtype else "") + (f"-{parallel}" if parallel else "")
        result = _stage_result(handler, stage, workdir / name, asked, dtype, parallel)
        record(Outcome("clean", "no bug", handler, stage, str(result.status), result.summary, result.status == "pass"))
    for m in chosen:
        if m.needs_server and no_server:
            record(Outcome(m.name, m.bug, m.handler, m.stage, "skip", no_server, True))
            continue
        with selftest.injected(m.name):
            result = _stage_result(m.handler, m.stage, workdir / m.name, m.layouts, m.dtype, m.parallel)
        record(Outcome(m.name, m.bug, m.handler, m.stage, str(result.status), result.summary, result.status == "fail"))
    return outcomes


def markdown_table(outcomes: Sequence[Outcome]) -> str:
    """The outcomes as a Markdown table (the one docs/stages.md carries)."""
    lines = ["| mutation | bug | handler | must fail | result | caught |", "| --- | --- | --- | --- | --- | --- |"]
    for o in outcomes:
        verdict = ("passed (clean)" if o.ok else "FAILED (clean)") if o.name == "clean" else ("yes" if o.ok else "NO")
        summary = o.summary.replace("|", "\\|")
        lines.append(f"| {o.name} | {o.bug} | {o.handler} | {o.stage} | {o.status}: {summary} | {verdict} |")
    return "\n".join(lines) + "\n"
