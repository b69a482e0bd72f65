"""Report renderers: terminal table, JSON, Markdown, JUnit XML."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

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


def render_terminal(report: Report, console: Console) -> None:
    show_gpu = _shows_gpu(report)
    table = Table(title=f"model-support check: {report.target} -> {report.handler} ({report.handler_origin})")
    table.add_column("stage")
    table.add_column("status")
    table.add_column("time", justify="right")
    if show_gpu:
        table.add_column("gpu peak", justify="right")
    table.add_column("host peak", justify="right")
    table.add_column("result")
    for r in report.results:
        # Summaries quote packages and vLLM's words ("model-support[megatron]"): never read them as markup.
        text = escape(r.summary) + (f"\n[dim]{escape(metrics_line(r))}[/dim]" if r.metrics else "")
        memory = [_gpu_cell(r)] if show_gpu else []
        table.add_row(
            r.stage, f"[{_STYLE[r.status]}]{r.status}[/]", f"{r.duration_s:.1f}s", *memory, _host_cell(r), text
        )
    console.print(table)
    if _has_lifetime_peak(report):
        console.print(f"[dim]{_LIFETIME_NOTE}[/dim]")
    counts = report.counts()
    console.print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped  ({report.layout})")


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
