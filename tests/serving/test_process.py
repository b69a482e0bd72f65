"""Server processes are reaped: on stop, and when the parent is SIGKILLed (launcher with plain processes, then vLLM)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from model_support.core.serving.launcher import group_members
from model_support.core.serving.process import ManagedProcess


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _wait_gone(pgid: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _parent(script: str, tmp_path: Path) -> tuple[subprocess.Popen[str], dict]:
    """Run ``script`` in a child Python that prints one JSON line once its server is up."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "parent.err").open("w"),
        text=True,
    )
    line = proc.stdout.readline()
    assert line, (tmp_path / "parent.err").read_text()[-2000:]
    return proc, json.loads(line)


def test_stop_takes_down_the_whole_group(tmp_path):
    proc = ManagedProcess(
        Path(sys.executable),
        ["sh", "-c", "sleep 300 & sleep 300 & wait"],
        env=dict(os.environ),
        log_path=tmp_path / "l",
    ).start()
    deadline = time.monotonic() + 20
    while len(proc.members()) < 4 and time.monotonic() < deadline:  # launcher, sh, 2 x sleep
        time.sleep(0.1)
    assert len(proc.members()) == 4
    proc.stop()
    assert group_members(proc.pid) == [] and not proc.alive()


def test_sigkill_of_the_parent_reaps_children_and_grandchildren(tmp_path):
    script = f"""
        import json, os, sys, time
        from pathlib import Path
        from model_support.core.serving.process import ManagedProcess
        proc = ManagedProcess(Path(sys.executable), ["sh", "-c", "sleep 300 & (sleep 300 &) ; sleep 300"],
                              env=dict(os.environ), log_path=Path({str(tmp_path / "log")!r})).start()
        while len(proc.members()) < 4:
            time.sleep(0.1)
        print(json.dumps({{"pgid": proc.pid, "members": proc.members()}}), flush=True)
        time.sleep(600)
    """
    parent, info = _parent(script, tmp_path)
    assert len(info["members"]) >= 4
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert _wait_gone(info["pgid"], 2) == []
    assert all(
        not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text() for pid in info["members"]
    )


@pytest.mark.slow
def test_sigkill_of_the_parent_reaps_a_real_vllm_server(runtime, tiny_model_dir, tmp_path):
    script = f"""
        import json
        from pathlib import Path
        from model_support.core.serving.backend import get_backend
        from model_support.core.serving.vllm_backend import ServeOptions
        server = get_backend("vllm").serve(Path({str(tiny_model_dir("qwen3"))!r}), "qwen3@0",
                                           ServeOptions(dtype="float32"), Path({str(tmp_path / "vllm.log")!r}))
        print(json.dumps({{"pgid": server.pid, "port": server.port, "members": server.process.members(),
                          "models": server.models()}}), flush=True)
        import time; time.sleep(900)
    """
    parent, info = _parent(script, tmp_path)
    assert info["models"] == ["qwen3@0"]
    # launcher, vLLM's API server, its engine core (+ multiprocessing's resource tracker)
    assert len(info["members"]) >= 3, info
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    killed = time.monotonic()
    # Killed at once, not after vLLM's graceful shutdown: nothing of the server lives 2 s after its parent.
    assert _wait_gone(info["pgid"], 2) == [], (tmp_path / "vllm.log").read_text()[-3000:]
    while _port_open(info["port"]) and time.monotonic() - killed < 2:
        time.sleep(0.1)  # a killed process's sockets close as the kernel finishes tearing it down
    assert not _port_open(info["port"])
