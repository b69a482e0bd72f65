"""The training-time API: what a trainer (ART, verl, NeMo RL) imports to run a model family through its handler.

Everything the harness validates goes through these functions: the CLI, the pytest plugin and the stages call
them, so what ``model-support check`` proves is what a trainer runs. A training step with it::

    from model_support.core import api

    handler = api.resolve("Qwen/Qwen3-30B-A3B")              # a model dir, config.json or cached hub id
    model = api.build_model("/ckpt/qwen3-30b-a3b", handler=handler, parallel=api.ParallelLayout(tensor_parallel=2))
    api.apply_lora(model, rank=16, alpha=32)                 # the handler's declared targets, base frozen
    out = api.forward_backward(model, tokens, loss_fn)       # megatron-core's schedule for the layout
    api.reduce_lora_grads(model)                             # (a trainer's DDP / finalize_model_grads instead)
    server.update_weights(api.merged_weights(model))         # HF-named buckets, base + LoRA, into a live server
    api.export_adapter(model, "/out/adapter")                # a PEFT adapter, through the handler's codec

Megatron-side functions need the ``megatron`` extra (megatron-core and megatron-bridge); ``resolve`` does not.
``build_model`` joins a caller's torch.distributed and megatron-core parallel state when they exist (never tearing
them down) and sets up a world of one otherwise.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_support.core.discovery import ModelSource, load_config, locate
from model_support.core.discovery import resolve_handler as _resolve_source
from model_support.core.layout import ModelLayout
from model_support.core.parallel import ParallelLayout, ParallelLayoutError
from model_support.core.registry import RegisteredHandler, Registry, load_registry
from model_support.core.serving.options import ServeOptions

if TYPE_CHECKING:
    import torch

    from model_support.core.megatron.builder import MegatronModel
    from model_support.core.megatron.forward import LossInputs, MicroBatch, Normalize, StepOutput, TokenScores
    from model_support.core.megatron.lora import LoraReport
    from model_support.core.serving.backend import Server

# Bucket size for merged_weights: large enough that per-bucket overhead vanishes, small enough to stay a
# fraction of a GPU's free memory beside the model.
DEFAULT_BUCKET_BYTES = 512 * 1024**2

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "ParallelLayout",
    "ServeOptions",
    "TrainingModel",
    "apply_lora",
    "build_model",
    "export_adapter",
    "forward_backward",
    "group_logprobs",
    "load_adapter",
    "load_state",
    "merged_weights",
    "push_adapter",
    "push_weights",
    "reduce_lora_grads",
    "resolve",
    "routed_experts",
    "save_merged",
    "save_state",
    "serve",
    "served_experts",
    "token_logprobs",
]


@dataclass
class TrainingModel:
    """A handler's megatron-core model as a trainer runs it, with what converting it to and from HF needs.

    ``chunks`` are this rank's megatron-core model chunks to train (LoRA wrapped in place by :func:`apply_lora`):
    one, or one per virtual pipeline stage; ``module`` is the one chunk of a layout without virtual stages.
    """

    handler: RegisteredHandler
    model_dir: Path
    config: Any
    layout: ModelLayout
    built: MegatronModel
    lora: LoraReport | None = field(default=None)

    @property
    def module(self) -> torch.nn.Module:
        return self.built.model

    @property
    def chunks(self) -> list[torch.nn.Module]:
        return self.built.chunks

    @property
    def spec(self):  # -> HandlerSpec
        return self.handler.spec

    def describe(self) -> str:
        """One line: the modules, dtype and kernel the model runs."""
        return self.built.numerics.describe(bool(self.layout.gdn_layers))


def resolve(
    target: str | Path | ModelSource, *, prefer: Mapping[str, str] | None = None, registry: Registry | None = None
) -> RegisteredHandler:
    """The one handler for ``target`` (model directory, ``config.json``, a hub id in the local HF cache, or an
    already located :class:`~model_support.core.discovery.ModelSource`).

    ``prefer`` settles an architecture claimed by several plugins (``{"Qwen3ForCausalLM": "my-qwen3"}``).
    Raises :class:`~model_support.core.errors.ModelSupportError` subclasses with a one-line reason.
    """
    registry = registry or load_registry(prefer=prefer)
    source = target if isinstance(target, ModelSource) else locate(str(target))
    return _resolve_source(source, registry)


def build_model(
    model_dir: str | Path,
    *,
    handler: RegisteredHandler | None = None,
    config: Any = None,
    parallel: ParallelLayout | None = None,
    dtype: torch.dtype | None = None,
    timeout: timedelta | None = None,
    recompute: bool = False,
) -> TrainingModel:
    """Build the language model of ``model_dir`` in megatron-core and load its weights through megatron-bridge.

    ``dtype`` defaults to the device's training dtype (bf16 on a GPU, fp32 on a CPU). Gated DeltaNet layers run
    on the kernel the handler's runtime policy selects; MTP layers are built only when the policy keeps them
    for training. ``handler`` and ``config`` default to :func:`resolve` and the directory's config.

    Under a launcher each rank builds on the GPU its ``LOCAL_RANK`` names. ``timeout`` bounds every collective of
    the process groups this call sets up (a peer that never arrives ends the wait with an error instead of a hang);
    a caller that initialised torch.distributed itself keeps its own timeout.

    ``recompute``: in training mode (``model.module.train()``) each decoder layer keeps only its input for the
    backward and runs its forward again there (megatron-core's full activation recompute, one layer at a time):
    activation memory of one layer instead of every layer's, for long rows of a deep checkpoint.
    """
    from model_support.core.megatron.builder import build_megatron_model, choose_numerics
    from model_support.core.megatron.dist import init_parallel

    source = locate(str(model_dir))
    handler = handler or _resolve_source(source, load_registry())
    config = config if config is not None else load_config(source)
    layout = handler.spec.layout(config)
    parallel = parallel or ParallelLayout()
    refused = handler.spec.runtime.refused(parallel)
    if refused:
        raise ParallelLayoutError(f"{handler.spec.name} cannot train in {parallel.name}: {refused}")
    runtime = handler.spec.runtime
    init_parallel(parallel, timeout=timeout)  # first: it makes this rank's GPU the current device
    numerics = choose_numerics(runtime.gdn_backend, dtype=dtype)
    mtp = bool(layout.mtp_layers) and not runtime.disable_mtp_for_training
    built = build_megatron_model(
        source.directory,
        config,
        parallel=parallel,
        mtp=mtp,
        numerics=numerics,
        layer_spec=handler.spec.megatron_layer_spec,
        recompute=recompute,
    )
    return TrainingModel(handler, source.directory, config, layout, built)


def apply_lora(model: TrainingModel, *, rank: int = 8, alpha: float = 16.0, seed: int = 0) -> LoraReport:
    """Wrap every module the handler declares a LoRA target for (B = 0, so the model is unchanged); freeze the rest.

    The fresh adapter is canonical: each module's A is drawn over its single-rank (TP=1) shape as PEFT draws it, from
    ``seed`` and the module's name, so every rank and every parallel layout starts from the same adapter
    (:func:`model_support.core.megatron.lora.fresh_lora`). The adapter weights are fp32 whatever the base dtype, as
    PEFT keeps them.
    """
    import math

    from model_support.core.megatron.lora import LoraError, fresh_lora
    from model_support.core.megatron.lora import apply_lora as wrap

    if model.lora is not None:
        raise LoraError("LoRA is already applied to this model")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraError(f"rank is the LoRA's rank (1 or more), got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise LoraError(f"alpha is the LoRA's positive, finite scale numerator, got {alpha!r}")
    model.lora = wrap(model.chunks, model.spec, rank=rank, alpha=alpha)
    fresh_lora(model.chunks, seed=seed)
    return model.lora


def _require_lora(model: TrainingModel) -> LoraReport:
    from model_support.core.megatron.lora import LoraError

    if model.lora is None:
        raise LoraError("no LoRA on this model: call apply_lora first")
    return model.lora


def export_adapter(model: TrainingModel, out_dir: str | Path) -> Path:
    """Write the model's LoRA as a PEFT adapter (HF module names) through the handler's codec.

    Every rank takes part in gathering the LoRA (tensor-parallel shards, expert-parallel experts, pipeline stages);
    rank 0 writes. Returns ``out_dir``.
    """
    import torch.distributed as dist

    from model_support.core.codecs import save_peft_adapter
    from model_support.core.megatron.lora import lora_state

    lora = _require_lora(model)
    first = next(iter(lora.wrapped.values()))
    peft = model.spec.codec.to_peft(lora_state(model.chunks), model.config, model.layout)
    out = Path(out_dir)
    if not dist.is_initialized() or dist.get_rank() == 0:
        stacked = getattr(model.spec.codec, "target_parameters", lambda _config: ())(model.config)
        save_peft_adapter(
            out, peft, rank=first.rank, alpha=first.alpha, base_model=str(model.model_dir), target_parameters=stacked
        )
    if dist.is_initialized():
        dist.barrier()
    return out


def load_adapter(model: TrainingModel, adapter_dir: str | Path) -> None:
    """Load a PEFT adapter (e.g. one :func:`export_adapter` wrote) into the model's LoRA through the codec.

    Everything is checked before the model changes: the adapter's rank and alpha must be the model's LoRA's (the
    scale alpha / r is the model's; rsLoRA's alpha / sqrt(r) is not), every tensor the codec maps must be there
    with its shape and finite; a refusal is one :class:`~model_support.core.megatron.lora.LoraError` line and the
    LoRA is as it was."""
    import math

    from model_support.core.codecs import load_peft_adapter
    from model_support.core.megatron.lora import LoraError, load_lora_state, refuse_nonfinite

    lora = _require_lora(model)
    config, tensors = load_peft_adapter(Path(adapter_dir))
    first = next(iter(lora.wrapped.values()))
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if config.get("use_rslora"):
        raise LoraError(f"{adapter_dir} is an rsLoRA adapter (scale alpha / sqrt(r)); the model's LoRA's is alpha / r")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or rank != first.rank:
        raise LoraError(
            f"{adapter_dir} has r={rank!r}, lora_alpha={alpha!r}; the model's LoRA has r={first.rank}, "
            f"lora_alpha={first.alpha:g}: apply_lora with the adapter's rank and alpha to load it"
        )
    if float(alpha) != float(first.alpha):
        raise LoraError(
            f"{adapter_dir} has lora_alpha={alpha:g}, the model's LoRA {first.alpha:g}: loading it would scale every "
            "update differently; apply_lora with the adapter's alpha to load it"
        )
    refuse_nonfinite(tensors, f"{adapter_dir}: ")
    load_lora_state(model.chunks, model.spec.codec.from_peft(tensors, model.config, model.layout))


def save_state(model: TrainingModel, optimizer: torch.optim.Optimizer, path: str | Path, *, step: int) -> Path:
    """Save what resuming the run needs at ``path`` (a new directory), atomically: every rank's LoRA tensors as the
    rank holds them, its ``optimizer.state_dict()`` and RNG states (torch CPU and CUDA, Python, numpy, megatron-core's
    tensor-parallel CUDA tracker) in ``rank-NNNNN.pt``, and rank 0's ``manifest.json`` with ``step``, the model and
    the parallel layout. Every rank calls it (on a file system they share). Returns ``path``.
    See :mod:`model_support.core.megatron.state`."""
    from model_support.core.megatron.state import save_state as save

    _require_lora(model)
    return save(model.chunks, optimizer, Path(path), step=step, model=model.spec.name)


def load_state(model: TrainingModel, optimizer: torch.optim.Optimizer, path: str | Path) -> int:
    """Load what :func:`save_state` wrote into the model's LoRA, ``optimizer`` (built over the same parameters) and
    the RNGs, and return its step: the next step then computes what the uninterrupted run's would, bit for bit.
    A state of another model, LoRA shape or parallel layout is refused with a one-line
    :class:`~model_support.core.megatron.state.StateError`, nothing loaded. Every rank calls it."""
    from model_support.core.megatron.state import load_state as load

    _require_lora(model)
    return load(model.chunks, optimizer, Path(path), model=model.spec.name)


def merged_weights(
    model: TrainingModel, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's tensors as the live model holds them now (base + LoRA merged), in HF names and dtypes.

    Streamed in buckets of at most ``bucket_bytes`` (a larger tensor gets one of its own), gathered across
    tensor-parallel ranks by the bridge's mappings, with no checkpoint written. Tensors the Megatron model does
    not hold (a vision tower, MTP layers not trained) come from the checkpoint unchanged. Every rank gets every
    bucket; feed them to :meth:`Server.update_weights` from one rank.
    """
    from model_support.core.megatron.hf_export import hf_weights
    from model_support.core.serving.export import buckets

    return buckets(hf_weights(model.built), bucket_bytes)


def save_merged(model: TrainingModel, out_dir: str | Path, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Path:
    """Write :func:`merged_weights` as a servable checkpoint (shards, index, the checkpoint's config and tokenizer
    files) at ``out_dir``, atomically: a failure leaves no directory there. Every rank iterates; rank 0 writes."""
    import torch.distributed as dist

    from model_support.core.serving.export import write_checkpoint

    shards = merged_weights(model, bucket_bytes=bucket_bytes)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_checkpoint(shards, Path(out_dir), support_from=model.model_dir)
    else:
        for _ in shards:  # the other ranks take part in the gathers
            pass
    if dist.is_initialized():
        dist.barrier()
    return Path(out_dir)


def serve(
    model_dir: str | Path,
    served_name: str,
    log_path: str | Path,
    *,
    options: ServeOptions | None = None,
    backend: str = "vllm",
) -> Server:
    """Start a server (an OpenAI-compatible vLLM in the managed runtime) on ``model_dir`` as ``served_name``, as
    ``options`` say (:class:`ServeOptions`; default: the options that serve every shipped family's tiny replica,
    MoE and multimodal checkpoints read from their config). ``dtype="auto"`` on the CPU build takes the dtype the
    checkpoint's handler declares for it (``RuntimePolicy.cpu_serving_dtype``: the CPU build runs Gated DeltaNet in
    bf16 only), else the checkpoint's. Relative paths are taken from this process's working directory.

    Name it ``<model>@0``: each :meth:`Server.update_weights` advances the step (``@1``, ``@2`` ...). The server is
    a child process, stopped by ``server.stop()`` and reaped when this process exits.
    """
    from dataclasses import replace

    from model_support.core.errors import ModelSupportError
    from model_support.core.serving.backend import get_backend
    from model_support.core.serving.runtime import load_runtime

    options = options or ServeOptions()
    chosen = get_backend(backend)
    if options.dtype == "auto" and backend == "vllm" and load_runtime().flavor == "cpu":
        try:
            policy = resolve(model_dir).spec.runtime
        except ModelSupportError:  # no handler claims it: vLLM serves the checkpoint's own dtype
            policy = None
        if policy is not None and policy.cpu_serving_dtype is not None:
            options = replace(options, dtype=policy.cpu_serving_dtype)
    return chosen.serve(Path(model_dir), served_name, options, Path(log_path))


def push_weights(
    server: Server | None, model: TrainingModel, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> str | None:
    """Push the model's merged weights into ``server`` in place (``Server.update_weights``: streamed, applied after
    the last bucket, generation paused only for the swap); returns the new served name (``model@N``).

    Every rank calls it (the gathers are collectives): the rank that talks to the server passes it, the others
    pass ``None`` and get ``None``."""
    weights = merged_weights(model, bucket_bytes=bucket_bytes)
    if server is None:
        for _ in weights:  # this rank takes part in the gathers only
            pass
        return None
    return server.update_weights(weights)


def push_adapter(server: Server | None, model: TrainingModel, name: str | None = None) -> str | None:
    """Hot-swap the model's LoRA into ``server`` as a PEFT adapter (exported through the handler's codec): loaded
    as ``<name>@N+1`` (default name ``<model>-lora``) beside the untouched base and the other adapters, that name's
    previous step unloaded; returns the adapter's served name, to send requests to. Several adapters trained on one
    base (one per run or task: load each one's LoRA with :func:`load_adapter` before its push) are served side by
    side under their own names. For families whose vLLM LoRA is native (``spec.vllm_lora.native``; the server started
    with ``ServeOptions(enable_lora=True)``). Every rank calls it (:func:`export_adapter` gathers); the rank that
    talks to the server passes it, the others pass ``None`` and get ``None``."""
    import tempfile

    import torch.distributed as dist

    writes = not dist.is_initialized() or dist.get_rank() == 0
    # Only rank 0 writes the adapter (export_adapter); the other ranks' directory is never created.
    out = Path(tempfile.mkdtemp(prefix="adapter-")) if writes else Path(tempfile.gettempdir()) / "adapter-unused"
    try:
        export_adapter(model, out)
        return None if server is None else server.update_adapter(out, name)  # the server loads a copy of its own
    finally:
        if writes:
            shutil.rmtree(out, ignore_errors=True)


def forward_backward(
    model: TrainingModel,
    input_ids: torch.Tensor,
    loss_fn: Callable[[torch.Tensor | TokenScores, MicroBatch], torch.Tensor],
    *,
    position_ids: torch.Tensor | None = None,
    micro_batches: int = 1,
    forward_only: bool = False,
    keep_logits: bool = False,
    loss_inputs: LossInputs = "logits",
    normalize: Normalize = "micro_batch",
    loss_mask: torch.Tensor | None = None,
    routed_experts: torch.Tensor | None = None,
) -> StepOutput:
    """One forward and backward of ``input_ids`` [B, S] in any layout, through megatron-core's schedule (1F1B,
    interleaved over virtual stages); ``loss_fn(inputs, micro_batch)`` turns a micro-batch's [b, S, V] fp32 logits
    (``loss_inputs="logits"``) or its vocabulary-parallel :class:`~model_support.core.megatron.forward.TokenScores`
    (``"logprobs"``: [b, S - 1] log-probs of the next token and entropies, no full-vocabulary logits) into its mean
    loss, or with ``normalize="global_tokens"`` its per-token loss [b, S - 1], which is summed over ``loss_mask``
    and divided by the loss tokens of every micro-batch and data-parallel replica. Every rank calls it and gets the
    loss (and what ``loss_fn`` got, with ``keep_logits``). ``routed_experts`` [B, S, L, k] (an MoE model): each
    token's experts at every decoder layer, as the server routed it (vLLM's ``routed_experts``; :func:`routed_experts`
    gives the trainer's own): the routers take them instead of their own top-k (routing replay, R3).
    See :func:`model_support.core.megatron.forward.forward_backward`."""
    from model_support.core.megatron.forward import forward_backward as run

    return run(
        model.chunks,
        input_ids,
        loss_fn,
        position_ids=position_ids,
        micro_batches=micro_batches,
        forward_only=forward_only,
        keep_logits=keep_logits,
        loss_inputs=loss_inputs,
        normalize=normalize,
        loss_mask=loss_mask,
        routed_experts=routed_experts,
    )


def reduce_lora_grads(model: TrainingModel) -> None:
    """Make every rank's LoRA gradients the whole batch's, as megatron-core's DistributedDataParallel and
    ``finalize_model_grads`` would: sequence-parallel factors summed over tensor-parallel ranks, then summed over
    context-parallel ranks and averaged over data-parallel replicas (expert factors over the expert data-parallel
    group, whose tokens the dispatcher already gathered across expert-parallel ranks)."""
    from model_support.core.megatron.lora import reduce_lora_grads as reduce

    reduce(model.chunks)


@contextlib.contextmanager
def lora_disabled(model: TrainingModel) -> Iterator[None]:
    """Inside, the model computes without its LoRA: the base policy, for a KL term's reference log-probs
    (``with api.lora_disabled(model): ref = api.token_logprobs(model, rows)``), in any layout, with no second copy
    of the weights. Every rank enters it around the same calls; the adapter is untouched."""
    from model_support.core.megatron.lora import lora_disabled as disabled

    _require_lora(model)
    with disabled(model.chunks):
        yield


@contextlib.contextmanager
def lora_merged(model: TrainingModel) -> Iterator[None]:
    """Inside, the model computes with each LoRA update merged into its base weight in the base's dtype, as
    :func:`merged_weights` pushes it: the policy a server holds after a merged push, which a bf16 base serves with
    part of a small update rounded away (``rl_trainability`` reports how much). The base weights are kept in host
    memory meanwhile and come back on exit; the adapter is untouched. Every rank enters it around the same calls;
    forward only."""
    from model_support.core.megatron.lora import lora_merged as merged

    _require_lora(model)
    with merged(model.chunks):
        yield


def lora_grad_norm(model: TrainingModel) -> float:
    """The L2 norm of every LoRA gradient of the whole model, the same on every rank, after
    :func:`reduce_lora_grads`: each distinct element counted once across tensor, pipeline, expert, context and data
    parallel ranks (which factors are sharded and which replicated: docs/trainer-api.md). Every rank calls it."""
    from model_support.core.megatron.lora import lora_grad_norm as norm

    return norm(model.chunks).item()


def clip_lora_grads(model: TrainingModel, max_norm: float) -> float:
    """Scale every rank's LoRA gradients by ``max_norm / norm`` where the whole model's norm
    (:func:`lora_grad_norm`) is larger, as ``torch.nn.utils.clip_grad_norm_`` does on one process; returns the norm
    before clipping. Every rank calls it, after :func:`reduce_lora_grads`."""
    import torch

    from model_support.core.megatron.lora import lora_grad_norm as norm

    total = norm(model.chunks)
    params = [p for chunk in model.chunks for p in chunk.parameters() if p.requires_grad and p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total.item()


def token_logprobs(
    model: TrainingModel,
    sequences: Sequence[Sequence[int]],
    routed_experts: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Per-position log-softmax rows of each sequence, ``[len(seq), vocab]`` fp32, from one packed forward.

    Row ``t`` is the model's distribution over the token after ``seq[:t + 1]``. The sequences are packed into
    one row with position ids restarting at 0 (as trainers pack), so no sequence sees another; under context
    parallelism (packed rows need THD attention, which the local spec lacks) each sequence is a row of its own.
    Any layout: the forward runs through megatron-core's schedule (:func:`forward_backward`), every rank takes part
    and gets the rows. Differentiable when the model's parameters require grad, except under pipeline parallelism,
    where the rows are the last stage's logits broadcast to every stage, detached
    (:func:`model_support.core.megatron.forward.scored_logits`; train through :func:`forward_backward`).
    ``routed_experts``: each sequence's ``[len(seq), L, k]`` experts, as the server routed it (see
    :func:`forward_backward`).
    """
    import torch

    from model_support.core.megatron.forward import scored_logits

    lengths = [len(seq) for seq in sequences]
    if not lengths or not all(lengths):
        raise ValueError("token_logprobs needs at least one sequence, and no empty one")
    if routed_experts is not None and [len(e) for e in routed_experts] != lengths:
        raise ValueError(
            f"routed experts are one [len(seq), layers, top-k] tensor a sequence: sequences of {lengths} tokens, "
            f"experts of {[len(e) for e in routed_experts]}"
        )
    rows, positions, experts = _scoring_rows(sequences, routed_experts)
    out = torch.log_softmax(scored_logits(model.chunks, rows, positions, experts), dim=-1)
    if positions is None:
        return [out[i, :n] for i, n in enumerate(lengths)]
    return list(out[0].split(lengths))


def _scoring_rows(
    sequences: Sequence[Sequence[int]], routed_experts: Sequence[torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(rows, position ids, routed experts) that score ``sequences``: one packed row with positions restarting at 0,
    or under context parallelism (packed rows need THD attention) a row each, padded at the end (causal: unseen)."""
    import torch

    from model_support.core.megatron.context_parallel import group as context_parallel_group
    from model_support.core.megatron.routing import padded

    lengths = [len(seq) for seq in sequences]
    if context_parallel_group() is None:
        row = torch.tensor([t for seq in sequences for t in seq])[None]
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        return row, positions, None if routed_experts is None else torch.cat(list(routed_experts))[None]
    width = max(lengths)
    rows = torch.tensor([[*seq, *[0] * (width - len(seq))] for seq in sequences])
    if routed_experts is None:
        return rows, None, None
    return rows, None, torch.stack([padded(e, width - len(e), dim=0) for e in routed_experts])


def served_experts(choice: dict[str, Any], length: int) -> torch.Tensor:
    """The experts a server routed a completion's tokens to, ``[length, L, k]`` for its ``length`` tokens (prompt and
    completion: the row a trainer scores), as :func:`token_logprobs` and :func:`forward_backward` replay them. From
    a server started with ``ServeOptions(return_routed_experts=True)`` (an MoE model, vLLM on a GPU); vLLM routes
    every token but the last sampled one, whose entry repeats the one before it (no scored token sees it)."""
    import torch

    from model_support.core.serving.vllm_backend import routed_experts_of

    routed = torch.from_numpy(routed_experts_of(choice).astype("int64"))
    if len(routed) != length - 1:
        raise ValueError(
            f"the completion's routed experts cover {len(routed)} tokens; a row of {length} tokens needs "
            f"{length - 1} (every token but the last sampled one)"
        )
    return torch.cat([routed, routed[-1:]])


def routed_experts(model: TrainingModel, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """The experts the trainer's own routers choose for each sequence, ``[len(seq), L, k]`` (-1 at a dense layer):
    the format :func:`token_logprobs` and :func:`forward_backward` replay, and vLLM returns, so a trainer can count
    how often it routes as the server did. From one forward of the rows :func:`token_logprobs` scores; any layout,
    every rank calls it and gets them."""
    from model_support.core.megatron.forward import scored_logits
    from model_support.core.megatron.routing import assemble, recorded

    lengths = [len(seq) for seq in sequences]
    if not lengths or not all(lengths):
        raise ValueError("routed_experts needs at least one sequence, and no empty one")
    if not model.chunks[0].config.num_moe_experts:
        raise ValueError("the model has no MoE layer: it routes no token")
    rows, positions, _ = _scoring_rows(sequences, None)
    with recorded(model.chunks) as records:
        scored_logits(model.chunks, rows, positions)
    # records cover the padded rows (scored_logits pads to the layout's multiple); assemble cuts them to the rows
    experts = assemble(model.chunks, records, rows.shape[0], rows.shape[1])
    if positions is None:
        return [experts[i, :n].cpu() for i, n in enumerate(lengths)]
    return list(experts[0].cpu().split(lengths))


def group_logprobs(
    model: TrainingModel, prompt: Sequence[int], completions: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """Each completion's log-softmax rows, ``[len(c), vocab]`` fp32, from one forward of ``[prompt, c1, ..., cG]``
    with the prompt computed once (a GRPO group).

    Row ``t`` of completion ``c`` is the model's distribution over ``c[t]`` given ``prompt + c[:t]``: the same as
    :func:`token_logprobs` of ``prompt + c`` from ``len(prompt) - 1`` on, without repeating the prompt. Each
    completion's position ids continue the prompt's; attention and Gated DeltaNet layers keep completions apart
    (:mod:`model_support.core.megatron.rows`). Under context parallelism (no packed rows without THD attention) it is
    :func:`token_logprobs` of each ``prompt + c``, the prompt computed once per completion. Any layout, every rank
    gets the rows; differentiable as :func:`token_logprobs` is.
    """
    import torch

    from model_support.core.megatron.context_parallel import group as context_parallel_group
    from model_support.core.megatron.forward import scored_logits
    from model_support.core.megatron.rows import RowLayout

    if not prompt or not completions or not all(completions):
        raise ValueError("a group needs a non-empty prompt and at least one non-empty completion")
    if context_parallel_group() is not None:
        full = token_logprobs(model, [[*prompt, *c] for c in completions])
        return [rows[len(prompt) - 1 : -1] for rows in full]
    rows = RowLayout.shared_prefix(len(prompt), [len(c) for c in completions])
    row = torch.tensor([*prompt, *(t for c in completions for t in c)])[None]
    out = torch.log_softmax(scored_logits(model.chunks, row, rows.position_ids())[0], dim=-1)
    last = out[len(prompt) - 1 : len(prompt)]  # the prompt's last position predicts every completion's first token
    return [torch.cat([last, out[s.start : s.end - 1]]) for s in rows.groups[0][1:]]
