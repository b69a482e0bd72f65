"""A bridge reads a checkpoint through megatron-bridge's own state accessor: globs, regexes and ``has_glob`` on the
state source, over the text-model names of the safetensors files."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model_support.core.checkpoint import TextCheckpoint
from tests.megatron.conftest import require_megatron

PER_EXPERT = {f"model.layers.1.mlp.experts.{e}.{p}.weight": torch.full((2, 2), float(e)) for e in range(2)
              for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
FUSED = {"model.layers.1.mlp.experts.gate_up_proj": torch.zeros(2, 4, 2), "model.layers.1.mlp.experts.down_proj":
         torch.zeros(2, 2, 2)}  # fmt: skip
COMMON = {"model.embed_tokens.weight": torch.ones(4, 2), "lm_head.weight": torch.ones(4, 2)}


def _checkpoint(directory: Path, tensors: dict[str, torch.Tensor]) -> TextCheckpoint:
    directory.mkdir()
    save_file({**COMMON, **tensors}, directory / "model.safetensors")
    return TextCheckpoint(directory)


def _glm_bridge(checkpoint: TextCheckpoint):
    from transformers import Glm4MoeConfig

    from model_support.core.megatron.builder import family_bridge
    from model_support.core.megatron.state_source import hf_pretrained

    config = Glm4MoeConfig(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=2)
    config.architectures = ["Glm4MoeForCausalLM"]
    bridge, tcfg = family_bridge(config)
    bridge.hf_pretrained = hf_pretrained(tcfg, checkpoint)
    return bridge


def test_the_state_accessor_answers_names_globs_regexes_and_has_glob(tmp_path: Path):
    require_megatron()
    from model_support.core.megatron.state_source import hf_pretrained

    state = hf_pretrained(None, _checkpoint(tmp_path / "ckpt", PER_EXPERT)).state
    assert state.source.has_glob("*experts.1.up_proj*") and not state.source.has_glob("*gate_up_proj*")
    torch.testing.assert_close(state["model.layers.1.mlp.experts.1.down_proj.weight"], torch.ones(2, 2))
    assert sorted(state["model.layers.1.mlp.experts.0.*"]) == [
        f"model.layers.1.mlp.experts.0.{p}.weight" for p in ("down_proj", "gate_proj", "up_proj")
    ]
    assert len(state[re.compile(r"experts\.1\.")]) == 3
    assert set(state[["lm_head.weight", "model.embed_tokens.weight"]]) == set(COMMON)
    with pytest.raises(KeyError, match=r"Key not found: model\.norm\.weight"):
        state["model.norm.weight"]


def test_glm45s_bridge_picks_its_expert_mappings_by_the_checkpoints_names(tmp_path: Path):
    """GLM45Bridge asks its state source ``has_glob`` which expert layout the checkpoint stores."""
    require_megatron()
    per_expert = _glm_bridge(_checkpoint(tmp_path / "per-expert", PER_EXPERT))
    fused = _glm_bridge(_checkpoint(tmp_path / "fused", FUSED))
    assert (per_expert._uses_fused_experts(), fused._uses_fused_experts()) == (False, True)
