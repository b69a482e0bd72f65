"""The bf16 path (what trainers run on a GPU) on CPU: correct handlers pass within tolerances calibrated on
transformers' own bf16 run, and planted weight-mapping bugs still fail."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from model_support.core.registry import load_registry
from model_support.validation.context import CheckContext
from model_support.validation.runner import plan, run_checks
from model_support.validation.stage import Status
from model_support.validation.stage_registry import load_stages
from tests.megatron.conftest import MEGATRON_STAGES, require_megatron

pytestmark = pytest.mark.slow


def _context(model_dir: Path, workdir: Path) -> CheckContext:
    registry = load_registry()
    config = AutoConfig.from_pretrained(model_dir)
    from model_support.core.discovery import locate, resolve_handler

    handler = resolve_handler(locate(str(model_dir)), registry)
    return CheckContext(
        target=str(model_dir),
        model_dir=model_dir,
        handler=handler,
        config=config,
        layout=handler.spec.layout(config),
        registry=registry,
        workdir=workdir,
        dtype="bf16",
    )


def _run(ctx: CheckContext, stages: tuple[str, ...], mutate: Callable[[torch.nn.Module], None] | None = None):
    from model_support.validation.megatron_session import megatron_model

    if mutate is not None:
        with torch.no_grad():
            mutate(megatron_model(ctx).model)
    report = run_checks(ctx, plan(load_stages(ctx.registry).classes(), list(stages)))
    return {r.stage: r for r in report.results}


@pytest.mark.parametrize("handler", ["qwen3-moe", "qwen3.5-moe"])
def test_bf16_model_passes_with_calibrated_tolerances(tiny_model_dir, tmp_path, handler: str) -> None:
    require_megatron()
    results = _run(_context(tiny_model_dir(handler), tmp_path), MEGATRON_STAGES)
    for stage in MEGATRON_STAGES:
        assert results[stage].status is Status.PASS, (stage, results[stage].summary)
    parity = results["hf_parity"]
    m = parity.metrics
    assert m["dtype"] == "bfloat16"
    # Held to twice transformers' own bf16 distance from fp32 (same weights, tokens and routing).
    assert parity.thresholds["rel_l2"] == pytest.approx(2 * max(m["reference_bfloat16_rel_l2"], 1e-3))
    assert 1e-4 < m["rel_l2"] < parity.thresholds["rel_l2"]
    assert m["router_flips"] == 0
    assert results["lora_coverage"].metrics["codec_layout_err"] == 0.0
    assert results["trainability"].metrics["base_params_changed"] == 0
    # The same-model gradient comparisons are held to transformers' own bf16 distance on gradients (lora_gradients'
    # worst case), not to the logits'.
    g = results["lora_gradients"].metrics
    grad_lowp = max(g["long_reference_bfloat16_grad_mean_abs_pct"], g["packed_reference_bfloat16_grad_mean_abs_pct"])
    for stage in ("packed_position_ids", "shared_prefix"):
        limit = results[stage].thresholds["grad_mean_abs_pct"]
        assert limit == pytest.approx(2 * max(grad_lowp, 0.1)), stage
        assert limit != pytest.approx(results[stage].thresholds["logits_mean_abs_pct"]), stage


def test_gdn_in_proj_sections_swapped_fails_hf_parity_in_bf16(tiny_model_dir, tmp_path) -> None:
    """q and k rows of one GDN layer's fused in_proj exchanged (a mis-split the bridge mapping could make)."""
    require_megatron()

    def swap_q_k(model: torch.nn.Module) -> None:
        gdn = model.decoder.layers[0].self_attention
        q, k = gdn.sections[0], gdn.sections[1]
        weight = gdn.in_proj.weight
        weight[: q + k] = torch.cat([weight[q : q + k], weight[:q]]).clone()

    parity = _run(_context(tiny_model_dir("qwen3.5"), tmp_path), ("hf_parity",), swap_q_k)["hf_parity"]
    assert parity.status is Status.FAIL
    assert parity.metrics["rel_l2"] > 5 * parity.thresholds["rel_l2"]
    assert parity.summary.startswith("rel_l2=")


def test_router_rows_off_by_one_is_a_routing_flip_in_bf16(tiny_model_dir, tmp_path) -> None:
    """Expert index off by one in one MoE layer's router: reported as top-k flips, not only as a logit error."""
    require_megatron()

    def roll_router(model: torch.nn.Module) -> None:
        router = model.decoder.layers[1].mlp.router
        router.weight.copy_(router.weight.roll(1, dims=0))

    parity = _run(_context(tiny_model_dir("qwen3-moe"), tmp_path), ("hf_parity",), roll_router)["hf_parity"]
    assert parity.status is Status.FAIL
    assert parity.metrics["router_flips"] > parity.metrics["router_tokens"] // 4
    assert "router_flips=" in parity.summary


def test_lora_that_does_not_reach_the_loss_fails_trainability(tiny_model_dir, tmp_path) -> None:
    """LoRA applied everywhere but scaled to nothing: no step can move the loss, and the stage says so."""
    require_megatron()
    from model_support.core.megatron.lora import lora_modules
    from model_support.validation.megatron_session import LORA, megatron_model

    ctx = _context(tiny_model_dir("qwen3"), tmp_path)
    ctx.state.get(LORA)
    for module in lora_modules(megatron_model(ctx).model).values():
        module.scale = 0.0
    trained = _run(ctx, ("trainability",))["trainability"]
    assert trained.status is Status.FAIL
    assert trained.metrics["loss_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert trained.metrics["steps"] == 40
    assert trained.summary.startswith("loss_ratio=")


def test_a_stage_alone_in_bf16_measures_the_reference_rounding_as_hf_parity_does(tiny_model_dir, tmp_path) -> None:
    """bf16 comparisons are held to transformers' own bf16 distance, which hf_parity (logits) and lora_gradients
    (gradients) provide as they compare. Run alone (neither run), a stage has each measured on first use: on those
    stages' rows, to the same numbers."""
    require_megatron()
    from model_support.validation.megatron_session import REFERENCE_LOWP_ERROR
    from model_support.validation.stages.lora_gradients import REFERENCE_LOWP_GRAD_ERROR

    model_dir = tiny_model_dir("qwen3-moe")
    with_parity = _context(model_dir, tmp_path / "with")
    _run(with_parity, ("hf_parity", "lora_gradients"))
    provided = {r: with_parity.state.get(r) for r in (REFERENCE_LOWP_ERROR, REFERENCE_LOWP_GRAD_ERROR)}
    alone = _context(model_dir, tmp_path / "alone")
    report = run_checks(alone, plan(load_stages(alone.registry).classes(), ["packed_position_ids"], alone=True))
    (result,) = report.results
    assert result.status is Status.PASS, result.summary
    for resource, value in provided.items():
        assert result.built[resource.name]["provided"] is False
        assert value is not None and alone.state.get(resource) == pytest.approx(value, rel=1e-9)
