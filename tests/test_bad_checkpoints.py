"""A bad checkpoint is refused in one line naming the file and what to do, or gets a correct verdict; the model under
test, the reference and the weights stage read exactly the same files (``core/checkpoint.py``'s rule).

Each case is built from the tiny qwen3 replica: a copy of its directory, sharded, edited or corrupted.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_support.core.checkpoint import INDEX, SINGLE, CheckpointError, TextCheckpoint, stored_tensors, weight_files
from model_support.handlers import QWEN3
from tests.helpers import run_cli
from tests.test_architecture_bridge import _context
from tests.test_bad_inputs import _edit_weights, _tiny_copy

REDO = "re-download or re-save it"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _shard(model_dir: Path) -> dict[str, str]:
    """Split the replica's ``model.safetensors`` into two shards and their index, as ``save_pretrained`` does;
    returns the index's weight map."""
    tensors = load_file(model_dir / SINGLE)
    names = sorted(tensors)
    weight_map = {name: SHARDS[i * 2 // len(names)] for i, name in enumerate(names)}
    for shard in SHARDS:
        save_file({n: tensors[n] for n, s in weight_map.items() if s == shard}, model_dir / shard, {"format": "pt"})
    (model_dir / SINGLE).unlink()
    _write_index(model_dir, weight_map)
    return weight_map


def _write_index(model_dir: Path, weight_map: dict[str, str]) -> None:
    (model_dir / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _header(path: Path) -> tuple[int, dict]:
    """(header length, header) of a safetensors file."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return length, json.loads(data[8 : 8 + length])


def _rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite ``path``'s safetensors header through ``edit``, keeping its tensor bytes as they are."""
    data = path.read_bytes()
    length, header = _header(path)
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + length :])


def _by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


@pytest.fixture
def qwen3_copy(tiny_model_dir, tmp_path: Path) -> Path:
    return _tiny_copy(tiny_model_dir, "qwen3", tmp_path)


# --- which files a checkpoint is ------------------------------------------------------------------------------------


def test_the_files_a_checkpoint_is(tiny_model_dir, qwen3_copy: Path, tmp_path: Path) -> None:
    """The index's files; else model.safetensors alone (no adapter, no stray *.safetensors); a Hugging Face cache
    snapshot's links into its blobs are inside the model."""
    (qwen3_copy / "adapter_model.safetensors").write_bytes(b"\x01\x00")  # a PEFT adapter left in the directory
    (qwen3_copy / "consolidated.safetensors").write_bytes(b"")
    assert weight_files(qwen3_copy) == [qwen3_copy / SINGLE]
    assert len(TextCheckpoint(qwen3_copy)) == 24
    _shard(qwen3_copy)
    (qwen3_copy / "model-00001-of-00003.safetensors").write_bytes(b"")  # a shard of an older save the index drops
    assert weight_files(qwen3_copy) == [qwen3_copy / s for s in SHARDS]
    assert stored_tensors(qwen3_copy).keys() == load_file(tiny_model_dir("qwen3") / SINGLE).keys()

    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for path in tiny_model_dir("qwen3").iterdir():
        shutil.copy(path, blobs / f"sha-{path.name}")
        (snapshot / path.name).symlink_to(Path("../../blobs") / f"sha-{path.name}")
    assert weight_files(snapshot) == [snapshot / SINGLE]
    assert len(stored_tensors(snapshot)) == 24


def _stale_single(model_dir: Path) -> str:
    _shard(model_dir)
    shutil.copy(model_dir.parent / "single.safetensors", model_dir / SINGLE)
    return (
        f"{model_dir} holds both {INDEX} and {SINGLE}, and the index does not list it: transformers would load "
        f"{SINGLE}, vLLM and this check the files the index lists; remove the stale one"
    )


def _parent_in_index(model_dir: Path) -> str:
    weight_map = _shard(model_dir)
    outside = model_dir.parent / "outside"
    outside.mkdir()
    shutil.move(model_dir / SHARDS[1], outside / "x.safetensors")
    _write_index(model_dir, {n: "../outside/x.safetensors" if s == SHARDS[1] else s for n, s in weight_map.items()})
    return (
        f"{model_dir / INDEX} names ../outside/x.safetensors as a shard, a path outside {model_dir}; an index names "
        "files in its own directory: re-download the checkpoint or fix the index"
    )


def _absolute_in_index(model_dir: Path) -> str:
    _write_index(model_dir, {**_shard(model_dir), "model.norm.weight": "/etc/passwd"})
    return (
        f"{model_dir / INDEX} names /etc/passwd as a shard, a path outside {model_dir}; an index names files in "
        "its own directory: re-download the checkpoint or fix the index"
    )


def _link_out(model_dir: Path) -> str:
    (model_dir / SINGLE).unlink()
    (model_dir / SINGLE).symlink_to(model_dir.parent / "single.safetensors")
    return (
        f"{model_dir / SINGLE} is a symlink to {model_dir.parent / 'single.safetensors'}, outside {model_dir}; copy "
        "the file into the model directory"
    )


def _shards_without_index(model_dir: Path) -> str:
    _shard(model_dir)
    (model_dir / INDEX).unlink()
    return (
        f"{model_dir} holds 2 shard(s) ({SHARDS[0]} ...) but no {INDEX}, without which transformers cannot load "
        "them; restore the index (re-download, or re-save with save_pretrained)"
    )


def _single_and_shards(model_dir: Path) -> str:
    _shards_without_index(model_dir)
    shutil.copy(model_dir.parent / "single.safetensors", model_dir / SINGLE)
    return (
        f"{model_dir} holds {SINGLE} and 2 shard(s) ({SHARDS[0]} ...) but no {INDEX}: transformers would load "
        f"{SINGLE}, vLLM every *.safetensors; remove the stale one(s)"
    )


def _missing_shard(model_dir: Path) -> str:
    _shard(model_dir)
    (model_dir / SHARDS[1]).unlink()
    return f"{model_dir / SHARDS[1]} is missing or not a file; {REDO}"


def _tensor_in_two_shards(model_dir: Path) -> str:
    _shard(model_dir)
    first, second = (load_file(model_dir / s) for s in SHARDS)
    name = sorted(first)[0]
    save_file({**second, name: first[name]}, model_dir / SHARDS[1], {"format": "pt"})
    first_path, second_path = (model_dir / s for s in SHARDS)
    return f"{name} is in both {first_path} and {second_path}; one is stale: re-download the checkpoint"


def _index_not_json(model_dir: Path) -> str:
    _shard(model_dir)
    (model_dir / INDEX).write_text('{"weight_map": ')
    return f"{model_dir / INDEX} is not a JSON object (Expecting value: line 1 column 16 (char 15)); {REDO}"


LAYOUTS: dict[str, Callable[[Path], str]] = {
    "an index and a model.safetensors it does not list": _stale_single,
    "an index naming ../": _parent_in_index,
    "an index naming an absolute path": _absolute_in_index,
    "model.safetensors a symlink out of the directory": _link_out,
    "shards without their index": _shards_without_index,
    "model.safetensors and shards without an index": _single_and_shards,
    "a shard the index names is missing": _missing_shard,
    "a tensor in two shards": _tensor_in_two_shards,
    "an index that is no JSON": _index_not_json,
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_a_directory_whose_files_are_ambiguous_or_outside_is_refused(qwen3_copy: Path, case: str) -> None:
    shutil.copy(qwen3_copy / SINGLE, qwen3_copy.parent / "single.safetensors")
    message = LAYOUTS[case](qwen3_copy)
    with pytest.raises(CheckpointError) as err:
        stored_tensors(qwen3_copy)
    assert str(err.value) == message


# --- a corrupt file -------------------------------------------------------------------------------------------------


def _truncated(path: Path) -> str:
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-100])
    return f"truncated (header says {size} bytes, file has {size - 100}); {REDO}"


def _past_the_end(path: Path) -> str:
    def past(header: dict) -> None:
        last = header[_by_offset(header)[-1]]
        last["data_offsets"] = [o + 64 for o in last["data_offsets"]]

    _rewrite_header(path, past)
    length, header = _header(path)
    end = header[_by_offset(header)[-1]]["data_offsets"][1]
    return f"truncated (header says {8 + length + end} bytes, file has {path.stat().st_size}); {REDO}"


def _overlapping(path: Path) -> str:
    def overlap(header: dict) -> None:
        second = header[_by_offset(header)[1]]
        second["data_offsets"] = [o - 8 for o in second["data_offsets"]]

    _rewrite_header(path, overlap)
    _, header = _header(path)
    first, second = _by_offset(header)[:2]
    begin, stop = header[second]["data_offsets"]
    end = header[first]["data_offsets"][1]
    return f"{second} (bytes {begin}-{stop}) overlaps {first} (ending at byte {end}); {REDO}"


def _trailing_bytes(path: Path) -> str:
    size = path.stat().st_size
    path.write_bytes(path.read_bytes() + b"xx")
    return f"longer than its tensors (header says {size} bytes, file has {size + 2}); {REDO}"


def _shape_against_offsets(path: Path) -> str:
    _rewrite_header(path, lambda h: h["model.norm.weight"].update(shape=[3, 3]))
    return f"model.norm.weight is F32 [3, 3] (36 bytes), but its offsets hold 256; {REDO}"


def _header_not_json(path: Path) -> str:
    path.write_bytes((16).to_bytes(8, "little") + b"{not json at all")
    return f"bad header (Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); {REDO}"


def _empty(path: Path) -> str:
    path.write_bytes(b"")
    return f"empty (0 bytes); {REDO}"


def _shorter_than_a_header(path: Path) -> str:
    path.write_bytes(b"abc")
    return f"truncated (3 bytes, too few for a header); {REDO}"


def _lfs_pointer(path: Path) -> str:
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123\nsize 528560\n")
    return "a Git LFS pointer, not the weights; fetch them (git lfs pull) or re-download"


def _text_file(path: Path) -> str:
    path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    length = int.from_bytes(b"root:x:0", "little")
    return f"not a safetensors file (its first 8 bytes give a header of {length} bytes); {REDO}"


CORRUPTIONS: dict[str, Callable[[Path], str]] = {
    "truncated": _truncated,
    "offsets past the end": _past_the_end,
    "overlapping offsets": _overlapping,
    "bytes after the last tensor": _trailing_bytes,
    "a shape its offsets do not hold": _shape_against_offsets,
    "a header that is no JSON": _header_not_json,
    "empty": _empty,
    "shorter than a header": _shorter_than_a_header,
    "a Git LFS pointer": _lfs_pointer,
    "a text file": _text_file,
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_corrupt_file_is_named_with_its_problem(qwen3_copy: Path, case: str) -> None:
    from safetensors import SafetensorError, safe_open

    path = qwen3_copy / SINGLE
    problem = CORRUPTIONS[case](path)
    with pytest.raises(CheckpointError) as err:
        stored_tensors(qwen3_copy)
    assert str(err.value) == f"{path}: {problem}"
    with pytest.raises(SafetensorError):  # the library refuses it too: the check is no stricter than the reader
        safe_open(path, "pt")


def test_a_file_that_goes_bad_after_its_header_was_read_is_named(qwen3_copy: Path) -> None:
    checkpoint = TextCheckpoint(qwen3_copy)
    (qwen3_copy / SINGLE).write_bytes((qwen3_copy / SINGLE).read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"^{qwen3_copy / SINGLE}: cannot be read \(.*\); {REDO}$"):
        dict(checkpoint.read_named(["model.norm.weight"]))


# --- every reader reads the same files ------------------------------------------------------------------------------


def test_every_reader_refuses_the_stale_single_file_next_to_an_index(qwen3_copy: Path) -> None:
    """The stale file was all NaN: before, the weights stage read the index's shards and passed while transformers'
    own loader would read model.safetensors."""
    from model_support.core.megatron.hf_reference import StreamedReference
    from model_support.core.serving.export import base_tensors
    from model_support.validation.stages.architecture import ArchitectureStage
    from model_support.validation.stages.weights import WeightsStage

    ctx = _context(QWEN3, qwen3_copy, qwen3_copy.parent)
    _shard(qwen3_copy)
    tensors = load_file(qwen3_copy / SHARDS[0]) | load_file(qwen3_copy / SHARDS[1])
    save_file({k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, qwen3_copy / SINGLE)
    readers = {
        "architecture": lambda: ArchitectureStage().run(ctx),
        "weights": lambda: WeightsStage().run(ctx),
        "transformers reference": lambda: StreamedReference(qwen3_copy, ctx.config, torch.device("cpu")),
        "Megatron model's checkpoint": lambda: TextCheckpoint(qwen3_copy, ctx.config),
        "merged export": lambda: next(base_tensors(qwen3_copy)),
    }
    for reader, read in readers.items():
        with pytest.raises(CheckpointError) as err:
            read()
        assert str(err.value).startswith(f"{qwen3_copy} holds both {INDEX} and {SINGLE}, "), reader


def test_a_stray_adapter_is_no_weight_for_any_reader(qwen3_copy: Path) -> None:
    from model_support.core.megatron.hf_reference import StreamedReference
    from model_support.validation.stages.weights import WeightsStage

    _edit_weights(qwen3_copy, lambda t: t["model.norm.weight"].fill_(0.5))
    # Not even a safetensors file: read as a weight, it would fail every reader.
    (qwen3_copy / "adapter_model.safetensors").write_bytes(b"\x01\x00")
    ctx = _context(QWEN3, qwen3_copy, qwen3_copy.parent)
    result = WeightsStage().run(ctx)
    assert (result.status, result.metrics["files"], result.metrics["tensors"]) == ("pass", 1, 24)
    reference = StreamedReference(qwen3_copy, ctx.config, torch.device("cpu"))
    assert torch.equal(reference.model.model.norm.weight, torch.full((64,), 0.5))


# --- tensors the config does not imply ------------------------------------------------------------------------------


def test_a_tensor_of_another_shape_or_an_integer_dtype_fails_architecture_by_name(qwen3_copy: Path) -> None:
    """Before: a q_proj of the wrong shape (F32 or F64 alike) passed architecture and weights, failing only when
    hf_parity's bridge could not convert it; an I32 weight passed every stage."""
    from model_support.validation.stages.architecture import ArchitectureStage

    ctx = _context(QWEN3, qwen3_copy, qwen3_copy.parent)
    q, down = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[q] = torch.randn(tensors[q].shape[0] + 8, tensors[q].shape[1], dtype=torch.float64)
        tensors[down] = (tensors[down] * 1000).to(torch.int32)

    _edit_weights(qwen3_copy, edit)
    result = ArchitectureStage().run(ctx)
    assert result.status == "fail"
    assert result.summary == (
        f"{q} in model.safetensors is [136, 64], the config implies [128, 64]: the checkpoint does not match its "
        f"config.json; {down} in model.safetensors is stored as I32, not as floating point: re-save the checkpoint "
        "in BF16, F16 or F32"
    )


# --- through the command line ---------------------------------------------------------------------------------------


def test_check_no_longer_passes_a_stale_nan_file_next_to_an_index(qwen3_copy: Path, tmp_path: Path) -> None:
    """The user's report: a valid index and a stale all-NaN model.safetensors passed hf_parity (exit 0)."""
    _shard(qwen3_copy)
    save_file({"model.norm.weight": torch.full((64,), float("nan"))}, qwen3_copy / SINGLE)
    report = tmp_path / "report.json"
    work = tmp_path / "work"  # the failed run keeps its files: here, not in the system's temporary directory
    result = run_cli("check", str(qwen3_copy), "-s", "hf_parity", "--json", str(report), "--workdir", str(work))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {qwen3_copy} holds both {INDEX} and {SINGLE}, and the index does not list it: transformers would "
        f"load {SINGLE}, vLLM and this check the files the index lists; remove the stale one"
    ]
    assert not report.exists() and not (work.exists() and any(work.iterdir()))  # refused before a run started
