"""A handler with a wrong codec split makes `lora_coverage` fail, with the numbers that show why."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoConfig

from model_support.core.codecs import BridgeLoraCodec
from model_support.validation.stage import Status
from tests.megatron.conftest import require_megatron

pytestmark = pytest.mark.slow


class SwappedGateUpCodec(BridgeLoraCodec):
    """The classic bug: Megatron's fused fc1 read as [up; gate] instead of [gate; up] (self-consistent,
    so its own round trip is still exact)."""

    @staticmethod
    def _swap(tensors: dict[str, torch.Tensor], marker: str) -> dict[str, torch.Tensor]:
        out = dict(tensors)
        for key in tensors:
            if f"gate_proj.{marker}" in key:
                other = key.replace("gate_proj", "up_proj")
                out[key], out[other] = tensors[other], tensors[key]
        return out

    def to_peft(self, tensors, config, layout):
        return self._swap(super().to_peft(tensors, config, layout), "lora_B")

    def from_peft(self, tensors, config, layout):
        return super().from_peft(self._swap(dict(tensors), "lora_B"), config, layout)


def test_swapped_gate_up_fails_lora_coverage(tiny_model_dir, tmp_path) -> None:
    require_megatron()
    from model_support.core.registry import load_registry
    from model_support.validation.context import CheckContext
    from model_support.validation.runner import plan, run_checks
    from model_support.validation.stage_registry import load_stages

    registry = load_registry()
    good = registry.get("qwen3")
    broken = dataclasses.replace(good, spec=dataclasses.replace(good.spec, codec=SwappedGateUpCodec("broken")))
    model_dir = tiny_model_dir("qwen3")
    config = AutoConfig.from_pretrained(model_dir)
    ctx = CheckContext(
        target="broken-qwen3",
        model_dir=model_dir,
        handler=broken,
        config=config,
        layout=broken.spec.layout(config),
        registry=registry,
        workdir=tmp_path,
        tiny=True,
    )
    report = run_checks(ctx, plan(load_stages(registry).classes(), ["lora_coverage"]))
    results = {r.stage: r for r in report.results}
    assert results["hf_parity"].status is Status.PASS
    coverage = results["lora_coverage"]
    assert coverage.status is Status.FAIL
    m = coverage.metrics
    # The codec's own round trip cannot see the bug; the layout check and the HF logits can.
    assert m["roundtrip_mismatches"] == 0
    assert m["codec_layout_err"] > 0.01
    assert m["adapter_logits_max_abs_err"] > 1e-3
    assert coverage.summary.startswith("codec_layout_err=")
    assert "adapter_logits_max_abs_err=" in coverage.summary and "> 0.0001" in coverage.summary
