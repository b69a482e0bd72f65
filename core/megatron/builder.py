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
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from model_support.core.checkpoint import TextCheckpoint
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
# Local-spec parameter name -> the transformer-engine spec name megatron-bridge mappings use.
_TE_NAMES = (
    (".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight"),
    (".self_attention.in_proj.layer_norm_weight", ".input_layernorm.weight"),
    (".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight"),
)


class MegatronBuildError(ModelSupportError):
    """The Megatron model could not be built or filled from the checkpoint."""


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


@dataclass(frozen=True)
class Numerics:
    """How the model under test is built: the trainer's way on a GPU, the portable way on a CPU.

    GPU: bf16 parameters, megatron-core's own ``GatedDeltaNet`` with its recurrence on the kernel the
    runtime policy selects, the MoE router in fp32. CPU: fp32 and :class:`LocalGatedDeltaNet` (megatron-core's
    ``GatedDeltaNet`` needs fla and CUDA).
    """

    dtype: torch.dtype
    device: torch.device
    gdn_module: str  # "megatron-core GatedDeltaNet" or "LocalGatedDeltaNet"
    gdn_kernel: str  # a name from model_support.kernels.backend.BACKENDS
    gdn_reason: str  # why that module and kernel

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self, gdn: bool) -> str:
        text = f"{self.dtype_name} on {self.device.type}, attention SDPAttention"
        if gdn:
            text += f", GDN {self.gdn_module} with kernel {self.gdn_kernel} ({self.gdn_reason})"
        return text


def choose_numerics(
    gdn_backend: str = "auto", device_: torch.device | None = None, dtype: torch.dtype | None = None
) -> Numerics:
    """The build for ``device_`` (default: the current device); ``gdn_backend`` is the handler's runtime policy.

    ``dtype`` overrides the device's training dtype (bf16 on a GPU, fp32 on a CPU), e.g. to check the bf16
    comparison on a CPU or to look for a bug without bf16 rounding on a GPU.
    """
    from model_support.kernels.backend import check_backend, select_backend

    where = device_ or device()
    if gdn_backend == "auto":
        choice = select_backend(where, need_backward=True)
        kernel, reason = choice.name, choice.reason
    else:
        check_backend(gdn_backend, where, need_backward=True)
        kernel, reason = gdn_backend, "the handler's runtime policy names it"
    if where.type != "cuda":
        return Numerics(dtype or torch.float32, where, "LocalGatedDeltaNet", kernel, reason)
    from megatron.core.ssm.gated_delta_net import HAVE_FLA

    if HAVE_FLA:
        return Numerics(dtype or torch.bfloat16, where, "megatron-core GatedDeltaNet", kernel, reason)
    return Numerics(
        dtype or torch.bfloat16,
        where,
        "LocalGatedDeltaNet",
        kernel,
        f"{reason}; flash-linear-attention is not installed, which megatron-core's GatedDeltaNet needs",
    )


@dataclass
class MegatronModel:
    """A built megatron-core model with what is needed to convert to and from HF."""

    model: torch.nn.Module
    provider: Any
    bridge: Any  # the family's MegatronModelBridge
    checkpoint: TextCheckpoint
    tensor_parallel: int
    numerics: Numerics
    mapped: dict[str, str] = field(default_factory=dict)  # Megatron param -> HF tensor names it came from


def text_architecture(config: Any) -> str:
    arch = (getattr(config, "architectures", None) or [""])[0]
    return arch.replace("ForConditionalGeneration", "ForCausalLM")


def load_layer_spec(path: str) -> Callable[..., Any]:
    """The function a handler's ``megatron_layer_spec`` ("package.module:function") names."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise MegatronBuildError(f"the handler's megatron_layer_spec {path!r} cannot be loaded: {exc}") from exc


def _configure(
    provider: Any,
    tensor_parallel: int,
    numerics: Numerics,
    *,
    gdn: bool,
    mtp: bool,
    layer_spec: Callable[..., Any] | None = None,
) -> None:
    for name in _FUSIONS_OFF:
        setattr(provider, name, False)
    provider.use_cpu_initialization = numerics.device.type != "cuda"
    provider.perform_initialization = False
    provider.params_dtype = numerics.dtype
    provider.bf16 = numerics.dtype == torch.bfloat16
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
        provider.moe_router_dtype = "fp32"  # as RL trainers run the router; a no-op for an fp32 model
        provider.moe_enable_routing_replay = True  # lets a check replay the reference's routing (R3)
    from model_support.core.megatron.spec import gpt_layer_spec, hybrid_block_spec

    if layer_spec is not None:
        provider.transformer_layer_spec = layer_spec
    elif gdn:
        routed = numerics.gdn_module == "megatron-core GatedDeltaNet"
        provider.transformer_layer_spec = functools.partial(
            hybrid_block_spec, gdn_kernel=numerics.gdn_kernel if routed else None
        )
    else:
        provider.transformer_layer_spec = gpt_layer_spec


def build_megatron_model(
    model_dir: Path,
    config: Any,
    *,
    tensor_parallel: int = 1,
    mtp: bool = False,
    numerics: Numerics | None = None,
    layer_spec: str | None = None,
) -> MegatronModel:
    """Build the language model of ``model_dir`` in megatron-core and load its weights through the bridge.

    ``mtp=False`` (training with a handler whose runtime policy disables MTP) builds no multi-token
    prediction layers whatever the config declares. ``numerics`` defaults to :func:`choose_numerics`.
    ``layer_spec`` is a handler's ``megatron_layer_spec`` (default: the local spec of :mod:`.spec`).
    """
    import_bridge()
    init_parallel(tensor_parallel)
    numerics = numerics or choose_numerics()
    from megatron.bridge import AutoBridge
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router_replay import RouterReplay

    tcfg = copy.deepcopy(text_config(config))
    tcfg.architectures = [text_architecture(config)]
    try:
        model_bridge = AutoBridge.from_hf_config(tcfg)._model_bridge
    except ValueError as exc:
        raise MegatronBuildError(f"megatron-bridge has no bridge for {tcfg.architectures[0]}: {exc}") from exc
    checkpoint = TextCheckpoint(Path(model_dir), tcfg)
    shim = SimpleNamespace(config=tcfg, state=checkpoint, generation_config=None)
    model_bridge.hf_pretrained = shim
    provider = model_bridge.provider_bridge(shim)
    gdn = provider.experimental_attention_variant == "gated_delta_net"
    spec_fn = load_layer_spec(layer_spec) if layer_spec else None
    _configure(provider, tensor_parallel, numerics, gdn=gdn, mtp=mtp, layer_spec=spec_fn)
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    # One RouterReplay per router of the model being built (the class keeps a process-wide list).
    RouterReplay.clear_global_router_replay_instances()
    model = provider.provide().to(numerics.device)
    if numerics.device.type != "cuda":
        _keep_on_cpu(model)
    built = MegatronModel(model, provider, model_bridge, checkpoint, tensor_parallel, numerics)
    _load_weights(built)
    return built


def _keep_on_cpu(model: torch.nn.Module) -> None:
    """Stop megatron-core from moving tensors to ``torch.cuda.current_device()`` when there is no GPU.

    RotaryEmbedding.get_emb moves ``inv_freq`` and TopKRouter.gating moves the router weight to CUDA
    whenever they sit on the CPU; every rotary embedding of the model (a family may keep several, e.g. one
    per attention kind) and every router get an instance-level CPU version of the same computation.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.moe.moe_utils import router_gating_linear
    from megatron.core.transformer.moe.router import TopKRouter

    for rope in (m for m in model.modules() if isinstance(m, RotaryEmbedding)):

        def get_emb(max_seq_len: int, offset: int = 0, rope: RotaryEmbedding = rope) -> torch.Tensor:
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
    AutoMapping.register_module_type("RoutedGatedDeltaNet", "column")
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
        if built.tensor_parallel > 1 and built.numerics.device.type != "cuda":
            _replicate_locally(mapping, module)
        try:
            value = mapping.hf_to_megatron(hf_weights, module)
        except Exception as exc:  # the bridge's own errors do not name the tensor
            shapes = (
                {k: tuple(v.shape) for k, v in hf_weights.items()}
                if isinstance(hf_weights, dict)
                else tuple(hf_weights.shape)
            )
            raise MegatronBuildError(
                f"{name}: cannot convert {', '.join(hf_names)} {shapes} from {built.checkpoint.source_dir} "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); does the checkpoint "
                "match its config.json?"
            ) from None
        if tuple(value.shape) != tuple(param.shape):
            raise MegatronBuildError(f"{name}: bridge produced {tuple(value.shape)}, model has {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        built.mapped[name] = ", ".join(hf_names)
    if missing:
        raise MegatronBuildError(f"{len(missing)} Megatron parameter(s) have no bridge mapping: {missing[:4]}")
