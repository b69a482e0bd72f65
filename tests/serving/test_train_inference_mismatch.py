"""train_inference_mismatch holds the server and the trainer each to the fp32 oracle on the sampled tokens: a bug in
the trainer's scoring fails the trainer's own comparison (and the pair's), while the server's stays within its
limits; so the comparison says which side is wrong, and where both run below fp32 (their pair then held to the sum
of the two sides' allowances) each side is still held to its own."""

from __future__ import annotations

import pytest

from model_support.validation.pytest_plugin import CheckRequest, run_check
from model_support.validation.selftest import injected, mutation_named
from tests.megatron.conftest import require_megatron


@pytest.mark.slow
def test_a_trainer_that_scores_a_packed_row_as_one_sequence_fails_its_own_comparison(runtime, tmp_path):
    require_megatron()
    # The selftest's run of the catalogue's bug (a bf16 trainer beside the CPU build's fp32 server): the trainer's
    # packed row of the four sampled sequences is one sequence to its layers (attention and positions run across
    # the boundaries); the server and transformers score each on its own.
    bug = mutation_named("samples-scored-as-one-sequence")
    assert (bug.handler, bug.stage, bug.dtype) == ("qwen3", "train_inference_mismatch", "bf16")
    request = CheckRequest(target=bug.handler, tiny=True, stages=(bug.stage,), alone=True, dtype=bug.dtype)
    with injected(bug.name):
        report = run_check(request, tmp_path)
    (result,) = report.results
    metrics, limits = result.metrics, result.thresholds
    assert result.status == "fail", result.summary
    assert metrics["sampled_tokens"] == 256, metrics
    # The server's own comparison with fp32 passes: the bug is not in what it serves.
    assert all(metrics[k] <= v for k, v in limits.items() if k.startswith("hf_")), (metrics, limits)
    # The trainer's fails, by far more than bf16 rounding, and the summary names it.
    assert metrics["megatron_hf_abs_delta_logprob_mean"] > 3 * limits["megatron_hf_abs_delta_logprob_mean"], metrics
    assert "megatron_hf_abs_delta_logprob_mean=" in result.summary
    assert metrics["abs_delta_logprob_mean"] > limits["abs_delta_logprob_mean"], (metrics, limits)


@pytest.mark.slow
def test_on_a_gpu_the_servers_experts_replayed_are_held_and_misread_ones_fail(runtime, tmp_path, monkeypatch):
    """Routing replay (R3): the server's experts replayed in the trainer are held to the server-vs-trainer limits; read
    with their layers shifted by one (a format bug between server and trainer) they fail those limits only."""
    require_megatron()
    if runtime.flavor != "gpu":
        pytest.skip("routed experts are returned by vLLM on a GPU only")
    from model_support.core import api

    request = CheckRequest(target="qwen3-moe", tiny=True, stages=("train_inference_mismatch",), alone=True)
    (clean,) = run_check(request, tmp_path / "clean").results
    assert clean.status == "pass", clean.summary
    assert clean.metrics["routed_as_served"] >= 0.9, clean.metrics
    read = api.served_experts
    monkeypatch.setattr(api, "served_experts", lambda choice, n: read(choice, n).roll(1, dims=1))
    (shifted,) = run_check(request, tmp_path / "shifted").results
    assert shifted.status == "fail", shifted.summary
    failed = {k for k, v in shifted.thresholds.items() if shifted.metrics[k] > v}
    assert failed and all(k.startswith("replayed_") for k in failed), (failed, shifted.metrics)
