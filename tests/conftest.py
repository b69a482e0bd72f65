"""Shared fixtures: tiny random replicas of each built-in handler's reference architecture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from model_support.handlers import BUILTIN_HANDLERS

HANDLER_NAMES = [h.name for h in BUILTIN_HANDLERS]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model_dir("qwen3.5")`` -> a saved tiny replica of that handler's reference config.

    Built once per session and handler (seed 0); tests must not modify the directory.
    """
    from model_support.core.tiny import build_tiny

    built: dict[str, Path] = {}
    specs = {h.name: h for h in BUILTIN_HANDLERS}

    def build(handler: str) -> Path:
        if handler not in built:
            raw = json.loads(specs[handler].reference_config.read_text())
            built[handler] = build_tiny(raw, tmp_path_factory.mktemp(f"tiny-{handler}"), seed=0)
        return built[handler]

    return build


def pip_install_target(package_dir: Path, target: Path) -> Path:
    """Really pip-install a package (no deps, no network) into ``target``; return ``target``.

    Run the CLI with ``PYTHONPATH=target`` to see its entry points next to the project's own.
    """
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(package_dir),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return target


def run_cli(*args: str, site: Path | None = None, env: dict[str, str] | None = None, cwd: Path | None = None):
    """Run ``model-support`` in a subprocess (fresh plugin discovery); returns CompletedProcess."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200", **(env or {})}
    if site is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), full_env.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "model_support.core.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=900,
    )
