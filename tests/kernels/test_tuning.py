"""The shipped tuned kernel settings: entries of Triton's own autotuning cache, copied in without overwriting."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from model_support.core.precision import settled_fla_kernels
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


def test_fla_config_files_hold_each_key_s_fastest_setting_smallest_shapes_first() -> None:
    """fla's config cache gets, per kernel, each shipped key with its fastest setting (a setting that did not run,
    timed inf, never), the entries of the smallest shapes first: fla takes the first loose match."""
    fast, slow, broken = {"kwargs": {"BV": 32}}, {"kwargs": {"BV": 64}}, {"kwargs": {"BV": 128}}
    inf = float("inf")
    entries = {
        "A/chunk_fwd_kernel_o.autotune.json": {
            "key": [48, 128, False, "torch.bfloat16"],
            "configs_timings": [[slow, [0.3, 0.2, 0.4]], [broken, [inf, inf, inf]], [fast, [0.1, 0.1, 0.2]]],
        },
        "B/chunk_fwd_kernel_o.autotune.json": {
            "key": [2, 128, True, "torch.bfloat16"],
            "configs_timings": [[slow, [0.1, 0.1, 0.1]], [fast, [0.2, 0.1, 0.3]]],
        },
        "C/l2norm_fwd_kernel.autotune.json": {"key": [4, "torch.float32"], "configs_timings": [[fast, [0.1] * 3]]},
    }
    files = tuning.fla_config_files(entries)
    assert sorted(files) == ["chunk_fwd_kernel_o.json", "l2norm_fwd_kernel.json"]
    chunk = files["chunk_fwd_kernel_o.json"]
    assert chunk["kernel_name"] == "chunk_fwd_kernel_o"
    assert list(chunk["autotune_entries"].values()) == [
        {"autotune_key": [2, 128, True, "torch.bfloat16"], "config": slow},
        {"autotune_key": [48, 128, False, "torch.bfloat16"], "config": fast},
    ]


def test_the_shipped_settings_cover_kernels_in_fla_s_format() -> None:
    """Every shipped entry reaches fla's files: one per kernel, each entry a key and a setting fla can build
    (``kwargs``, ``num_warps``, ``num_stages``, ``num_ctas``)."""
    for path in sorted(tuning.TUNED_DIR.glob("*.json")):
        entries = json.loads(path.read_text())["entries"]
        files = tuning.fla_config_files(entries)
        assert sum(len(f["autotune_entries"]) for f in files.values()) == len(entries)
        for content in files.values():
            for entry in content["autotune_entries"].values():
                assert {"kwargs", "num_warps", "num_stages", "num_ctas"} <= set(entry["config"]), entry


def test_settling_fla_kernels_changes_nothing_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLA_CACHE_MODE", raising=False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with settled_fla_kernels(tmp_path / "fla") as settled:
        assert settled == 0
        assert "FLA_CACHE_MODE" not in os.environ
    assert not (tmp_path / "fla").exists()


def test_settled_fla_kernels_take_the_shipped_settings_while_open_and_fla_its_own_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an H100 (capability faked: fla's kernels are not run here): fla's config files hold every shipped entry while
    open, fla's config cache reads them loosely, and afterwards the environment (and an imported fla) is as it was."""
    import sys
    from types import SimpleNamespace

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda: (9, 0))
    monkeypatch.setenv("FLA_CACHE_MODE", "strict")
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)

    class Mode(SimpleNamespace):  # fla.ops.utils.cache.FlaCacheMode's one method used here
        @staticmethod
        def from_env() -> str:
            return os.environ.get("FLA_CACHE_MODE", "disabled")

    fla_cache = SimpleNamespace(FlaCacheMode=Mode, FLA_CACHE_MODE="strict")
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cache", fla_cache)
    shipped = json.loads((tuning.TUNED_DIR / "sm90.json").read_text())["entries"]
    with settled_fla_kernels(tmp_path / "fla") as settled:
        assert settled == len(tuning.fla_config_files(shipped)) > 0
        assert os.environ["FLA_CACHE_MODE"] == "fuzzy" and os.environ["FLA_CONFIG_DIR"] == str(tmp_path / "fla")
        assert fla_cache.FLA_CACHE_MODE == "fuzzy"
        assert len(list((tmp_path / "fla").glob("*.json"))) == settled
    assert os.environ["FLA_CACHE_MODE"] == "strict" and "FLA_CONFIG_DIR" not in os.environ
    assert fla_cache.FLA_CACHE_MODE == "strict"
