"""A child process that is always reaped: on stop, at interpreter exit, and when this process dies.

vLLM servers and the ``parallel_parity`` job run as a :class:`ManagedProcess`. The command runs under
:mod:`model_support.core.serving.launcher` (see there for how it survives a SIGKILL of this process and reaches the
command's descendants). ``PR_SET_PDEATHSIG`` fires when the *thread* that started the launcher ends, so start
children from a thread that lives as long as the child should (the main thread in the CLI and tests).

Each command gets a temporary directory of its own next to its log (``<log stem>-XXXXXXXX.tmp``): its working
directory and its ``TMPDIR`` (vLLM's IPC sockets and file store, whatever uses :mod:`tempfile`). It is removed once
the command and its family are gone; a run's logs are in its run directory, so after a SIGKILL of this process it
goes with the run directory. torch's compile cache is kept between runs instead (:func:`compile_cache_dir`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from model_support.core.serving.errors import ServerError
from model_support.core.serving.launcher import STOP_NOW, family, group_members

LAUNCHER = Path(__file__).with_name("launcher.py")
_LIVE: set[ManagedProcess] = set()


def compile_cache_dir() -> Path:
    """Where torch's compile cache lives for this project's processes and their children: under the user's cache
    directory (``MODEL_SUPPORT_CACHE_DIR``, else ``$XDG_CACHE_HOME/model-support``, else ``~/.cache/model-support``),
    kept between runs. It is no temporary file: vLLM's CPU build compiles about 160 MB of kernels at each start, once
    with a kept cache, every time with one per run."""
    root = os.environ.get("MODEL_SUPPORT_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "model-support"
    )
    return Path(root) / "torchinductor"


def temp_env(directory: Path) -> dict[str, str]:
    """The environment variables that send a Python process's temporary files to ``directory``, and torch's compile
    cache to :func:`compile_cache_dir` (set explicitly: torch writes the variable into the environment on first use,
    so a parent that imported Megatron would pass on its own, in ``TMPDIR``)."""
    return {"TMPDIR": str(directory), "TORCHINDUCTOR_CACHE_DIR": str(compile_cache_dir())}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a server's, a process group's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ManagedProcess:
    """``command`` run by ``python`` under the launcher, its output appended to ``log_path``."""

    def __init__(
        self,
        python: Path,
        command: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        grace_s: float = 20.0,
    ) -> None:
        self.python, self.command, self.env = Path(python), list(command), dict(env)
        self.log_path, self.grace_s = Path(log_path).absolute(), grace_s
        self.tmp_dir: Path | None = None
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp_dir = Path(tempfile.mkdtemp(prefix=f"{self.log_path.stem}-", suffix=".tmp", dir=self.log_path.parent))
        with self.log_path.open("ab") as log:
            self._popen = subprocess.Popen(
                [str(self.python), str(LAUNCHER), str(os.getpid()), str(self.grace_s), "--", *self.command],
                env={**self.env, **temp_env(self.tmp_dir)},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # An empty directory: `python -m` puts the working directory on sys.path.
                cwd=self.tmp_dir,
            )
        _LIVE.add(self)
        return self

    @property
    def pid(self) -> int:
        """The launcher's PID, which is also the process group of everything it started."""
        if self._popen is None:
            raise ServerError("process was never started")
        return self._popen.pid

    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def returncode(self) -> int | None:
        return None if self._popen is None else self._popen.poll()

    def wait(self, timeout_s: float) -> int | None:
        """The command's exit status, or None when it still runs after ``timeout_s``."""
        if self._popen is None:
            raise ServerError("process was never started")
        try:
            return self._popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def members(self) -> list[int]:
        """Live processes of the family (launcher, command and whatever the command spawned, see
        :func:`~model_support.core.serving.launcher.family`). Once the launcher is reaped its PID may be reused:
        then only its process group, which outlives it while a member lives, is searched."""
        if self._popen is None:
            return []
        return family(self.pid) if self._popen.poll() is None else group_members(self.pid)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop_now(self) -> None:
        """Ask the launcher to SIGKILL the family at once, without waiting (``stop`` then waits for it)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self._popen.send_signal(STOP_NOW)

    def stop(self) -> None:
        """Ask the launcher to take the family down; SIGKILL it if it has not after the grace period. Then remove
        the command's temporary directory."""
        if self._popen is None:
            return
        if self._popen.poll() is None:
            self._popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(self.grace_s + 15)
        deadline = time.monotonic() + 10
        while self.members() and time.monotonic() < deadline:
            for pid in self.members():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        if self._popen.poll() is None:
            self._popen.kill()
        self._popen.wait()
        # Only now: a stop cut short (by an interrupt) is still found by stop_all_now and stop_all.
        _LIVE.discard(self)
        left = self.members()
        if left:
            raise ServerError(f"processes {left} of group {self.pid} survived SIGKILL")
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)


def stop_all_now() -> None:
    """Have every live child killed at once (a signal to each launcher; returns without waiting). For an interrupt
    handler: the ``stop`` calls that the interrupt's unwinding reaches then find the children gone or going."""
    for proc in list(_LIVE):
        proc.stop_now()


@atexit.register
def stop_all() -> None:
    """Stop every child still running: at interpreter exit, and before a run directory is removed (its children
    write in it)."""
    for proc in list(_LIVE):
        proc.stop()
