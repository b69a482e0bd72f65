"""What a process killed while writing leaves (a staged output, an export's staging directory, a save's, a push's
buckets) is removed by the next writer in the same place, and only that: a directory another live process holds
(its lock taken, whatever PID namespace it runs in) is left alone, and an export two processes would write at once
is refused. The lock is the directory's ``.owner-lock`` (flock); a killed writer's lock is free."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_support.core.outputs import abandoned, hold, release, staged_dir, sweep
from model_support.core.serving.export import CheckpointWriter, ExportError
from tests.helpers import held_by_another_process


def _left_by_a_killed_writer(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / ".owner-lock").write_text("12345\n")  # nobody holds it
    (path / "half-written.bin").write_bytes(b"x" * 10)
    return path


def test_a_held_directory_is_not_abandoned_and_a_released_one_keeps_no_lock_file(tmp_path: Path):
    fd = hold(tmp_path)
    assert (tmp_path / ".owner-lock").is_file() and not abandoned(tmp_path)
    release(tmp_path, fd)
    assert not (tmp_path / ".owner-lock").exists() and not abandoned(tmp_path)  # no lock file: never swept


def test_the_next_staged_write_removes_a_killed_ones_leftovers_only(tmp_path: Path):
    dead = _left_by_a_killed_writer(tmp_path / ".model.partial-dead0001")
    live = tmp_path / ".model.partial-live0001"
    other = _left_by_a_killed_writer(tmp_path / ".other.partial-dead0002")  # another output's: not this write's
    with held_by_another_process(live):
        with staged_dir(tmp_path / "model") as out:
            (out / "config.json").write_text("{}")
        assert not dead.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json"]  # no lock file published


def test_an_export_being_written_elsewhere_is_refused_and_a_killed_ones_is_replaced(tmp_path: Path):
    staging = tmp_path / ".merged.partial"
    with held_by_another_process(staging):
        with pytest.raises(ExportError, match=r"\.merged\.partial is being written by another process"):
            CheckpointWriter(tmp_path / "merged")
        assert staging.exists()
    staging_file = staging / "half-written.bin"
    staging_file.write_bytes(b"x")  # the holder is gone now: its lock is free
    writer = CheckpointWriter(tmp_path / "merged")
    writer.write_shard({"w": torch.zeros(2)})
    out = writer.commit()
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert not staging.exists()


def test_sweep_removes_abandoned_push_buckets_only(tmp_path: Path):
    dead = _left_by_a_killed_writer(tmp_path / "push-dead")
    with held_by_another_process(tmp_path / "push-live"):
        assert sweep(tmp_path, "push-*") == [dead]
        assert (tmp_path / "push-live").exists()
