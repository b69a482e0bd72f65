"""Where commands write: checked before any work starts, and never left half-written."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from model_support.core.errors import ModelSupportError
from model_support.core.serving.process import stop_all, temp_env


class OutputPathError(ModelSupportError):
    """A path the user asked a command to write to cannot be used (one line, exit status 2)."""


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """A model directory may be written when it does not exist, is an empty directory, or ``overwrite`` is set."""
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputPathError(f"{out_dir} is a file, not a directory; choose a directory to write the model to")
    if overwrite or not (out_dir.exists() or out_dir.is_symlink()):
        return
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        return
    raise OutputPathError(f"{out_dir} exists and is not an empty directory; pass --overwrite to replace it")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


@contextmanager
def staged_dir(out_dir: Path) -> Iterator[Path]:
    """A hidden sibling of ``out_dir`` to write into, renamed to ``out_dir`` when the block completes.

    On any failure the sibling is removed and ``out_dir`` is as it was; whatever ``out_dir`` held is removed
    only after the rename (same file system, so the rename is atomic).
    """
    out_dir = out_dir.absolute()
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(f"cannot create {out_dir.parent} ({exc.strerror}); choose a writable directory") from None
    sweep(out_dir.parent, f".{out_dir.name}.partial-*")  # what a killed earlier write left
    tmp = out_dir.with_name(f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        tmp.mkdir()
    except OSError as exc:
        raise OutputPathError(
            f"cannot write in {out_dir.parent} ({exc.strerror}); choose a writable directory"
        ) from None
    fd: int | None = hold(tmp)
    try:
        yield tmp
        release(tmp, fd)
        fd = None
        if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        if out_dir.exists() or out_dir.is_symlink():
            old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            _remove(old)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if fd is not None:  # not released: the write failed
            os.close(fd)


def check_report_path(option: str, path: Path) -> None:
    """A report file (``--json`` ...) must be writable before any stage runs: not a directory, and its directory
    either there and writable or creatable (the nearest existing ancestor a writable directory)."""
    if path.is_dir():
        raise OutputPathError(f"{option} {path}: is a directory; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputPathError(f"{option} {path}: not writable; choose another path")
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputPathError(f"{option} {path}: {ancestor} is a file, not a directory; choose another path")
    if not _can_create_in(ancestor):
        raise OutputPathError(f"{option} {path}: {ancestor} is not writable; choose another path")


def check_report_inputs(reports: dict[str, Path], model_dir: Path) -> None:
    """Report files must not be an input of the run (a file of the model directory checked: ``--json
    MODEL/config.json`` would overwrite the config) nor the same file twice (one report would replace the other)."""
    seen: dict[Path, str] = {}
    inside = model_dir.resolve()
    for option, path in reports.items():
        resolved = path.resolve()
        if resolved in seen:
            raise OutputPathError(f"{seen[resolved]} and {option} both name {path}; give each report its own file")
        seen[resolved] = option
        if resolved.exists() and resolved.is_relative_to(inside):
            raise OutputPathError(
                f"{option} {path}: is a file of the model directory being checked ({model_dir}); write reports "
                "elsewhere"
            )


def _can_create_in(directory: Path) -> bool:
    """Whether a file can be created in ``directory`` (tried: permission bits say nothing for root or /proc)."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".model-support-probe-"):
            return True
    except OSError:
        return False


def check_workdir(path: Path) -> None:
    """``--workdir`` must be a directory (created if missing) this process can write in."""
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"--workdir {path}: is a file; give a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(
            f"--workdir {path}: cannot be created ({exc.strerror}); give a writable directory"
        ) from None
    if not _can_create_in(path):
        raise OutputPathError(f"--workdir {path}: not writable; give a writable directory")


RUN_PREFIX = "model-support-run-"
# Held locked (flock) by the process that made the directory while it writes there (a run directory, a staged
# output, a push's buckets): the lock goes with the process however it ends, and another process sees it on the same
# file whatever PID namespace either runs in (a PID names nothing across namespaces: a live run in another container
# was once judged dead by its PID and deleted).
_OWNER = ".owner-lock"
_held: dict[Path, int] = {}  # run directory -> the descriptor holding its lock


def hold(directory: Path) -> int:
    """Lock ``directory``'s owner file for this process; returns the descriptor (:func:`release` it). Locked under a
    name no sweeper reads, then renamed into place (the lock follows the file), so no other process ever finds the
    file unlocked while this one lives."""
    staged = directory / f"{_OWNER}.new"
    fd = os.open(staged, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, f"{os.getpid()}\n".encode())  # for a person reading it; the lock is what counts
    staged.rename(directory / _OWNER)
    return fd


def release(directory: Path, fd: int) -> None:
    """Drop the lock file (a directory published from here keeps no trace of it), then the lock."""
    (directory / _OWNER).unlink(missing_ok=True)
    os.close(fd)


def abandoned(directory: Path) -> bool:
    """Whether ``directory`` was held by a process that is gone (its lock file there, and free)."""
    lock = directory / _OWNER
    if not lock.is_file():
        return False
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False  # unreadable: not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases the lock if it was taken
    return True


def claim_staging(staging: Path, target: Path, error: type[Exception]) -> int:
    """Make ``staging`` (the hidden directory ``target`` is written in before it is published) this process's and
    return its lock's descriptor (:func:`release` it): a killed writer's leftovers there are removed; a staging
    directory another live process holds, or one an older version left without a lock, is refused with ``error``."""
    if staging.exists():
        if not abandoned(staging):
            raise error(
                f"{staging} is being written by another process (or was left by a version that held no lock): wait "
                f"for it, or remove it if nothing writes {target}"
            )
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return hold(staging)


def sweep(parent: Path, pattern: str) -> list[Path]:
    """Remove the directories under ``parent`` matching ``pattern`` whose process died while writing them."""
    removed = []
    for candidate in parent.glob(pattern):
        if candidate.is_dir() and not candidate.is_symlink() and abandoned(candidate):
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
    return removed


def clean_dead_runs(parent: Path) -> list[Path]:
    """Remove the run directories under ``parent`` whose run died without finishing (e.g. ``kill -9``): their
    children's temporary files go with them (see ``ManagedProcess``). Finished runs drop their lock file: what they
    kept stays."""
    return sweep(parent, f"{RUN_PREFIX}*")


_TMP = "tmp"  # the run's own temporary directory (this process's while the run lives)
_saved_temp: dict[Path, tuple[dict[str, str | None], str | None]] = {}


def start_run_dir(workdir: Path | None) -> Path:
    """A fresh directory that this run owns: under ``workdir`` when given, else in the system's temp directory.

    Each run gets its own (timestamp and PID in the name), so runs in one ``--workdir`` never share files and a
    re-run never meets the last one's exports. Directories of runs that died (their lock free) are removed first. Until
    :func:`finish_run_dir`, this process's temporary files (``TMPDIR``, :mod:`tempfile`) go to the run's ``tmp/``,
    and so do those of the children it starts (``ManagedProcess`` gives each its own); torch's compile cache is
    kept between runs (:func:`~model_support.core.serving.process.compile_cache_dir`).
    """
    parent = workdir if workdir is not None else Path(tempfile.gettempdir())
    clean_dead_runs(parent)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(tempfile.mkdtemp(prefix=f"{RUN_PREFIX}{stamp}-{os.getpid()}-", dir=parent))
    _held[run_dir] = hold(run_dir)
    tmp = run_dir / _TMP
    tmp.mkdir()
    redirect = temp_env(tmp)
    _saved_temp[run_dir] = ({name: os.environ.get(name) for name in redirect}, tempfile.tempdir)
    os.environ.update(redirect)
    tempfile.tempdir = str(tmp)  # gettempdir() caches its first answer
    return run_dir


def finish_run_dir(run_dir: Path, *, keep: bool) -> None:
    """Remove ``run_dir``, or keep it (no longer marked as a live run's) when its files are worth reading; its
    temporary files go either way, and this process's temporary directory is the one it had before the run.

    The children still running are stopped first (a command runs one run, and its children write in its directory):
    those a stage leaked, or whose stop an interrupt cut short."""
    stop_all()
    environ, tempdir = _saved_temp.pop(run_dir, ({}, tempfile.tempdir))
    for name, value in environ.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = tempdir
    fd = _held.pop(run_dir, None)
    if keep:
        shutil.rmtree(run_dir / _TMP, ignore_errors=True)
        if fd is not None:
            release(run_dir, fd)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        if fd is not None:
            os.close(fd)
