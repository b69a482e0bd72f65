"""One process per rank, forked from this one with the variables torchrun would set, ended together: the launcher
of ``parallel_parity``'s worker and of ``check --parallel``.

The ranks inherit the modules this process imported (torch, megatron-core, the bridge, transformers), seconds of CPU
that each rank would spend importing them again. They are forked before any of them touches CUDA, OpenMP or
torch.distributed (the caller starts no thread of theirs).

The first rank to exit non-zero ends the job, as torchrun's agent does: the others get ``GRACE_S`` seconds, then
SIGTERM, then SIGKILL (a rank waiting in a collective for the failed one never returns by itself). A rank that fails
writes its error with :func:`fail` and leaves at once.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

GRACE_S = 3.0  # how long the other ranks get to end by themselves once one has failed
FAILURE_FILE = "job.failure"  # the launcher's word on which rank failed first


class JobFailed(Exception):
    """A rank of the job exited non-zero (``line``: what the launcher saw of the first)."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


def launch(world: int, target: Callable[..., None], args: tuple[Any, ...], out_dir: Path) -> None:
    """Run ``target(*args)`` in ``world`` forked ranks, until every one has ended.

    Raises :class:`JobFailed` when a rank exits non-zero (the others ended as described above), after writing
    ``out_dir/job.failure`` (JSON: ``rank``, ``line``): a rank killed by a signal wrote no error of its own.

    Rank 0 hosts the rendezvous store on a port the system gives it when it binds, and tells the others (which join
    it as clients, ``TORCHELASTIC_USE_AGENT_STORE``, as torchrun's ranks join its agent's store): a port chosen free
    beforehand could be taken before rank 0 bound it (a vLLM server starting beside the job took one: EADDRINUSE)."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    fork = multiprocessing.get_context("fork")
    port, published = fork.Value("i", 0), fork.Event()
    context = mp.start_processes(
        _rank, args=(world, port, published, target, args), nprocs=world, start_method="fork", join=False
    )
    try:
        while not context.join(grace_period=GRACE_S):
            pass
    except ProcessException as exc:
        line = f"rank {exc.error_index}: {str(exc).splitlines()[0]}"
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / FAILURE_FILE).write_text(json.dumps({"rank": exc.error_index, "line": line}))
        raise JobFailed(line) from None


_STORE: list[dist.TCPStore] = []  # rank 0's rendezvous store, held for the job's life


def _rank(rank: int, world: int, port: Any, published: Any, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    if rank == 0:
        _STORE.append(dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False))
        port.value = _STORE[0].port
        published.set()
    published.wait()  # no timeout: if rank 0 dies first, torch.multiprocessing ends this rank
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port.value),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    target(*args)


def fail(path: Path, exc: BaseException) -> None:
    """Write this rank's error to ``path`` (its line first, ``Type: message``, then the traceback) and leave at once
    (exit 1).

    A rank that goes on after an error leaves its peers waiting in a collective it will never join: nothing in
    torch.distributed ends that wait short of the group's timeout. So the rank exits, and the launcher (this
    module's, or torchrun's agent) ends the others. ``os._exit``: interpreter shutdown would wait on the process
    group's pending work, which a failed peer never completes."""
    first = str(exc).splitlines()[0] if str(exc) else ""
    error = f"{type(exc).__name__}: {first}\n{traceback.format_exc()}"
    path.write_text(error)
    rank = os.environ.get("RANK", "0")  # not dist.get_rank(): the error may be the process group's own start
    print(f"rank {rank}: {error}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
