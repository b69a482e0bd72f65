"""ART's train/inference mismatch figures (``train_inference_mismatch``): mean |p_server - p_trainer| of the sampled
tokens and KL(server || trainer) over the server's top-k, on numbers worked by hand; and the limits of a
server-vs-trainer comparison below fp32."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from model_support.validation.serving_session import compared_dtype, runs_below_fp32
from model_support.validation.stages.train_inference_mismatch import art_figures, mismatch, mismatch_tolerance


def _rows(*probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_a_trainer_that_agrees_with_the_server_has_no_mismatch():
    rows = _rows([0.5, 0.25, 0.25], [0.1, 0.2, 0.7])
    tokens = torch.tensor([0, 2])
    tops = [{0: math.log(0.5), 1: math.log(0.25)}, {2: math.log(0.7), 1: math.log(0.2)}]
    ours = rows.gather(1, tokens[:, None])[:, 0]
    figures = art_figures(ours, ours, tops, rows)
    assert figures == pytest.approx({"art_prob_abs_diff_mean": 0.0, "art_top20_kl_mean": 0.0}, abs=1e-12)


def test_the_figures_measure_the_probability_gap_and_the_top_k_divergence():
    # The server gives the sampled tokens 0.5 and 0.7, the trainer 0.4 and 0.6: mean |dp| = 0.1.
    trainer = _rows([0.4, 0.4, 0.2], [0.1, 0.3, 0.6])
    tokens = torch.tensor([0, 2])
    served = torch.tensor([0.5, 0.7], dtype=torch.float64).log()
    # The server's top 2 at each position: renormalised (0.5, 0.5) vs the trainer's (0.5, 0.5) -> 0; and
    # (0.7, 0.2) -> (7/9, 2/9) vs the trainer's (0.6, 0.3) -> (2/3, 1/3).
    tops = [{0: math.log(0.5), 1: math.log(0.5)}, {2: math.log(0.7), 1: math.log(0.2)}]
    second = 7 / 9 * math.log((7 / 9) / (2 / 3)) + 2 / 9 * math.log((2 / 9) / (1 / 3))
    figures = art_figures(served, trainer.gather(1, tokens[:, None])[:, 0], tops, trainer)
    assert figures["art_prob_abs_diff_mean"] == pytest.approx(0.1, abs=1e-12)
    assert figures["art_top20_kl_mean"] == pytest.approx(second / 2, abs=1e-12)


def test_low_precision_limits_scale_with_the_references_own_distance_and_fp32_stays_fixed():
    fixed = mismatch_tolerance("bfloat16")
    # transformers' own bf16 run close to its fp32 one: the fixed limits stand.
    assert mismatch_tolerance("bfloat16", {"abs_delta_logprob_mean": 1e-3, "abs_delta_logprob_max": 0.01}) == fixed
    # A wider model drifting further: at least twice that distance; the KL, quadratic in delta, four times its own.
    own = {"abs_delta_logprob_mean": 0.04, "abs_delta_logprob_max": 0.3, "kl_mean": 0.01}
    wide = mismatch_tolerance("bfloat16", own)
    assert wide["abs_delta_logprob_mean"] == pytest.approx(0.08) and wide["abs_delta_logprob_max"] == pytest.approx(0.6)
    assert wide["kl_mean"] == pytest.approx(0.04)
    assert mismatch_tolerance("bfloat16", own | {"kl_mean": 1e-3})["kl_mean"] == fixed["kl_mean"]
    assert mismatch_tolerance("float32")["abs_delta_logprob_max"] == 1e-4


def test_two_runs_below_fp32_may_drift_apart_by_both_allowances_and_each_is_held_to_its_own():
    # transformers' own bf16 run is 0.1 / 0.4 (KL 0.01) from its fp32 run on the sampled tokens.
    own = {"abs_delta_logprob_mean": 0.1, "abs_delta_logprob_max": 0.4, "kl_mean": 0.01}
    one, two = mismatch_tolerance("bfloat16", own), mismatch_tolerance("bfloat16", own, sides=2)
    assert two == pytest.approx({"abs_delta_logprob_mean": 0.4, "abs_delta_logprob_max": 1.6, "kl_mean": 0.16})
    # Each side's own drift within one allowance bounds the pair's by the triangle inequality, token by token.
    fp32 = torch.zeros(64, dtype=torch.float64)
    server, trainer = fp32 + 0.2 * torch.linspace(-1, 1, 64), fp32 - 0.2 * torch.linspace(-1, 1, 64).flip(0)
    pair, sides = mismatch(server - trainer), [mismatch(server - fp32), mismatch(trainer - fp32)]
    assert all(side[k] <= one[k] for side in sides for k in one)
    assert all(pair[k] <= two[k] for k in two)
    # A trainer three times transformers' own distance from fp32: the pair can still be within both allowances,
    # the trainer's own comparison is not.
    wrong = fp32 + 3 * 0.1 * torch.ones(64, dtype=torch.float64)
    assert mismatch(server - wrong)["abs_delta_logprob_mean"] <= two["abs_delta_logprob_mean"]
    assert mismatch(wrong - fp32)["abs_delta_logprob_mean"] > one["abs_delta_logprob_mean"]


def test_a_comparison_is_held_to_the_lower_precision_of_the_server_and_the_trainer():
    def ctx(training: str) -> SimpleNamespace:
        return SimpleNamespace(training_dtype=training)

    assert compared_dtype(ctx("bf16"), "float32") == "bfloat16"  # an fp32 server on the CPU build, a bf16 trainer
    assert compared_dtype(ctx("fp32"), "bfloat16") == "bfloat16"
    assert compared_dtype(ctx("fp32"), "float32") == "float32"
    # How many of the two run below fp32: the server vs trainer limits allow each its own drift.
    assert runs_below_fp32(ctx("bf16"), "float32") == 1 and runs_below_fp32(ctx("fp32"), "bfloat16") == 1
    assert runs_below_fp32(ctx("bf16"), "bfloat16") == 2 and runs_below_fp32(ctx("fp32"), "float32") == 0
