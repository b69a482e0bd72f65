"""hf_weights: the live Megatron model, LoRA merged, streamed under the checkpoint's own names and dtypes.

References are file-based: the checkpoint itself, and ``merged_tensors`` (base + PEFT adapter merged on the HF
side). Each tiny model is built once per module (building takes milliseconds after the first import).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from model_support.core.checkpoint import TextCheckpoint
from model_support.core.codecs import save_peft_adapter
from model_support.core.megatron.builder import MegatronModel, build_megatron_model
from model_support.core.megatron.hf_export import HFExportError, hf_weights
from model_support.core.megatron.lora import apply_lora, load_lora_state, lora_state, random_lora_state
from model_support.core.serving.export import adapter_deltas, base_tensors, merged_tensors
from model_support.handlers import BUILTIN_HANDLERS
from tests.megatron.conftest import require_megatron

pytestmark = pytest.mark.slow

SPECS = {h.name: h for h in BUILTIN_HANDLERS}
HANDLERS = ("qwen3", "qwen3.5", "qwen3-moe", "qwen3.5-moe")  # tied embeddings; VL names + vision tower; experts
TOL = 1e-6  # fp32: both sides compute base + 2 * B @ A in fp32 (observed: 0.0)
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _build(model_dir: Path) -> MegatronModel:
    require_megatron()
    return build_megatron_model(model_dir, AutoConfig.from_pretrained(model_dir))


def _export(built: MegatronModel) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_weights(built):
        assert name not in out, name
        out[name] = tensor.clone()  # a tensor may share memory with a parameter
    return out


def _add_lora(built: MegatronModel, handler: str, adapter_dir: Path) -> None:
    """The same random LoRA (seed 3) on the model and, through the handler's codec, as a PEFT adapter."""
    spec, config = SPECS[handler], AutoConfig.from_pretrained(built.checkpoint.source_dir)
    apply_lora(built.model, spec, rank=4, alpha=8.0)
    load_lora_state(built.model, random_lora_state(built.model, seed=3, b_std=0.05))
    peft = spec.codec.to_peft(lora_state(built.model), config, spec.layout(config))
    save_peft_adapter(adapter_dir, peft, rank=4, alpha=8.0, base_model=str(built.checkpoint.source_dir))


@dataclass
class Exports:
    model_dir: Path
    built: MegatronModel  # LoRA applied
    base: dict[str, torch.Tensor]  # hf_weights as loaded
    plus_one: dict[str, torch.Tensor]  # hf_weights with every Megatron parameter + 1
    lora: dict[str, torch.Tensor]  # hf_weights with the random LoRA
    adapter_dir: Path  # that LoRA as a PEFT adapter


@pytest.fixture(scope="module", params=HANDLERS)
def exports(request, tiny_model_dir, tmp_path_factory) -> Exports:
    """One build per handler, exported as loaded, with every parameter + 1 (then restored), and with a LoRA."""
    model_dir = tiny_model_dir(request.param)
    built = _build(model_dir)
    base = _export(built)
    params = list(built.model.parameters())
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    plus_one = _export(built)
    with torch.no_grad():
        for p, value in zip(params, saved, strict=True):
            p.copy_(value)
    adapter_dir = tmp_path_factory.mktemp(f"adapter-{request.param}")
    _add_lora(built, request.param, adapter_dir)
    return Exports(model_dir, built, base, plus_one, _export(built), adapter_dir)


def test_without_lora_the_export_is_the_checkpoint(exports: Exports) -> None:
    stored = dict(base_tensors(exports.model_dir))
    assert set(exports.base) == set(stored)
    for name, tensor in stored.items():
        assert exports.base[name].dtype == tensor.dtype and torch.equal(exports.base[name], tensor), name
    # Every language-model tensor comes from the live model (it moves with it); the rest (vision) from the files.
    checkpoint = exports.built.checkpoint
    text = {checkpoint.raw_key(n) for n in checkpoint.get_all_keys()}
    assert {n for n in stored if not torch.equal(exports.plus_one[n], stored[n])} == text
    assert all(torch.allclose(exports.plus_one[n], stored[n] + 1, atol=1e-5) for n in text)


def test_lora_is_merged_like_the_file_based_merge(exports: Exports) -> None:
    reference = dict(merged_tensors(exports.model_dir, exports.adapter_dir))
    targeted = set(adapter_deltas(exports.adapter_dir))
    assert set(exports.lora) == set(reference) and len(targeted) >= 14
    for name, tensor in reference.items():
        assert exports.lora[name].dtype == tensor.dtype, name
        assert (exports.lora[name] - tensor).abs().max() < TOL, name
        # The tensors LoRA targets really moved (the test cannot pass with the LoRA ignored); no other did.
        moved = (exports.lora[name] - exports.base[name]).abs().max().item()
        assert moved > 1e-3 if name in targeted else moved == 0, (name, moved)


def _pack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> the fused layout (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _EXPERT.match(name)
        if match:
            experts.setdefault(match[1], {})[int(match[2]), match[3]] = tensor
        else:
            out[name] = tensor
    for prefix, parts in experts.items():
        count = len(parts) // 3
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[i, "gate"], parts[i, "up"]]) for i in range(count)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([parts[i, "down"] for i in range(count)])
    return out


def test_fused_experts_are_exported_fused(tiny_model_dir, tmp_path) -> None:
    """A checkpoint with fused routed experts goes through the bridge's grouped export, LoRA merged per expert."""
    per_expert = tiny_model_dir("qwen3.5-moe")
    model_dir = shutil.copytree(per_expert, tmp_path / "fused")
    fused = _pack_experts(load_file(model_dir / "model.safetensors"))
    save_file(fused, model_dir / "model.safetensors", metadata={"format": "pt"})
    built = _build(model_dir)
    base = _export(built)
    assert set(base) == set(fused) and all(torch.equal(base[n], fused[n]) for n in fused)
    _add_lora(built, "qwen3.5-moe", tmp_path / "adapter")  # PEFT names per expert, as the codec writes them
    reference = _pack_experts(dict(merged_tensors(per_expert, tmp_path / "adapter")))
    lora = _export(built)
    assert set(lora) == set(reference)
    assert max((lora[n] - reference[n]).abs().max().item() for n in reference) < TOL
    gate_up = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert (lora[gate_up] - base[gate_up]).abs().max() > 1e-3


def test_dtypes_follow_the_checkpoint(tiny_model_dir, tmp_path) -> None:
    """An fp32 model loaded from a checkpoint with bf16 decoder layers exports those in bf16, the rest in fp32."""
    model_dir = shutil.copytree(tiny_model_dir("qwen3.5"), tmp_path / "mixed")
    path = model_dir / "model.safetensors"
    mixed = {k: v.to(torch.bfloat16) if ".layers." in k else v for k, v in load_file(path).items()}
    save_file(mixed, path, metadata={"format": "pt"})
    built = _build(model_dir)
    assert {p.dtype for p in built.model.parameters()} == {torch.float32}
    out = _export(built)
    assert set(out) == set(mixed) and {v.dtype for v in mixed.values()} == {torch.float32, torch.bfloat16}
    for name, tensor in mixed.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name


def test_tied_embeddings_follow_the_checkpoint(tiny_model_dir, tmp_path) -> None:
    """Tied Qwen3 stores no lm_head (see the first test); a tied checkpoint that does gets the live embedding."""
    model_dir = shutil.copytree(tiny_model_dir("qwen3"), tmp_path / "tied")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    built = _build(model_dir)
    assert built.provider.share_embeddings_and_output_weights
    with torch.no_grad():
        built.model.embedding.word_embeddings.weight.add_(1.0)
    out = _export(built)
    assert set(out) == set(tensors)
    assert torch.equal(out["lm_head.weight"], out["model.embed_tokens.weight"])
    assert torch.allclose(out["lm_head.weight"], tensors["lm_head.weight"] + 1)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("model.norm.weight"), r"exports model\.norm\.weight but .* does not have it"),
        (lambda t: t.update({"model.norm.weight": torch.ones(32)}), r"model\.norm\.weight as \(64,\), .* \(32,\)"),
    ],
    ids=["missing", "shape"],
)
def test_a_checkpoint_that_does_not_fit_fails_naming_the_tensor(tiny_model_dir, tmp_path, edit, message) -> None:
    model_dir = tiny_model_dir("qwen3")
    built = _build(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    other = replace(built, checkpoint=TextCheckpoint(tmp_path, built.checkpoint.config))
    with pytest.raises(HFExportError, match=message):
        _export(other)
