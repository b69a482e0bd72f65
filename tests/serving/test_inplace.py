"""In-place update of a live vLLM server: buckets applied once after the last, same PID, served name advances."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model_support.core.serving.backend import Server, get_backend
from model_support.core.serving.errors import ServerError, ServingError
from model_support.core.serving.export import buckets, export_merged, merged_tensors
from model_support.core.serving.session import random_adapter
from model_support.core.serving.update import WeightUpdater
from model_support.core.serving.vllm_backend import ServeOptions
from model_support.handlers import BUILTIN_HANDLERS

PROMPT = [17, 101, 44, 250, 9, 311, 66, 140, 23, 77]
TARGETS = next(h for h in BUILTIN_HANDLERS if h.name == "qwen3").hf_target_modules
FP32_TOL = 1e-4


@pytest.fixture(scope="module")
def qwen3_server(runtime, tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("vllm-inplace") / "vllm.log"
    server = get_backend("vllm").serve(tiny_model_dir("qwen3"), "qwen3@0", ServeOptions(dtype="float32"), log)
    yield server
    server.stop()


def _served(server: Server, model: str | None = None) -> torch.Tensor:
    choice = server.completion(PROMPT, model=model, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    return torch.tensor(
        [row[str(t)]["logprob"] for row, t in zip(choice["prompt_logprobs"][1:], PROMPT[1:], strict=True)]
    )


def _reference(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].double(), -1)
    return logprobs[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])].float()


@pytest.mark.slow
def test_weights_update_in_place_bucket_by_bucket(qwen3_server, tiny_model_dir, tmp_path):
    server, base = qwen3_server, tiny_model_dir("qwen3")
    pid = server.pid
    previous = _served(server)
    assert (previous - _reference(base)).abs().max().item() < FP32_TOL
    updater = WeightUpdater(server, "qwen3", tmp_path / "updates", support_from=base)
    for step in (1, 2):
        adapter = random_adapter(base, TARGETS, tmp_path / f"adapter-{step}", seed=20 + step)
        expected = _reference(export_merged(base, adapter, tmp_path / f"reference-{step}"))
        parts = list(buckets(merged_tensors(base, adapter), max_bytes=150_000))
        assert len(parts) >= 3
        updater.begin(len(parts))
        for part in parts[:-1]:
            assert updater.push(part) is False
            # Nothing is applied before the last bucket: same name, same outputs.
            assert server.models() == [f"qwen3@{step - 1}"]
            assert (_served(server) - previous).abs().max().item() < 1e-6
        assert updater.push(parts[-1]) is True
        assert server.models() == [f"qwen3@{step}"]
        assert server.pid == pid and server.process.alive()
        with pytest.raises(ServerError, match=rf"404.*qwen3@{step - 1}.*does not exist"):
            server.completion(PROMPT, model=f"qwen3@{step - 1}", max_tokens=1)
        now = _served(server)
        assert (now - expected).abs().max().item() < FP32_TOL
        assert (now - previous).abs().max().item() > 1e-2
        previous = now


def test_a_second_begin_before_the_last_bucket_is_refused(qwen3_server, tiny_model_dir, tmp_path):
    updater = WeightUpdater(qwen3_server, "qwen3", tmp_path / "updates", support_from=tiny_model_dir("qwen3"))
    updater.begin(2)
    with pytest.raises(ServingError, match=r"update to step 1 is still open \(0/2 buckets\)"):
        updater.begin(1)
