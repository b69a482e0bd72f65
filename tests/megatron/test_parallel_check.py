"""``check --parallel LAYOUT``: the Megatron stages with the model under test sharded across ranks (CPU, gloo), held
to transformers with the same tolerances, reporting the whole model's numbers; a rank that raises ends the job and
fails the stage with its error; layouts it cannot run are refused in one line. Planted sharding bugs are the
selftest's ``sharded-*`` mutations."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from model_support.validation.stage import Status
from tests.helpers import run_cli
from tests.megatron.conftest import MEGATRON_STAGES, require_megatron

# What the sharded run must report exactly as the single-process run does: counts over the whole model.
SAME_COUNTS = {
    "lora_coverage": ("lora_modules", "lora_params", "peft_tensors", "missing_lora_modules", "zero_grad_params"),
    "lora_gradients": ("long_factors", "packed_factors", "long_tokens"),
    "trainability": ("trainable_params", "base_params_changed"),
}
FAILURE_TO_VERDICT_S = 30  # from the failing rank's error file to the check's result (the bound)


def _by_stage(report) -> dict:
    return {r.stage: r for r in report.results}


@pytest.mark.slow
# Qwen3.5 in tp2 (its GDN layers split over tensor-parallel ranks) is in the exhaustive tier: the first tier splits
# them so in parallel_parity (tests/megatron/test_parallel_parity.py, qwen3.5-moe's tp2-sp).
@pytest.mark.parametrize(
    ("handler", "layout"), [("qwen3-moe", "ep2"), pytest.param("qwen3.5", "tp2", marks=pytest.mark.exhaustive)]
)
def test_a_sharded_check_reports_the_whole_models_numbers(megatron_report, handler, layout, tmp_path) -> None:
    """Experts split over expert-parallel ranks (Qwen3-MoE), attention, GDN and MLP split over tensor-parallel ranks
    (Qwen3.5): every Megatron stage passes against transformers, its counts are the single-process run's, and what
    the same adapter and the same training compute is the single-process run's within fp32 reduction order."""
    require_megatron()
    from model_support.validation.pytest_plugin import CheckRequest, run_check

    sharded = _by_stage(
        run_check(CheckRequest(target=handler, tiny=True, stages=MEGATRON_STAGES, parallel=layout), tmp_path)
    )
    single = _by_stage(megatron_report(handler))
    for stage in MEGATRON_STAGES:
        assert sharded[stage].status is Status.PASS, (stage, sharded[stage].summary)
    for stage, keys in SAME_COUNTS.items():
        for key in keys:
            assert sharded[stage].metrics[key] == single[stage].metrics[key], (stage, key)
    assert sharded["hf_parity"].metrics["rel_l2"] < 1e-5
    effect = "adapter_effect_rel_l2"
    assert sharded["lora_coverage"].metrics[effect] == pytest.approx(single["lora_coverage"].metrics[effect], 1e-5)
    trained = sharded["trainability"].metrics
    assert trained["steps"] == single["trainability"].metrics["steps"]
    assert trained["final_loss"] == pytest.approx(single["trainability"].metrics["final_loss"], rel=1e-4)


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_sharded_check(tmp_path: Path) -> None:
    """Rank 1 raises in the trainer's step (``api.forward_backward``) while rank 0 goes on into its collectives: the
    job ends, the stage fails with rank 1's own line, the stages after it are skipped, and no rank is left."""
    require_megatron()
    from model_support.validation import selftest
    from model_support.validation.pytest_plugin import CheckRequest, run_check

    request = CheckRequest(
        target="qwen3", tiny=True, stages=("lora_gradients", "trainability"), alone=True, parallel="tp2"
    )
    started = time.time()
    with selftest.injected("one-rank-raises"):
        report = run_check(request, tmp_path)
    ended = time.time()
    results = _by_stage(report)
    assert results["lora_gradients"].status is Status.FAIL
    assert results["lora_gradients"].summary.startswith("rank 1 raised RuntimeError: planted failure on rank 1")
    assert results["trainability"].status is Status.SKIP
    assert "ended in stage 'lora_gradients'" in results["trainability"].summary
    # the first error is rank 1's own; rank 0 may write one too, as it sees its peer go
    error = min((tmp_path / "ranks").glob("*.error"), key=lambda p: p.stat().st_mtime_ns)
    assert error.name == "lora_gradients.rank1.error"
    assert ended - error.stat().st_mtime < FAILURE_TO_VERDICT_S
    # the job and its ranks are gone (processes of other tests' shared runs may live on)
    assert not [p for p in psutil.Process().children(recursive=True) if p.create_time() >= started - 1]


@pytest.mark.parametrize(
    ("layout", "env", "message"),
    [
        ("pp2", {}, "check --parallel shards the model in tensor and expert parallel layouts"),
        ("tp64", {}, "--parallel tp64 needs 64 ranks and this machine runs at most"),
        ("tp2", {"WORLD_SIZE": "2"}, "check --parallel starts its own ranks, one per GPU"),
    ],
)
def test_a_layout_the_check_cannot_shard_is_refused_in_one_line(layout, env, message, tmp_path) -> None:
    result = run_cli("check", "qwen3", "--tiny", "--parallel", layout, "--workdir", str(tmp_path / "w"), env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())


# Peaks of `check --parallel ep4` on GPUs (GB; docs/gpu-validation.md): the 48-layer Qwen3-30B-A3B width (used,
# nvidia-smi), its 4 layers and a 4-layer GLM-4.5-Air width (allocated, rank 0).
MEASURED_PEAKS = [("qwen3-moe", 48, 51.9), ("qwen3-moe", 4, 35.4), ("glm4-moe", 4, 51.7)]
GLM_PLUGIN = Path(__file__).parents[2] / "plugins" / "model-support-glm4-moe" / "src"


def _replica_context(monkeypatch: pytest.MonkeyPatch, handler: str, layers: int):
    """A check context for ``handler``'s reference config at ``layers`` layers (bf16), its checkpoint's tensors the
    transformers model's parameters (names and shapes; nothing written)."""
    import json
    from types import SimpleNamespace

    import transformers

    from model_support.core import checkpoint
    from model_support.core.meta_model import build_meta_model
    from model_support.core.registry import load_registry
    from model_support.core.replica import replica_config

    if handler == "glm4-moe":
        monkeypatch.syspath_prepend(str(GLM_PLUGIN))
        from model_support_glm4_moe.handler import GLM4_MOE as spec
    else:
        spec = load_registry().get(handler).spec
    raw = replica_config(json.loads(spec.reference_config.read_text()), layers=layers, experts=None, dtype="bfloat16")
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    shapes = {name: (Path(), tuple(p.shape), "BF16") for name, p in build_meta_model(config).named_parameters()}
    monkeypatch.setattr(checkpoint, "stored_tensors", lambda _model_dir: shapes)
    return SimpleNamespace(model_dir=Path(), config=config, layout=spec.layout(config), training_dtype="bf16")


@pytest.mark.parametrize(("handler", "layers", "measured_gb"), MEASURED_PEAKS)
def test_the_memory_estimate_covers_the_peaks_measured_on_gpus(monkeypatch, handler, layers, measured_gb) -> None:
    from model_support.core.parallel import ParallelLayout
    from model_support.validation.parallel_check import memory_per_rank

    parts = memory_per_rank(_replica_context(monkeypatch, handler, layers), ParallelLayout.parse("ep4"))
    estimate = sum(parts.values()) / 1e9
    assert measured_gb <= estimate <= 1.15 * measured_gb, parts


def test_a_layout_the_gpus_cannot_hold_is_refused_naming_the_estimate(monkeypatch) -> None:
    """The whole GLM-4.5-Air (46 layers, 106.9B) in ep4: 59.8 GiB of weights a GPU, under 80 % of an H100, but with the
    oracle's fp32 layer and the long row's logits it needs more than an H100 holds; four H200s hold it."""
    from model_support.core.parallel import ParallelLayout
    from model_support.validation import parallel_check

    ctx = _replica_context(monkeypatch, "glm4-moe", 46)
    ep4 = ParallelLayout.parse("ep4")
    monkeypatch.setattr(parallel_check, "gpu_memory", lambda: [81559 * 2**20] * 4)  # H100 80GB HBM3
    with pytest.raises(parallel_check.ParallelCheckError) as refused:
        parallel_check.refuse_memory(ctx, ep4)
    line = str(refused.value)
    assert line.startswith("--parallel ep4: each GPU would need about 10") and "\n" not in line
    assert "weights 59.8, the oracle's fp32 layer 8.7, its embedding and head 4.6, 13 copies of a 4096-token" in line
    assert line.endswith("more than 90% of its 79.6 GiB: shard it over more GPUs (a larger tp or ep)")
    monkeypatch.setattr(parallel_check, "gpu_memory", lambda: [143771 * 2**20] * 4)  # H200
    parallel_check.refuse_memory(ctx, ep4)
