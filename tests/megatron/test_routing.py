"""Routing replay for a trainer (R3): ``api.routed_experts`` gives the trainer's own expert choices, and
``api.token_logprobs`` / ``api.forward_backward`` take a server's, in vLLM's format, on one rank and on two gloo
ranks in ep2, etp2, tp2-sp, cp2 and pp2 (tests/megatron/routing_worker.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model_support.core import api
from tests.megatron import routing_worker
from tests.megatron.conftest import require_megatron

pytestmark = pytest.mark.slow
WORKER = Path(routing_worker.__file__)


@pytest.fixture(scope="module")
def moe(tiny_model_dir) -> api.TrainingModel:
    """The tiny Qwen3-MoE with the worker's canonical random LoRA, at one rank."""
    require_megatron()
    return routing_worker.build(tiny_model_dir("qwen3-moe"), None)


def _shape(model: api.TrainingModel) -> tuple[int, int, int]:
    config = model.chunks[0].config
    return config.num_layers, config.moe_router_topk, config.num_moe_experts


def test_replaying_the_trainers_own_routing_changes_nothing_and_a_servers_other_routing_is_taken(moe):
    sequences = routing_worker.SEQUENCES
    own = api.routed_experts(moe, sequences)
    layers, top_k, experts = _shape(moe)
    assert [tuple(e.shape) for e in own] == [(len(s), layers, top_k) for s in sequences]
    assert all(((e >= 0) & (e < experts)).all() for e in own)  # every layer of the tiny Qwen3-MoE routes
    alone = api.token_logprobs(moe, sequences)
    # The trainer's own choices replayed: the same computation, bit for bit.
    replayed = api.token_logprobs(moe, sequences, routed_experts=own)
    assert all(torch.equal(a, b) for a, b in zip(alone, replayed, strict=True))
    # A server that routed otherwise: the rows follow its experts (the planted routing moves them by O(0.1)), and
    # what the trainer routes itself in the same call is untouched.
    planted = [routing_worker.planted(len(s), *_shape(moe)) for s in sequences]
    mismatch = sum(int((p != o).any(-1).sum()) for p, o in zip(planted, own, strict=True))
    assert mismatch > 0
    other = api.token_logprobs(moe, sequences, routed_experts=planted)
    assert max((a - b).abs().max().item() for a, b in zip(alone, other, strict=True)) > 0.05
    assert all(torch.equal(a, b) for a, b in zip(own, api.routed_experts(moe, sequences), strict=True))


def test_a_step_replays_each_micro_batchs_experts(moe):
    rows = routing_worker.step_rows()
    experts = torch.stack([routing_worker.planted(rows.shape[1], *_shape(moe))] * rows.shape[0])
    experts[1] = (experts[1] + 1) % _shape(moe)[2]  # the second row (micro-batch) routed otherwise

    def keep(logits: torch.Tensor, _micro: object) -> torch.Tensor:
        return logits.new_zeros(())

    step = api.forward_backward(
        moe, rows, keep, forward_only=True, keep_logits=True, micro_batches=2, routed_experts=experts
    )
    for i in range(2):
        (scored,) = api.token_logprobs(moe, [rows[i].tolist()], routed_experts=[experts[i]])
        assert (torch.log_softmax(step.logits[i], dim=-1) - scored).abs().max() < 1e-5


def test_malformed_routed_experts_are_refused_in_one_line(moe, tiny_model_dir):
    rows = routing_worker.step_rows()
    layers, top_k, _ = _shape(moe)

    def keep(logits: torch.Tensor, _micro: object) -> torch.Tensor:
        return logits.new_zeros(())

    with pytest.raises(ValueError, match=rf"routed experts are \[B, S, layers, top-k\] = \[2, 16, {layers}, {top_k}\]"):
        api.forward_backward(moe, rows, keep, forward_only=True, routed_experts=torch.zeros(2, 16, layers, 1))
    with pytest.raises(ValueError, match=r"routed experts are integer expert ids, got torch\.float32"):
        api.forward_backward(moe, rows, keep, forward_only=True, routed_experts=torch.zeros(2, 16, layers, top_k))
    count = _shape(moe)[2]
    beyond = torch.full((2, 16, layers, top_k), count)  # one past the last expert
    message = rf"ids of the model's {count} experts at its MoE layers, got ids from {count} "
    with pytest.raises(ValueError, match=message):
        api.forward_backward(moe, rows, keep, forward_only=True, routed_experts=beyond)
    (own,) = api.routed_experts(moe, [[1, 2, 3]])
    with pytest.raises(ValueError, match=rf"experts at its MoE layers, got ids from -1 to {own.max().item()}"):
        api.token_logprobs(moe, [[1, 2, 3]], routed_experts=[torch.cat([own[:2], torch.full_like(own[2:], -1)])])
    with pytest.raises(ValueError, match=r"sequences of \[3\] tokens, experts of \[2\]"):
        api.token_logprobs(moe, [[1, 2, 3]], routed_experts=[torch.zeros(2, layers, top_k, dtype=torch.long)])
    dense = api.build_model(tiny_model_dir("qwen3"), dtype=torch.float32)
    with pytest.raises(ValueError, match="the model has no MoE layer"):
        api.routed_experts(dense, [[1, 2, 3]])


def test_a_model_built_to_recompute_replays_where_no_backward_recomputes(moe, tiny_model_dir):
    """Scoring without gradients (a check's, a trainer's log-probs of samples) runs no recomputed forward: replay is
    taken there and gives the rows of a model built without recompute; where a backward could recompute, refused."""
    recomputing = routing_worker.build(tiny_model_dir("qwen3-moe"), None, recompute=True)
    sequences = routing_worker.SEQUENCES
    planted = [routing_worker.planted(len(s), *_shape(moe)) for s in sequences]
    with torch.no_grad():
        ours = api.token_logprobs(recomputing, sequences, routed_experts=planted)
        plain = api.token_logprobs(moe, sequences, routed_experts=planted)
    assert max((a - b).abs().max().item() for a, b in zip(ours, plain, strict=True)) < 1e-6
    with pytest.raises(ValueError, match=r"routing replay with activation recompute replays only a forward no"):
        api.token_logprobs(recomputing, sequences, routed_experts=planted)


def test_two_ranks_route_and_replay_as_one_rank_does(moe, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    proc = subprocess.run(
        [*cmd, str(WORKER), str(tmp_path), str(moe.model_dir)], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = load_file(str(tmp_path / "routing.safetensors"))
    alone = routing_worker.results(moe)
    assert any(k.startswith("grad.") for k in alone)
    for layout in routing_worker.LAYOUTS:
        # Each rank's routers saw their part of the tokens (a context-parallel part, a sequence-parallel slice, a
        # pipeline stage's layers): reassembled, the single-rank model's choices, and the planted experts replayed
        # where each token is.
        for key, expected in alone.items():
            got = found[f"{layout}.{key}"]
            if key.startswith("own."):
                assert torch.equal(got, expected), (layout, key)
            else:
                assert (got - expected).abs().max() < 1e-5, (layout, key, (got - expected).abs().max())
