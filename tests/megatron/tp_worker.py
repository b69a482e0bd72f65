"""Worker of test_tensor_parallel: run under ``torchrun --nproc_per_node <TP>`` (gloo on CPU).

Builds the handler's Megatron model at tensor parallel = world size, puts the same canonical random LoRA on
it, and writes (rank 0) the logits, the PEFT tensors of the fresh adapter ``fresh_lora`` draws (``api.apply_lora``'s),
the PEFT tensors exported before and after one SGD step, and the merged HF weights (``hf_weights``, a collective
every rank runs) of the model with that LoRA before the step.
Usage: tp_worker.py <out_dir> <handler>=<model_dir> ...   (results under <out_dir>/<handler>/)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from transformers import AutoConfig

from model_support.core.megatron.builder import build_megatron_model
from model_support.core.megatron.dist import ParallelLayout
from model_support.core.megatron.forward import logits
from model_support.core.megatron.hf_export import hf_weights
from model_support.core.megatron.lora import apply_lora, fresh_lora, load_lora_state, lora_state, random_lora_state
from model_support.handlers import BUILTIN_HANDLERS


def main(handler: str, model_dir: Path, out_dir: Path) -> None:
    spec = {h.name: h for h in BUILTIN_HANDLERS}[handler]
    config = AutoConfig.from_pretrained(model_dir)
    layout = spec.layout(config)
    built = build_megatron_model(
        model_dir, config, parallel=ParallelLayout(tensor_parallel=int(os.environ["WORLD_SIZE"]))
    )
    model = built.model
    apply_lora(model, spec, rank=4, alpha=8.0)
    fresh_lora(model, seed=11)  # what api.apply_lora loads: one canonical adapter whatever the layout
    fresh = spec.codec.to_peft(lora_state(model), config, layout)
    load_lora_state(model, random_lora_state(model, seed=3, b_std=0.05))
    tokens = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(5))
    before = spec.codec.to_peft(lora_state(model), config, layout)
    merged = {name: tensor.clone() for name, tensor in hf_weights(built)}
    out = logits(model, tokens)
    torch.nn.functional.cross_entropy(out[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param -= 0.5 * param.grad
    after = spec.codec.to_peft(lora_state(model), config, layout)
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({"logits": out.detach().contiguous()}, str(out_dir / "logits.safetensors"))
        save_file({k: v.contiguous() for k, v in before.items()}, str(out_dir / "before.safetensors"))
        save_file({k: v.contiguous() for k, v in fresh.items()}, str(out_dir / "fresh.safetensors"))
        save_file({k: v.contiguous() for k, v in after.items()}, str(out_dir / "after.safetensors"))
        save_file(merged, str(out_dir / "hf.safetensors"))
    dist.barrier()


if __name__ == "__main__":
    for pair in sys.argv[2:]:
        name, directory = pair.split("=", 1)
        main(name, Path(directory), Path(sys.argv[1]) / name)
