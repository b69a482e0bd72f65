"""A child server process that is always reaped: on stop, at interpreter exit, and when this process dies.

The command runs under :mod:`model_support.core.serving.launcher` (see there for how it survives a
SIGKILL of this process). ``PR_SET_PDEATHSIG`` fires when the *thread* that started the launcher ends, so
start servers from a thread that lives as long as the server should (the main thread in the CLI and tests).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from model_support.core.serving.errors import ServerError
from model_support.core.serving.launcher import group_members

LAUNCHER = Path(__file__).with_name("launcher.py")
_LIVE: set[ManagedProcess] = set()


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
        self.log_path, self.grace_s = Path(log_path), grace_s
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._popen = subprocess.Popen(
                [str(self.python), str(LAUNCHER), str(os.getpid()), str(self.grace_s), "--", *self.command],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # `python -m` puts the working directory on sys.path: keep this project's folders off it.
                cwd=self.log_path.parent,
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

    def members(self) -> list[int]:
        """Live processes of the group (launcher, server and whatever the server spawned)."""
        return group_members(self.pid) if self._popen is not None else []

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Ask the launcher to take the group down; SIGKILL the group if it has not after the grace period."""
        if self._popen is None:
            return
        _LIVE.discard(self)
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
        left = self.members()
        if left:
            raise ServerError(f"processes {left} of group {self.pid} survived SIGKILL")


@atexit.register
def _stop_all() -> None:
    for proc in list(_LIVE):
        proc.stop()
