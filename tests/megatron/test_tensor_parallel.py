"""Tensor parallel 2 (two gloo processes on CPU) exports the same PEFT adapter and merged HF weights as TP 1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.megatron.conftest import require_megatron

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("tp_worker.py")


FILES = ("logits", "fresh", "before", "after", "hf")  # what tp_worker writes per handler
HANDLERS = ("qwen3", "qwen3.5")  # GQA split by query group; GDN in_proj sections, gated attention, gate/up


def _run(model_dirs: dict[str, Path], out: Path, tp: int) -> dict[str, dict[str, dict]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}", f"--master_port={port}"]
    cmd += [str(WORKER), str(out), *(f"{h}={d}" for h, d in model_dirs.items())]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {h: {name: load_file(str(out / h / f"{name}.safetensors")) for name in FILES} for h in model_dirs}


def test_tp2_exports_the_tp1_adapter(tiny_model_dir, tmp_path) -> None:
    require_megatron()
    model_dirs = {h: tiny_model_dir(h) for h in HANDLERS}
    runs = {tp: _run(model_dirs, tmp_path / f"tp{tp}", tp) for tp in (1, 2)}
    for handler in HANDLERS:
        tp1, tp2 = runs[1][handler], runs[2][handler]
        # apply_lora's fresh adapter is drawn over the canonical shapes: the same A in both layouts, B = 0.
        assert set(tp1["fresh"]) == set(tp2["fresh"]) == set(tp1["before"]), handler
        assert all(torch.equal(tp1["fresh"][k], tp2["fresh"][k]) for k in tp1["fresh"]), handler
        assert all((v == 0).all() == k.endswith("lora_B.weight") for k, v in tp1["fresh"].items()), handler
        # Same canonical LoRA scattered to two ranks and gathered back through the codec: bit-identical adapter.
        assert set(tp1["before"]) == set(tp2["before"]) and len(tp1["before"]) > 20, handler
        assert all((tp1["before"][k] == tp2["before"][k]).all() for k in tp1["before"]), handler
        # Same forward, and one SGD step on LoRA gives the same adapter (gradients reduced correctly across TP).
        assert (tp1["logits"]["logits"] - tp2["logits"]["logits"]).abs().max() < 1e-5, handler
        moved = max((tp1["after"][k] - tp1["before"][k]).abs().max().item() for k in tp1["after"])
        err = max((tp1["after"][k] - tp2["after"][k]).abs().max().item() for k in tp1["after"])
        assert moved > 1e-2 > 1e-5 > err, (handler, moved, err)
        # The merged weights streamed from the live model: LoRA shards merged per rank, gathered by the bridge.
        assert set(tp1["hf"]) == set(tp2["hf"]) and len(tp1["hf"]) > 20, handler
        assert all(tp1["hf"][k].dtype == tp2["hf"][k].dtype for k in tp1["hf"]), handler
        merged_err = max((tp1["hf"][k] - tp2["hf"][k]).abs().max().item() for k in tp1["hf"])
        assert merged_err < 1e-6, (handler, merged_err)
