"""Standard LoRA target sets, shared by the handlers of Qwen-style decoder families.

Megatron names are the leaf module names of megatron-core's GPT / hybrid layers; HF names are the
PEFT ``target_modules`` an adapter on disk uses.
"""

from model_support.core.spec import LoraTarget, TargetScope

ATTENTION = (
    LoraTarget("linear_qkv", ("q_proj", "k_proj", "v_proj"), TargetScope.ATTENTION),
    LoraTarget("linear_proj", ("o_proj",), TargetScope.ATTENTION),
)
DENSE_MLP = (
    LoraTarget("linear_fc1", ("gate_proj", "up_proj"), TargetScope.MLP),
    LoraTarget("linear_fc2", ("down_proj",), TargetScope.MLP),
)
EXPERTS = (
    LoraTarget("linear_fc1", ("gate_proj", "up_proj"), TargetScope.EXPERT),
    LoraTarget("linear_fc2", ("down_proj",), TargetScope.EXPERT),
)
SHARED_EXPERT = (
    LoraTarget("linear_fc1", ("gate_proj", "up_proj"), TargetScope.SHARED_EXPERT),
    LoraTarget("linear_fc2", ("down_proj",), TargetScope.SHARED_EXPERT),
)
GATED_DELTANET = (
    LoraTarget("in_proj", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), TargetScope.GDN),
    LoraTarget("out_proj", ("out_proj",), TargetScope.GDN),
)
