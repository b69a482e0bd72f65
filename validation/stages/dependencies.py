"""Stage `dependencies`: installed packages meet the handler's floors; which GDN kernel path runs."""

from __future__ import annotations

from importlib import metadata

from packaging.version import Version

from model_support.validation.context import CheckContext
from model_support.validation.stage import Stage, StageResult


class DependenciesStage(Stage):
    name = "dependencies"
    title = "Installed packages meet the handler's version floors; the GDN kernel path is known."
    order = 10
    sharded = True

    def run(self, ctx: CheckContext) -> StageResult:
        problems: list[str] = []
        details: list[str] = []
        metrics: dict[str, str] = {}
        for floor in ctx.spec.dependencies:
            try:
                installed = metadata.version(floor.package)
            except metadata.PackageNotFoundError:
                if floor.extra is None:
                    problems.append(f"{floor.package} is not installed (needs >= {floor.minimum}: {floor.reason})")
                else:
                    details.append(
                        f"{floor.package} not installed: stages that need it will skip "
                        f"(pip install 'model-support[{floor.extra}]')"
                    )
                continue
            metrics[floor.package] = installed
            if Version(installed) < Version(floor.minimum):
                problems.append(
                    f"{floor.package} {installed} < {floor.minimum} ({floor.reason}); "
                    f"pip install -U '{floor.package}>={floor.minimum}'"
                )
            else:
                details.append(f"{floor.package} {installed} >= {floor.minimum}: {floor.reason}")
        if ctx.spec.linear_attention:
            from model_support.kernels import select_backend

            choice = select_backend()
            metrics["gdn_backend"] = choice.name
            details.append(f"GDN kernels: {choice.name} ({choice.reason})")
        if problems:
            return self.failed("; ".join(problems), metrics=metrics, details=details)
        return self.passed(f"{len(ctx.spec.dependencies)} floor(s) met", metrics=metrics, details=details)
