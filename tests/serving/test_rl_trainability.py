"""rl_trainability fails a push that slices weights into the wrong place, though training itself works, a push
whose weights are applied without the server's weight version advancing (sampled tokens then claim stale weights),
and counts a push that does not serve under the next step's name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from model_support.core import api
from model_support.core.serving.vllm_backend import VllmServer
from model_support.validation.pytest_plugin import CheckRequest, run_check
from tests.megatron.conftest import require_megatron

SLICED = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.slow
def test_q_halves_swapped_in_the_pushed_weights_fail_the_stage(runtime, tmp_path, monkeypatch):
    require_megatron()
    exported = api.merged_weights
    swapped: list[str] = []

    def sliced_wrong(model: api.TrainingModel, **kw: int) -> Iterator[dict[str, torch.Tensor]]:
        """The merged weights with layer 0's query heads pushed in the wrong order (halves swapped)."""
        for bucket in exported(model, **kw):
            if SLICED in bucket:
                weight = bucket[SLICED]
                bucket[SLICED] = torch.cat(weight.chunk(2)[::-1])
                swapped.append(SLICED)
            yield bucket

    monkeypatch.setattr(api, "merged_weights", sliced_wrong)
    # Second planted bug, caught by its own metric: the step is applied but its weight version never set.
    sent = VllmServer.request
    unversioned: list[str] = []

    def no_version(self: VllmServer, path: str, body: dict | None = None, timeout: float = 600):
        if path == "/finish_weight_update" and body:
            unversioned.append(body.pop("weight_version"))
        return sent(self, path, body, timeout)

    monkeypatch.setattr(VllmServer, "request", no_version)
    # bf16 (the trainer; the CPU build serves the fp32 checkpoint): the limits are the ones scaled by transformers'
    # own bf16 distance, as on a GPU, and must still catch the swap.
    request = CheckRequest(target="qwen3", tiny=True, stages=("rl_trainability",), dtype="bf16")
    report = run_check(request, tmp_path)
    (result,) = (r for r in report.results if r.stage == "rl_trainability")
    assert swapped and unversioned, "a planted bug never ran"
    assert result.status == "fail", result.summary
    metrics, limits = result.metrics, result.thresholds
    # The trainer and the server disagree on the sampled tokens' log-probabilities by far more than bf16 rounding:
    # several times the limit, itself at least twice transformers' own bf16 distance on the same tokens.
    assert limits["abs_delta_logprob_mean"] >= 2 * metrics["reference_abs_delta_logprob_mean"], (metrics, limits)
    assert metrics["abs_delta_logprob_mean"] > 3 * limits["abs_delta_logprob_mean"], (metrics, limits)
    assert "abs_delta_logprob_mean=" in result.summary and "kl_mean=" in result.summary
    # The merged loop's samples say they came from older weights than the last pushed, every one of them.
    assert metrics["stale_tokens"] == metrics["samples_per_step"] * (metrics["merged_steps"] + 1), metrics
    assert "stale_tokens=" in result.summary
    # Everything else about the loop worked: pushes landed under the right names, the base stayed frozen; the LoRA
    # loop (hot-swapped adapters: neither bug touches it) learned.
    assert metrics["stale_served_names"] == 0 and metrics["base_params_changed"] == 0
    assert metrics["lora_final_reward"] >= 0.9


def test_a_push_that_does_not_serve_under_the_next_steps_name_is_counted() -> None:
    from model_support.validation.stages.rl_trainability import _not_advanced

    assert _not_advanced(["qwen3-lora@1", "qwen3-lora@2", "qwen3-lora@3"]) == 0
    assert _not_advanced(["qwen3@4", "qwen3@5"]) == 0
    assert _not_advanced(["qwen3-lora@1", "qwen3-lora@1", "qwen3-lora@1"]) == 2  # the alias reused
    assert _not_advanced(["qwen3@1", "qwen3@3"]) == 1  # a step skipped
    assert _not_advanced(["qwen3@1", "other@2"]) == 1  # another model's name
