"""Llama dense decoders (Llama 2, Llama 3.x): GQA attention without q/k norm, SwiGLU MLP."""

from pathlib import Path

from model_support.core import targets
from model_support.core.codecs import BridgeLoraCodec
from model_support.core.spec import DependencyFloor, HandlerSpec, Topology, VllmLora

# meta-llama/Llama-3.2-1B's config.json: 16 layers, hidden 2048, 32 heads / 8 KV heads, llama3 RoPE scaling.
REFERENCE_CONFIG = Path(__file__).with_name("llama-3.2-1b.json")

LLAMA = HandlerSpec(
    name="llama",
    description="Llama dense decoder (GQA attention, SwiGLU MLP, llama3 RoPE scaling).",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    topology=Topology.DENSE,
    # The same module names as Qwen3 dense: q/k/v/o_proj fused into linear_qkv, gate/up into linear_fc1.
    lora_targets=targets.ATTENTION + targets.DENSE_MLP,
    vllm_lora=VllmLora(native=True, reason="vLLM's LlamaForCausalLM implements SupportsLoRA"),
    # LoRA splits derived from LlamaBridge's own mappings (QKV by query group, [gate; up]).
    codec=BridgeLoraCodec("llama"),
    dependencies=(
        DependencyFloor("transformers", "4.43.0", "llama3 RoPE scaling of Llama 3.1+ configs"),
        DependencyFloor("megatron-bridge", "0.6.2", "LlamaBridge weight mappings", extra="megatron"),
    ),
    reference_config=REFERENCE_CONFIG,
)
