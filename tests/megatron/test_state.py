"""api.save_state / api.load_state: a resumed run's next step is bit for bit the uninterrupted run's; a state that
does not fit the model is refused in one line with nothing changed, and a failed save leaves nothing behind."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from model_support.core import api
from model_support.core.errors import ModelSupportError
from model_support.core.megatron.state import StateError
from tests.megatron import train_worker
from tests.megatron.conftest import require_megatron

pytestmark = pytest.mark.slow
STEPS = 3  # before the save; the resumed run then takes one more


def _model(model_dir: Path, *, rank: int = 4) -> tuple[api.TrainingModel, torch.optim.Optimizer]:
    """A new model with apply_lora's fresh adapter, and a new AdamW over its LoRA."""
    model = api.build_model(model_dir, handler=api.resolve(model_dir))
    api.apply_lora(model, rank=rank, alpha=8.0)
    params = [p for p in model.module.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _draws() -> tuple[float, ...]:
    """One number from each RNG a trainer draws from."""
    return (*torch.rand(2).tolist(), random.random(), float(np.random.random()))


def _train_step(model: api.TrainingModel, optimizer: torch.optim.Optimizer) -> None:
    """One step on rows and a loss mask drawn from the RNGs (as a trainer samples its batch)."""
    tokens = torch.randint(0, 500, (4, 16))
    mask = torch.rand(4, 15) < random.uniform(0.3, 0.9)
    weight = float(np.random.uniform(0.5, 1.5))

    def loss(scores, micro):
        return -weight * scores.logprobs - train_worker.ENTROPY_WEIGHT * scores.entropy

    api.forward_backward(
        model, tokens, loss, micro_batches=2, loss_inputs="logprobs", normalize="global_tokens", loss_mask=mask
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _lora(model: api.TrainingModel) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.module.parameters() if p.requires_grad]


def test_a_resumed_runs_next_step_is_bitwise_the_uninterrupted_one(tiny_model_dir, tmp_path):
    require_megatron()
    model_dir = tiny_model_dir("qwen3")
    model, optimizer = _model(model_dir)
    _seed(0)
    for _ in range(STEPS):
        _train_step(model, optimizer)
    draws = _draws()
    _train_step(model, optimizer)
    uninterrupted, moments = _lora(model), [s["exp_avg_sq"].clone() for s in optimizer.state.values()]

    model, optimizer = _model(model_dir)
    _seed(0)
    for _ in range(STEPS):
        _train_step(model, optimizer)
    assert api.save_state(model, optimizer, tmp_path / "state", step=STEPS) == tmp_path / "state"
    assert json.loads((tmp_path / "state" / "manifest.json").read_text())["step"] == STEPS

    model, optimizer = _model(model_dir)  # a new model and optimizer, and RNGs seeded otherwise
    _seed(1234)
    assert api.load_state(model, optimizer, tmp_path / "state") == STEPS
    assert _draws() == draws  # every RNG continues where the saved run's did
    _train_step(model, optimizer)
    resumed = _lora(model)
    assert len(resumed) == 16 and all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted, strict=True))
    assert all(torch.equal(s["exp_avg_sq"], m) for s, m in zip(optimizer.state.values(), moments, strict=True))
    # The step moved the adapter: equality is not that of an untrained one.
    assert not all(torch.equal(a, b) for a, b in zip(resumed, _lora(_model(model_dir)[0]), strict=True))


def _refusal(model: api.TrainingModel, optimizer: torch.optim.Optimizer, path: Path) -> str:
    """The one-line error of loading ``path``, having checked that nothing changed."""
    before = _lora(model)
    with pytest.raises(StateError) as caught:
        api.load_state(model, optimizer, path)
    assert all(torch.equal(a, b) for a, b in zip(_lora(model), before, strict=True)) and not optimizer.state
    assert isinstance(caught.value, ModelSupportError) and "\n" not in str(caught.value)
    return str(caught.value)


def _edited(state: Path, to: Path, **manifest: object) -> Path:
    shutil.copytree(state, to)
    saved = json.loads((to / "manifest.json").read_text())
    (to / "manifest.json").write_text(json.dumps(saved | manifest))
    return to


def test_a_state_that_does_not_fit_is_refused_and_a_failed_save_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch):
    require_megatron()
    model_dir = tiny_model_dir("qwen3")
    model, optimizer = _model(model_dir)
    _seed(0)
    _train_step(model, optimizer)
    state = api.save_state(model, optimizer, tmp_path / "state", step=1)
    with pytest.raises(StateError, match="state already exists: save each state to a new path"):
        api.save_state(model, optimizer, state, step=1)

    other, fresh_optimizer = _model(model_dir, rank=2)
    assert _refusal(other, fresh_optimizer, state) == (
        f"the state at {state} holds other LoRA tensors than this model "
        "(decoder.layers.0.mlp.linear_fc1.lora_A.weight: (4, 64) saved, (2, 64) here): "
        "apply_lora with the rank and targets it was saved with"
    )
    model, fresh_optimizer = _model(model_dir)
    two_ranks = _edited(state, tmp_path / "two-ranks", layout={"world": 2, "tp": 2, "dp": 1})
    assert _refusal(model, fresh_optimizer, two_ranks).endswith(
        "was saved by 2 ranks (tp2), this run is 1 rank: resume in the layout it was saved in"
    )
    qwen35 = _edited(state, tmp_path / "qwen3.5", model="qwen3.5")
    assert _refusal(model, fresh_optimizer, qwen35).endswith(
        "was saved from qwen3.5, this model is qwen3: load it into the model it was saved from"
    )
    half = torch.optim.AdamW([p for p in model.module.parameters() if p.requires_grad][:8])
    assert "build the optimizer over the same parameters, in the same order" in _refusal(model, half, state)
    assert "holds no training state (manifest.json missing)" in _refusal(model, fresh_optimizer, tmp_path)
    tampered = _edited(state, tmp_path / "tampered", step="12; rm -rf /")
    assert "has step '12; rm -rf /', not a count of steps: it was changed after saving" in _refusal(
        model, fresh_optimizer, tampered
    )
    no_rng = _edited(state, tmp_path / "no-rng")
    shard = torch.load(no_rng / "rank-00000.pt", weights_only=True)
    del shard["rng"]["python"]
    torch.save(shard, no_rng / "rank-00000.pt")
    assert _refusal(model, fresh_optimizer, no_rng).endswith("lacks rng.python: it was changed after saving")
    sgd = torch.optim.SGD([p for p in model.module.parameters() if p.requires_grad], lr=0.1)
    assert "holds a AdamW optimizer, this one is SGD: build the optimizer it was saved with" in _refusal(
        model, sgd, state
    )
    # Another checkpoint of the same architecture and shapes (a replica of another seed): other base weights.
    from model_support.core.tiny import build_tiny

    other_dir = build_tiny(json.loads((model_dir / "config.json").read_text()), tmp_path / "other-weights", seed=1)
    elsewhere, elsewhere_optimizer = _model(other_dir)
    assert "was trained on other base weights than this model's (same names and shapes, other values)" in _refusal(
        elsewhere, elsewhere_optimizer, state
    )
    # The optimizer's moments of another shape are only found while loading: all is put back as it was.
    shapes = _edited(state, tmp_path / "moments")
    shard = torch.load(shapes / "rank-00000.pt", weights_only=True)
    first = next(iter(shard["optimizer"]["state"].values()))
    first["exp_avg"] = torch.zeros(3)
    torch.save(shard, shapes / "rank-00000.pt")
    assert "does not fit: optimizer state 'exp_avg' is [3], its parameter" in _refusal(model, fresh_optimizer, shapes)

    def full_disk(*_args, **_kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(StateError, match="rank 0 could not save or load its state: OSError: No space left on device"):
        api.save_state(model, optimizer, tmp_path / "failed", step=2)
    assert not (tmp_path / "failed").exists() and not (tmp_path / ".failed.partial").exists()
