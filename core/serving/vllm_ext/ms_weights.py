"""Loaded into vLLM's worker (``--worker-extension-cls ms_weights.WorkerExtension``); standard library + vLLM only.

Registers ``model_support_local``, a weight-transfer engine written to vLLM's interface
(``vllm.distributed.weight_transfer.base.WeightTransferEngine``; the server runs with
``--weight-transfer-config '{"backend": "model_support_local"}'``) and driven through vLLM's own routes:
``/start_weight_update``, ``/update_weights`` once per message, ``/finish_weight_update``. A bucket comes either as
a local file (the trainer and the server on one machine), as one broadcast from the trainer (rank 0) to every
worker of the server, over NCCL between GPUs (gloo on the CPU build), in a process group the trainer opens once
with ``/init_weight_transfer_engine`` (``{"host", "port", "world_size", "rank_offset", "backend", "timeout_s"}``),
or as a CUDA IPC handle of a buffer on the trainer's GPU when the server shares it.
The group is built on torch's process groups, not vLLM's own NCCL engine: that one needs vLLM in the trainer's
process too, which this project keeps vLLM out of.

One step is, in order:

1. ``{"params": [[name, dtype, shape], ...]}``: every tensor of the step announced (HF names, as the checkpoint
   stores them) before any data;
2. per bucket, ``{"path": "<file>.safetensors", "is_last": bool}`` (the trainer wrote the bucket to a local file,
   in ``/dev/shm`` where there is one; the worker reads it and deletes it) or ``{"bucket": [[name, dtype, shape],
   ...], "nbytes": N, "is_last": bool}`` (the worker receives the bucket's N bytes, its tensors packed in that
   order, from the trainer's broadcast, then reads them out), the same with ``"ipc": {...}`` (the bytes are a
   buffer on the trainer's GPU, opened through its CUDA IPC handle and copied before the message is answered);
   the worker keeps each tensor after checking it against the announcement (a broadcast or IPC bucket on the
   worker's device: the whole step, until the last bucket);
3. on ``is_last`` (every announced tensor received, nothing else) the whole step is loaded in place by the steps
   of vLLM's own ``reload_weights`` (:func:`_reload_in_place`, which the file-system transport's
   ``model_support_reload_weights`` runs too); before that nothing of the step reaches the model, so a failed step
   changes nothing;
4. ``{"abort": true}`` drops a step that will not be completed.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "model_support_local"
# Key prefix of the weight group in the trainer's store (core/serving/update.py opens it under the same one).
STORE_PREFIX = "model_support_weights"


@dataclass
class LocalInitInfo(WeightTransferInitInfo):
    """Where the trainer's weight group is (broadcast buckets); file buckets need none."""

    host: str = ""
    port: int = 0
    world_size: int = 0
    rank_offset: int = 1
    backend: str = "gloo"
    timeout_s: float = 300.0


@dataclass
class LocalUpdateInfo(WeightTransferUpdateInfo):
    params: list[list[Any]] | None = None
    path: str | None = None
    bucket: list[list[Any]] | None = None
    nbytes: int = 0
    ipc: dict[str, Any] | None = None
    is_last: bool = False
    abort: bool = False


@dataclass
class _Step:
    expected: dict[str, tuple[str, tuple[int, ...]]]
    received: dict[str, torch.Tensor] = field(default_factory=dict)


class LocalWeightTransferEngine(WeightTransferEngine[LocalInitInfo, LocalUpdateInfo]):
    init_info_cls = LocalInitInfo
    update_info_cls = LocalUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._step: _Step | None = None
        self._group: Any = None
        self.applied = 0

    def init_transfer_engine(self, init_info: LocalInitInfo) -> None:
        """Join the trainer's weight group (replacing an earlier one): this worker's rank counts the workers of every
        data-parallel replica before it, after the trainer's ranks (``rank_offset``)."""
        import torch.distributed as dist

        wanted = "nccl" if self.device.type == "cuda" else "gloo"
        if init_info.backend != wanted:
            raise ValueError(
                f"the trainer asked for {init_info.backend}; a worker on {self.device.type} takes {wanted}"
            )
        config = self.parallel_config
        rank = getattr(config, "data_parallel_index", 0) * config.world_size + config.rank + init_info.rank_offset
        timeout = timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(init_info.host, init_info.port, init_info.world_size, False, timeout=timeout)
        store = dist.PrefixStore(STORE_PREFIX, store)
        self._group = None
        if wanted == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(store, rank, init_info.world_size, options)
        else:
            self._group = dist.ProcessGroupGloo(store, rank, init_info.world_size, timeout)

    def start_weight_update(self) -> None:
        self._step = None

    def finish_weight_update(self) -> None:
        if self._step is not None:
            missing = len(self._step.expected) - len(self._step.received)
            self._step = None
            raise ValueError(f"the weight update finished with {missing} announced tensor(s) never sent; dropped")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after each message; on the CPU build there is none to wait for.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: LocalUpdateInfo) -> None:
        if update_info.abort:
            self._step = None
            return
        if update_info.params is not None:
            self._step = _Step({str(n): (str(d), tuple(int(x) for x in s)) for n, d, s in update_info.params})
            return
        step = self._step
        try:
            tensors = self._bucket(update_info)  # a broadcast is received even when its bucket cannot be taken
            if step is None:
                raise ValueError("a weight bucket arrived before the step's tensors were announced")
            self._take(step, tensors)
            if update_info.is_last:
                self._apply(step)
        except BaseException:
            self._step = None
            raise

    def _bucket(self, update_info: LocalUpdateInfo) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        if update_info.path is not None:
            try:
                return load_file(update_info.path)
            finally:
                if os.path.exists(update_info.path):
                    os.unlink(update_info.path)
        if update_info.bucket is None:
            raise ValueError("a weight bucket message needs 'path', or 'bucket' and 'nbytes'")
        if update_info.ipc is not None:
            return unpack(self._opened(update_info.ipc, int(update_info.nbytes)), update_info.bucket)
        if self._group is None:
            raise ValueError("a broadcast bucket arrived before /init_weight_transfer_engine opened the weight group")
        packed = torch.empty(int(update_info.nbytes), dtype=torch.uint8, device=self.device)
        self._group.broadcast([packed], _broadcast_root()).wait()
        return unpack(packed, update_info.bucket)

    def _opened(self, ipc: dict[str, Any], nbytes: int) -> torch.Tensor:
        """A copy, on this worker's device, of the trainer's byte buffer that ``ipc`` (``update.ipc_handle``) names."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if self.device.type != "cuda":
            raise ValueError("an IPC bucket came to a worker without a GPU; push with weight_transfer='stream'")
        here = str(torch.cuda.get_device_properties(self.device).uuid)
        if ipc.get("gpu") != here:
            raise ValueError(
                f"the trainer's bucket is on GPU {ipc.get('gpu')}, this worker on {here}: CUDA IPC hands over memory "
                "of one GPU; push with weight_transfer='collective'"
            )

        def raw(key: str) -> bytes | None:
            return None if ipc.get(key) is None else base64.b64decode(ipc[key])

        shared = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(ipc["size"]), tuple(ipc["stride"]), int(ipc["offset"]), torch.TypedStorage,
            torch.uint8, self.device.index, raw("handle"), int(ipc["storage_bytes"]), int(ipc["storage_offset"]),
            False, raw("counter"), int(ipc["counter_offset"]), raw("event"), bool(ipc["event_sync"]),
        )  # fmt: skip
        if shared.numel() != nbytes:
            raise ValueError(f"the IPC buffer holds {shared.numel()} bytes, the message announces {nbytes}")
        copy = shared.clone()
        torch.cuda.synchronize(self.device)  # the copy is complete before the trainer may free its buffer
        del shared  # releases the trainer's buffer (its IPC reference count)
        return copy

    @staticmethod
    def _take(step: _Step, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            if name not in step.expected:
                raise ValueError(f"tensor {name!r} was not announced for this step")
            if name in step.received:
                raise ValueError(f"tensor {name!r} arrived twice")
            dtype, shape = step.expected[name]
            got = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
            if got != (dtype, shape):
                raise ValueError(f"tensor {name!r} is {got[0]} {list(got[1])}, announced {dtype} {list(shape)}")
            step.received[name] = tensor

    def _apply(self, step: _Step) -> None:
        missing = sorted(set(step.expected) - set(step.received))
        if missing:
            raise ValueError(f"the last bucket came with {len(missing)} announced tensor(s) missing: {missing[:3]}")
        received, self._step = step.received, None
        _reload_in_place(self.vllm_config, self.model, received.items())
        self.applied += 1

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """vLLM 0.26 and 0.27 declare this abstract (later releases moved the trainer's side out of the engine): the
        project's trainer side is :mod:`model_support.core.serving.update`, which sends each bucket itself."""
        raise NotImplementedError("model_support_local is sent to by model_support.core.serving.update")

    def shutdown(self) -> None:
        self._step = None
        self._group = None


def unpack(packed: torch.Tensor, header: list[list[Any]]) -> dict[str, torch.Tensor]:
    """The tensors of a packed bucket (``update.pack``: each tensor's bytes in ``header``'s order), as views of it."""
    tensors, offset = {}, 0
    for name, dtype, shape in header:
        kind = getattr(torch, str(dtype), None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"tensor {name!r} has no torch dtype {dtype!r}")
        count = int(torch.Size(shape).numel()) * torch.empty((), dtype=kind).element_size()
        if offset + count > packed.numel():
            raise ValueError(f"a bucket of {packed.numel()} bytes ends inside {name!r}")
        tensors[str(name)] = packed[offset : offset + count].view(kind).reshape(shape)
        offset += count
    if offset != packed.numel():
        raise ValueError(f"a bucket of {packed.numel()} bytes has {packed.numel() - offset} bytes past its tensors")
    return tensors


def _reload_in_place(vllm_config: Any, model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Checkpoint-format weights loaded into the served model in place, by the steps vLLM's own in-place reload
    takes (0.26's model runner and 0.32's ``model_loader.reload.inplace`` alike: ``initialize_layerwise_reload``,
    the model's ``load_weights``, ``finalize_layerwise_reload``), with what a server with LoRA on or fused-MoE
    layers needs around them. vLLM only logs a layer that took none of the weights and keeps its old ones; here that
    is an error naming the layers (the server then serves a mix of old and new weights: restart it)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    with _lora_wrappers_load(model), _experts_named_as_checkpoint(model), _moe_first_load(model):
        initialize_layerwise_reload(model)
        model.load_weights(iter(weights))
        unloaded = _layers_left_unloaded(model, get_layerwise_info)
        finalize_layerwise_reload(model, vllm_config.model_config)
    if unloaded:
        raise ValueError(
            f"the in-place reload left {len(unloaded)} layer(s) on their old weights (none of the step's tensors "
            f"reached them): {unloaded[:3]}; the server now serves a mix of old and new weights, restart it"
        )


def _layers_left_unloaded(model: Any, info_of: Any) -> list[str]:
    """The layers with parameters that took none of the reloaded tensors, between ``load_weights`` and
    ``finalize_layerwise_reload``. Not counted: a layer with buffers only (a rotary cache), an attention layer
    (vLLM derives what it holds, MLA's absorbed projections or an attention's scales, when it finalizes the reload)
    and a layer whose parameters are another loaded layer's (a tied ``lm_head``)."""
    deferred = _deferred_attention()
    waiting: dict[str, list[Any]] = {}
    loaded: set[int] = set()
    for name, layer in model.named_modules():
        info = info_of(layer)
        if not info.can_load():  # processed, its parameters the live ones again
            loaded.update(id(p) for p in layer._parameters.values() if p is not None)
        elif info.load_numel == 0 and info.kernel_tensors and info.kernel_tensors[0] and not deferred(layer):
            waiting[name] = list(info.kernel_tensors[0].values())
    return [name for name, parameters in waiting.items() if not all(id(p) in loaded for p in parameters)]


def _deferred_attention() -> Any:
    """vLLM's test for the attention layers its layerwise reload processes last, at finalize (0.32 names it; 0.26
    tests the two classes)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:
        from vllm.model_executor.layers.attention import Attention, MLAAttention

        return lambda layer: isinstance(layer, (Attention, MLAAttention))
    return is_deferred_attention_layer


@contextlib.contextmanager
def _lora_wrappers_load(model: Any) -> Any:
    """Within the block, each LoRA-wrapped layer (a server with LoRA on) loads checkpoint weights into the layer it
    wraps: vLLM 0.32's ``BaseLayerWithLoRA.load_weights``, which 0.26 lacks (without it the model's loader walks
    past the wrapper and its layer keeps its old weights)."""
    from vllm.lora.layers import BaseLayerWithLoRA

    added = [
        module
        for module in model.modules()
        if isinstance(module, BaseLayerWithLoRA) and not hasattr(type(module), "load_weights")
    ]
    for module in added:
        module.load_weights = functools.partial(_load_into_wrapped, module)
    try:
        yield
    finally:
        for module in added:
            del module.load_weights


@contextlib.contextmanager
def _experts_named_as_checkpoint(model: Any) -> Any:
    """Within the block, fused-MoE experts under a LoRA wrapper take the checkpoint's expert names.

    vLLM's LoRA wrapper of a fused-MoE layer sets ``lora_base_layer_prefix = "base_layer."`` on its routed experts,
    whose own ``load_weights`` (0.26 and 0.32) then matches only checkpoint names with ``.base_layer.`` in them
    (``experts.0.gate_proj.base_layer.``) and skips ``experts.0.gate_proj.weight``: every expert kept its old
    weights after a push (0.344 off on a tiny Qwen3-MoE on the H100). The first load ran before the wrapper existed,
    with no prefix; so does the reload here."""
    wrapped = [
        module
        for module in model.modules()
        if getattr(module, "lora_base_layer_prefix", "") and hasattr(module, "get_expert_mapping")
    ]
    prefixes = [module.lora_base_layer_prefix for module in wrapped]
    for module in wrapped:
        module.lora_base_layer_prefix = ""
    try:
        yield
    finally:
        for module, prefix in zip(wrapped, prefixes, strict=True):
            module.lora_base_layer_prefix = prefix


def _checkpoint_tensors(weights_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors checkpoint directory, one file at a time (vLLM's own iterator), in the files'
    name order."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(path) for path in Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{weights_dir} has no *.safetensors file to reload")
    return safetensors_weights_iterator(files, use_tqdm_on_load=False)


@contextlib.contextmanager
def _moe_first_load(model: Any) -> Any:
    """Within the block, each unquantized fused-MoE layer processes reloaded weights as it processed the first load.

    vLLM 0.32's ``UnquantizedFusedMoEMethod`` runs its experts' ``process_weights_after_loading`` (on the CPU build:
    packing ``w13`` / ``w2`` into the grouped GEMM's layout, same shape, elements reordered) only while it has no
    ``moe_kernel``, i.e. at the first load; a reload then copied checkpoint-order experts into the packed storage,
    and the kernel read them as packed (log-probs off by 0.15 after reloading a tiny Qwen3-MoE's own weights). With
    the kernel hidden, the layer being reloaded is packed before vLLM copies it into the live tensors; the kernel
    and its quantization config, which refer to the live tensors, are put back after."""
    try:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without the class has no such step to skip
        yield
        return
    hidden: dict[int, tuple[Any, Any, Any]] = {}
    for module in model.modules():
        method = getattr(module, "quant_method", None)  # a LoRA wrapper shows its base layer's: counted once
        if isinstance(method, UnquantizedFusedMoEMethod) and method.moe_kernel is not None:
            hidden.setdefault(id(method), (method, method.moe_kernel, getattr(method, "moe_quant_config", None)))
    for method, _, _ in hidden.values():
        method.moe_kernel = None
    try:
        yield
    finally:
        for method, kernel, quant_config in hidden.values():
            method.moe_kernel, method.moe_quant_config = kernel, quant_config


def _load_into_wrapped(wrapper: Any, weights: Any) -> Any:  # vLLM 0.32's BaseLayerWithLoRA.load_weights
    from vllm.model_executor.models.utils import AutoWeightsLoader

    own = getattr(wrapper.base_layer, "load_weights", None)
    return own(weights) if callable(own) else AutoWeightsLoader(wrapper.base_layer).load_weights(weights)


def _broadcast_root() -> Any:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return options


with contextlib.suppress(ValueError):  # the module was imported before in this process
    WeightTransferEngineFactory.register_engine(BACKEND, LocalWeightTransferEngine)


class WorkerExtension:
    """Mixed into vLLM's worker: importing this module registers the engine in the worker's process before the
    worker creates it (after loading the model)."""

    def model_support_weight_updates(self) -> int:
        """How many steps the local engine has applied (for tests and logs)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return engine.applied if isinstance(engine, LocalWeightTransferEngine) else 0

    def model_support_reload_weights(self, weights_dir: str) -> None:
        """Load a complete checkpoint directory into the served model in place (the ``files`` transport), as the
        engine loads a streamed step: vLLM's own worker ``reload_weights`` lacks what a server with LoRA on or
        fused-MoE layers needs (see :func:`_reload_in_place`)."""
        _reload_in_place(self.vllm_config, self.model_runner.get_model(), _checkpoint_tensors(weights_dir))
