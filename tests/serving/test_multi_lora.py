"""Several LoRA adapters trained on one base in one trainer (one per task, ART's shape), served side by side: each
served as its trainer computes it, each hot-swapped alone."""

from __future__ import annotations

import pytest
import torch

from model_support.core import api
from model_support.core.megatron.lora import load_lora_state, lora_state
from model_support.core.serving.errors import ServerError
from tests.megatron.conftest import require_megatron

PROMPT = [17, 101, 44, 250, 9, 311, 66, 140, 23, 77]
TOL = 1e-4  # fp32 trainer and server (the CPU build)


def _train(model: api.TrainingModel, target: int, steps: int) -> None:
    """``steps`` SGD steps raising the log-probability of ``target`` after every prefix of ``PROMPT``."""
    params = [p for p in model.module.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.5)
    for _ in range(steps):
        loss = -api.token_logprobs(model, [PROMPT])[0][:, target].mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _served(server, name: str) -> torch.Tensor:
    choice = server.completion(PROMPT, model=name, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    return torch.tensor(
        [row[str(t)]["logprob"] for row, t in zip(choice["prompt_logprobs"][1:], PROMPT[1:], strict=True)]
    )


def _trainer(model: api.TrainingModel) -> torch.Tensor:
    with torch.no_grad():
        rows = api.token_logprobs(model, [PROMPT])[0]
    return rows[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]


@pytest.mark.slow
def test_two_adapters_trained_apart_are_served_side_by_side_and_swapped_alone(qwen3_server, tiny_model_dir, tmp_path):
    require_megatron()
    server = qwen3_server
    model = api.build_model(tiny_model_dir("qwen3"), handler=api.resolve(tiny_model_dir("qwen3")))
    api.apply_lora(model, rank=4, alpha=8.0, seed=1)
    fresh = {k: v.clone() for k, v in lora_state(model.module).items()}
    try:
        _train(model, target=5, steps=3)
        task_a = api.push_adapter(server, model, name="task-a")
        expected_a = _trainer(model)
        api.export_adapter(model, tmp_path / "a")  # task A's state, kept while B trains
        load_lora_state(model.module, fresh)  # task B starts from the same fresh adapter
        _train(model, target=300, steps=3)
        task_b = api.push_adapter(server, model, name="task-b")
        expected_b = _trainer(model)
        assert (task_a, task_b) == ("task-a@1", "task-b@1")
        assert (expected_a - expected_b).abs().max().item() > 0.1  # trained apart
        assert (_served(server, task_a) - expected_a).abs().max().item() < TOL
        assert (_served(server, task_b) - expected_b).abs().max().item() < TOL

        api.load_adapter(model, tmp_path / "a")  # task A's next step: B stays as it was
        _train(model, target=5, steps=1)
        assert api.push_adapter(server, model, name="task-a") == "task-a@2"
        assert (_served(server, "task-a@2") - _trainer(model)).abs().max().item() < TOL
        assert (_served(server, task_b) - expected_b).abs().max().item() < TOL
        assert server.adapters == {"task-a": "task-a@2", "task-b": "task-b@1"}
        with pytest.raises(ServerError, match="404"):
            server.completion(PROMPT, model=task_a, max_tokens=1)
        with pytest.raises(ServerError, match="adapter name 'qwen3'"):
            server.update_adapter(tmp_path / "a", name="qwen3")
    finally:
        for name in ("task-a", "task-b"):
            server.remove_adapter(name)
    assert server.adapters == {} and server.models() == [server.served_name]
