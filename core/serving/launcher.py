"""Runs one command so that it cannot outlive the process that asked for it.

This file is executed by the child's own Python (``python launcher.py PARENT_PID GRACE -- CMD...``) and imports
nothing outside the standard library. The caller starts it in a new session, so the launcher leads a process group
that holds the command and everything the command spawns. The launcher then:

* asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``; this also covers a SIGKILLed
  parent), and double-checks ``getppid()`` every 0.2 s in case the parent died before that request;
* starts the command with ``PR_SET_PDEATHSIG=SIGKILL``, so the command dies if the launcher is killed;
* becomes a child subreaper, so descendants that the command orphans are re-parented to it and reaped;
* takes down its whole *family* (:func:`family`): the members of its process group and every descendant, also
  one that moved to a group or session of its own (torchrun starts each worker in a new session);
* on SIGTERM (or SIGINT, SIGHUP) or the command's exit: SIGTERM to the family, then SIGKILL after the grace
  period; on :data:`STOP_NOW` (the caller is being interrupted) or the parent's death: SIGKILL at once, also
  in the middle of a graceful stop (nobody is left to wait for a clean shutdown); then it exits with the
  command's status.

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
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STOP_NOW = signal.SIGUSR1  # the caller's request to kill the command and its family without a grace period
_POLL_S = 0.2
_KILL_WAIT_S = 10.0  # how long SIGKILLed processes get to disappear (a process in uninterruptible sleep may not)
_LIBC = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _LIBC.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def _processes() -> dict[int, tuple[str, int, int]]:
    """(state, parent PID, process group) of every process, by PID (from /proc)."""
    table = {}
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
        table[int(entry)] = (fields[0], int(fields[1]), int(fields[2]))
    return table


def group_members(pgid: int) -> list[int]:
    """PIDs of the live processes in process group ``pgid``."""
    return sorted(pid for pid, (state, _, pgrp) in _processes().items() if pgrp == pgid and state != "Z")


def family(root: int) -> list[int]:
    """PIDs of the live processes that the launcher ``root`` answers for: ``root`` itself, the members of its
    process group, and every descendant of ``root`` in whatever group or session it runs."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = {pid for pid, (_, _, pgrp) in table.items() if pgrp == root}
    todo = [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(child for child in children.get(pid, []) if child not in found)
    return sorted(pid for pid in found if pid in table and table[pid][0] != "Z")


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


def _take_down_family(child_pid: int, status: dict[str, int], grace_s: float, hurry: Callable[[], bool]) -> None:
    """SIGTERM to every other member of the family, then SIGKILL (also to what appears meanwhile) once ``grace_s``
    has passed or ``hurry()`` says so; returns when none is left or SIGKILL has had ``_KILL_WAIT_S``."""
    me = os.getpid()
    graceful_until = time.monotonic() + grace_s
    killing_since: float | None = None
    terminated = False
    while True:
        _reap(child_pid, status)
        others = [pid for pid in family(me) if pid != me]
        if not others:
            return
        now = time.monotonic()
        if now < graceful_until and not hurry():
            sig = None if terminated else signal.SIGTERM
            terminated = True
        else:
            killing_since = now if killing_since is None else killing_since
            if now - killing_since > _KILL_WAIT_S:
                return  # the caller finds what survived (ManagedProcess.stop raises)
            sig = signal.SIGKILL
        for pid in others if sig is not None else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
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
    stop = {"requested": False, "now": False}

    def request_stop(signum: int, frame: object) -> None:
        stop["requested"] = True
        stop["now"] = stop["now"] or signum == STOP_NOW

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, STOP_NOW):
        signal.signal(sig, request_stop)
    child = subprocess.Popen(command, preexec_fn=lambda: _prctl(PR_SET_PDEATHSIG, signal.SIGKILL))
    status: dict[str, int] = {}
    while "code" not in status and not stop["requested"] and os.getppid() == parent:
        _reap(child.pid, status)
        time.sleep(_POLL_S)
    # STOP_NOW keeps its handler: it cuts a graceful stop short.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)

    def hurry() -> bool:
        # An orphaned command has nobody to shut down cleanly for: kill it at once, so nothing outlives a
        # SIGKILLed parent by more than the poll interval.
        return stop["now"] or os.getppid() != parent

    _take_down_family(child.pid, status, grace_s, hurry)
    return status.get("code", 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
