"""Where a streamed push writes its buckets (``core/serving/update.py``), without a server."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def test_a_bucket_too_large_for_the_memory_directory_goes_to_disk(tmp_path: Path) -> None:
    from model_support.core.serving.update import SHM_MARGIN, bucket_root, memory_dir

    shm = memory_dir()
    if shm is None:
        pytest.skip("no /dev/shm here")
    free = shutil.disk_usage(shm).free
    assert bucket_root(1024, tmp_path) == shm
    assert bucket_root(free - SHM_MARGIN + 1, tmp_path) == tmp_path  # a container's 64 MiB /dev/shm, say
