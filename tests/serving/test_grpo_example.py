"""docs/examples/grpo.py, the asynchronous GRPO example, runs on two ranks as documented and learns."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from model_support.core.serving.vllm_backend import free_port
from tests.megatron.conftest import require_megatron

EXAMPLE = Path(__file__).parents[2] / "docs" / "examples" / "grpo.py"
STEP = re.compile(
    r"step (\d+): reward ([\d.]+), kl ([\d.]+), grad norm ([\d.]+), trained on groups sampled by (\S+) "
    r"\(policy_epoch (.+)\), now serving (\S+)"
)


@pytest.mark.slow
@pytest.mark.exhaustive  # the first tier runs the API example on two ranks (test_api_example.py)
def test_the_grpo_example_trains_one_step_behind_its_rollouts_on_two_ranks(runtime, tmp_path):
    """tp2 under torchrun: each step trains on the groups the previous adapter sampled (their tokens say so), the
    gradients are clipped by the whole model's norm, and the good answer gets likelier."""
    require_megatron()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}"]
    proc = subprocess.run(
        [*torchrun, str(EXAMPLE), str(tmp_path), "--layout", "tp2"],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    steps = [m.groups() for line in proc.stdout.splitlines() if (m := STEP.fullmatch(line))]
    assert [int(s[0]) for s in steps] == list(range(6))
    for index, (_, _, kl, norm, sampled_by, epochs, serving) in enumerate(steps):
        step = int(sampled_by.rpartition("@")[2])
        assert step == max(index, 1)  # one step behind the policy (the first two groups: the first adapter)
        assert epochs == f"[[0, {step}]]"  # every sampled token says which adapter sampled it
        assert serving == f"qwen3-lora@{index + 2}"
        assert float(kl) >= 0 and float(norm) > 0
    before, after = map(float, re.search(r"p\(good answer\): ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert after > before
