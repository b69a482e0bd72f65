"""docs/examples/train_and_push.py, the training-time API's example, runs as documented and checks itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.megatron.conftest import require_megatron

EXAMPLE = Path(__file__).parents[2] / "docs" / "examples" / "train_and_push.py"


@pytest.mark.slow
def test_the_api_example_trains_exports_and_pushes(runtime, tmp_path):
    require_megatron()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), str(tmp_path)], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    losses = [float(line.rsplit("= ", 1)[1]) for line in lines if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "adapter: ['adapter_config.json', 'adapter_model.safetensors']" in lines
    pushed = next(line for line in lines if line.startswith("pushed:"))
    assert "the server lists ['qwen3@1']" in pushed
