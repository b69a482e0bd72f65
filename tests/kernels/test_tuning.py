"""The shipped tuned kernel settings: entries of Triton's own autotuning cache, copied in without overwriting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_support.kernels import tuning


def _entry(timings: list) -> dict:
    return {"key": ["64", "128", "torch.bfloat16"], "configs_timings": timings}


def test_harvest_and_write_round_trip(tmp_path: Path) -> None:
    tuned = tmp_path / "tuned-cache"
    (tuned / "ABC").mkdir(parents=True)
    (tuned / "ABC" / "chunk_fwd_kernel_o.autotune.json").write_text(json.dumps(_entry([[{"num_warps": 4}, 0.1]])))
    (tuned / "ABC" / "chunk_fwd_kernel_o.cubin").write_bytes(b"\0")  # compiled code is no tuning result
    entries = tuning.harvest(tuned)
    assert list(entries) == ["ABC/chunk_fwd_kernel_o.autotune.json"]

    fresh = tmp_path / "fresh-cache"
    assert tuning.write_entries(entries, fresh) == 1
    assert tuning.harvest(fresh) == entries
    assert not list(fresh.rglob("*.tmp"))


def test_an_entry_already_in_the_cache_is_kept(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "ABC").mkdir(parents=True)
    own = cache / "ABC" / "k.autotune.json"
    own.write_text(json.dumps(_entry([[{"num_warps": 8}, 0.05]])))
    shipped = {"ABC/k.autotune.json": _entry([[{"num_warps": 4}, 0.1]]), "DEF/k.autotune.json": _entry([])}
    assert tuning.write_entries(shipped, cache) == 1
    assert json.loads(own.read_text())["configs_timings"][0][0] == {"num_warps": 8}


@pytest.mark.parametrize(
    "relative", ["../outside/k.autotune.json", "ABC/k.cubin", "k.autotune.json", "A/B/k.autotune.json"]
)
def test_a_file_that_is_no_cache_entry_is_refused(tmp_path: Path, relative: str) -> None:
    with pytest.raises(ValueError, match="not an autotuning entry"):
        tuning.write_entries({relative: {}}, tmp_path / "cache")
    assert not (tmp_path / "outside").exists()


def test_file_names_by_compute_capability() -> None:
    assert tuning.tuned_file_name((9, 0)) == "sm90.json"
    assert tuning.tuned_file_name((10, 0)) == "sm100.json"


def test_shipped_files_are_cache_entries() -> None:
    """Every shipped file names the GPU it was tuned on and the versions, and holds only autotuning entries of a
    Triton cache."""
    for path in sorted(tuning.TUNED_DIR.glob("*.json")):
        shipped = json.loads(path.read_text())
        assert path.name == tuning.tuned_file_name(tuple(shipped["capability"]))
        assert shipped["gpu"]
        assert {"triton", "torch", "flash-linear-attention"} <= set(shipped["versions"])
        assert shipped["entries"]
        for relative, entry in shipped["entries"].items():
            assert Path(relative).parent.name and relative.endswith(".autotune.json"), relative
            assert entry["configs_timings"], relative
