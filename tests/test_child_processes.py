"""Every child a ``check`` starts dies with it, and a run leaves nothing behind in the temp directory.

Real runs of the CLI: ``parallel_parity`` on the tiny qwen3 (a job that forks two gloo ranks) and a serving stage
(a vLLM server and its engine process), each stopped by a signal as soon as its children are up. A process belongs
to the run under test when its environment names the test's directory: the run sets ``TMPDIR`` inside it for itself
and every child, and the children inherit it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from model_support.core.outputs import RUN_PREFIX, finish_run_dir, start_run_dir
from tests.megatron.conftest import require_megatron

STARTUP_POLLS = 6000  # x 0.1 s: the stages before the children (tiny replica, prerequisite stages) on a loaded CI box
EXIT_POLLS = 100  # x 0.1 s: children of a stopped run (the requirement is 2 s; this bounds a loaded machine)
PLAIN_CHECK_ENV = {"HF_HUB_OFFLINE": "1", "COLUMNS": "200"}


def _start_check(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``model-support check ARGS`` with ``TMPDIR`` at ``tmp_path/tmp`` (its run directory goes there)."""
    (tmp_path / "tmp").mkdir()
    return subprocess.Popen(
        [sys.executable, "-m", "model_support.core.cli", "check", *args],
        env={**os.environ, **PLAIN_CHECK_ENV, "TMPDIR": str(tmp_path / "tmp"), **(env or {})},
        stdout=(tmp_path / "stdout").open("w"),
        stderr=(tmp_path / "stderr").open("w"),
        text=True,
        # A check keeps a stop signal it was started with ignored (a background job's SIGINT): the tests that send
        # one start it as a terminal would, whatever pytest itself was started with.
        preexec_fn=lambda: [signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGINT, signal.SIGTERM)],
    )


def _run_processes(tmp_path: Path) -> list[psutil.Process]:
    """The live processes whose environment names ``tmp_path`` (what the run under test started, and the run)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and str(tmp_path) in proc.environ().get("TMPDIR", ""):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _cmdlines(procs: list[psutil.Process]) -> list[str]:
    lines = []
    for proc in procs:
        try:
            lines.append(" ".join(proc.cmdline()))
        except psutil.NoSuchProcess:
            continue
    return lines


def _wait_for_children(
    check: subprocess.Popen[str], tmp_path: Path, ready: Callable[[list[str]], bool]
) -> list[psutil.Process]:
    """Poll until ``ready`` holds for the command lines of the run's processes; returns them."""
    for _ in range(STARTUP_POLLS):
        procs = _run_processes(tmp_path)
        if ready(_cmdlines(procs)):
            return procs
        assert check.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
        time.sleep(0.1)
    pytest.fail(f"the children did not come up: {_cmdlines(_run_processes(tmp_path))}")


def _the_checks_own(proc: psutil.Process, check: subprocess.Popen[str]) -> bool:
    """The check process itself, or multiprocessing's resource tracker of it (it ends when the check does)."""
    try:
        own_tracker = proc.ppid() == check.pid and "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return True
    return proc.pid == check.pid or own_tracker


def _left_after_polls(tmp_path: Path, check: subprocess.Popen[str]) -> list[str]:
    """What of the run (other than the check process and its own bookkeeping) is still alive after at most
    EXIT_POLLS polls."""
    for _ in range(EXIT_POLLS):
        left = [p for p in _run_processes(tmp_path) if not _the_checks_own(p, check)]
        if not left:
            return []
        time.sleep(0.1)
    return _cmdlines(left)


def _listening_ports(procs: list[psutil.Process]) -> list[int]:
    """The ports the parallel job's processes (launcher and ranks: ``--world`` in their command line) listen on."""
    ports = []
    for proc in procs:
        try:
            if "--world" in " ".join(proc.cmdline()):
                ports += [c.laddr.port for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            continue
    return ports


def _job_port(check: subprocess.Popen[str], tmp_path: Path) -> int:
    """A port the parallel job listens on (rank 0's rendezvous store, bound once the ranks are up, or a rank's gloo
    connections), polled for."""
    procs = _wait_for_children(check, tmp_path, _parallel_ranks_up)
    for _ in range(STARTUP_POLLS):
        ports = _listening_ports(procs)
        if ports:
            return ports[0]
        time.sleep(0.1)
        procs = _run_processes(tmp_path)
    pytest.fail("no process of the parallel job listens")


def _option(cmdlines: list[str], flag: str) -> int:
    """The value of ``flag`` (``--port 8000`` or ``--port=8000``) in the first command line that has it."""
    for line in cmdlines:
        words = line.replace("=", " ").split()
        if flag in words:
            return int(words[words.index(flag) + 1])
    raise AssertionError(f"no {flag} in {cmdlines}")


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _leftovers(tmp: Path) -> list[str]:
    """What a run left in its TMPDIR: a run directory, or any file. (Not an empty directory: torch creates its
    compile cache's, empty, when ``check`` first imports transformers, before the run directory exists.)"""
    return sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.name.startswith(RUN_PREFIX) or not p.is_dir())


def _parallel_ranks_up(cmdlines: list[str]) -> bool:
    """The job and its two ranks (forks of it: the same command line; the launcher's names the job's too)."""
    return sum("validation.parallel_worker" in c and "launcher.py" not in c for c in cmdlines) == 3


def _interrupted(tmp_path: Path, check: subprocess.Popen[str], sig: signal.Signals) -> None:
    """The check reports the signal in one line and exits with 128 + its number, having removed its run directory
    and every temporary file of its children, and nothing of the run outlives it."""
    check.wait(timeout=600)
    assert _left_after_polls(tmp_path, check) == []
    stderr = (tmp_path / "stderr").read_text()
    assert check.returncode == 128 + sig.value, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == f"interrupted by {sig.name}"
    assert _leftovers(tmp_path / "tmp") == []


@pytest.mark.slow
def test_sigterm_stops_the_parallel_job_and_its_ranks_and_removes_the_run(tmp_path: Path) -> None:
    require_megatron()
    check = _start_check(tmp_path, "qwen3", "--tiny", "-s", "parallel_parity", "--layouts", "tp2")
    port = _job_port(check, tmp_path)
    check.send_signal(signal.SIGTERM)
    assert _left_after_polls(tmp_path, check) == []
    assert not _listening(port)
    _interrupted(tmp_path, check, signal.SIGTERM)


@pytest.mark.slow
def test_sigkill_takes_the_parallel_job_and_its_ranks_down_and_the_next_run_removes_the_run_dir(tmp_path: Path) -> None:
    require_megatron()
    check = _start_check(tmp_path, "qwen3", "--tiny", "-s", "parallel_parity", "--layouts", "tp2")
    port = _job_port(check, tmp_path)
    check.send_signal(signal.SIGKILL)
    check.wait()
    # The launcher sees its parent die: it kills the family itself.
    assert _left_after_polls(tmp_path, check) == []
    assert not _listening(port)
    # A dead process cannot clean up: its run directory (children's temporary files included) stays, its lock file
    # free, until the next run in the same place starts.
    (dead_run,) = (tmp_path / "tmp").glob(f"{RUN_PREFIX}*")
    assert (dead_run / ".owner-lock").read_text().split()[0] == str(check.pid)
    next_run = start_run_dir(tmp_path / "tmp")
    finish_run_dir(next_run, keep=False)
    assert _leftovers(tmp_path / "tmp") == []


@pytest.mark.slow
def test_sigint_stops_the_vllm_server_and_its_engine_and_removes_the_run(tmp_path: Path) -> None:
    from model_support.core.serving.errors import RuntimeMissingError
    from model_support.core.serving.runtime import load_runtime

    require_megatron()
    try:
        load_runtime()
    except RuntimeMissingError as exc:
        pytest.skip(str(exc))
    check = _start_check(tmp_path, "qwen3", "--tiny", "-s", "merged_serving")

    def engine_up(cmdlines: list[str]) -> bool:  # vLLM's API server has spawned its engine process
        return any("vllm.entrypoints" in c for c in cmdlines) and any("multiprocessing.spawn" in c for c in cmdlines)

    procs = _wait_for_children(check, tmp_path, engine_up)
    port = _option(_cmdlines(procs), "--port")
    check.send_signal(signal.SIGINT)
    assert _left_after_polls(tmp_path, check) == []
    assert not _listening(port)
    _interrupted(tmp_path, check, signal.SIGINT)


@pytest.mark.slow
def test_a_selftest_mutation_in_the_environment_does_not_reach_a_plain_check(tmp_path: Path) -> None:
    """Only ``model-support selftest`` injects its bugs: a plain check ignores the variable the workers once read
    (this bug fails tp2 when injected), and a finished run leaves nothing in the temp directory."""
    require_megatron()
    check = _start_check(
        tmp_path,
        "qwen3", "--tiny", "-s", "parallel_parity", "--alone", "--layouts", "tp2",
        env={"MODEL_SUPPORT_SELFTEST_MUTATION": "lora-tp-all-reduce-missing"},
    )  # fmt: skip
    check.wait(timeout=900)
    assert check.returncode == 0, (tmp_path / "stderr").read_text()[-3000:]
    assert _leftovers(tmp_path / "tmp") == []
