"""Runs one command so that it cannot outlive the process that asked for it.

This file is executed by the serving runtime's own Python (``python launcher.py PARENT_PID GRACE -- CMD...``)
and imports nothing outside the standard library. The caller starts it in a new session, so the launcher
leads a process group that holds the command and everything the command spawns. The launcher then:

* asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``; this also covers a SIGKILLed
  parent), and double-checks ``getppid()`` every 0.2 s in case the parent died before that request;
* starts the command with ``PR_SET_PDEATHSIG=SIGKILL``, so the command dies if the launcher is killed;
* becomes a child subreaper, so descendants that the command orphans are re-parented to it and reaped;
* on a stop signal or the command's exit: SIGTERM to every other member of its process group, then SIGKILL
  after the grace period; on parent death: SIGKILL at once (nobody is left to wait for a clean shutdown);
  then it exits with the command's status.

Linux only (prctl, /proc).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.2
_LIBC = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _LIBC.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def group_members(pgid: int) -> list[int]:
    """PIDs of the live processes in process group ``pgid`` (from /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _reap(child_pid: int, status: dict[str, int]) -> None:
    """Collect every exited child (we are a subreaper); remember the command's exit code."""
    while True:
        try:
            pid, wstatus = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == child_pid:
            status["code"] = os.waitstatus_to_exitcode(wstatus)


def _take_down_group(child_pid: int, status: dict[str, int], grace_s: float | None) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; straight to SIGKILL when ``grace_s`` is None."""
    me = os.getpid()
    steps = [(signal.SIGKILL, 10.0)] if grace_s is None else [(signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)]
    for sig, wait_s in steps:
        others = [pid for pid in group_members(me) if pid != me]
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            _reap(child_pid, status)
            if not [pid for pid in group_members(me) if pid != me]:
                return
            time.sleep(0.05)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: launcher.py PARENT_PID GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    parent, grace_s, command = int(argv[0]), float(argv[1]), argv[3:]
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        return 3
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    stop = {"requested": False}

    def request_stop(signum: int, frame: object) -> None:
        stop["requested"] = True

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, request_stop)
    child = subprocess.Popen(command, preexec_fn=lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGKILL))
    status: dict[str, int] = {}
    while "code" not in status and not stop["requested"] and os.getppid() == parent:
        _reap(child.pid, status)
        time.sleep(_POLL_S)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    # An orphaned command has nobody to shut down cleanly for: kill it at once, so no server outlives a
    # SIGKILLed parent by more than the poll interval. A requested stop gets the grace period.
    orphaned = os.getppid() != parent
    _take_down_group(child.pid, status, None if orphaned else grace_s)
    return status.get("code", 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
