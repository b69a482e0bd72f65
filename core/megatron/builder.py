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

import contextlib
import copy
import functools
import importlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model_support.core.checkpoint import TextCheckpoint
from model_support.core.environment import environment
from model_support.core.errors import ModelSupportError
from model_support.core.layout import text_config
from model_support.core.megatron.dist import ParallelLayout, device, init_parallel
from model_support.core.megatron.imports import import_bridge
from model_support.core.megatron.names import global_name
from model_support.core.megatron.state_source import hf_pretrained

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


class UnimplementedFeatureError(MegatronBuildError):
    """The config or the checkpoint asks for a feature (a sliding window, rope scaling, a tensor such as attention
    sinks) the built model does not implement."""


# A grouped-GEMM expert weight's name (`weight*`: one tensor per expert) and the per-expert SequentialMLP name of the
# same linear; both name the experts in the same order (layer, expert), so a mapping serves either unchanged.
_GROUPED_EXPERTS = re.compile(r"^(?P<head>.*\.mlp\.experts)\.(?P<fc>linear_fc\d+)\.weight\*$")


def mapping_registry(model_bridge: Any) -> Any:
    """The bridge's mapping registry, with per-expert (SequentialMLP) names for every expert mapping.

    Several bridges map routed experts only under the grouped-GEMM names (``mlp.experts.linear_fc1.weight*``), while
    the local spec builds per-expert modules (``mlp.experts.local_experts.<e>.linear_fc1.weight``). For each such
    mapping lacking its per-expert twin, a copy under the per-expert name is added: the same mapping class with the
    same HF tensors.
    """
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

    mappings = list(model_bridge.mapping_registry().mappings)
    names = {m.megatron_param for m in mappings}
    derived = []
    for mapping in mappings:
        match = _GROUPED_EXPERTS.match(mapping.megatron_param)
        if not match:
            continue
        local = f"{match['head']}.local_experts.*.{match['fc']}.weight"
        if local not in names:
            twin = copy.copy(mapping)
            twin.megatron_param = local
            derived.append(twin)
    return MegatronMappingRegistry(*mappings, *derived)


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
    """A built megatron-core model with what is needed to convert to and from HF.

    ``chunks`` are this rank's model chunks: one, or one per virtual pipeline stage (in order).
    """

    chunks: list[torch.nn.Module]
    provider: Any
    bridge: Any  # the family's MegatronModelBridge
    checkpoint: TextCheckpoint
    parallel: ParallelLayout
    numerics: Numerics
    mapped: dict[str, str] = field(default_factory=dict)  # Megatron param -> HF tensor names it came from

    @property
    def tensor_parallel(self) -> int:
        return self.parallel.tensor_parallel

    @property
    def model(self) -> torch.nn.Module:
        """This rank's model, in every layout without virtual pipeline stages (those have several :attr:`chunks`)."""
        if len(self.chunks) != 1:
            raise MegatronBuildError(
                f"the model has {len(self.chunks)} chunks on this rank (layout {self.parallel.name}): use .chunks"
            )
        return self.chunks[0]


def text_architecture(config: Any) -> str:
    arch = (getattr(config, "architectures", None) or [""])[0]
    return arch.replace("ForConditionalGeneration", "ForCausalLM")


def family_bridge(config: Any) -> tuple[Any, Any]:
    """(megatron-bridge's bridge of the family, the text config it reads) for a transformers config (the text model
    of a multimodal one)."""
    import_bridge()
    from megatron.bridge import AutoBridge

    tcfg = copy.deepcopy(text_config(config))
    tcfg.architectures = [text_architecture(config)]
    # The bridge would look up the class a config's ``auto_map`` names (remote code, which is never run here);
    # transformers and vLLM build the built-in class of ``architectures``, and that is the model checked.
    tcfg.auto_map = None
    try:
        return AutoBridge.from_hf_config(tcfg)._model_bridge, tcfg
    except ValueError as exc:
        raise MegatronBuildError(f"megatron-bridge has no bridge for {tcfg.architectures[0]}: {exc}") from None


def load_layer_spec(path: str) -> Callable[..., Any]:
    """The function a handler's ``megatron_layer_spec`` ("package.module:function") names."""
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise MegatronBuildError(f"the handler's megatron_layer_spec {path!r} cannot be loaded: {exc}") from exc


def _configure(
    provider: Any,
    parallel: ParallelLayout,
    numerics: Numerics,
    *,
    gdn: bool,
    mtp: bool,
    layer_spec: Callable[..., Any] | None = None,
    recompute: bool = False,
) -> None:
    for name in _FUSIONS_OFF:
        setattr(provider, name, False)
    provider.use_cpu_initialization = numerics.device.type != "cuda"
    provider.perform_initialization = False
    if recompute:  # in training mode each decoder layer keeps only its input and runs again in the backward
        provider.recompute_granularity = "full"
        provider.recompute_method = "uniform"
        provider.recompute_num_layers = 1
    provider.params_dtype = numerics.dtype
    provider.bf16 = numerics.dtype == torch.bfloat16
    provider.fp16 = False
    provider.tensor_model_parallel_size = parallel.tensor_parallel
    provider.sequence_parallel = parallel.sequence_parallel
    provider.pipeline_model_parallel_size = parallel.pipeline_parallel
    provider.virtual_pipeline_model_parallel_size = parallel.virtual_pipeline if parallel.virtual_pipeline > 1 else None
    provider.context_parallel_size = parallel.context_parallel
    provider.pipeline_dtype = numerics.dtype
    provider.batch_p2p_sync = numerics.device.type == "cuda"  # a CUDA synchronize after pipeline sends
    provider.expert_model_parallel_size = parallel.expert_parallel
    provider.expert_tensor_parallel_size = parallel.expert_tensor_parallel
    if not mtp:  # the bridge sets it from the config (top level or text_config, either field name)
        provider.mtp_num_layers = None
    if provider.num_moe_experts:
        provider.moe_grouped_gemm = False  # SequentialMLP: per-expert linear modules (local spec)
        provider.moe_token_dispatcher_type = "allgather"  # alltoall allocates a CUDA stream
        provider.moe_shared_expert_overlap = False  # megatron-core overlaps only with alltoall / flex dispatch
        provider.moe_aux_loss_coeff = 0.0
        provider.moe_router_load_balancing_type = "none"
        provider.moe_router_dtype = "fp32"  # as RL trainers run the router; a no-op for an fp32 model
        provider.moe_enable_routing_replay = True  # lets a check replay the reference's routing (R3)
    from model_support.core.megatron.spec import gpt_block_spec, hybrid_block_spec

    if layer_spec is not None:
        provider.transformer_layer_spec = layer_spec
    elif gdn:
        routed = numerics.gdn_module == "megatron-core GatedDeltaNet"
        provider.transformer_layer_spec = functools.partial(
            hybrid_block_spec, gdn_kernel=numerics.gdn_kernel if routed else None
        )
    else:
        provider.transformer_layer_spec = gpt_block_spec


def build_megatron_model(
    model_dir: Path,
    config: Any,
    *,
    parallel: ParallelLayout | None = None,
    mtp: bool = False,
    numerics: Numerics | None = None,
    layer_spec: str | None = None,
    recompute: bool = False,
) -> MegatronModel:
    """Build the language model of ``model_dir`` in megatron-core and load its weights through the bridge.

    ``mtp=False`` (training with a handler whose runtime policy disables MTP) builds no multi-token
    prediction layers whatever the config declares. ``numerics`` defaults to :func:`choose_numerics`.
    ``layer_spec`` is a handler's ``megatron_layer_spec`` (default: the local spec of :mod:`.spec`).
    ``recompute``: megatron-core's full activation recompute, one layer at a time (in training mode).
    """
    import_bridge()
    parallel = parallel or ParallelLayout()
    init_parallel(parallel)
    numerics = numerics or choose_numerics()
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router_replay import RouterReplay

    model_bridge, tcfg = family_bridge(config)
    checkpoint = TextCheckpoint(Path(model_dir), tcfg)
    shim = hf_pretrained(tcfg, checkpoint)
    model_bridge.hf_pretrained = shim
    provider = model_bridge.provider_bridge(shim)
    gdn = provider.experimental_attention_variant == "gated_delta_net"
    spec_fn = load_layer_spec(layer_spec) if layer_spec else None
    _configure(provider, parallel, numerics, gdn=gdn, mtp=mtp, layer_spec=spec_fn, recompute=recompute)
    provider.finalize()
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    # One RouterReplay per router of the model being built (the class keeps a process-wide list).
    RouterReplay.clear_global_router_replay_instances()
    stages = [None] if parallel.virtual_pipeline == 1 else list(range(parallel.virtual_pipeline))
    chunks = []
    with _te_attention_env_kept():
        for vp_stage in stages:
            if numerics.device.type == "cuda":
                chunks.append(provider.provide(vp_stage=vp_stage).to(numerics.device))
            else:
                with _cpu_as_current_device():
                    chunks.append(provider.provide(vp_stage=vp_stage).to(numerics.device))
                _keep_on_cpu(chunks[-1])
    from model_support.core.megatron.features import unimplemented

    ignored = unimplemented(tcfg, chunks)
    if ignored:  # a model that computes the checkpoint's function on short rows only must not train
        raise UnimplementedFeatureError("; ".join(ignored))
    if recompute:
        for chunk in chunks:
            _embedding_output_takes_grad(chunk)
    built = MegatronModel(chunks, provider, model_bridge, checkpoint, parallel, numerics)
    _load_weights(built)
    unread = _unread_tensors(built, mtp)
    if unread:  # a checkpoint tensor no built parameter takes (attention sinks, a bias) changes what the model computes
        raise UnimplementedFeatureError(
            f"the built model reads {len(unread)} checkpoint tensor(s) into no parameter: {', '.join(unread[:3])}"
            f"{' ...' if len(unread) > 3 else ''}; the layer spec builds no module the bridge maps them to"
        )
    return built


# Checkpoint tensors a model computes nothing from: rotary inverse frequencies some checkpoints keep (recomputed from
# the config) and fp8 scales (read with their weights by the bridge's dequantising read).
_DERIVED = re.compile(r"(\.rotary_emb\.inv_freq|_scale_inv)$")


def _unread_tensors(built: MegatronModel, mtp: bool) -> list[str]:
    """The checkpoint's text-model tensors no parameter of the build was filled from (a single-stage, single-expert-
    rank build holds every layer and expert; MTP layers past the decoder count only where MTP is built)."""
    if built.parallel.pipeline_parallel > 1 or built.parallel.expert_parallel > 1:
        return []
    read = {name for names in built.mapped.values() for name in names.split(", ")}
    if built.provider.share_embeddings_and_output_weights:  # a checkpoint may keep the tied head's copy
        read.add("lm_head.weight")
    layers = built.provider.num_layers
    return sorted(
        name
        for name in built.checkpoint
        if name not in read
        and not _DERIVED.search(name)
        and (mtp or (layer := built.checkpoint.layer_of(name)) is None or layer < layers)
    )


_TE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@contextlib.contextmanager
def _te_attention_env_kept() -> Iterator[None]:
    """Build with transformer-engine's attention switches unset, and leave them as they were.

    megatron-core's language model asserts those process-wide variables agree with the provider's attention backend
    and then sets them; one family's provider (Gemma 3: flash) would then refuse to build after another's (auto), in
    one process or in the processes it starts. The local spec runs no transformer-engine attention either way.
    """
    with environment(**dict.fromkeys(_TE_ATTENTION_ENV)):
        yield


def _embedding_output_takes_grad(chunk: torch.nn.Module) -> None:
    """Mark the embedding's output as needing a gradient. megatron-core's recompute is an autograd function over
    each layer's inputs: with the embedding frozen (LoRA) none of them needs a gradient, so the layers' adapters
    would get none (what transformers' ``enable_input_require_grads`` does for its own checkpointing)."""
    embedding = getattr(chunk, "embedding", None)
    if embedding is not None:
        embedding.register_forward_hook(lambda _m, _a, out: out.requires_grad_(torch.is_grad_enabled()))


@contextlib.contextmanager
def _cpu_as_current_device() -> Iterator[None]:
    """Let megatron-core code that assumes a GPU run on the CPU: ``torch.cuda.current_device()`` names the CPU,
    ``Tensor.cuda()`` keeps a tensor where it is, ``torch.zeros(..., device="cuda")`` allocates on the CPU.

    megatron-core places some tensors on the current CUDA device whatever the model's device: TopKRouter's
    expert-bias buffers at construction, RotaryEmbedding / YarnRotaryEmbedding's inverse frequencies and
    TopKRouter's weight in their forward, pipeline communication buffers; its schedules count tokens in
    ``torch.zeros(device="cuda")`` tensors, and a tied embedding's pipeline copy is synced with ``.cuda()``.
    Activation recompute saves and restores the CUDA RNG states around each recomputed layer: only the CPU's here.
    """
    from megatron.core.tensor_parallel import random as tp_random

    real_device, real_cuda, real_zeros = torch.cuda.current_device, torch.Tensor.cuda, torch.zeros
    real_rng = tp_random._get_all_rng_states, tp_random._set_all_rng_states

    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return real_zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.zeros = zeros
    _rng_states_on_cpu()
    try:
        yield
    finally:
        torch.cuda.current_device, torch.Tensor.cuda, torch.zeros = real_device, real_cuda, real_zeros
        tp_random._get_all_rng_states, tp_random._set_all_rng_states = real_rng


def on_cpu_device(where: torch.device) -> contextlib.AbstractContextManager[None]:
    """:func:`_cpu_as_current_device` for a model on the CPU (megatron-core's schedules and pipeline
    communication allocate on the current CUDA device), nothing for one on a GPU."""
    return _cpu_as_current_device() if where.type == "cpu" else contextlib.nullcontext()


def _on_cpu(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _cpu_as_current_device():
            return method(*args, **kwargs)

    return run


def _keep_on_cpu(model: torch.nn.Module) -> None:
    """Run megatron-core's own rotary embeddings (every one: multi-latent attention has one per layer) and
    router gating with :func:`_cpu_as_current_device`, so their tensors stay on the CPU."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.moe.router import TopKRouter

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.get_emb = _on_cpu(module.get_emb)
        elif isinstance(module, TopKRouter):
            module.gating = _on_cpu(module.gating)
    config = getattr(model, "config", None)
    parallel = config is not None and config.tensor_model_parallel_size * config.expert_model_parallel_size > 1
    parallel |= config is not None and (config.expert_tensor_parallel_size or 1) > 1
    parallel |= config is not None and config.pipeline_model_parallel_size * config.context_parallel_size > 1
    if parallel and not torch.cuda.is_available():
        _collectives_on_cpu()
    if config is not None and config.recompute_granularity and not torch.cuda.is_available():
        # The recompute's backward saves and restores the RNG states outside any call of ours: for good here.
        _rng_states_on_cpu()


def _rng_states_on_cpu() -> None:
    """megatron-core's activation recompute saves the CUDA RNG states with the CPU's before each recomputed layer
    and restores them in the backward; on the CPU there is only the CPU's (module functions, looked up at every
    call)."""
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._get_all_rng_states = lambda: (torch.get_rng_state(), None, {})
    tp_random._set_all_rng_states = lambda cpu, _cuda, _tracker: torch.set_rng_state(cpu)


def _collectives_on_cpu() -> None:
    """megatron-core's tensor-parallel gathers / reduce-scatters (sequence parallelism, the token dispatcher,
    multi-latent attention) allocate their outputs on the current CUDA device, forward and backward; on a host
    without one they get the CPU (module functions, looked up at every call)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, mappings

    for name in (
        "_gather_along_first_dim",
        "_reduce_scatter_along_first_dim",
        "_gather_along_last_dim",
        "_reduce_scatter_along_last_dim",
    ):
        function = getattr(mappings, name)
        if not getattr(function, "on_cpu", False):
            wrapped = _on_cpu(function)
            wrapped.on_cpu = True
            setattr(mappings, name, wrapped)
    # The sequence-parallel embedding forks the model-parallel CUDA RNG around its dropout; the CPU's RNG stands in.
    get_cuda_rng_tracker().fork = lambda *_args, **_kwargs: torch.random.fork_rng(devices=[])
    # The rotary embedding selects this context-parallel rank's positions with an index tensor in pinned memory
    # moved to the GPU; the same selection, on the CPU.
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    from model_support.core.megatron.context_parallel import local_part

    for module in (rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = lambda emb, dim, group: local_part(emb, dim, group.rank(), group.size())


@contextlib.contextmanager
def _replicated_read_locally(mapping: Any, module: torch.nn.Module) -> Iterator[None]:
    """On CPU, while open, a replicated parameter takes the checkpoint tensor every rank has read itself.

    megatron-bridge's ReplicatedMapping broadcasts from TP rank 0 after moving the tensor to
    ``torch.cuda.current_device()``; without a GPU each rank reads the same tensor from the checkpoint. The
    mapping sees a tensor-parallel group of one for the read, so a family's own mapping class (ERNIE 4.5's squeezes
    its expert bias to megatron-core's shape) still converts the tensor; its groups are put back after.
    """
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, ReplicatedMapping

    if isinstance(mapping, AutoMapping) and mapping._mapping is None:
        mapping._detected_type = mapping._detect_parallelism_type(module)
        mapping._mapping = mapping._get_or_create_mapping(mapping._detected_type)
    target = mapping._mapping if isinstance(mapping, AutoMapping) else mapping
    if not isinstance(target, ReplicatedMapping):
        yield
        return
    groups = target._tp_group, target._etp_group
    target._tp_group = target._etp_group = None
    try:
        yield
    finally:
        target._tp_group, target._etp_group = groups


def _mapped_tensors(
    chunks: list[torch.nn.Module], lookup: Callable[[str], Any]
) -> Iterator[tuple[torch.nn.Module, str, torch.Tensor]]:
    """(chunk, local name, tensor) for every parameter, and every persistent buffer the bridge maps."""
    for chunk in chunks:
        persistent = chunk.state_dict(keep_vars=True).keys()
        yield from ((chunk, name, param) for name, param in chunk.named_parameters())
        for name, buffer in chunk.named_buffers():
            if name in persistent and lookup(mapping_name(global_name(chunk, name), lookup)) is not None:
                yield chunk, name, buffer


def _load_weights(built: MegatronModel) -> None:
    """Fill every parameter, and every persistent buffer the bridge maps (e.g. a router's expert bias), from the
    checkpoint with the bridge's mapping; fail on any parameter unmapped."""
    from megatron.bridge.models.conversion.param_mapping import AutoMapping
    from megatron.bridge.models.conversion.utils import get_module_and_param_from_name

    # How megatron-bridge shards parameters of our local modules under tensor parallelism.
    AutoMapping.register_module_type("LocalGatedDeltaNet", "column")
    AutoMapping.register_module_type("RoutedGatedDeltaNet", "column")
    AutoMapping.register_module_type("ZeroCenteredRMSNorm", "replicated")
    AutoMapping.register_module_type("LocalRMSNorm", "replicated")
    AutoMapping.register_module_type("PostNormRowParallelLinear", "row")
    AutoMapping.register_module_type("SDPAttention", "column")  # attention sinks: one per head
    registry = mapping_registry(built.bridge)
    registry.set_process_groups_from_pg_collection(built.provider._pg_collection)

    def lookup(name: str) -> Any:
        return registry.megatron_to_hf_lookup(name)

    missing: list[str] = []
    tied = bool(built.provider.share_embeddings_and_output_weights)
    for chunk, name, param in _mapped_tensors(built.chunks, lookup):
        source = global_name(chunk, name)
        if tied and source == "output_layer.weight":
            # The last pipeline stage's copy of a tied embedding: megatron-core syncs it from the first stage only
            # at construction, before any weight is loaded, so it is read from the embedding's tensor.
            source = "embedding.word_embeddings.weight"
        mapping = lookup(mapping_name(source, lookup))
        if mapping is None:
            missing.append(name)
            continue
        hf_names = [mapping.hf_param] if isinstance(mapping.hf_param, str) else list(mapping.hf_param.values())
        absent = [n for n in hf_names if n not in built.checkpoint]
        if absent:
            missing.append(f"{name} (checkpoint lacks {absent[0]})")
            continue
        # The bridge's own read (dequantises an fp8 checkpoint where its family needs that).
        hf_weights = built.bridge.maybe_modify_loaded_hf_weight(mapping.hf_param, built.checkpoint)
        module, _ = get_module_and_param_from_name([chunk], name)
        if not hasattr(module, "config"):
            module.config = built.provider
        local = built.tensor_parallel > 1 and built.numerics.device.type != "cuda"
        try:
            with _replicated_read_locally(mapping, module) if local else contextlib.nullcontext():
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
        built.mapped[global_name(chunk, name)] = ", ".join(hf_names)
    if missing:
        raise MegatronBuildError(f"{len(missing)} Megatron parameter(s) have no bridge mapping: {missing[:4]}")
