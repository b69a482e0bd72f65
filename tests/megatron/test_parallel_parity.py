"""`parallel_parity`: every default layout of a dense and an MoE handler matches the single-rank model (one torchrun
job of gloo processes per handler), its fp32 maxima calibrated by transformers' fp32 run of the same rows, and a
malformed --layouts is a one-line error."""

from __future__ import annotations

import io
import json
import os
import re
import sys
from pathlib import Path

import pytest
from rich.console import Console

from model_support.core import progress
from model_support.core.parallel import ParallelLayout, ParallelLayoutError, parse_layouts
from model_support.core.serving.process import ManagedProcess
from model_support.validation.stages.parallel_parity import ParallelParityStage
from tests.helpers import run_cli
from tests.megatron.conftest import require_megatron

LIMITS = {
    "logits_max_abs_err": 1e-4,
    "grad_max_abs_err": 1e-5,
    "adapter_mismatches": 0,
    "router_topk_mismatches": 0,
    "merged_max_abs_err": 1e-5,
    "merged_mismatches": 0,
}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("handler", "layouts"),
    [
        # Two layers: no four pipeline chunks (pp2-vp2 is named as not checked).
        ("qwen3", ("tp2", "tp2-sp", "pp2", "cp2", "tp2-pp2")),
        ("qwen3.5-moe", ("ep2", "etp2", "tp2-sp", "pp2", "pp2-vp2", "cp2", "tp2-sp-ep2", "ep2-pp2")),
    ],
)
def test_default_layouts_match_the_single_rank_model(handler: str, layouts: tuple[str, ...], tmp_path: Path):
    require_megatron()
    report_path = tmp_path / "report.json"
    result = run_cli("check", handler, "--tiny", "-s", "parallel_parity", "--alone", "--json", str(report_path))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    verdict = {r["stage"]: r for r in json.loads(report_path.read_text())["results"]}["parallel_parity"]
    assert verdict["status"] == "pass", verdict
    metrics = verdict["metrics"]
    assert metrics["layouts"] == len(layouts) and metrics["layouts_failed"] == 0
    assert metrics["world_size"] == max(ParallelLayout.parse(name).model_parallel for name in layouts)
    for name in layouts:
        for key, limit in LIMITS.items():
            assert metrics[f"{name}.{key}"] <= limit, (name, key, metrics[f"{name}.{key}"])
    # transformers' fp32 model on the oracle's rows (its adapter merged, an MoE model's routing replayed) lands within
    # the tiny replicas' fixed maxima, so the fixed limits stand; a replay of the wrong experts would be off by O(1).
    assert 0 < metrics["fp32.noise.logits_max_abs"] < 5e-5, metrics["fp32.noise.logits_max_abs"]
    assert 0 < metrics["fp32.noise.logprobs_max_abs"] < 5e-5, metrics["fp32.noise.logprobs_max_abs"]
    for name in layouts:
        assert metrics[f"{name}.transformers_logits_max_abs"] < 1e-4
    if handler.endswith("moe"):  # every router's top-k sets compared, none differ
        assert metrics["router_topk_mismatches"] == 0
    else:
        assert "pp2-vp2: not checked, the model cannot be split so (its 2 layers do not split into 4 pipeline " in (
            "\n".join(verdict["details"])
        )


def test_layouts_parse_to_canonical_names_and_refuse_what_they_cannot_say():
    assert parse_layouts("tp2, tp2-sp,EP2,tp2xep2") == ("tp2", "tp2-sp", "ep2", "tp2-ep2")
    assert ParallelLayout.parse("tp2-sp-ep2") == ParallelLayout(2, True, 2)
    assert parse_layouts("pp2xtp2,cp2, vp2-pp2") == ("tp2-pp2", "cp2", "pp2-vp2")
    assert ParallelLayout.parse("tp2-pp2").model_parallel == 4
    assert ParallelLayout.parse("ep2-etp2") == ParallelLayout(expert_parallel=2, expert_tensor_parallel=2)
    with pytest.raises(ParallelLayoutError, match="parts are tpN, epN, etpN, ppN, vpN, cpN and sp"):
        parse_layouts("dp2")
    with pytest.raises(ParallelLayoutError, match="need pipeline_parallel > 1"):
        parse_layouts("vp2")
    with pytest.raises(ParallelLayoutError, match="needs tensor_parallel > 1"):
        parse_layouts("sp")


def test_check_with_a_malformed_layout_is_a_one_line_error():
    result = run_cli("check", "qwen3", "--tiny", "--layouts", "zp2")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .endswith("parts are tpN, epN, etpN, ppN, vpN, cpN and sp (e.g. tp2-sp-ep2, pp2-vp2)")
    )


def test_a_handler_refuses_the_parallel_dimensions_it_declares_it_cannot_train_in():
    import dataclasses

    from model_support.core.spec import RuntimePolicy, SpecError
    from model_support.handlers.qwen3 import QWEN3_MOE

    policy = RuntimePolicy(parallel_limits={"tensor_parallel": "the kernel keeps one rank's gradient"})
    assert policy.refused(ParallelLayout(expert_parallel=2)) is None
    assert policy.refused(ParallelLayout(2, True, 2)) == "tensor parallel: the kernel keeps one rank's gradient"
    with pytest.raises(SpecError, match="parallel_limits map one of tensor_parallel, sequence_parallel"):
        dataclasses.replace(QWEN3_MOE, runtime=RuntimePolicy(parallel_limits={"pipeline": "not built"}))


def test_build_model_refuses_a_layout_the_handler_refuses(tiny_model_dir):
    import dataclasses

    from model_support.core import api
    from model_support.core.registry import load_registry
    from model_support.core.spec import RuntimePolicy

    handler = load_registry().get("qwen3")
    limited = dataclasses.replace(
        handler, spec=dataclasses.replace(handler.spec, runtime=RuntimePolicy(parallel_limits={"expert_parallel": "x"}))
    )
    with pytest.raises(ParallelLayoutError, match="qwen3 cannot train in ep2: expert parallel: x"):
        api.build_model(tiny_model_dir("qwen3"), handler=limited, parallel=ParallelLayout(expert_parallel=2))


def test_merged_bf16_tensors_are_compared_beyond_one_rounding():
    import torch

    from model_support.core.megatron.compare import beyond_rounding

    x = torch.tensor([1e-5, 0.1, 0.5, -3.0]).bfloat16()
    step = (x.view(torch.int16) + 1).view(torch.bfloat16)  # each element one bf16 step up: a rounding the other way
    assert beyond_rounding(x, x) == 0
    assert beyond_rounding(x, step) == 0
    # base and LoRA cancelling: 1e-8 apart, thousands of units in the last place of the tiny result, within 1e-5
    tiny = torch.tensor([1e-8]).bfloat16()
    assert beyond_rounding(tiny, torch.tensor([2e-8]).bfloat16()) < 1e-5
    # a LoRA update of 3e-3 left out of a weight near 0.1 (a unit there is 4.9e-4)
    assert beyond_rounding(x, (x.float() + torch.tensor([0, 3e-3, 0, 0])).bfloat16()) > 2e-3
    # fp32: the plain distance
    assert beyond_rounding(torch.tensor([1.0]), torch.tensor([1.0 + 2**-20])) == 2**-20


def test_only_the_fp32_oracle_writes_merged_weights_and_each_run_measures_itself_against_them(tmp_path: Path):
    import torch
    from safetensors.torch import save_file

    from model_support.validation.parallel_worker import _merged_results

    weights = {"a": torch.tensor([0.1, 0.5]).bfloat16(), "b": torch.ones(2, 3).bfloat16()}
    oracle = _merged_results(tmp_path, "single", weights)
    assert sorted(oracle) == ["merged.a", "merged.b"]
    assert _merged_results(tmp_path, "single.bf16", weights) == {} == _merged_results(tmp_path, "tp2.bf16", weights)
    # before the oracle ran: nothing to compare with, every tensor counted
    missing = _merged_results(tmp_path, "tp2", weights)
    assert missing["merged_mismatches"].item() == 2 and missing["merged_max_abs_err"].item() == float("inf")
    save_file(oracle, str(tmp_path / "single.safetensors"))
    same = _merged_results(tmp_path, "tp2", weights)
    assert sorted(same) == ["merged_max_abs_err", "merged_mismatches"]  # a layout's run writes its distance alone
    assert same["merged_max_abs_err"].item() == 0 and same["merged_mismatches"].item() == 0
    # a LoRA update of 3e-3 left out of the weight near 0.1, a tensor left out, one of another shape, one extra
    broken = {"a": torch.tensor([0.103, 0.5]).bfloat16(), "b": torch.ones(3, 2).bfloat16(), "c": torch.ones(1)}
    found = _merged_results(tmp_path, "pp2", broken)
    assert found["merged_max_abs_err"].item() > 2e-3 and found["merged_mismatches"].item() == 2
    assert _merged_results(tmp_path, "pp2", {"a": weights["a"]})["merged_mismatches"].item() == 1


def test_fp32_noise_is_transformers_distance_in_logits_and_log_softmax_rows():
    import torch

    from model_support.validation.stages.parallel_parity import fp32_noise

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=gen)
    tokens = torch.randint(0, 11, (2, 6), generator=gen)
    reference = logits.clone()
    reference[1, 2, 7] += 3e-4
    noise = fp32_noise({"logits": logits, "tokens": tokens}, reference)
    assert noise["logits_max_abs"] == pytest.approx(3e-4, rel=1e-3)
    # the whole row's log-softmax, as the scoring calls return it: the raised entry moves by 3e-4 less its share of
    # the normaliser, the others by that share
    share = torch.softmax(reference[1, 2].double(), -1)[7].item()
    assert noise["logprobs_max_abs"] == pytest.approx(3e-4 * (1 - share), rel=1e-2)
    # a shift of a whole row moves its logits, not its distribution
    shifted = logits.clone()
    shifted[0, 5] += 1.0
    moved = fp32_noise({"logits": logits, "tokens": tokens}, shifted)
    assert moved["logits_max_abs"] == pytest.approx(1.0) and moved["logprobs_max_abs"] < 1e-6


def test_transformers_replays_the_oracles_decoder_routing_row_after_row(monkeypatch, tmp_path):
    import torch

    from model_support.core.megatron import hf_reference
    from model_support.validation import megatron_session
    from model_support.validation.stages.parallel_parity import transformers_logits

    seen = {}

    class Reference:
        def forward(self, tokens, *, adapter, replay):
            seen["tokens"], seen["replay"] = tokens, replay
            return type("Out", (), {"logits": torch.zeros(2, 3, 5)})()

    monkeypatch.setattr(megatron_session, "hf_reference", lambda _ctx: Reference())
    monkeypatch.setattr(hf_reference, "adapter_deltas", lambda _path: {})
    # two decoder routers (layers 10 and 2: ordered by layer, not by name), two micro-batches of one row each, and an
    # MTP layer's router, which transformers does not run
    record = {f"topk.decoder.layers.{layer}.mlp.router.{i}": torch.full((1, 3, 2), 10 * layer + i) for layer in (10, 2)
              for i in (1, 0)}  # fmt: skip
    record["topk.mtp.layers.0.transformer_layer.mlp.router.0"] = torch.zeros(1, 3, 2, dtype=torch.long)
    transformers_logits(None, {"tokens": torch.zeros(2, 3, dtype=torch.long), **record}, tmp_path)
    first, second = seen["replay"]
    assert first.shape == second.shape == (6, 2)
    assert first[:3].eq(20).all() and first[3:].eq(21).all() and second[:3].eq(100).all() and second[3:].eq(101).all()


def test_a_parameter_held_in_another_dtype_on_some_rank_is_counted_and_named():
    from model_support.validation.stages.parallel_parity import dtype_mismatches

    single = {"decoder.final_layernorm.weight": ["float32"], "decoder.layers.0.mlp.linear_fc1.weight": ["bfloat16"]}
    layout = {"decoder.final_layernorm.weight": ["bfloat16", "float32"], **dict(list(single.items())[1:])}
    assert dtype_mismatches(single, single) == (0, "")
    count, line = dtype_mismatches(single, layout)
    assert count == 1
    assert line == "decoder.final_layernorm.weight is bfloat16/float32 on some rank, float32 single-rank"


def test_a_run_names_its_layout_and_dtype():
    import torch

    from model_support.validation.parallel_worker import parse_run

    assert parse_run("tp2-sp") == ("tp2-sp", torch.float32)
    assert parse_run("single.bf16") == ("single", torch.bfloat16)
    with pytest.raises(ValueError, match="the dtype after the layout is bf16 or nothing"):
        parse_run("tp2.fp16")


def test_a_layout_needing_more_ranks_than_the_cpus_run_is_named_not_started(tmp_path):
    require_megatron()
    report_path = tmp_path / "report.json"
    result = run_cli(
        "check", "qwen3", "--tiny", "-s", "parallel_parity", "--alone", "--layouts", "cp512", "--json", str(report_path)
    )
    assert result.returncode == 0, result.stderr[-2000:]
    verdict = json.loads(report_path.read_text())["results"][0]
    assert verdict["status"] == "skip"
    assert "cp512: not checked, it needs 512 ranks and this machine runs at most" in verdict["summary"]


def _job(tmp_path: Path, script: str) -> ManagedProcess:
    """A real job under the launcher, as the stage starts the worker: ``script`` stands for the worker's ranks."""
    return ManagedProcess(
        Path(sys.executable), [sys.executable, "-c", script], env=dict(os.environ), log_path=tmp_path / "job.log"
    ).start()


def test_the_stage_follows_each_run_and_stops_a_job_that_finishes_none_for_the_run_timeout(tmp_path: Path):
    """The job may take as long as it needs while runs keep finishing (a fresh GPU autotunes for minutes a run); one
    that finishes no run for ``run_timeout_s`` is given up (None), and one that ends before its run finishes gives
    its exit status, its run's step line saying it failed."""
    out = tmp_path / "out"
    out.mkdir()
    stage = ParallelParityStage()
    stage.run_timeout_s = 1.0
    finished_one = f"import pathlib, time; pathlib.Path({str(out)!r}, 'single.safetensors').touch(); time.sleep(600)"
    silent = _job(tmp_path, finished_one)
    shown = io.StringIO()
    try:
        with progress.shown_on(Console(file=shown, width=200)):
            assert stage._follow(silent, ["single", "tp2"], out) is None
    finally:
        silent.stop()
    assert re.search(r"^single: done in [\d.]+ s$", shown.getvalue(), re.M), shown.getvalue()
    assert re.search(r"^tp2: failed after [\d.]+ s$", shown.getvalue(), re.M), shown.getvalue()

    stage.run_timeout_s = 600.0
    failing = _job(tmp_path, "import sys; sys.exit(3)")
    try:
        assert stage._follow(failing, ["single", "tp2"], out) == 3
    finally:
        failing.stop()
