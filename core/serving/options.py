"""How a vLLM server starts: :class:`ServeOptions`, public through ``model_support.core.api`` (imports no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

# How ``Server.update_weights`` reaches the served model (core/serving/update.py).
TRANSPORTS = ("stream", "collective", "ipc", "files")

# vllm serve flags the server's handle depends on (serve() sets them); extra_args may not name them.
_OWNED_FLAGS = frozenset(
    {"--model", "--served-model-name", "--host", "--port", "--middleware", "--api-key", "--uds", "--root-path"}
)


@dataclass(frozen=True)
class ServeOptions:
    """How a server starts (``api.serve``, and the harness's servers alike). The defaults serve every shipped
    family's tiny replica on the CPU build; ``None`` means "from the checkpoint" (:meth:`for_checkpoint`).

    ``dtype``: vLLM's ``--dtype``; "auto" is vLLM's choice: a bf16 or fp16 checkpoint's own dtype, but bf16 (fp16 where
    bf16 is not supported) for an fp32 checkpoint; "float32" serves an fp32 checkpoint as it is. ``max_model_len``,
    ``max_num_seqs``: vLLM's limits of a sequence's length and of the sequences in flight. ``kv_cache_gib``: the KV
    cache on the CPU build (``VLLM_CPU_KVCACHE_SPACE``); ``gpu_memory_utilization``: the share of a GPU's memory vLLM
    takes (``None``: vLLM's default). ``tensor_parallel_size``: GPUs per server. ``enforce_eager``: no CUDA graphs or
    ``torch.compile`` (fast to start; off for throughput on a GPU). ``enable_lora`` with ``max_lora_rank`` and
    ``max_loras``: adapters loaded at run time (``Server.load_lora``). ``moe``: the model has routed experts, so its
    LoRA adapters hold one LoRA per expert (vLLM's 2-D MoE LoRA format is forced); ``language_model_only``: serve only
    the text model of a multimodal checkpoint (no image processor is loaded). ``extra_args``: further ``vllm serve``
    arguments, passed on as they are, after the ones above. ``weight_transfer``: how ``Server.update_weights`` reaches
    the model: "stream" (vLLM's weight-transfer interface with the project's local engine: buckets streamed through
    memory, applied after the last), "collective" (the same interface, each bucket broadcast from the trainer's device
    to the server's: NCCL GPU to GPU, gloo on the CPU build), "ipc" (the same interface for a server on the trainer's
    own GPU: each bucket handed over as a CUDA IPC handle of trainer memory) or "files" (each step written as a
    checkpoint and reloaded from disk). ``gpus``: the GPUs the server runs on (a trainer on GPU 0, the server on
    ``"1"``), its ``CUDA_VISIBLE_DEVICES``. ``enable_sleep_mode``: ``Server.sleep`` / ``wake_up`` can give the
    server's GPU memory to a trainer on the same GPU and take it back (vLLM's sleep mode, GPUs only).
    ``return_routed_experts``: every completion carries the experts each token was routed to
    (``--enable-return-routed-experts``; an MoE model on a GPU; read with ``api.served_experts``).
    """

    dtype: str = "auto"
    max_model_len: int = 512
    max_num_seqs: int = 8
    kv_cache_gib: int = 1
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = True
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    moe: bool | None = None
    language_model_only: bool | None = None
    extra_args: tuple[str, ...] = ()
    weight_transfer: str = "stream"
    # The GPUs the server runs on, as CUDA_VISIBLE_DEVICES names them ("1", "2,3"); None: the ones this process sees.
    gpus: str | None = None
    enable_sleep_mode: bool = False
    return_routed_experts: bool = False
    startup_timeout_s: float = 900.0

    def for_checkpoint(self, model_dir: Path) -> ServeOptions:
        """These options with ``moe`` and ``language_model_only`` that are ``None`` read from ``model_dir``'s
        config.json: routed experts (an expert count in the text config), a vision tower (``vision_config``)."""
        if self.moe is not None and self.language_model_only is not None:
            return self
        config = json.loads((Path(model_dir) / "config.json").read_text())
        text = config.get("text_config") or config
        experts = any(text.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
        return replace(
            self,
            moe=experts if self.moe is None else self.moe,
            language_model_only=("vision_config" in config)
            if self.language_model_only is None
            else self.language_model_only,
        )

    def vllm_args(self) -> list[str]:
        """The ``vllm serve`` arguments these options give (model, name, host and port aside)."""
        args = ["--dtype", self.dtype, "--max-model-len", str(self.max_model_len)]
        args += ["--max-num-seqs", str(self.max_num_seqs), "--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.enable_lora:
            args += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
            if self.moe:
                # Our adapters are per expert (PEFT's HF names). vLLM classes that hold the experts as 3-D weights
                # (is_3d_moe_weight: Qwen3.5-MoE) refuse those unless its 2-D MoE LoRA wrapper is forced; for the
                # other MoE classes that wrapper is already the one used.
                args.append("--enable-mixed-moe-lora-format")
        if self.language_model_only:
            args.append("--language-model-only")
        if self.enable_sleep_mode:
            args.append("--enable-sleep-mode")
        if self.return_routed_experts:
            args.append("--enable-return-routed-experts")
        if self.weight_transfer not in TRANSPORTS:
            choices = ", ".join(repr(t) for t in TRANSPORTS)
            raise ValueError(f"weight_transfer must be one of {choices}, not {self.weight_transfer!r}")
        if self.weight_transfer != "files":
            # The engine (every other transport's) is registered by the worker extension's module, imported in the
            # worker before it is built.
            args += ["--weight-transfer-config", json.dumps({"backend": "model_support_local"})]
        # Every transport's reload runs through the extension (ms_weights._reload_in_place).
        args += ["--worker-extension-cls", "ms_weights.WorkerExtension"]
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0]
            if flag in _OWNED_FLAGS:
                raise ValueError(
                    f"extra_args {arg!r}: {flag} is set by the project (the server would answer under another name, "
                    "host, port or middleware than the one its handle uses); use ServeOptions' fields or leave it out"
                )
        return [*args, *self.extra_args]
