"""Report renderers: terminal table, JSON, Markdown, JUnit XML."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.padding import Padding
from rich.rule import Rule
from rich.text import Text

from model_support.validation.runner import Report
from model_support.validation.stage import StageResult, Status

_STYLE = {Status.PASS: "green", Status.FAIL: "bold red", Status.SKIP: "yellow"}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def metrics_line(result: StageResult) -> str:
    parts = []
    for key, value in result.metrics.items():
        limit = result.thresholds.get(key)
        parts.append(f"{key}={_fmt(value)}" + (f" (<= {_fmt(limit)})" if limit is not None else ""))
    return ", ".join(parts)


def _gpu_cell(result: StageResult) -> str:
    """Peak GPU memory of a stage: allocated (reserved) by torch's CUDA allocator."""
    if result.peak_gpu_mib is None:
        return "-"
    return f"{result.peak_gpu_mib:.0f} MiB ({result.peak_gpu_reserved_mib:.0f} reserved)"


def _host_cell(result: StageResult) -> str:
    """Peak host resident set of a stage; ``*`` marks the process's peak so far (``_LIFETIME_NOTE``)."""
    if result.peak_host_mib is None:
        return "-"
    return f"{result.peak_host_mib:.0f} MiB" + ("*" if result.peak_host_lifetime else "")


_LIFETIME_NOTE = "* host peak of the whole process so far: this system could not reset it per stage"


def _shows_gpu(report: Report) -> bool:
    return any(r.peak_gpu_mib is not None for r in report.results)


def _has_lifetime_peak(report: Report) -> bool:
    return any(r.peak_host_lifetime for r in report.results)


# Below this console width the peak-memory columns leave the terminal table (they stay in verbose lines, JSON,
# Markdown and JUnit), so that an 80-column terminal or a CI log keeps room for each stage's summary.
_WIDE = 120


def _verbose_lines(result: StageResult, summary_shown: bool) -> list[str]:
    """What ``check --verbose`` shows under a stage: the summary where its line cut it, the metrics (with their
    limits), memory peaks and details."""
    lines = [] if summary_shown else [result.summary]
    for key, value in result.metrics.items():
        limit = result.thresholds.get(key)
        lines.append(f"{key} = {_fmt(value)}" + (f"  (<= {_fmt(limit)})" if limit is not None else ""))
    if result.peak_gpu_mib is not None:
        lines.append(f"gpu peak {_gpu_cell(result)}")
    if result.peak_host_mib is not None:
        lines.append(f"host peak {_host_cell(result)}")
    if result.built:
        made = (f"{name} ({o['phase']}, {o['seconds']:.1f} s)" for name, o in result.built.items())
        lines.append("built: " + ", ".join(made))
    if result.origin:
        lines.append(f"from {result.origin}")
    return lines + list(result.details)


def render_terminal(report: Report, console: Console, verbose: bool = False) -> None:
    """The report as one line per stage: stage, status, time and its summary, cut to the console's width.

    A console at least ``_WIDE`` columns wide also gets the peak-memory columns. ``verbose`` adds each stage's
    metrics with their limits, memory peaks and details under its line, indented and wrapped to the width.
    """
    show_memory = console.width >= _WIDE
    show_gpu = show_memory and _shows_gpu(report)
    header = ["stage", "status", "time"] + ["gpu peak"] * show_gpu + ["host peak"] * show_memory
    rows = [
        [r.stage, str(r.status), f"{r.duration_s:.1f}s"] + [_gpu_cell(r)] * show_gpu + [_host_cell(r)] * show_memory
        for r in report.results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def cells(values: list[str], styles: list[str]) -> Text:
        """The fixed columns, two spaces apart: stage and status left-aligned, the numbers right-aligned."""
        line = Text()
        for i, (value, width, style) in enumerate(zip(values, widths, styles, strict=True)):
            line.append((value.ljust if i < 2 else value.rjust)(width) + "  ", style=style)
        return line

    console.print(
        Text(f"model-support check: {report.target} -> {report.handler} ({report.handler_origin})", style="bold")
    )
    console.print(cells(header, ["bold"] * len(header)).append("result", style="bold"), no_wrap=True, crop=True)
    console.print(Rule(style="dim"))
    for r, row in zip(report.results, rows, strict=True):
        # Summaries quote packages and vLLM's words ("model-support[megatron]"): Text, never read as markup.
        line = cells(row, ["", _STYLE[r.status], *[""] * (len(row) - 2)]).append(r.summary)
        console.print(line, no_wrap=True, overflow="ellipsis")
        if verbose:
            for extra in _verbose_lines(r, summary_shown=line.cell_len <= console.width):
                console.print(Padding(Text(extra, style="dim"), (0, 0, 0, 4), expand=False))
    if (show_memory or verbose) and _has_lifetime_peak(report):
        console.print(Text(_LIFETIME_NOTE, style="dim"))
    counts = report.counts()
    console.print(
        f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped  ({report.layout})",
        markup=False,
        highlight=False,
    )
    hidden = sum(report.suppressed_warnings.values())
    if hidden:
        plural = "s" if hidden != 1 else ""
        console.print(
            Text(f"{hidden} known third-party warning{plural} hidden (counted by message in the --json report)"),
            style="dim",
        )


def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, default=str) + "\n"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: Report) -> str:
    show_gpu = _shows_gpu(report)
    lines = [
        f"# model-support check: `{report.target}`",
        "",
        f"- handler: `{report.handler}` ({report.handler_origin})",
        f"- model: `{report.model_dir}`{' (tiny replica)' if report.tiny else ''}",
        f"- layout: {report.layout}",
        f"- started: {report.started}",
        "- environment: " + ", ".join(f"{k} {v}" for k, v in report.environment.items()),
        "",
        f"| stage | status | time |{' gpu peak |' if show_gpu else ''} host peak | result | metrics |",
        f"| --- | --- | ---: |{' ---: |' if show_gpu else ''} ---: | --- | --- |",
    ]
    for r in report.results:
        memory = f"{_gpu_cell(r)} | " if show_gpu else ""
        lines.append(
            f"| {r.stage} | {r.status.upper()} | {r.duration_s:.1f}s | {memory}{_host_cell(r)} | "
            f"{_md_escape(r.summary)} | {_md_escape(metrics_line(r))} |"
        )
    if _has_lifetime_peak(report):
        lines += ["", "\\" + _LIFETIME_NOTE]  # escaped: a leading "*" would start a list
    counts = report.counts()
    lines += ["", f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped", ""]
    return "\n".join(lines)


def to_junit(report: Report) -> str:
    counts = report.counts()
    suite = ET.Element(
        "testsuite",
        name=f"model-support.{report.handler}",
        tests=str(len(report.results)),
        failures=str(counts["fail"]),
        skipped=str(counts["skip"]),
        time=f"{sum(r.duration_s for r in report.results):.3f}",
    )
    for r in report.results:
        case = ET.SubElement(suite, "testcase", classname=report.handler, name=r.stage, time=f"{r.duration_s:.3f}")
        peaks = {k: v for k, v in r.to_dict().items() if k.startswith("peak_") and v is not None}
        if peaks:
            properties = ET.SubElement(case, "properties")
            for name, value in peaks.items():
                ET.SubElement(properties, "property", name=name, value=json.dumps(value))
        body = "\n".join([metrics_line(r), *r.details]).strip()
        if r.status is Status.FAIL:
            node = ET.SubElement(case, "failure", message=r.summary)
            node.text = body
        elif r.status is Status.SKIP:
            ET.SubElement(case, "skipped", message=r.summary)
        elif body:
            ET.SubElement(case, "system-out").text = body
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_reports(report: Report, json_path: Path | None, markdown_path: Path | None, junit_path: Path | None) -> None:
    for path, render in ((json_path, to_json), (markdown_path, to_markdown), (junit_path, to_junit)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(render(report))
