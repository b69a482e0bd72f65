"""Merged-weight export: values (against PEFT's own merge), sharding + index, atomicity under a real crash."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model_support.core.serving.errors import ExportError
from model_support.core.serving.export import INDEX, base_tensors, buckets, export_merged
from model_support.handlers import BUILTIN_HANDLERS
from tests.serving.adapters import random_adapter

SPECS = {h.name: h for h in BUILTIN_HANDLERS}


def _export_tensors(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / INDEX).read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(out / shard), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118
                assert index["weight_map"][name] == shard
                tensors[name] = fh.get_tensor(name)
    return tensors


@pytest.fixture(scope="module")
def qwen3_adapter(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    model = tiny_model_dir("qwen3")
    return model, random_adapter(model, SPECS["qwen3"].hf_target_modules, tmp_path_factory.mktemp("adapter"), seed=3)


def test_export_equals_peft_merge_and_loads_sharded(qwen3_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, adapter = qwen3_adapter
    out = export_merged(model_dir, adapter, tmp_path / "merged", max_shard_bytes=200_000)
    index = json.loads((out / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert all((out / s).stat().st_size < 200_000 + 64 * 1024 for s in shards)
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    exported = _export_tensors(out)
    assert set(exported) == {name for name, _ in base_tensors(model_dir)}

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter)
    reference = peft.merge_and_unload().state_dict()
    changed = 0
    for name, tensor in exported.items():
        assert torch.allclose(tensor, reference[name], atol=1e-6, rtol=0), name
        changed += int(not torch.equal(tensor, dict(base_tensors(model_dir))[name])) if "proj" in name else 0
    assert changed == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)

    ids = torch.tensor([[11, 40, 99, 7, 300, 12]])
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert (loaded(ids).logits - peft(input_ids=ids).logits).abs().max().item() < 1e-5


def test_moe_experts_merge_like_the_independent_reference_merge(tiny_model_dir, tmp_path):
    from model_support.core.megatron.hf_reference import adapter_deltas

    model_dir = tiny_model_dir("qwen3.5-moe")
    adapter = random_adapter(model_dir, SPECS["qwen3.5-moe"].hf_target_modules, tmp_path / "adapter", seed=5)
    ours = _export_tensors(export_merged(model_dir, adapter, tmp_path / "ours"))
    # The merge the fp32 transformers reference applies, tensor by tensor.
    theirs = dict(base_tensors(model_dir))
    for name, delta in adapter_deltas(adapter).items():
        theirs[name] = (theirs[name].float() + delta.on(torch.device("cpu"))).to(theirs[name].dtype)
    assert set(ours) == set(theirs)
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-6
    expert = "model.language_model.layers.0.mlp.experts.3.down_proj.weight"
    assert not torch.equal(ours[expert], dict(base_tensors(model_dir))[expert])


def test_buckets_respect_the_size_limit():
    stream = [(f"t{i}", torch.zeros(10, dtype=torch.float32)) for i in range(7)]
    sizes = [list(b) for b in buckets(stream, max_bytes=100)]
    assert sizes == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t6"]]


def test_refuses_existing_export_and_foreign_adapter_modules(qwen3_adapter, tmp_path):
    model_dir, adapter = qwen3_adapter
    out = export_merged(model_dir, adapter, tmp_path / "merged")
    with pytest.raises(ExportError, match="already exists; choose a new directory"):
        export_merged(model_dir, adapter, out)
    other = random_adapter(model_dir, ("q_proj",), tmp_path / "other", seed=1)
    (other / "adapter_config.json").write_text((other / "adapter_config.json").read_text())
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(other / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"] = torch.zeros(8, 64)
    tensors["base_model.model.model.layers.9.self_attn.q_proj.lora_B.weight"] = torch.zeros(128, 8)
    save_file(tensors, str(other / "adapter_model.safetensors"))
    with pytest.raises(ExportError, match=r"adapter modules not in the checkpoint .*layers\.9\.self_attn\.q_proj"):
        export_merged(model_dir, other, tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not (tmp_path / ".bad.partial").exists()


def test_a_killed_export_leaves_no_checkpoint_and_the_next_one_succeeds(qwen3_adapter, tmp_path):
    model_dir, adapter = qwen3_adapter
    out = tmp_path / "merged"
    script = textwrap.dedent(
        f"""
        import os
        from model_support.core.serving import export
        written = []
        original = export.CheckpointWriter.write_shard
        def crash_after_two(self, tensors):
            if len(written) == 2:
                os.kill(os.getpid(), 9)
            written.append(original(self, tensors))
        export.CheckpointWriter.write_shard = crash_after_two
        export.export_merged({str(model_dir)!r}, {str(adapter)!r}, {str(out)!r}, max_shard_bytes=100_000)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    assert not out.exists()
    staging = tmp_path / ".merged.partial"
    assert len(list(staging.glob("shard-*.safetensors"))) == 2 and not (staging / INDEX).exists()
    export_merged(model_dir, adapter, out, max_shard_bytes=100_000)
    assert (out / INDEX).exists() and not staging.exists()


def test_the_reference_rounds_a_merge_to_the_dtype_asked_before_its_own(tiny_model_dir):
    """``merge_dtype``: the fp32 reference of the policy a bf16 server holds after a merged push (``rl_trainability``
    calibrates on it): each merged tensor rounded to bf16, then computed in fp32."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from model_support.core.megatron.hf_reference import LoraDelta, StreamedReference

    model_dir = tiny_model_dir("qwen3")
    reference = StreamedReference(model_dir, AutoConfig.from_pretrained(model_dir), torch.device("cpu"))
    name = "model.layers.0.self_attn.q_proj.weight"
    weight = load_file(model_dir / "model.safetensors")[name].float()
    gen = torch.Generator().manual_seed(3)
    update = LoraDelta(
        torch.randn(4, weight.shape[1], generator=gen), 1e-3 * torch.randn(weight.shape[0], 4, generator=gen), 1.0
    )
    rounded = (weight + update.on(torch.device("cpu"))).bfloat16().float()
    # The rounded merge written as an update of its own: B = rounded - weight, A = I (both exact in fp32).
    as_rounded = LoraDelta(torch.eye(weight.shape[1]), rounded - weight, 1.0)
    ids = torch.tensor([[11, 40, 99, 7, 300, 12]])
    got = reference.forward(ids, adapter={name: update}, merge_dtype=torch.bfloat16).logits
    assert torch.equal(got, reference.forward(ids, adapter={name: as_rounded}).logits)
    unrounded = reference.forward(ids, adapter={name: update}).logits
    assert (got - unrounded).abs().max().item() > 1e-5
