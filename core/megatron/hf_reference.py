"""The transformers side of the Megatron checks: reference logits, with or without a PEFT adapter on disk.

Two ways to put an adapter on the HF model:

* ``peft``: ``PeftModel.from_pretrained`` (used when every adapter module exists as an ``nn.Linear`` in
  the transformers model);
* ``merged``: transformers >= 5 stores routed experts as fused 3-D parameters, which PEFT cannot address
  by the per-expert names the adapter (and the checkpoint, and vLLM) use. The adapter is then merged into
  a copy of the checkpoint tensor by tensor (``W += alpha / r * B @ A`` on each ``<module>.weight``), and
  the merged checkpoint is loaded by transformers.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from model_support.core.codecs import PEFT_PREFIX, load_peft_adapter


def load_hf_model(model_dir: Path, config: Any) -> torch.nn.Module:
    """The transformers model of ``model_dir`` in fp32, eval mode (multimodal checkpoints included)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    arch = (getattr(config, "architectures", None) or [""])[0]
    cls = AutoModelForImageTextToText if arch.endswith("ForConditionalGeneration") else AutoModelForCausalLM
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids).logits.float()


def merge_adapter_checkpoint(model_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """Copy of ``model_dir`` with the adapter merged into the named checkpoint tensors; fails on a name it lacks."""
    from safetensors.torch import load_file, save_file

    config, tensors = load_peft_adapter(adapter_dir)
    scale = float(config["lora_alpha"]) / int(config["r"])
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            shutil.copy2(item, out_dir / item.name)
    deltas: dict[str, torch.Tensor] = {}
    for key, lora_a in tensors.items():
        if key.endswith(".lora_A.weight"):
            module = key[len(PEFT_PREFIX) : -len(".lora_A.weight")]
            lora_b = tensors[key.replace(".lora_A.", ".lora_B.")]
            deltas[f"{module}.weight"] = scale * lora_b.float() @ lora_a.float()
    for shard in sorted(model_dir.glob("*.safetensors")):
        state = load_file(str(shard))
        for name in list(state):
            if name in deltas:
                state[name] = (state[name].float() + deltas.pop(name)).to(state[name].dtype)
        save_file(state, str(out_dir / shard.name), metadata={"format": "pt"})
    if deltas:
        raise ValueError(f"adapter modules not in the checkpoint: {sorted(deltas)[:3]}")
    return out_dir


def adapter_logits(
    model_dir: Path, config: Any, adapter_dir: Path, input_ids: torch.Tensor, workdir: Path, *, method: str
) -> torch.Tensor:
    """HF logits with the adapter applied by ``method`` ("peft" or "merged")."""
    if method == "merged":
        merged = merge_adapter_checkpoint(model_dir, adapter_dir, workdir / "merged")
        return hf_logits(load_hf_model(merged, config), input_ids)
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_hf_model(model_dir, config), adapter_dir).eval()
    state = model.state_dict()
    _, tensors = load_peft_adapter(adapter_dir)
    for key, value in tensors.items():
        loaded = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        )
        if loaded not in state or not torch.equal(state[loaded], value):
            raise ValueError(f"PEFT did not load adapter tensor {key}")
    return hf_logits(model, input_ids)
