"""Helpers for tests that install real plugin packages and run the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


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


def run_plugin_tests(source: Path, site: Path) -> subprocess.CompletedProcess:
    """Run a plugin's own test suite (its ``architecture`` stage test and prerequisites) against ``site``."""
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--model-support-stage", "architecture"],
        cwd=source, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path},
    )  # fmt: skip


def within_thresholds(verdict: dict) -> bool:
    """Every metric a stage's JSON verdict holds to a threshold is within it."""
    return all(float(verdict["metrics"][k]) <= limit for k, limit in verdict["thresholds"].items())


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


@contextmanager
def held_by_another_process(directory: Path) -> Iterator[None]:
    """``directory``'s ``.owner-lock`` held (flock) by a live process other than this one while the block runs, as
    a run, a staged write or a push in another process (or PID namespace) holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".owner-lock").write_text("live\n")
    code = (
        "import fcntl, sys, time; f = open(sys.argv[1], 'r+'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(directory / ".owner-lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield
    finally:
        holder.kill()
        holder.wait()
