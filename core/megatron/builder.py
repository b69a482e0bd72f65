"""HF model directory -> megatron-core GPTModel, through megatron-bridge.

The bridge of the model family (found by architecture, e.g. ``Qwen3Bridge``, ``Qwen35MoEBridge``) turns
the HF config into a ``GPTModelProvider`` and owns the weight mappings (fused QKV by query group,
gate/up merge, per-expert mappings, GDN in_proj / conv1d / zero-centred norms). This module only

* reads the language-model part of the checkpoint (:class:`TextCheckpoint`: a multimodal checkpoint's
  ``model.language_model.*`` tensors under the text model's own names),
* builds the model with the local (transformer-engine free) spec, MTP disabled, fusions off on CPU,
* and feeds every Megatron parameter from the bridge's own mapping, translating local-spec parameter
  names to the transformer-engine names the mappings use in one place (:func:`mapping_name`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from model_support.core.errors import ModelSupportError
from model_support.core.layout import text_config
from model_support.core.megatron.dist import device, init_parallel
from model_support.core.megatron.imports import import_bridge

# Fusions that need transformer-engine, apex or megatron's CUDA extensions, none of which the local spec
# path assumes (on CPU none of them could run at all).
_FUSIONS_OFF = (
    "gradient_accumulation_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "apply_rope_fusion",
    "moe_permute_fusion",
)
_VL_PREFIX = "model.language_model."
# Local-spec parameter name -> the transformer-engine spec name megatron-bridge mappings use.
_TE_NAMES = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".self_attention.in_proj.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
)


class MegatronBuildError(ModelSupportError):
    """The Megatron model could not be built or filled from the checkpoint."""


class TextCheckpoint:
    """The language-model tensors of a safetensors checkpoint, under text-model names.

    Acts as the ``hf_pretrained`` a megatron-bridge model bridge expects (``config``, ``state[name]``,
    ``state.source.get_all_keys()``). For a multimodal checkpoint (``model.language_model.*``),
    ``model.X`` names are served from ``model.language_model.X``; vision and MTP tensors are dropped.
    """

    def __init__(self, model_dir: Path, config: Any) -> None:
        from safetensors import safe_open

        self.config = config
        index = model_dir / "model.safetensors.index.json"
        files = (
            sorted({model_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
            if index.exists()
            else sorted(model_dir.glob("*.safetensors"))
        )
        if not files:
            raise MegatronBuildError(f"no safetensors weights in {model_dir}")
        self._where: dict[str, tuple[Path, str]] = {}
        raw: dict[str, Path] = {}
        for path in files:
            with safe_open(path, "pt") as f:
                raw.update(dict.fromkeys(f.keys(), path))
        multimodal = any(k.startswith(_VL_PREFIX) for k in raw)
        for key, path in raw.items():
            if multimodal and key.startswith(_VL_PREFIX):
                self._where["model." + key[len(_VL_PREFIX) :]] = (path, key)
            elif key.startswith(("model.", "lm_head.")) and not (multimodal and key.startswith("model.")):
                self._where[key] = (path, key)
        self.multimodal = multimodal
        self.state = self
        self.source = self

    def get_all_keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path, key = self._where[name]
        with safe_open(path, "pt") as f:
            return f.get_tensor(key)


def mapping_name(local_name: str, has_mapping: Any) -> str:
    """The name under which the bridge maps a local-spec parameter (TE-spec alias where needed)."""
    if has_mapping(local_name):
        return local_name
    for te_suffix, local_suffix in _TE_NAMES:
        if local_name.endswith(local_suffix):
            alias = local_name[: -len(local_suffix)] + te_suffix
            if has_mapping(alias):
                return alias
    return local_name


@dataclass
class MegatronModel:
    """A built megatron-core model with what is needed to convert to and from HF."""

    model: torch.nn.Module
    provider: Any
    bridge: Any  # the family's MegatronModelBridge
    checkpoint: TextCheckpoint
    tensor_parallel: int
    mapped: dict[str, str] = field(default_factory=dict)  # Megatron param -> HF tensor names it came from


def _text_architecture(config: Any) -> str:
    arch = (getattr(config, "architectures", None) or [""])[0]
    return arch.replace("ForConditionalGeneration", "ForCausalLM")


def _configure(provider: Any, tensor_parallel: int, *, gdn: bool, mtp: bool) -> None:
    for name in _FUSIONS_OFF:
        setattr(provider, name, False)
    provider.use_cpu_initialization = not torch.cuda.is_available()
    provider.perform_initialization = False
    provider.params_dtype = torch.float32
    provider.bf16 = False
    provider.fp16 = False
    provider.tensor_model_parallel_size = tensor_parallel
    provider.sequence_parallel = False
    if not mtp:  # the bridge sets it from the config (top level or text_config, either field name)
        provider.mtp_num_layers = None
    if provider.num_moe_experts:
        provider.moe_grouped_gemm = False  # SequentialMLP: per-expert linear modules (local spec)
        provider.moe_token_dispatcher_type = "allgather"  # alltoall allocates a CUDA stream
        provider.moe_aux_loss_coeff = 0.0
        provider.moe_router_load_balancing_type = "none"
    from model_support.core.megatron.spec import gpt_layer_spec, hybrid_block_spec

    provider.transformer_layer_spec = hybrid_block_spec if gdn else gpt_layer_spec


def build_megatron_model(model_dir: Path, config: Any, *, tensor_parallel: int = 1, mtp: bool = False) -> MegatronModel:
    """Build the language model of ``model_dir`` in megatron-core and load its weights through the bridge.

    ``mtp=False`` (training with a handler whose runtime policy disables MTP) builds no multi-token
    prediction layers whatever the config declares.
    """
    import_bridge()
    init_parallel(tensor_parallel)
    from megatron.bridge import AutoBridge
    from megatron.core.process_groups_config import ProcessGroupCollection

    tcfg = copy.deepcopy(text_config(config))
    tcfg.architectures = [_text_architecture(config)]
    try:
        model_bridge = AutoBridge.from_hf_config(tcfg)._model_bridge
    except ValueError as exc:
        raise MegatronBuildError(f"megatron-bridge has no bridge for {tcfg.architectures[0]}: {exc}") from exc
    checkpoint = TextCheckpoint(Path(model_dir), tcfg)
    shim = SimpleNamespace(config=tcfg, state=checkpoint, generation_config=None)
    model_bridge.hf_pretrained = shim
    provider = model_bridge.provider_bridge(shim)
    gdn = provider.experimental_attention_variant == "gated_delta_net"
    _configure(provider, tensor_parallel, gdn=gdn, mtp=mtp)
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    model = provider.provide().to(device())
    if not torch.cuda.is_available():
        _keep_on_cpu(model)
    built = MegatronModel(model, provider, model_bridge, checkpoint, tensor_parallel)
    _load_weights(built)
    return built


def _keep_on_cpu(model: torch.nn.Module) -> None:
    """Stop megatron-core from moving tensors to ``torch.cuda.current_device()`` when there is no GPU.

    RotaryEmbedding.get_emb moves ``inv_freq`` and TopKRouter.gating moves the router weight to CUDA
    whenever they sit on the CPU; both get an instance-level CPU version of the same computation.
    """
    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    from megatron.core.transformer.moe.router import TopKRouter

    rope = getattr(model, "rotary_pos_emb", None)
    if rope is not None:

        def get_emb(max_seq_len: int, offset: int = 0) -> torch.Tensor:
            freqs = rope.get_freqs_non_repeated(max_seq_len, offset)
            if rope.rotary_interleaved:
                emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
            else:
                emb = torch.cat((freqs, freqs), dim=-1)
            return emb[:, None, None, :]

        rope.get_emb = get_emb
    for router in (m for m in model.modules() if isinstance(m, TopKRouter)):

        def gating(x: torch.Tensor, router: TopKRouter = router) -> torch.Tensor:
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(router.config.moe_router_dtype, x.dtype)
            return router_gating_linear(x, router.weight, router.bias, dtype)

        router.gating = gating


def _replicate_locally(mapping: Any, module: torch.nn.Module) -> None:
    """On CPU, let a replicated parameter take the checkpoint tensor every rank has read itself.

    megatron-bridge's ReplicatedMapping broadcasts from TP rank 0 after moving the tensor to
    ``torch.cuda.current_device()``; without a GPU each rank reads the same tensor from the checkpoint.
    """
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, ReplicatedMapping

    if isinstance(mapping, AutoMapping) and mapping._mapping is None:
        mapping._detected_type = mapping._detect_parallelism_type(module)
        mapping._mapping = mapping._get_or_create_mapping(mapping._detected_type)
    target = mapping._mapping if isinstance(mapping, AutoMapping) else mapping
    if isinstance(target, ReplicatedMapping):
        target.hf_to_megatron = lambda weights, _module: weights


def _load_weights(built: MegatronModel) -> None:
    """Fill every parameter from the checkpoint with the bridge's mapping; fail on anything unmapped."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping
    from megatron.bridge.models.conversion.utils import get_module_and_param_from_name

    # How megatron-bridge shards parameters of our local modules under tensor parallelism.
    AutoMapping.register_module_type("LocalGatedDeltaNet", "column")
    AutoMapping.register_module_type("ZeroCenteredRMSNorm", "replicated")
    registry = built.bridge.mapping_registry()
    registry.set_process_groups_from_pg_collection(built.provider._pg_collection)

    def lookup(name: str) -> Any:
        return registry.megatron_to_hf_lookup(name)

    missing: list[str] = []
    for name, param in built.model.named_parameters():
        mapping = lookup(mapping_name(name, lookup))
        if mapping is None:
            missing.append(name)
            continue
        hf_names = [mapping.hf_param] if isinstance(mapping.hf_param, str) else list(mapping.hf_param.values())
        absent = [n for n in hf_names if n not in built.checkpoint]
        if absent:
            missing.append(f"{name} (checkpoint lacks {absent[0]})")
            continue
        if isinstance(mapping.hf_param, str):
            hf_weights = built.checkpoint[mapping.hf_param]
        else:
            hf_weights = {k: built.checkpoint[v] for k, v in mapping.hf_param.items()}
        module, _ = get_module_and_param_from_name([built.model], name)
        if not hasattr(module, "config"):
            module.config = built.provider
        if built.tensor_parallel > 1 and not torch.cuda.is_available():
            _replicate_locally(mapping, module)
        value = mapping.hf_to_megatron(hf_weights, module)
        if tuple(value.shape) != tuple(param.shape):
            raise MegatronBuildError(f"{name}: bridge produced {tuple(value.shape)}, model has {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        built.mapped[name] = ", ".join(hf_names)
    if missing:
        raise MegatronBuildError(f"{len(missing)} Megatron parameter(s) have no bridge mapping: {missing[:4]}")
