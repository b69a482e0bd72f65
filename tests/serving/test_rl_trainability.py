"""rl_trainability fails a push that slices weights into the wrong place, though training itself works."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from model_support.core import api
from model_support.plugins.pytest_plugin import CheckRequest, run_check
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
    report = run_check(CheckRequest(target="qwen3", tiny=True, stages=("rl_trainability",)), tmp_path)
    (result,) = (r for r in report.results if r.stage == "rl_trainability")
    assert swapped, "the planted bug never ran"
    assert result.status == "fail", result.summary
    metrics, limits = result.metrics, result.thresholds
    # The trainer and the server disagree on the sampled tokens' log-probabilities by far more than round-off.
    assert metrics["abs_delta_logprob_max"] > 100 * limits["abs_delta_logprob_max"], metrics
    assert "abs_delta_logprob_max=" in result.summary and "kl_mean=" in result.summary
    # Everything else about the loop worked: pushes landed under the right names, the base stayed frozen.
    assert metrics["stale_served_names"] == 0 and metrics["base_params_changed"] == 0
