"""pytest plugin (entry point ``pytest11``): run the model-support harness from a handler author's tests.

Two ways to use it, both available as soon as model-support is installed:

``model_support_check`` runs a check and fails the test with the stage report when a stage fails::

    def test_my_handler(model_support_check):
        model_support_check("my-arch", tiny=True)

``model_support_stage`` gives one test per registered stage per target, parametrised automatically
(the stages come from the plugin registry, so stages added by any installed plugin appear too)::

    @pytest.mark.model_support("my-arch", tiny=True)
    def test_stage(model_support_stage):
        model_support_stage.check()

A target is a handler name or architecture (with ``tiny=True``: a tiny replica of its reference
config), a config.json, or a model directory. A run is made once per target and shared by all
the tests that ask for it. ``--model-support-stage NAME`` (repeatable) narrows every run to those
stages and their prerequisites (``--model-support-alone``: those stages only);
``--model-support-reports DIR`` writes each run's Markdown and JSON report there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from model_support.core.registry import Registry
    from model_support.validation.runner import Report
    from model_support.validation.stage import StageResult
    from model_support.validation.stage_registry import StageRegistry

MARKER = "model_support"
TARGETS_INI = "model_support_targets"


@dataclass(frozen=True)
class CheckRequest:
    """One harness run: what to check and how."""

    target: str
    tiny: bool = False
    stages: tuple[str, ...] = ()
    seed: int = 0
    prefer: tuple[tuple[str, str], ...] = ()
    # Parallel layouts for `parallel_parity` (e.g. ("tp2", "ep2")); empty: the stage's default for the model.
    layouts: tuple[str, ...] = ()
    # Run ``stages`` without their prerequisites (``check --alone``).
    alone: bool = False
    # The Megatron model's dtype (``check --dtype``: "bf16" or "fp32"); None: the device's.
    dtype: str | None = None
    # The layout the Megatron stages' model is sharded in across ranks (``check --parallel``, e.g. "ep2").
    parallel: str | None = None

    @property
    def label(self) -> str:
        """A short test-id friendly name for the target."""
        path = Path(self.target)
        if path.name == "config.json":
            return path.parent.name
        return path.stem if path.suffix == ".json" else path.name or self.target


def run_check(request: CheckRequest, workdir: Path, registry: Registry | None = None) -> Report:
    """Resolve the handler for ``request.target`` and run the planned stages on it, in process.

    This is what ``model-support check`` does; ``workdir`` receives the tiny replica and the
    stages' files.
    """
    from model_support.core import api
    from model_support.core.discovery import load_config, locate, source_for
    from model_support.core.parallel import ParallelLayout
    from model_support.core.registry import load_registry
    from model_support.validation.context import CheckContext
    from model_support.validation.parallel_check import refuse_layout, refuse_memory, run_sharded
    from model_support.validation.runner import plan, run_checks
    from model_support.validation.stage_registry import load_stages

    registry = registry or load_registry(prefer=dict(request.prefer))
    source = source_for(request.target, registry, request.tiny)
    handler = api.resolve(source, registry=registry)
    stages = plan(load_stages(registry).classes(), list(request.stages) or None, alone=request.alone)
    workdir.mkdir(parents=True, exist_ok=True)
    if request.tiny:
        from model_support.core.tiny import build_tiny

        source = locate(
            str(build_tiny(source.raw_config, workdir / "tiny-model", seed=request.seed, spec=handler.spec))
        )
    config = load_config(source)
    ctx = CheckContext(
        target=request.target,
        model_dir=source.directory,
        handler=handler,
        config=config,
        layout=handler.spec.layout(config),
        registry=registry,
        workdir=workdir,
        tiny=request.tiny,
        seed=request.seed,
        layouts=request.layouts or None,
        dtype=request.dtype,
        parallel=None if request.parallel is None else ParallelLayout.parse(request.parallel),
    )
    if ctx.parallel is None:
        return run_checks(ctx, stages)
    refuse_layout(ctx.spec, ctx.parallel)
    refuse_memory(ctx, ctx.parallel)
    return run_sharded(ctx, stages, on_result=lambda _result: None, prefer=dict(request.prefer))


def report_text(report: Report, problems: Sequence[str] = ()) -> str:
    """The stage report as plain text: one line per stage, then the details of what failed."""
    from model_support.validation.report import metrics_line
    from model_support.validation.stage import Status

    lines = [f"model-support check {report.target} -> {report.handler} ({report.handler_origin}): {report.layout}"]
    for r in report.results:
        lines.append(f"  {r.stage:<26} {r.status.upper():<4}  {r.summary}")
        metrics = metrics_line(r)
        if metrics:
            lines.append(f"  {'':<26}       {metrics}")
    for r in report.results:
        if r.status is Status.FAIL and r.details:
            lines.append(f"{r.stage} details:")
            lines.extend(f"    {d}" for d in r.details)
    lines.extend(f"registry warning: {p}" for p in problems)
    counts = report.counts()
    lines.append(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    return "\n".join(lines)


@dataclass
class Harness:
    """Session-wide runs, one per distinct :class:`CheckRequest` (a run that raised is remembered too)."""

    reports_dir: Path | None
    default_stages: tuple[str, ...]
    alone: bool = False  # run the chosen stages without their prerequisites (``check --alone``)
    runs: dict[CheckRequest, Report | str] = field(default_factory=dict)
    _registry: Registry | None = None
    _stages: StageRegistry | None = None

    @property
    def registry(self) -> Registry:
        if self._registry is None:
            from model_support.core.registry import load_registry

            self._registry = load_registry()
        return self._registry

    @property
    def stages(self) -> StageRegistry:
        """The stages of :attr:`registry`'s plugins."""
        if self._stages is None:
            from model_support.validation.stage_registry import load_stages

            self._stages = load_stages(self.registry)
        return self._stages

    def request(
        self,
        target: str | Path,
        tiny: bool = False,
        stages: Sequence[str] | None = None,
        seed: int = 0,
        prefer: dict[str, str] | None = None,
        layouts: Sequence[str] = (),
    ) -> CheckRequest:
        from model_support.core.parallel import parse_layouts

        chosen = tuple(stages) if stages else self.default_stages
        chosen_layouts = parse_layouts(",".join(layouts)) if layouts else ()
        preferred = tuple(sorted((prefer or {}).items()))
        return CheckRequest(str(target), tiny, chosen, seed, preferred, chosen_layouts, self.alone and bool(chosen))

    def planned(self, request: CheckRequest) -> list[str]:
        """The stage names a run of ``request`` reports, in pipeline order."""
        from model_support.validation.runner import plan

        return [s.name for s in plan(self.stages.classes(), list(request.stages) or None, alone=request.alone)]

    def run(self, request: CheckRequest, tmp: pytest.TempPathFactory) -> Report:
        """The report of ``request``; fails the calling test when the target cannot be checked at all."""
        from model_support.core.errors import ModelSupportError

        if request not in self.runs:
            index = len(self.runs)
            try:
                # A request with its own preferences builds its own registry.
                registry = None if request.prefer else self.registry
                report = run_check(request, tmp.mktemp(f"model-support-{request.label}"), registry)
            except ModelSupportError as exc:
                self.runs[request] = f"model-support cannot check {request.target!r}: {exc}"
            else:
                self.runs[request] = report
                if self.reports_dir is not None:
                    from model_support.validation.report import write_reports

                    stem = f"{request.label}-{index}"
                    write_reports(report, self.reports_dir / f"{stem}.json", self.reports_dir / f"{stem}.md", None)
        outcome = self.runs[request]
        if isinstance(outcome, str):
            pytest.fail(outcome, pytrace=False)
        return outcome

    def failure_message(self, report: Report) -> str:
        return report_text(report, [*self.registry.problems, *self.stages.problems])


_HARNESS = pytest.StashKey[Harness]()


@dataclass(frozen=True)
class StageOutcome:
    """One stage's result from a shared run; :meth:`check` turns it into the test's outcome."""

    result: StageResult
    report: Report
    message: str

    def check(self) -> StageResult:
        """Pass on a passed stage, skip on a skipped one (with its reason), fail with the stage report."""
        from model_support.validation.stage import Status

        if self.result.status is Status.SKIP:
            pytest.skip(f"{self.result.stage}: {self.result.summary}")
        if self.result.status is Status.FAIL:
            pytest.fail(f"stage {self.result.stage} failed: {self.result.summary}\n{self.message}", pytrace=False)
        return self.result


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("model-support", "model-support validation harness")
    group.addoption(
        "--model-support-stage",
        action="append",
        default=[],
        metavar="NAME",
        help="Run only this stage and its prerequisites (repeatable).",
    )
    group.addoption(
        "--model-support-alone",
        action="store_true",
        help="Run the --model-support-stage stages without their prerequisites (check --alone).",
    )
    group.addoption(
        "--model-support-reports",
        default=None,
        metavar="DIR",
        help="Write each model-support run's Markdown and JSON report to DIR.",
    )
    parser.addini(TARGETS_INI, "Targets for tests using model_support_stage without a marker.", type="linelist")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(*targets, tiny=False, stages=None, seed=0): targets that a test using the "
        "model_support_stage fixture is parametrised over, one test per stage",
    )


def _harness(config: pytest.Config) -> Harness:
    if _HARNESS not in config.stash:
        reports = config.getoption("model_support_reports")
        config.stash[_HARNESS] = Harness(
            reports_dir=Path(reports) if reports else None,
            default_stages=tuple(config.getoption("model_support_stage")),
            alone=config.getoption("model_support_alone"),
        )
    return config.stash[_HARNESS]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "model_support_stage" not in metafunc.fixturenames:
        return
    from model_support.core.errors import ModelSupportError

    marker = metafunc.definition.get_closest_marker(MARKER)
    targets = list(marker.args) if marker and marker.args else metafunc.config.getini(TARGETS_INI)
    if not targets:
        pytest.fail(
            f"{metafunc.definition.nodeid} uses model_support_stage but names no target: mark it with "
            f"@pytest.mark.{MARKER}('<handler>', tiny=True) or set {TARGETS_INI} in the pytest ini",
            pytrace=False,
        )
    kwargs = dict(marker.kwargs) if marker else {}
    harness = _harness(metafunc.config)
    params, ids = [], []
    for target in targets:
        request = harness.request(target, **kwargs)
        try:
            planned = harness.planned(request)
        except ModelSupportError as exc:
            pytest.fail(f"{metafunc.definition.nodeid}: {exc}", pytrace=False)
        for stage in planned:
            params.append((request, stage))
            ids.append(f"{request.label}-{stage}")
    metafunc.parametrize("model_support_stage", params, ids=ids, indirect=True)


@pytest.fixture
def model_support_stage(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> StageOutcome:
    """One stage of one target (see the module docstring); parametrised by the plugin."""
    check_request, stage = request.param
    harness = _harness(request.config)
    report = harness.run(check_request, tmp_path_factory)
    result = next(r for r in report.results if r.stage == stage)
    return StageOutcome(result, report, harness.failure_message(report))


@pytest.fixture
def model_support_check(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Report]:
    """``model_support_check(target, tiny=False, stages=None, seed=0, prefer=None, layouts=(), expect_pass=True)``.

    Runs (or reuses) the check of ``target`` and returns its report; when ``expect_pass`` and a
    stage failed, fails the test with the stage report.
    """
    harness = _harness(request.config)

    def check(
        target: str | Path,
        tiny: bool = False,
        stages: Sequence[str] | None = None,
        seed: int = 0,
        prefer: dict[str, str] | None = None,
        layouts: Sequence[str] = (),
        expect_pass: bool = True,
    ) -> Report:
        report = harness.run(harness.request(target, tiny, stages, seed, prefer, layouts), tmp_path_factory)
        if expect_pass and report.failed:
            failed = ", ".join(r.stage for r in report.failed)
            pytest.fail(f"model-support stage(s) failed: {failed}\n{harness.failure_message(report)}", pytrace=False)
        return report

    return check
