"""forward_backward's vocabulary-parallel log-probs and entropies (``loss_inputs="logprobs"``) and its global token
normalisation: against full-vocabulary logits on one rank, and on two gloo ranks in tp2, cp2, pp2 and dp2
(tests/megatron/train_worker.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model_support.core import api
from model_support.core.megatron.forward import MicroBatch, TokenScores
from model_support.core.megatron.lora import load_lora_state, lora_state, random_lora_state
from model_support.core.megatron.state import StateError
from tests.megatron import train_worker
from tests.megatron.conftest import require_megatron

pytestmark = pytest.mark.slow
WORKER = Path(train_worker.__file__)


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir) -> api.TrainingModel:
    """The tiny Qwen3 with the worker's canonical random LoRA, at one rank."""
    require_megatron()
    model_dir = tiny_model_dir("qwen3")
    model = api.build_model(model_dir, handler=api.resolve(model_dir))
    api.apply_lora(model, rank=4, alpha=8.0)
    load_lora_state(model.chunks, random_lora_state(model.chunks, seed=train_worker.LORA_SEED, b_std=0.05))
    return model


def _scores(model: api.TrainingModel, tokens: torch.Tensor) -> tuple[torch.Tensor, TokenScores]:
    """(the full-vocabulary logits, the vocabulary-parallel scores) of ``tokens``, forward only."""
    logits = api.forward_backward(model, tokens, lambda out, _: out.new_zeros(()), forward_only=True, keep_logits=True)
    scores = api.forward_backward(
        model,
        tokens,
        lambda s, _: s.logprobs.new_zeros(()),
        forward_only=True,
        keep_logits=True,
        loss_inputs="logprobs",
    )
    return logits.logits, scores.scores


def test_logprobs_are_the_next_tokens_log_softmax_and_entropy_the_full_distributions(qwen3):
    tokens, _, _ = train_worker.batch()
    logits, scores = _scores(qwen3, tokens)
    assert scores.logprobs.shape == scores.entropy.shape == (4, 15)
    logp = torch.log_softmax(logits.double(), dim=-1)  # float64: the reference's own rounding stays out of the bound
    expected = logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)[:, :-1]
    assert (scores.logprobs - expected).abs().max() < 1e-6
    assert (scores.entropy - entropy).abs().max() < 1e-6
    # A planted off-by-one (the label is the current token, or the next position's distribution scores it) is caught.
    for wrong in (logp[:, :-1].gather(-1, tokens[:, :-1, None]), logp[:, 1:].gather(-1, tokens[:, 1:, None])):
        assert (scores.logprobs - wrong.squeeze(-1)).abs().max() > 1.0
    assert (scores.entropy + (logp.exp() * logp).sum(-1)[:, 1:]).abs().max() > 1e-2
    # The same loss from either path: the same loss and LoRA gradients (two micro-batches, global token mean).
    metrics, _ = train_worker.compare_paths(qwen3)
    assert metrics["loss_err"] < 1e-6 and metrics["grad_err"] < 1e-6 < 1e-2 < metrics["grad_max"], metrics


def _grads(model: api.TrainingModel) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.module.parameters() if p.requires_grad]
    model.module.zero_grad(set_to_none=True)
    return grads


def _largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_global_token_normalisation_is_the_whole_batchs_token_mean(qwen3):
    tokens, mask, _ = train_worker.batch()
    assert mask[:2].sum() == 6 and mask[2:].sum() == 28  # the two micro-batches' loss tokens

    def whole_batch_mean(logits: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
        return (train_worker.from_logits(logits, micro) * mask).sum() / mask.sum()

    def micro_batch_mean(logits: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
        return (train_worker.from_logits(logits, micro) * micro.loss_mask).sum() / micro.loss_mask.sum()

    reference = api.forward_backward(qwen3, tokens, whole_batch_mean)
    expected = _grads(qwen3)
    step = api.forward_backward(
        qwen3,
        tokens,
        train_worker.from_scores,
        micro_batches=2,
        normalize="global_tokens",
        loss_mask=mask,
        loss_inputs="logprobs",
    )
    grads = _grads(qwen3)
    assert (step.loss - reference.loss).abs() < 1e-6
    err = _largest_difference(grads, expected)
    # The mean of each micro-batch's token mean weighs the 6 tokens' as much as the 28: clearly another gradient.
    api.forward_backward(qwen3, tokens, micro_batch_mean, micro_batches=2, loss_mask=mask)
    naive = _largest_difference(_grads(qwen3), expected)
    assert err < 1e-6 and naive > 1e-3, (err, naive)


def test_forward_backward_refuses_malformed_options(qwen3):
    tokens, _, _ = train_worker.batch()
    with pytest.raises(ValueError, match="loss_inputs is 'logits' or 'logprobs', not 'probs'"):
        api.forward_backward(qwen3, tokens, train_worker.from_scores, loss_inputs="probs")
    with pytest.raises(ValueError, match="normalize is 'micro_batch' or 'global_tokens', not 'tokens'"):
        api.forward_backward(qwen3, tokens, train_worker.from_scores, normalize="tokens")
    with pytest.raises(ValueError, match=r"loss_mask is \[B, S - 1\] = \[4, 15\] .* got \[4, 16\]"):
        api.forward_backward(qwen3, tokens, train_worker.from_scores, loss_mask=torch.ones(4, 16))
    with pytest.raises(ValueError, match=r"loss_fn returns the per-token loss \[b, S - 1\] = \[4, 15\], got \[\]"):
        api.forward_backward(
            qwen3, tokens, lambda s, _: s.logprobs.sum(), loss_inputs="logprobs", normalize="global_tokens"
        )
    qwen3.module.zero_grad(set_to_none=True)


def _run_two_ranks(model_dir: Path, out: Path) -> dict[str, dict[str, float]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    cmd += [str(WORKER), str(out), str(model_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "metrics.json").read_text())


def test_two_ranks_score_and_train_as_the_full_vocabulary_and_one_rank_do(qwen3, tmp_path):
    metrics = _run_two_ranks(qwen3.model_dir, tmp_path)
    # tp2 (each rank a vocabulary half: a dropped all-reduce of the max, sum of exponentials or label logit fails
    # here), cp2 (labels across the sequence chunks), pp2 (scores broadcast from the last stage).
    for layout in ("tp2", "cp2", "pp2"):
        found = metrics[layout]
        assert found["logprobs_err"] < 1e-5 and found["entropy_err"] < 1e-5 and found["loss_err"] < 1e-5, found
        assert found["grad_err"] < 1e-6 < 1e-2 < found["grad_max"], (layout, found)
    # dp2: each replica half the rows, loss tokens counted over both: the whole batch's token mean and gradient.
    assert metrics["dp2"]["loss_err"] < 1e-6 and metrics["dp2"]["grad_err"] < 1e-6, metrics["dp2"]
    tokens, _, _ = train_worker.batch()
    _, alone = _scores(qwen3, tokens)
    scores = load_file(str(tmp_path / "scores.safetensors"))
    for layout in ("tp2", "cp2", "pp2"):
        assert (scores[f"{layout}.logprobs"] - alone.logprobs).abs().max() < 1e-5, layout
        assert (scores[f"{layout}.entropy"] - alone.entropy).abs().max() < 1e-5, layout
    # Each rank saved and loaded back its own shard; a one-rank run refuses the two-rank state, changing nothing.
    assert metrics["tp2"]["state_step"] == 1 and metrics["tp2"]["state_mismatches"] == 0
    state = tmp_path / "state-tp2"
    assert sorted(p.name for p in state.iterdir()) == ["manifest.json", "rank-00000.pt", "rank-00001.pt"]
    before = lora_state(qwen3.module)
    optimizer = torch.optim.AdamW([p for p in qwen3.module.parameters() if p.requires_grad])
    with pytest.raises(StateError, match=r"saved by 2 ranks \(tp2\), this run is 1 rank: resume in the layout"):
        api.load_state(qwen3, optimizer, state)
    assert all(torch.equal(v, before[k]) for k, v in lora_state(qwen3.module).items())
