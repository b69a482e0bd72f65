"""Routed experts from the server (R3): ``ServeOptions(return_routed_experts=True)`` and ``api.served_experts``,
which reads a completion's ``routed_experts`` (vLLM's base64 ``.npy``) into the rows a trainer replays
(tests/megatron/test_routing.py holds the replay). The server's side runs on a GPU (the CPU build's engine refuses
the flag, tests/serving/test_options.py)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from model_support.core import api


def _encoded(array: np.ndarray) -> str:
    """As vLLM's completion serving encodes them (``np.save`` then base64)."""
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_a_completions_routed_experts_become_the_rows_a_trainer_replays():
    routed = np.random.default_rng(0).integers(0, 128, size=(11, 4, 8)).astype(np.uint8)  # 12 tokens, 4 layers, top-8
    rows = api.served_experts({"routed_experts": _encoded(routed)}, 12)
    assert rows.shape == (12, 4, 8) and rows.dtype == torch.int64
    assert torch.equal(rows[:11], torch.from_numpy(routed).long())
    assert torch.equal(rows[11], rows[10])  # the last sampled token was never run: its entry repeats the one before
    with pytest.raises(ValueError, match=r"cover 11 tokens; a row of 13 tokens needs 12 \(every token but the last"):
        api.served_experts({"routed_experts": _encoded(routed)}, 13)


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        ({}, r"carries no routed experts: start the server with ServeOptions\(return_routed_experts=True\)"),
        ({"routed_experts": None}, "carries no routed experts"),
        ({"routed_experts": "not base64!"}, "the completion's routed_experts is no base64 .npy array"),
        ({"routed_experts": base64.b64encode(b"\x93NUMPY garbage").decode()}, "is no base64 .npy array"),
        # an object array needs pickle to load: refused, never unpickled
        ({"routed_experts": _encoded(np.array([{"x": 1}], dtype=object))}, "is no base64 .npy array"),
        ({"routed_experts": _encoded(np.zeros((3, 4, 2), dtype=np.float32))}, r"integers, got float32 \[3, 4, 2\]"),
        ({"routed_experts": _encoded(np.zeros((3, 4), dtype=np.int32))}, r"integers, got int32 \[3, 4\]"),
    ],
    ids=["missing", "null", "not-base64", "not-npy", "pickled-object", "floats", "two-dims"],
)
def test_routed_experts_that_are_not_integer_rows_are_one_line_errors(choice, message):
    with pytest.raises(ValueError, match=message) as err:
        api.served_experts(choice, 4)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_the_server_routes_as_the_trainer_and_replaying_its_choices_takes_them(runtime, tiny_model_dir, tmp_path):
    """On a GPU: the tiny Qwen3-MoE served in bf16 returns every token's experts; the fp32 trainer routes the same row
    the same way but for near ties, and replaying the server's choices makes its routing the server's."""
    if runtime.flavor != "gpu":
        pytest.skip("routed experts are returned by vLLM on a GPU only")
    model_dir = tiny_model_dir("qwen3-moe")
    options = api.ServeOptions(return_routed_experts=True)
    server = api.serve(model_dir, "moe@0", tmp_path / "vllm.log", options=options)
    try:
        prompt = [17, 101, 44, 250, 9, 3]
        choice = server.completion(prompt, max_tokens=8, temperature=0.0)
    finally:
        server.stop()
    row = [*prompt, *choice["token_ids"]]
    served = api.served_experts(choice, len(row))
    model = api.build_model(model_dir, dtype=torch.float32)
    config = model.chunks[0].config
    assert served.shape == (len(row), config.num_layers, config.moe_router_topk)
    assert ((served >= 0) & (served < config.num_moe_experts)).all()
    (own,) = api.routed_experts(model, [row])
    same = (torch.sort(own, -1).values == torch.sort(served, -1).values).all(-1)[:-1].float().mean().item()
    assert same >= 0.9, same  # bf16 against fp32 on the same weights: a near tie may flip, not one in ten
    (replayed,) = api.token_logprobs(model, [row], routed_experts=[served])
    (alone,) = api.token_logprobs(model, [row])
    # Where every expert set agrees, replaying changes nothing but the order of a sum; where one differs, the rows move
    # (the last token's entry is a stand-in: its own row left out, causal attention keeps it from the others).
    moved = (replayed[:-1] - alone[:-1]).abs().max().item()
    assert moved > 1e-4 if same < 1 else moved < 1e-5, (same, moved)
