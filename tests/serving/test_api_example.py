"""docs/examples/train_and_push.py, the training-time API's example, runs as documented and checks itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_support.core.serving.vllm_backend import free_port
from tests.megatron.conftest import require_megatron

EXAMPLE = Path(__file__).parents[2] / "docs" / "examples" / "train_and_push.py"


def _run(args: list[str]) -> list[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout.splitlines()


def _synced(lines: list[str]) -> None:
    """Both sync modes reached the server, which agrees with the trainer; the tokens carry the weights' step."""
    lora = next(line for line in lines if line.startswith("lora: served qwen3-lora@1"))
    assert "policy_epoch [[0, 1]]" in lora and "['qwen3-lora@1', 'qwen3@0']" in lora
    merged = next(line for line in lines if line.startswith("merged: served qwen3@1"))
    assert "policy_epoch [[0, 1]]" in merged and "the server lists ['qwen3@1']" in merged


@pytest.mark.slow
def test_the_api_example_trains_exports_and_syncs_on_two_ranks_under_torchrun(runtime, tmp_path):
    """tp2, as its docstring runs it: the gathers of the adapter and the merged weights run on both ranks, rank 0
    pushes. (The one-process run takes the same path without the process group.)"""
    require_megatron()
    port = f"--master-port={free_port()}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", port]
    lines = _run([*torchrun, str(EXAMPLE), str(tmp_path), "--layout", "tp2"])
    assert any(line.startswith("qwen3 in tp2:") for line in lines)
    losses = [float(line.rsplit("= ", 1)[1]) for line in lines if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "adapter: ['adapter_config.json', 'adapter_model.safetensors']" in lines
    _synced(lines)
