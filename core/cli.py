"""The ``model-support`` command line: the top layer, which may import every other (docs/architecture.md); nothing
in the package imports it."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from model_support.core import api, progress, quiet
from model_support.core.discovery import ModelSource, load_config, locate, source_for
from model_support.core.errors import ModelSupportError
from model_support.core.plugin_loading import PluginControlError
from model_support.core.registry import Registry, load_registry, parse_preferences
from model_support.core.serving.cli import runtime_app
from model_support.core.spec import HandlerSpec
from model_support.plugins.new_handler import new_handler
from model_support.validation.reference_docs import docs_command
from model_support.validation.stage_registry import StageRegistry, load_stages

if TYPE_CHECKING:
    from model_support.validation.stage import StageResult

app = typer.Typer(
    help="Support a Hugging Face model family in a Megatron + vLLM RL/LoRA stack, and prove it.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
err = Console(stderr=True)
app.add_typer(runtime_app, name="runtime")


class ModelDtype(StrEnum):
    bf16 = "bf16"
    fp32 = "fp32"


# numpy's seeds stop at 2**32 - 1; the stages derive their generators' seeds from it by small offsets.
SeedOption = Annotated[int, typer.Option(min=0, max=2**32 - 1, help="Seed of the random weights and inputs.")]
PreferOption = Annotated[
    list[str] | None,
    typer.Option("--prefer", help="Settle a claim conflict: ARCH=HANDLER or HANDLER (repeatable)."),
]


def _loaded(prefer: list[str] | None = None, stages: bool = True) -> tuple[Registry, StageRegistry]:
    """The handler registry and the registered stages, their problems and unsettled conflicts printed;
    ``stages=False`` for commands that need handlers only (the stage modules import torch): no stages then."""
    registry = load_registry(prefer=parse_preferences(",".join(prefer or [])))
    found = load_stages(registry) if stages else StageRegistry()
    for problem in [*registry.problems, *found.problems]:
        err.print(f"[yellow]warning:[/] {escape(problem)}")
    for arch, claimants in registry.conflicts().items():
        names = ", ".join(c.label() for c in claimants)
        err.print(f"[yellow]warning:[/] architecture {escape(arch)} is claimed by {escape(names)} (use --prefer)")
    return registry, found


def _registry(prefer: list[str] | None = None, stages: bool = True) -> Registry:
    """The handler registry, as :func:`_loaded` prints it."""
    return _loaded(prefer, stages)[0]


def _print_progress(result: StageResult) -> None:
    """One stderr line per finished stage, so a run cut off by a time limit still shows what it reached."""
    line = f"  {result.stage}: {result.status} ({result.duration_s:.1f} s) {result.summary}"
    err.print(line, markup=False, highlight=False, soft_wrap=True)


def spec_to_dict(spec: HandlerSpec) -> dict[str, Any]:
    data = dataclasses.asdict(dataclasses.replace(spec, codec=None))
    data["codec"] = spec.codec.name if spec.codec is not None else None
    data["reference_config"] = str(spec.reference_config) if spec.reference_config else None
    return data


@app.command("list")
def list_handlers(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """List the installed handlers and the plugins that provide them."""
    registry = _registry(stages=False)
    rows = [
        {
            "handler": h.spec.name,
            "architectures": list(h.spec.architectures),
            "plugin": h.plugin.name,
            "distribution": h.plugin.distribution,
            "version": h.plugin.version,
            "vllm_lora": "native" if h.spec.vllm_lora.native else "merged-only",
        }
        for h in sorted(registry.handlers.values(), key=lambda h: h.spec.name)
    ]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="model-support handlers")
    for col in ("handler", "architectures", "plugin (distribution version)", "vLLM LoRA"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["handler"],
            "\n".join(r["architectures"]),
            f"{r['plugin']} ({r['distribution']} {r['version']})",
            r["vllm_lora"],
        )
    console.print(table)


@app.command()
def show(
    name: Annotated[str, typer.Argument(help="Handler name or architecture.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Show a handler's whole declaration."""
    entry = _registry(stages=False).get(name)
    data = spec_to_dict(entry.spec) | {"plugin": dataclasses.asdict(entry.plugin)}
    if as_json:
        print(json.dumps(data, indent=2, default=str))
        return
    spec = entry.spec
    console.print(f"[bold]{escape(spec.name)}[/] ({escape(entry.origin)}): {escape(spec.description)}")
    console.print(f"architectures: {', '.join(spec.architectures)}   model_types: {', '.join(spec.model_types)}")
    console.print(f"topology: {spec.topology}   GDN linear attention: {spec.linear_attention}")
    targets = Table(title="LoRA targets")
    for col in ("scope", "Megatron", "HF / vLLM"):
        targets.add_column(col)
    for t in spec.lora_targets:
        targets.add_row(str(t.scope), t.megatron, ", ".join(t.hf))
    console.print(targets)
    if spec.lora_exclusions:
        exclusions = Table(title="LoRA exclusions (mapped linears left untrained)")
        for col in ("scope", "Megatron", "reason"):
            exclusions.add_column(col)
        for e in spec.lora_exclusions:
            exclusions.add_row(str(e.scope), e.megatron, escape(e.reason))
        console.print(exclusions)
    else:
        console.print("LoRA exclusions: none")
    console.print(f"codec: {data['codec'] or 'none declared'}")
    status = "native" if spec.vllm_lora.native else "merged-only"
    console.print(f"vLLM LoRA: {status} ({spec.vllm_lora.reason})")
    for dep in spec.dependencies:
        extra = f" [extra {dep.extra}]" if dep.extra else ""
        console.print(escape(f"requires {dep.package} >= {dep.minimum}{extra}: {dep.reason}"))
    console.print(f"runtime: {dataclasses.asdict(spec.runtime)}")
    if spec.reference_config:
        console.print(f"reference config: {spec.reference_config}")


@app.command()
def stages() -> None:
    """List the validation stages in pipeline order."""
    from model_support.validation.runner import plan

    _, registered = _loaded()
    origin = {s.stage.name: s.plugin.distribution for s in registered.stages}
    table = Table(title="validation stages")
    for col in ("stage", "requires", "proves", "from"):
        table.add_column(col)
    for stage in plan(registered.classes()):
        table.add_row(stage.name, ", ".join(stage.requires), stage.title, origin[stage.name])
    console.print(table)


@contextmanager
def _written(out: Path) -> Iterator[None]:
    """A write that fails (a full disk, a quota, a file size limit) as a one-line error; ``staged_dir`` has removed
    what was half-written by then."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:  # safetensors reports a failed write as its own error
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelSupportError(
            f"cannot write {out} ({reason}); free space there or choose another directory"
        ) from None


def _check_preferred(prefer: list[str] | None, registry: Registry, source: ModelSource) -> None:
    """A bare ``--prefer HANDLER`` must name a handler that claims one of the model's architectures: otherwise it
    settles nothing for this model and the user meant another."""
    for key, name in parse_preferences(",".join(prefer or [])).items():
        claimed = registry.handlers[name].spec.architectures
        if key.startswith("*") and not set(claimed) & set(source.architectures):
            raise PluginControlError(
                f"--prefer {name}: handler {name} claims {', '.join(claimed)}, none of {source.config_file}'s "
                f"architectures ({', '.join(source.architectures) or 'none'}); drop it or name a handler that does"
            )


@app.command()
def tiny(
    target: Annotated[str, typer.Argument(help="Model dir, config.json, cached hub id, handler or architecture.")],
    out: Annotated[Path, typer.Argument(help="Directory to write the replica to.")],
    seed: SeedOption = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it is not empty.")] = False,
) -> None:
    """Build a tiny random replica of a model's architecture (weights, config, chat tokenizer)."""
    from model_support.core.outputs import check_out_dir, staged_dir
    from model_support.core.tiny import build_tiny

    registry = _registry()
    source = source_for(target, registry, tiny=True)
    handler = api.resolve(source, registry=registry)
    check_out_dir(out, overwrite)
    with _written(out), staged_dir(out) as tmp:
        build_tiny(source.raw_config, tmp, seed=seed, spec=handler.spec)
    console.print(f"tiny replica of {source.architectures[0]} written to {out}")


@app.command()
def check(
    target: Annotated[str, typer.Argument(help="Model dir, config.json or hub id in the local HF cache.")],
    tiny: Annotated[bool, typer.Option("--tiny", help="Check a tiny random replica of the architecture.")] = False,
    stage: Annotated[
        list[str] | None, typer.Option("--stage", "-s", help="Run only this stage and its prerequisites.")
    ] = None,
    alone: Annotated[
        bool,
        typer.Option(
            "--alone",
            help="Run the --stage stages without their prerequisites: what they need is built on first use, the "
            "prerequisites' verdicts are not checked.",
        ),
    ] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the report as JSON.")] = None,
    markdown_out: Annotated[Path | None, typer.Option("--markdown", help="Write the report as Markdown.")] = None,
    junit_out: Annotated[Path | None, typer.Option("--junit", help="Write the report as JUnit XML.")] = None,
    workdir: Annotated[
        Path | None,
        typer.Option(help="Keep artifacts (tiny model, exports, server logs) here, one subdirectory per run."),
    ] = None,
    prefer: PreferOption = None,
    seed: SeedOption = 0,
    dtype: Annotated[
        ModelDtype | None,
        typer.Option(help="dtype of the Megatron model under test (default: bf16 on a GPU, fp32 on a CPU)."),
    ] = None,
    layouts: Annotated[
        str | None,
        typer.Option(
            help="Parallel layouts parallel_parity checks, comma-separated: tpN, epN, etpN, ppN, vpN, cpN, sp joined "
            "by '-' (e.g. tp2,tp2-sp,ep2,ep2-etp2,pp2-vp2,cp2,tp2-pp2). Default: tp2,tp2-sp,pp2,pp2-vp2,cp2,tp2-pp2; "
            "MoE: ep2,etp2,tp2-sp,pp2,pp2-vp2,cp2,tp2-sp-ep2,ep2-pp2 (those the model's depth splits into)."
        ),
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v", help="Show each stage's metrics with their limits, memory peaks and details under it."
        ),
    ] = False,
    stage_timeout: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="Seconds any stage may run before it fails (0: no limit). Default: each stage's own (an hour for "
            "the built-in ones).",
        ),
    ] = None,
    parallel: Annotated[
        str | None,
        typer.Option(
            help="Run the Megatron stages with the model sharded in this tensor / expert parallel layout (tpN, epN, "
            "etpN joined by '-', e.g. ep4 or tp2-ep2) across one process per GPU (gloo ranks on a CPU): a checkpoint "
            "larger than one GPU. The other stages are skipped."
        ),
    ] = None,
) -> None:
    """Resolve the handler for a model and run the validation stages on it."""
    from model_support.core.outputs import (
        check_report_inputs,
        check_report_path,
        check_workdir,
        finish_run_dir,
        start_run_dir,
    )
    from model_support.validation.context import CheckContext
    from model_support.validation.report import render_terminal, write_reports
    from model_support.validation.runner import plan, run_checks

    for option, path in (("--json", json_out), ("--markdown", markdown_out), ("--junit", junit_out)):
        if path is not None:
            check_report_path(option, path)
    if workdir is not None:
        check_workdir(workdir)
    from model_support.core.parallel import ParallelLayout, parse_layouts

    chosen_layouts = parse_layouts(layouts) if layouts else None
    sharded = ParallelLayout.parse(parallel) if parallel else None
    registry, registered = _loaded(prefer)
    source = source_for(target, registry, tiny)
    reports = {"--json": json_out, "--markdown": markdown_out, "--junit": junit_out}
    check_report_inputs({option: path for option, path in reports.items() if path is not None}, source.directory)
    _check_preferred(prefer, registry, source)
    handler = api.resolve(source, registry=registry)
    if alone and not stage:
        raise ModelSupportError("--alone runs the stages named with --stage, and none is named; add --stage NAME")
    stages_to_run = plan(registered.classes(), stage, alone=alone)
    if sharded is not None:
        from model_support.validation.parallel_check import refuse_layout

        refuse_layout(handler.spec, sharded)
    if not tiny:
        from model_support.core.checkpoint import stored_tensors

        # An ambiguous, escaping or corrupt checkpoint is refused before a run starts (its headers only).
        stored_tensors(source.directory)
    work = start_run_dir(workdir)
    report = None
    # Long steps show progress on stderr; known third-party warnings are hidden, and counted in the report.
    with progress.shown_on(err), quiet.hidden_noise() as hidden:
        try:
            if tiny:
                from model_support.core.tiny import build_tiny

                with progress.step("building the tiny replica"):
                    model_dir = build_tiny(source.raw_config, work / "tiny-model", seed=seed, spec=handler.spec)
                source = locate(str(model_dir))
            # In the run: transformers' import writes a compile cache under TMPDIR, which the run dir now holds.
            config = load_config(source)
            ctx = CheckContext(
                target=target,
                model_dir=source.directory,
                handler=handler,
                config=config,
                layout=handler.spec.layout(config),
                registry=registry,
                workdir=work,
                tiny=tiny,
                seed=seed,
                dtype=None if dtype is None else dtype.value,
                layouts=chosen_layouts,
                stage_timeout_s=stage_timeout,
                parallel=sharded,
            )
            checking = f"checking {target} with handler {handler.spec.name} ({handler.origin}): {ctx.layout.describe()}"
            if sharded is None:
                err.print(checking, markup=False, highlight=False, soft_wrap=True)
                report = run_checks(ctx, stages_to_run, on_result=_print_progress)
            else:
                from model_support.validation.parallel_check import refuse_memory, run_sharded

                refuse_memory(ctx, sharded)
                checking += f"; sharded {sharded.name} over {sharded.model_parallel} ranks"
                err.print(checking, markup=False, highlight=False, soft_wrap=True)
                report = run_sharded(
                    ctx, stages_to_run, on_result=_print_progress, prefer=parse_preferences(",".join(prefer or []))
                )
        finally:
            # A finished --workdir run keeps its files; a temporary one keeps them only when a stage failed (logs to
            # read). A run refused (a config transformers rejects) or interrupted leaves nothing.
            keep = report is not None and (workdir is not None or report.exit_code != 0)
            finish_run_dir(work, keep=keep)
    if keep:
        err.print(f"artifacts and logs of this run: {work}", markup=False, highlight=False, soft_wrap=True)
    report.suppressed_warnings = dict(hidden)
    render_terminal(report, console, verbose=verbose)
    write_reports(report, json_out, markdown_out, junit_out)
    raise typer.Exit(report.exit_code)


@app.command()
def selftest(
    mutation: Annotated[
        list[str] | None, typer.Option("--mutation", "-m", help="Run only this mutation (repeatable).")
    ] = None,
    markdown_out: Annotated[Path | None, typer.Option("--markdown", help="Write the outcomes as Markdown.")] = None,
    workdir: Annotated[Path | None, typer.Option(help="Keep the runs' files here, one subdirectory per run.")] = None,
) -> None:
    """Inject named bugs into the real code path on tiny replicas: each must make its stage fail, and the same
    stages must pass without it. Exit status 1 when a bug went uncaught or a clean run failed."""
    from model_support.core.outputs import (
        check_report_path,
        check_workdir,
        finish_run_dir,
        start_run_dir,
    )
    from model_support.validation.selftest_runner import markdown_table, run_selftest

    if markdown_out is not None:
        check_report_path("--markdown", markdown_out)
    if workdir is not None:
        check_workdir(workdir)
    work = start_run_dir(workdir)
    outcomes = []
    try:

        def show(o: Any) -> None:
            verdict = "ok" if o.ok else ("NOT CAUGHT" if o.name != "clean" else "CLEAN RUN FAILED")
            err.print(f"  {o.name} ({o.handler}, {o.stage}): {o.status}: {verdict}", markup=False, highlight=False)

        outcomes = run_selftest(work, mutation, on_outcome=show)
    finally:
        finish_run_dir(work, keep=workdir is not None or not all(o.ok for o in outcomes))
    table = markdown_table(outcomes)
    if markdown_out is not None:
        markdown_out.write_text(table)
    bad = [o for o in outcomes if not o.ok]
    caught = sum(1 for o in outcomes if o.name != "clean" and o.ok and o.status == "fail")
    console.print(
        f"{caught} bug(s) caught, {len(bad)} problem(s): {', '.join(o.name for o in bad) or 'none'}", markup=False
    )
    raise typer.Exit(1 if bad else 0)


@app.command()
def replica(
    target: Annotated[str, typer.Argument(help="Model dir, config.json, cached hub id, handler or architecture.")],
    out: Annotated[Path, typer.Argument(help="Directory to write the replica to (must not exist or be empty).")],
    layers: Annotated[
        int | None, typer.Option(help="Keep the first N layers (default: all); they must hold every layer kind.")
    ] = None,
    experts: Annotated[int | None, typer.Option(help="Experts per MoE layer (MoE configs only; default: all).")] = None,
    dtype: Annotated[Literal["bf16", "fp32"], typer.Option(help="Dtype the model is built and saved in.")] = "bf16",
    device: Annotated[
        Literal["auto", "cpu", "cuda"], typer.Option(help="Where to build it; auto: CUDA when available.")
    ] = "auto",
    seed: SeedOption = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT when it is not empty.")] = False,
) -> None:
    """Build a random model at a real config's width, cutting only its depth and expert count.

    Widths (hidden, heads, head dims, intermediate, expert and GDN sizes, vocab) stay real; the tokenizer is tiny's.
    --layers keeps the first N layers and must keep every layer kind; a multimodal vision tower is shrunk.
    The model is built in --dtype on --device, saved in 5GB shards, and moved into OUT only once complete.
    """
    import torch

    from model_support.core.replica import build_replica

    registry = _registry()
    source = source_for(target, registry, tiny=True)
    handler = api.resolve(source, registry=registry)
    with _written(out):
        info = build_replica(
            source.raw_config,
            out,
            layers=layers,
            experts=experts,
            dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype],
            device=device,
            seed=seed,
            overwrite=overwrite,
            fields=handler.spec.config_fields,
        )
    console.print(info.describe(), markup=False, highlight=False, soft_wrap=True)


app.command("new-handler")(new_handler)
# The reference pages are rendered from this app: it is passed in, so the renderer never imports the command line.
app.command("docs")(docs_command(app))


def main() -> None:
    from model_support.core.interrupt import Interrupted, installed

    # SIGINT, SIGTERM and SIGHUP unwind the command (children stopped, run directory removed).
    with installed():
        try:
            app()
        except ModelSupportError as exc:
            # the error's text is printed as written: a path holding "[/]" is no markup
            err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            sys.exit(2)
        except Interrupted as exc:
            err.print(str(exc), markup=False, highlight=False)
            sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
