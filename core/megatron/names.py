"""Parameter names across parallel ranks: what one rank's model chunk calls a parameter, as the whole single-rank
model names it.

Its own module, below ``builder.py`` and the modules the build calls (``features.py``, ``lora.py``), so that they
need not import the builder for it.
"""

from __future__ import annotations

import re

import torch

_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)")
_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\.)")


def global_name(chunk: torch.nn.Module, local_name: str) -> str:
    """A parameter name of one model chunk as the whole single-rank model names it: the layer index of this pipeline
    stage replaced by the global one, the local expert index by the global one (expert parallelism).

    (megatron-bridge does the same in a private helper, ``_megatron_local_name_to_global``.)
    """
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        layers = chunk.decoder.layers
        # megatron-core numbers a stage's layers globally (from 1) in ``layer_number``.
        local_name = _LAYER.sub(lambda m: f"{m[1]}{layers[int(m[2])].layer_number - 1}{m[3]}", local_name)
    ep = parallel_state.get_expert_model_parallel_world_size()
    experts = getattr(getattr(chunk, "config", None), "num_moe_experts", None)
    if ep == 1 or not experts:
        return local_name
    # Megatron gives each expert-parallel rank a contiguous block of num_experts / ep experts.
    offset = parallel_state.get_expert_model_parallel_rank() * (experts // ep)
    return _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{int(m[2]) + offset}{m[3]}", local_name)
