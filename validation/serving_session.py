"""What the serving stages of one ``check`` run share: one server, the policy adapter, and the weights it serves.

One vLLM server per run is started on the *base* checkpoint as ``<handler>@0`` (LoRA enabled where the handler
declares native LoRA and the build can run it), and every serving stage reuses it: ``native_vllm_lora`` loads
the policy adapter into it while it serves the base weights; ``merged_serving`` then pushes the policy's merged
weights in place from the Megatron model through the training-time API (``@1``); ``rl_trainability`` pushes
each training step (``@2`` ...). The ``server`` resource records what the server holds, and a stage that
needs other weights pushes them. The server is stopped when the run ends (and reaped when its process exits).

The *policy* is base + one LoRA adapter: the adapter the Megatron trainer wrote in ``lora_coverage`` when that
ran (the ``trained_adapter`` resource of ``validation/megatron_session.py``), else a seeded random LoRA on the
Megatron model exported through the API (``random_adapter``). Trainer-side log-probabilities come from the Megatron
model carrying that adapter; transformers (fp32, adapter merged, streamed one decoder layer at a time) is the second
reference.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model_support.core import api, timing
from model_support.core.codecs import load_peft_adapter
from model_support.core.serving.backend import Server, ServingBackend, get_backend
from model_support.core.serving.export import base_tensors, buckets
from model_support.core.serving.options import ServeOptions
from model_support.core.serving.runtime import load_runtime
from model_support.core.serving.vllm_backend import CPU_MOE_LORA_GAP
from model_support.core.validate import TargetCoverageError, adapter_targets, uncovered_targets
from model_support.validation.context import CheckContext
from model_support.validation.megatron_session import LORA, LORA_RANK, TRAINED_ADAPTER, TRAINING_MODEL, hf_reference
from model_support.validation.state import Resource, stop_value

# The check's training dtypes as vLLM's --dtype names them.
VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
GPU_FP32_LORA_GAP = "vLLM's GPU LoRA kernels take fp16 / bf16 weights only, and this check serves float32"


def backend() -> ServingBackend:
    return get_backend("vllm")


def serving_workdir(ctx: CheckContext) -> Path:
    path = ctx.workdir / "serving"
    path.mkdir(parents=True, exist_ok=True)
    return path


def lora_gap(ctx: CheckContext) -> str | None:
    """Why this build cannot serve the handler's adapter natively (``None``: it can, as far as is known)."""
    flavor = load_runtime().flavor
    if ctx.layout.moe is not None and flavor == "cpu":
        return CPU_MOE_LORA_GAP
    if flavor == "gpu" and serving_dtype(ctx)[0] == "float32":
        return GPU_FP32_LORA_GAP
    return None


def inplace_gap(ctx: CheckContext) -> str | None:
    """Why this build cannot take the handler's weights in place, as its runtime policy declares for the CPU build
    (``None``: it can, as far as is known)."""
    gap = ctx.spec.runtime.cpu_inplace_reload_gap
    return gap if gap and load_runtime().flavor == "cpu" else None


def serving_dtype(ctx: CheckContext) -> tuple[str, str]:
    """(dtype, why). On a GPU the check's training dtype (bf16 unless ``check --dtype fp32``), as trainers serve
    and as vLLM's GPU LoRA kernels take only; on the CPU build the checkpoint's own (vLLM's "auto" would run fp32
    checkpoints in bf16 there), unless the handler's runtime policy names another for the CPU build."""
    policy = ctx.spec.runtime
    if load_runtime().flavor == "gpu":
        return VLLM_DTYPES[ctx.training_dtype], "the check's training dtype on the GPU"
    if policy.cpu_serving_dtype is not None:
        return (
            policy.cpu_serving_dtype,
            f"{ctx.spec.name}'s runtime policy on the CPU build: {policy.cpu_serving_reason}",
        )
    stored = str(getattr(ctx.config.get_text_config(), "dtype", None) or "auto").removeprefix("torch.")
    return stored, "the checkpoint's own"


def compared_dtype(ctx: CheckContext, served: str) -> str:
    """The precision a comparison of the server (serving ``served``) with the trainer is held to: the lower of the
    two (a bf16 trainer beside an fp32 server on the CPU build drifts as far as a bf16 one)."""
    return served if served != "float32" else VLLM_DTYPES[ctx.training_dtype]


def runs_below_fp32(ctx: CheckContext, served: str) -> int:
    """How many of the server (serving ``served``) and the trainer run below fp32: each may drift its own allowance
    from fp32, so a comparison of the two may drift by their sum."""
    return sum(dtype != "float32" for dtype in (served, VLLM_DTYPES[ctx.training_dtype]))


# vLLM's default share of a GPU (90 %) leaves the check's Megatron model on the same GPU no room: on a GPU a
# server takes the checkpoint's size and this much more for its activations, KV cache and LoRA slots.
GPU_SERVER_ALLOWANCE_BYTES = 8 << 30


def _stored_bytes(ctx: CheckContext) -> int:
    return sum(f.stat().st_size for f in Path(ctx.model_dir).glob("*.safetensors"))


def gpu_memory_share(ctx: CheckContext) -> float | None:
    """The share of the GPU a server of the run takes (``None`` off a GPU: vLLM's default, unused by the CPU
    build): the checkpoint as stored plus :data:`GPU_SERVER_ALLOWANCE_BYTES`, at most vLLM's own 0.9."""
    if load_runtime().flavor != "gpu" or not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(0).total_memory
    return round(min(0.9, (_stored_bytes(ctx) + GPU_SERVER_ALLOWANCE_BYTES) / total), 3)


def routing_gap(ctx: CheckContext) -> str | None:
    """Why the servers that hold the policy do not return each token's routed experts for the trainer to replay
    (``None``: they do)."""
    from model_support.core.serving.vllm_features import VllmFeatures

    runtime = load_runtime()
    if ctx.layout.moe is None:
        return "a dense model routes nothing"
    if runtime.flavor != "gpu":
        return f"the CPU build ({runtime.distribution} {runtime.vllm_version}) cannot capture routed experts"
    if VllmFeatures(runtime.vllm_version).has("routed_experts_mrv2"):
        # Capturing them would switch every serving stage's server to Model Runner V2: not the runner users start.
        return f"vLLM {runtime.vllm_version} captures routed experts only under Model Runner V2, not its default runner"
    return None


def serve_options(ctx: CheckContext, *, enable_lora: bool = False, routed_experts: bool = False) -> ServeOptions:
    """How the run's servers start: :func:`serving_dtype`, LoRA as asked, the model's MoE and multimodal shape,
    :func:`gpu_memory_share` of a GPU; with ``routed_experts`` each token's experts returned where the build can
    (:func:`routing_gap`)."""
    dtype, _ = serving_dtype(ctx)
    return ServeOptions(
        dtype=dtype,
        enable_lora=enable_lora,
        return_routed_experts=routed_experts and routing_gap(ctx) is None,
        max_lora_rank=LORA_RANK,
        moe=ctx.layout.moe is not None,
        language_model_only=getattr(ctx.config, "vision_config", None) is not None,
        gpu_memory_utilization=gpu_memory_share(ctx),
    )


RANDOM_ADAPTER_SEED = 7  # added to the run's seed
# The check's pushes carry the model in at least this many buckets (a tiny replica fits one bucket of the API's
# default size), so that a push that loses or misplaces whole buckets, which only a push of several can, fails.
PUSH_BUCKETS = 4


def push_bucket_bytes(ctx: CheckContext) -> int:
    """The bucket size of the check's pushes: a quarter of the checkpoint (:data:`PUSH_BUCKETS`), at most the
    API's default (what trainers push at real width)."""
    return max(1, min(api.DEFAULT_BUCKET_BYTES, _stored_bytes(ctx) // PUSH_BUCKETS))


@dataclass
class SharedServer:
    """The run's one server and the weights it holds now: "base", "policy" or "rl"."""

    server: Server
    holds: str = "base"

    def stop(self) -> None:
        self.server.stop()


def _start_on_base(ctx: CheckContext, served_name: str, lora: bool, log_name: str, routed: bool = False) -> Server:
    """A server on the base checkpoint, started and not waited for (a stage's ``prepare`` starts it while earlier
    stages run; ``wait_ready`` waits); ``routed``: returning routed experts where the build can."""
    options = serve_options(ctx, enable_lora=lora, routed_experts=routed)
    return backend().serve(ctx.model_dir, served_name, options, serving_workdir(ctx) / log_name, wait=False)


def _start_shared(ctx: CheckContext) -> SharedServer:
    lora = ctx.spec.vllm_lora.native and lora_gap(ctx) is None
    return SharedServer(_start_on_base(ctx, f"{ctx.spec.name}@0", lora, "vllm.log", routed=True))


def _random_adapter(ctx: CheckContext) -> Path:
    from model_support.core.megatron.lora import load_lora_state, random_lora_state

    model = ctx.state.get(TRAINING_MODEL)
    ctx.state.get(LORA)
    load_lora_state(model.module, random_lora_state(model.module, seed=ctx.seed + RANDOM_ADAPTER_SEED, b_std=0.05))
    return api.export_adapter(model, serving_workdir(ctx) / "random-adapter")


def _start_policy_server(ctx: CheckContext) -> Server:
    weights = api.save_merged(policy_model(ctx), serving_workdir(ctx) / "policy-weights")
    log = serving_workdir(ctx) / "vllm-policy.log"
    options = serve_options(ctx, routed_experts=True)
    return backend().serve(weights, f"{ctx.spec.name}-policy", options, log, wait=False)


SERVER: Resource[SharedServer] = Resource(
    "server",
    "the run's one vLLM server, started on the base checkpoint as `<handler>@0` (LoRA on where the build can serve "
    "the handler's adapter natively), and the weights it holds now",
    _start_shared,
    stop=stop_value,
)
LORA_SERVER: Resource[Server] = Resource(
    "lora_server",
    "a LoRA-enabled server of native_vllm_lora's own on the base checkpoint (`<handler>-base`), where the shared "
    "one runs no LoRA (lora_gap)",
    lambda ctx: _start_on_base(ctx, f"{ctx.spec.name}-base", True, "vllm-lora.log"),
    stop=stop_value,
)
RANDOM_ADAPTER: Resource[Path] = Resource(
    "random_adapter",
    "a seeded random LoRA on the Megatron model exported through the API: the policy adapter where no trained one "
    "was provided",
    _random_adapter,
    uses=(TRAINING_MODEL, LORA),
)
# What serving_session.policy_adapter and policy_model read.
POLICY: tuple[Resource[Any], ...] = (TRAINED_ADAPTER, RANDOM_ADAPTER, TRAINING_MODEL, LORA)
POLICY_SERVER: Resource[Server] = Resource(
    "policy_server",
    "a server of the policy's own (`<handler>-policy`) started on its merged weights written as a checkpoint, "
    "where the build cannot take weights in place (inplace_gap)",
    _start_policy_server,
    uses=POLICY,
    stop=stop_value,
)


def start_server(ctx: CheckContext) -> Server:
    """The run's one server on the base checkpoint (:data:`SERVER`), started and not waited for."""
    return ctx.state.get(SERVER).server


def server(ctx: CheckContext) -> Server:
    """The run's one server on the base checkpoint, ready (:func:`start_server`)."""
    with timing.phase("server_start"):
        return start_server(ctx).wait_ready()


def prestart_policy(ctx: CheckContext) -> None:
    """Start in the background the server :func:`serve_policy` will hold the policy in: the shared one; where the
    policy needs a server of its own (:func:`inplace_gap`), that one, once the Megatron trainer has written the
    policy adapter (``lora_coverage``; the runner prepares again after each stage)."""
    if inplace_gap(ctx) is None:
        start_server(ctx)
    elif ctx.state.find(TRAINED_ADAPTER) is not None:
        ctx.state.get(POLICY_SERVER)


def prestart_native_lora(ctx: CheckContext) -> None:
    """Start in the background the server a natively served adapter goes to: the shared one, or a LoRA server of
    its own where the shared one runs no LoRA (:func:`lora_gap`). Nothing for a merged-only handler (the stage asks
    vLLM first whether it could serve the adapter)."""
    if not ctx.spec.vllm_lora.native:
        return
    if lora_gap(ctx) is None:
        start_server(ctx)
    else:
        ctx.state.get(LORA_SERVER)


def serve_base(ctx: CheckContext) -> Server:
    """The run's server holding the checkpoint's own weights (pushed back in place if it holds others)."""
    running = server(ctx)
    shared = ctx.state.get(SERVER)
    if shared.holds != "base":
        running.update_weights(buckets(base_tensors(ctx.model_dir), push_bucket_bytes(ctx)))
        shared.holds = "base"
    return running


def policy_adapter(ctx: CheckContext) -> tuple[Path, str]:
    """(adapter dir, where it came from); an adapter that leaves a declared target uncovered is an error."""
    trained = ctx.state.find(TRAINED_ADAPTER)
    if trained is not None:
        adapter, origin = trained, "written by the Megatron trainer (lora_coverage)"
    else:
        seed = ctx.seed + RANDOM_ADAPTER_SEED
        adapter, origin = ctx.state.get(RANDOM_ADAPTER), f"random Megatron LoRA exported through the API (seed {seed})"
    adapter_config, tensors = load_peft_adapter(adapter)
    uncovered = uncovered_targets(ctx.spec, *adapter_targets(adapter_config, tensors))
    if uncovered:
        raise TargetCoverageError(
            f"the policy adapter ({origin}) covers no module for {', '.join(uncovered)}: the checkpoint does not "
            "name those targets as the handler declares them (see the architecture stage)"
        )
    return adapter, origin


def policy_model(ctx: CheckContext) -> api.TrainingModel:
    """The run's Megatron model carrying the policy adapter (loaded through the API)."""
    adapter, _ = policy_adapter(ctx)
    model = ctx.state.get(TRAINING_MODEL)
    ctx.state.get(LORA)
    api.load_adapter(model, adapter)
    return model


def serve_policy(ctx: CheckContext) -> Server:
    """A server holding the policy: the run's server with the policy's merged weights pushed in place from the
    Megatron model; where the build cannot take weights in place (:func:`inplace_gap`), a server started on
    those merged weights written as a checkpoint (``<handler>-policy``)."""
    if inplace_gap(ctx) is not None:
        policy_server = ctx.state.get(POLICY_SERVER)
        with timing.phase("server_start"):
            return policy_server.wait_ready()
    running = server(ctx)
    if _push_pending(ctx):
        api.push_weights(running, policy_model(ctx), bucket_bytes=push_bucket_bytes(ctx))
        ctx.state.get(SERVER).holds = "policy"
    return running


def _push_pending(ctx: CheckContext) -> bool:
    """Whether :func:`serve_policy` pushes the policy in place into the run's shared server when called next."""
    return inplace_gap(ctx) is None and ctx.state.get(SERVER).holds != "policy"


# A prompt longer than two of vLLM's KV blocks (128 tokens on its CPU build, 16 on a GPU): only whole blocks are cached.
CACHE_PROBE_TOKENS = 272
_NEXT_TOKEN = {"max_tokens": 1, "temperature": 0.0, "logprobs": 5}


def serve_policy_probed(ctx: CheckContext) -> tuple[Server, dict[str, float | int] | None]:
    """:func:`serve_policy`, and where it pushes in place, what the push left in vLLM's prefix cache: probe
    prompts (:data:`CACHE_PROBE_TOKENS` and a long one) sent twice at the old weights (the second reads whole blocks
    from the cache: ``prefix_cache_tokens_before_push``, 0 where the server caches none) and again after the push,
    which must read none of them (``prefix_cache_tokens_after_push``), and whose greedy next token's top
    log-probabilities must equal those of the same prompt under a cache salt of its own, computed afresh
    (``prefix_cache_logprob_max_abs_err``). None where nothing was pushed here."""
    if not _push_pending(ctx):
        return serve_policy(ctx), None
    running = server(ctx)
    probe = random_prompts(ctx, 1, CACHE_PROBE_TOKENS)
    for prompt in probe:
        running.completion(prompt, **_NEXT_TOKEN)
    start = running.prefix_cache_hits()
    for prompt in probe:
        running.completion(prompt, **_NEXT_TOKEN)
    before = running.prefix_cache_hits()
    served = serve_policy(ctx)
    cached = [served.completion(prompt, **_NEXT_TOKEN) for prompt in probe]
    after = served.prefix_cache_hits()
    salt = "fresh-" + re.sub(r"[^\w.-]", "-", served.served_name)  # vLLM refuses '@' and '/' in a salt
    fresh = [served.completion(prompt, cache_salt=salt, **_NEXT_TOKEN) for prompt in probe]
    if start is None or before is None or after is None:
        return served, None
    return served, {
        "prefix_cache_tokens_before_push": before - start,
        "prefix_cache_tokens_after_push": after - before,
        "prefix_cache_logprob_max_abs_err": max(_top_gap(c, f) for c, f in zip(cached, fresh, strict=True)),
    }


def _top_gap(first: dict[str, Any], second: dict[str, Any]) -> float:
    """The largest |log p| difference over the next token's top tokens of two answers (inf where they differ in
    which tokens they list)."""
    a, b = first["logprobs"]["top_logprobs"][0], second["logprobs"]["top_logprobs"][0]
    if a.keys() != b.keys():
        return float("inf")
    return max(abs(a[token] - b[token]) for token in a)


def megatron_logprobs(
    ctx: CheckContext, sequences: list[list[int]], routed_experts: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Per-position log-softmax of the Megatron policy (base + adapter) for each sequence, float64 on the CPU;
    ``routed_experts``: each sequence's experts replayed (``api.token_logprobs``)."""
    model = policy_model(ctx)
    with torch.no_grad():
        return [rows.double().cpu() for rows in api.token_logprobs(model, sequences, routed_experts)]


def routed_as_served(ctx: CheckContext, sequences: list[list[int]], served: list[torch.Tensor]) -> float:
    """The share of (token, MoE layer) pairs the Megatron policy routes to the experts the server chose
    (``served``: each sequence's ``api.served_experts``), every token but each sequence's last (a stand-in there)."""
    with torch.no_grad():
        own = api.routed_experts(policy_model(ctx), sequences)
    same = total = 0
    for mine, theirs in zip(own, served, strict=True):
        mine, theirs = mine[:-1], theirs[:-1]
        moe = (mine >= 0).all(-1)  # -1 at a dense layer
        equal = (mine.sort(-1).values == theirs.sort(-1).values).all(-1)
        same, total = same + int((equal & moe).sum()), total + int(moe.sum())
    return same / total


def trainer_logprobs(
    ctx: CheckContext,
    adapter: Path,
    sequences: list[list[int]],
    dtype: torch.dtype = torch.float32,
    merge_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Per-position log-softmax of the transformers policy (base + adapter merged, each merged tensor rounded to
    ``merge_dtype`` where given; fp32 unless ``dtype`` says) for each sequence."""
    from model_support.core.megatron.hf_reference import adapter_deltas

    reference, deltas = hf_reference(ctx, dtype), adapter_deltas(adapter)
    by_length: dict[int, list[int]] = {}
    for i, seq in enumerate(sequences):
        by_length.setdefault(len(seq), []).append(i)
    out: dict[int, torch.Tensor] = {}
    for rows in by_length.values():  # one forward per length: no padding
        ids = torch.tensor([sequences[i] for i in rows])
        logits = reference.forward(ids, adapter=deltas, merge_dtype=merge_dtype).logits
        # The log-softmax on the reference's device (a GPU's), the rows then kept on the host.
        out.update(zip(rows, torch.log_softmax(logits.double(), dim=-1).cpu(), strict=True))
    return [out[i] for i in range(len(sequences))]


def token_logprobs(logprobs: torch.Tensor, seq: list[int], start: int) -> torch.Tensor:
    """log p(seq[t] | seq[:t]) for t >= start, from per-position log-softmax rows."""
    positions = torch.arange(start, len(seq))
    return logprobs[positions - 1, torch.tensor(seq[start:])]


def served_prompt_logprobs(choice: dict[str, Any], seq: list[int]) -> torch.Tensor:
    """vLLM's prompt_logprobs for tokens 1.. of ``seq`` (entry 0 is None)."""
    rows = choice["prompt_logprobs"][1:]
    return torch.tensor([row[str(tok)]["logprob"] for row, tok in zip(rows, seq[1:], strict=True)], dtype=torch.float64)


def random_prompts(ctx: CheckContext, count: int, length: int) -> list[list[int]]:
    """``count`` random prompts of ``length`` tokens and one more across every length-dependent structure of the model
    (GDN chunks, a sliding window, where rope scaling starts: ``long_row_length``), so a serving comparison sees
    what a long rollout sees."""
    from model_support.core.layout import long_row_length

    vocab = int(getattr(ctx.config.get_text_config(), "vocab_size", 512))
    gen = torch.Generator().manual_seed(ctx.seed + 11)
    lengths = [length] * count + [long_row_length(ctx.config, ctx.layout)]
    return [torch.randint(10, min(vocab, 500), (n,), generator=gen).tolist() for n in lengths]
