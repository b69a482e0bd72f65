"""``model-support selftest``: named bugs injected into the real code path; each must make its stage fail.

A check that no bug can break proves nothing. Each `Mutation` patches one function or method of this
project at run time (``unittest.mock.patch``: the code under test is the real one, with one thing wrong), runs
``check --tiny --stage S --alone`` of one built-in handler: the stage S that must catch it, without its
prerequisites (under the parallel layout the bug lives in, where it names one), and records whether S failed. The
same stages, unpatched, must pass the same way: a clean run is part of the selftest.
Mutations that need a vLLM server skip where no runtime is installed. CI runs one bug of each stage, so a stage
that stops being able to fail breaks CI; the tests' exhaustive tier (``pytest --exhaustive``) runs the whole catalogue.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from model_support.core.errors import ModelSupportError


@dataclass(frozen=True)
class Mutation:
    """One injected bug: what is wrong, on which tiny replica, and the stage that must fail because of it."""

    name: str
    bug: str
    handler: str
    stage: str
    patch: Callable[[], AbstractContextManager[Any]]
    needs_server: bool = False
    # The parallel layouts the bug lives in: ``parallel_parity`` checks only those under it (empty: its default).
    layouts: tuple[str, ...] = ()
    # The dtype the check trains in (``check --dtype``; None: the device's), for a bug that only a bf16 run shows.
    dtype: str | None = None
    # The layout ``check --parallel`` shards the model under test in (None: one process), for a bug of the sharded
    # model that the stage holds to transformers.
    parallel: str | None = None


# --- the mutations -------------------------------------------------------------------------------------------------


def _swap_pairs(tensors: dict[str, torch.Tensor], first: str, second: str) -> dict[str, torch.Tensor]:
    out = dict(tensors)
    for key in tensors:
        if f".{first}.lora_B" in key:
            other = key.replace(f".{first}.", f".{second}.")
            out[key], out[other] = tensors[other], tensors[key]
    return out


@contextmanager
def _codec_output(rewrite: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Iterator[None]:
    """The codec's PEFT tensors rewritten on the way out and, inverted, on the way in (a self-consistent bug)."""
    from model_support.core.codecs import BridgeLoraCodec

    to_peft, from_peft = BridgeLoraCodec.to_peft, BridgeLoraCodec.from_peft

    def patched_to(self: Any, tensors: Any, config: Any, layout: Any) -> dict[str, torch.Tensor]:
        return rewrite(to_peft(self, tensors, config, layout))

    def patched_from(self: Any, tensors: Any, config: Any, layout: Any) -> dict[str, torch.Tensor]:
        return from_peft(self, rewrite(dict(tensors)), config, layout)

    with (
        mock.patch.object(BridgeLoraCodec, "to_peft", patched_to),
        mock.patch.object(BridgeLoraCodec, "from_peft", patched_from),
    ):
        yield


def _gate_up_swapped() -> AbstractContextManager[None]:
    return _codec_output(lambda t: _swap_pairs(t, "gate_proj", "up_proj"))


def _experts_off_by_one() -> AbstractContextManager[Any]:
    from model_support.core.codecs import BridgeLoraCodec

    to_peft = BridgeLoraCodec.to_peft

    def patched(self: Any, tensors: Any, config: Any, layout: Any) -> dict[str, torch.Tensor]:
        peft = to_peft(self, tensors, config, layout)
        count = 1 + max(int(m.group(1)) for k in peft if (m := re.search(r"\.experts\.(\d+)\.", k)))
        return {
            re.sub(r"\.experts\.(\d+)\.", lambda m: f".experts.{(int(m.group(1)) + 1) % count}.", k): v
            for k, v in peft.items()
        }

    return mock.patch.object(BridgeLoraCodec, "to_peft", patched)


def _split_rewritten(kind: str, rewrite: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> Any:
    """The codec's learnt split of every ``kind`` mapping (e.g. ``QKVMapping``) rewritten."""
    from model_support.core.codecs import _Family

    original = _Family.split

    def patched(self: Any, mapping: Any, rows: int, cols: int) -> list[tuple[str, torch.Tensor]]:
        split = original(self, mapping, rows, cols)
        return rewrite(split) if type(mapping).__name__ == kind else split

    return mock.patch.object(_Family, "split", patched)


def _qkv_by_head() -> AbstractContextManager[Any]:
    def contiguous(split: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        out, start = [], 0
        for role, rows in split:  # [all q; all k; all v] instead of interleaved per query group
            out.append((role, torch.arange(start, start + len(rows))))
            start += len(rows)
        return out

    return _split_rewritten("QKVMapping", contiguous)


def _gdn_b_a_swapped() -> AbstractContextManager[Any]:
    def swap(split: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        rows = dict(split)
        roles = [role for role, _ in split]
        b, a = roles[-2], roles[-1]  # in_proj_b and in_proj_a: the last two sections, of equal size
        rows[b], rows[a] = rows[a], rows[b]
        return [(role, rows[role]) for role in roles]

    return _split_rewritten("GDNLinearMappingSeparate", swap)


def _lora_scale_alpha() -> AbstractContextManager[Any]:
    from model_support.core.megatron.lora import LoraLinear

    init = LoraLinear.__init__

    def patched(self: LoraLinear, base: Any, rank: int, alpha: float, sections: list[int]) -> None:
        init(self, base, rank, alpha, sections)
        self.scale = alpha  # PEFT scales by alpha / r

    return mock.patch.object(LoraLinear, "__init__", patched)


def _lora_branch_dropped() -> AbstractContextManager[Any]:
    from model_support.core.megatron.lora import LoraLinear

    def forward(self: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.base(x, *args, **kwargs)

    return mock.patch.object(LoraLinear, "forward", forward)


def _base_left_trainable() -> AbstractContextManager[Any]:
    from model_support.core import api

    apply = api.apply_lora

    def patched(model: Any, **kw: Any) -> Any:
        report = apply(model, **kw)
        model.module.embedding.word_embeddings.weight.requires_grad_(True)
        return report

    return mock.patch.object(api, "apply_lora", patched)


def _boundaries_ignored() -> AbstractContextManager[Any]:
    from model_support.core.megatron.rows import RowLayout, Segment

    def one_sequence(position_ids: torch.Tensor) -> RowLayout:
        return RowLayout(((Segment(0, position_ids.shape[-1], 0),),), position_ids.shape[-1])

    return mock.patch.object(RowLayout, "from_position_ids", one_sequence)


def _gdn_state_not_reset() -> AbstractContextManager[Any]:
    """GDN layers are not told the row's layout: their state runs through it as one sequence."""
    return mock.patch("model_support.core.megatron.forward._gdn_layers", lambda model: [])


def _completion_rope_at_row_index() -> AbstractContextManager[Any]:
    """Shared-prefix rows: rotary embeddings by index in the row, not by the completion's true position."""
    return mock.patch(
        "model_support.core.megatron.forward._rotary_at", lambda module, positions, length: module.forward
    )


def _completion_conv_restarts() -> AbstractContextManager[Any]:
    """Shared-prefix rows: a completion's causal convolution starts from zeros, not after its prompt's tokens."""
    from model_support.core.megatron import gdn
    from model_support.core.megatron.rows import RowLayout

    conv = gdn.causal_conv

    def restarting(x: torch.Tensor, weight: torch.Tensor, rows: RowLayout | None, bias: Any = None) -> torch.Tensor:
        if rows is None or not rows.shared:
            return conv(x, weight, rows, bias)
        plain = RowLayout(tuple((segment,) for segment in rows.segments), rows.length)
        return conv(x, weight, plain, bias)

    return mock.patch.object(gdn, "causal_conv", restarting)


def _model_mutated(mutate: Callable[[torch.nn.Module], None]) -> AbstractContextManager[Any]:
    """The Megatron model as built through the API, with one weight mis-placed."""
    from model_support.core import api

    build = api.build_model

    def patched(*args: Any, **kw: Any) -> Any:
        model = build(*args, **kw)
        with torch.no_grad():
            mutate(model.module)
        return model

    return mock.patch.object(api, "build_model", patched)


def _router_rolled() -> AbstractContextManager[Any]:
    def roll(model: torch.nn.Module) -> None:
        router = model.decoder.layers[1].mlp.router
        router.weight.copy_(router.weight.roll(1, dims=0))

    return _model_mutated(roll)


def _q_norm_gain_permuted() -> AbstractContextManager[Any]:
    """Layer 0's query RMSNorm gain with its channels reversed (as a head-dim-major reshape misplaces them): invisible
    on a replica whose gains are all ones."""

    def permute(model: torch.nn.Module) -> None:
        norm = model.decoder.layers[0].self_attention.q_layernorm
        norm.weight.copy_(norm.weight.flip(0))

    return _model_mutated(permute)


def _long_row_capped() -> AbstractContextManager[Any]:
    """The stages' long row capped at 64 tokens: it no longer crosses a GDN chunk boundary, a window or where rope
    scaling starts, so nothing the comparisons hold to transformers sees those structures."""
    from model_support.validation import megatron_session

    long_row = megatron_session.long_row
    return mock.patch.object(megatron_session, "long_row", lambda ctx: min(long_row(ctx), 64))


def _layout_without_result() -> AbstractContextManager[Any]:
    """The ranks of a tensor-parallel layout leave with status 0 before writing its result, and without an error (a
    crash the launcher takes for a clean exit)."""
    import os

    from megatron.core import parallel_state

    from model_support.core import api

    apply = api.apply_lora

    def leaving(model: Any, **kw: Any) -> Any:
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            os._exit(0)
        return apply(model, **kw)

    return mock.patch.object(api, "apply_lora", leaving)


def _gdn_q_k_swapped() -> AbstractContextManager[Any]:
    def swap(model: torch.nn.Module) -> None:
        gdn = model.decoder.layers[0].self_attention
        q, k = gdn.sections[0], gdn.sections[1]
        weight = gdn.in_proj.weight
        weight[: q + k] = torch.cat([weight[q : q + k], weight[:q]]).clone()

    return _model_mutated(swap)


def _pushed_weights(rewrite: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Any:
    from model_support.core import api

    merged = api.merged_weights

    def patched(model: Any, **kw: Any) -> Iterator[dict[str, torch.Tensor]]:
        for bucket in merged(model, **kw):
            yield rewrite(bucket)

    return mock.patch.object(api, "merged_weights", patched)


_Q = "model.layers.0.self_attn.q_proj.weight"


def _served_q_halves_swapped() -> AbstractContextManager[Any]:
    return _pushed_weights(lambda b: {**b, _Q: torch.cat(b[_Q].chunk(2)[::-1])} if _Q in b else b)


def _weight_version_kept() -> AbstractContextManager[Any]:
    """A push applies its weights but leaves the server's weight version, which sampled tokens report, as it was."""
    from model_support.core.serving.update import WeightUpdater

    swap = WeightUpdater._swap

    def kept(self: WeightUpdater, apply: Any, finish: Any) -> None:
        swap(self, apply, lambda version: finish(None))

    return mock.patch.object(WeightUpdater, "_swap", kept)


def _staleness_boundary_late() -> AbstractContextManager[Any]:
    """Per-token weight versions read one token late: the first token the new weights sampled is reported as the
    old weights'."""
    from model_support.core.serving import vllm_backend

    staleness = vllm_backend.staleness

    def late(choice: dict[str, Any]) -> dict[str, Any]:
        spans = [dict(span) for span in choice.get("weight_versions") or []]
        for earlier, later in itertools.pairwise(spans):
            earlier["end"], later["start"] = earlier["end"] + 1, later["start"] + 1
        return staleness({**choice, "weight_versions": spans})

    return mock.patch.object(vllm_backend, "staleness", late)


def _adapter_staleness_next_step() -> AbstractContextManager[Any]:
    """A LoRA request's staleness fields name the step after its adapter's (the one hot-swapped in next)."""
    from model_support.core.serving import vllm_backend

    adapter_staleness = vllm_backend.adapter_staleness
    return mock.patch.object(
        vllm_backend, "adapter_staleness", lambda choice, step: adapter_staleness(choice, step + 1)
    )


def _push_keeps_last_bucket() -> AbstractContextManager[Any]:
    """A push that loses every bucket but the last: a push of one bucket (a tiny replica at the default size) loses
    nothing."""
    from model_support.core import api

    merged = api.merged_weights

    def last_only(model: Any, **kw: Any) -> Iterator[dict[str, torch.Tensor]]:
        *_, last = merged(model, **kw)
        yield last

    return mock.patch.object(api, "merged_weights", last_only)


def _export_drops_a_tensor() -> AbstractContextManager[Any]:
    return _pushed_weights(lambda b: {k: v for k, v in b.items() if k != _Q})


def _lora_row_reduce_missing() -> AbstractContextManager[Any]:
    """Row-parallel LoRA branches skip their tensor-parallel all-reduce (each rank adds its partial A(x))."""
    from megatron.core import tensor_parallel

    return mock.patch.object(tensor_parallel, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)


def _sequence_parallel_grads_unsynced() -> AbstractContextManager[Any]:
    from model_support.core.megatron import lora

    return mock.patch.object(lora, "sync_sequence_parallel_grads", lambda model: None)


def _part_not_gathered(kind: str) -> AbstractContextManager[Any]:
    """The LoRA state keeps this rank's part of the model: the ``kind`` ("expert" or "pipeline") parallel group is
    left out of the gathers, so the exported adapter lacks the other ranks' experts or layers."""
    from megatron.core import parallel_state

    from model_support.core.megatron import lora

    spread = lora._spread_over
    groups = {
        "expert": parallel_state.get_expert_model_parallel_group,
        "pipeline": parallel_state.get_pipeline_model_parallel_group,
    }
    return mock.patch.object(
        lora, "_spread_over", lambda: [(g, split) for g, split in spread() if g is not groups[kind]()]
    )


def _expert_tp_grad_unsummed() -> AbstractContextManager[Any]:
    """Under expert tensor parallelism the replicated LoRA factor keeps this shard's part of its gradient."""
    from model_support.core.megatron import lora

    return mock.patch.object(lora._SumGradient, "apply", lambda weight, group: weight)


def _grads_reduced_in_model_dtype() -> AbstractContextManager[Any]:
    """The LoRA gradients are rounded to the base model's dtype before they are reduced (a trainer's gradient
    buffer in the model's dtype): nothing changes in an fp32 model."""
    from model_support.core.megatron import lora

    reduce = lora.reduce_lora_grads

    def rounded(model: Any) -> None:
        for module in lora.lora_modules(model).values():
            for param in (module.lora_A.weight, module.lora_B.weight):
                if param.grad is not None:
                    param.grad.copy_(param.grad.to(module.base.weight.dtype))
        reduce(model)

    return mock.patch.object(lora, "reduce_lora_grads", rounded)


def _lora_shard_in_model_dtype() -> AbstractContextManager[Any]:
    """Tensor-parallel rank 1 keeps its LoRA factors in the base model's dtype, not fp32 (nothing changes in an
    fp32 model)."""
    from model_support.core.megatron.lora import LoraLinear

    init = LoraLinear.__init__

    def patched(self: LoraLinear, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.group.rank() == 1:
            self.lora_A.to(self.base.weight.dtype)
            self.lora_B.to(self.base.weight.dtype)

    return mock.patch.object(LoraLinear, "__init__", patched)


def _tp_shard_weights_fp8() -> AbstractContextManager[Any]:
    """Tensor-parallel rank 1's linear weights pass through float8 (e4m3, scaled per tensor) when the model is
    built in bf16: a shard quantised by a wrong load path, the dtype still bf16."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from model_support.core.megatron import builder

    load = builder._load_weights

    def quantised(built: Any) -> None:
        load(built)
        if built.numerics.dtype != torch.bfloat16:
            return
        with torch.no_grad():
            for chunk in built.chunks:
                for module in chunk.modules():
                    linear = isinstance(module, ColumnParallelLinear | RowParallelLinear)
                    if linear and module.weight is not None and module.tp_group.rank() == 1:
                        scale = module.weight.abs().amax().clamp_min(1e-12) / 448.0
                        module.weight.copy_((module.weight / scale).to(torch.float8_e4m3fn).to(torch.bfloat16) * scale)

    return mock.patch.object(builder, "_load_weights", quantised)


def _one_rank_raises() -> AbstractContextManager[Any]:
    """Rank 1 raises in its first training step of a model-parallel layout while its peers go on into the step's
    collectives (the oracle, one rank's model, runs)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from model_support.core import api

    step = api.forward_backward

    def raising(*args: Any, **kwargs: Any) -> Any:
        sizes = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if dist.get_rank() == 1 and max(sizes) > 1:
            raise RuntimeError("planted failure on rank 1")
        return step(*args, **kwargs)

    return mock.patch.object(api, "forward_backward", raising)


def _context_keys_local() -> AbstractContextManager[Any]:
    """Context-parallel attention attends to its own rank's keys and values only."""
    from model_support.core.megatron import context_parallel

    return mock.patch.object(context_parallel, "gather_keys", lambda local, cp_group: local)


def _gdn_chunk_state_not_decayed() -> AbstractContextManager[Any]:
    """The chunked GDN kernel carries the state into the next chunk without the chunk's decay (seen past 64 tokens)."""
    from model_support.kernels import gdn

    recurrence = gdn.state_recurrence

    def undecayed(u: Any, w: Any, kd: Any, gamma: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return recurrence(u, w, kd, torch.ones_like(gamma), *args, **kwargs)

    return mock.patch.object(gdn, "state_recurrence", undecayed)


def _declared(handler: str, change: Callable[[Any], Any]) -> AbstractContextManager[Any]:
    """``handler``'s registered declaration replaced by ``change(spec)`` in every registry built, as if its plugin
    declared it so (the replacement still passes ``declaration_problems``)."""
    from model_support.core.registry import RegisteredHandler, Registry

    build = Registry.from_plugins.__func__

    def patched(cls: type[Registry], loaded: Any, preferences: Any = None) -> Registry:
        registry = build(cls, loaded, preferences)
        entry = registry.handlers.get(handler)
        if entry is not None:
            changed = RegisteredHandler(change(entry.spec), entry.plugin)
            registry.handlers[handler] = changed
            for claimants in registry.claims.values():
                claimants[:] = [changed if claimant is entry else claimant for claimant in claimants]
        return registry

    return mock.patch.object(Registry, "from_plugins", classmethod(patched))


def _fc1_declares_gate_only() -> AbstractContextManager[Any]:
    from dataclasses import replace

    from model_support.core.spec import TargetScope

    def gate_only(spec: Any) -> Any:
        targets = tuple(
            replace(t, hf=("gate_proj",)) if (t.megatron, t.scope) == ("linear_fc1", TargetScope.MLP) else t
            for t in spec.lora_targets
        )
        return replace(spec, lora_targets=targets)

    return _declared("qwen3", gate_only)


def _gdn_in_proj_not_targeted() -> AbstractContextManager[Any]:
    from dataclasses import replace

    from model_support.core.spec import TargetScope

    def without_in_proj(spec: Any) -> Any:
        targets = tuple(t for t in spec.lora_targets if (t.megatron, t.scope) != ("in_proj", TargetScope.GDN))
        return replace(spec, lora_targets=targets)

    return _declared("qwen3.5", without_in_proj)


def _doubled_shared_expert_width(text: Any) -> int:
    return 2 * text.shared_expert_intermediate_size


def _shared_expert_width_doubled() -> AbstractContextManager[Any]:
    from dataclasses import replace

    def doubled(spec: Any) -> Any:
        fields = replace(spec.config_fields, shared_expert_intermediate_size=_doubled_shared_expert_width)
        return replace(spec, config_fields=fields)

    return _declared("qwen3.5-moe", doubled)


def _group_logprobs_off_by_one() -> AbstractContextManager[Any]:
    """``api.group_logprobs`` returns each completion's rows one position late (row t scores c[t + 1])."""
    from model_support.core import api

    group = api.group_logprobs

    def shifted(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        return [rows.roll(-1, dims=0) for rows in group(*args, **kwargs)]

    return mock.patch.object(api, "group_logprobs", shifted)


def _fresh_adapter_not_identity() -> AbstractContextManager[Any]:
    """``apply_lora``'s fresh adapter draws B ~ N(0, 0.02) instead of zeros."""
    from model_support.core.megatron import lora

    factors = lora.fresh_factors

    def random_b(name: str, seed: int, shape_a: Any, shape_b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = factors(name, seed, shape_a, shape_b)
        return a, torch.randn(b.shape, generator=torch.Generator().manual_seed(seed)) * 0.02

    return mock.patch.object(lora, "fresh_factors", random_b)


def _lora_dropout_in_train_mode() -> AbstractContextManager[Any]:
    """A Dropout(p=0.1) on the LoRA branch's input, active in train mode (one rank: the branch is linear there, so
    adding ``scale * B(A(dropout(x) - x))`` is the branch run on ``dropout(x)``)."""
    from model_support.core.megatron.lora import LoraLinear

    init, forward = LoraLinear.__init__, LoraLinear.forward

    def patched_init(self: LoraLinear, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.lora_dropout = torch.nn.Dropout(0.1)

    def patched_forward(self: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out, bias = forward(self, x, *args, **kwargs)
        dropped = (self.lora_dropout(x) - x).to(self.lora_A.weight.dtype)
        extra = torch.nn.functional.linear(torch.nn.functional.linear(dropped, self.lora_A.weight), self.lora_B.weight)
        return out + (self.scale * extra).to(out.dtype), bias

    stack = ExitStack()
    stack.enter_context(mock.patch.object(LoraLinear, "__init__", patched_init))
    stack.enter_context(mock.patch.object(LoraLinear, "forward", patched_forward))
    return stack


def _scoring_outside_the_schedule() -> AbstractContextManager[Any]:
    """The trainer's scoring calls run this rank's own model chunk directly, outside megatron-core's schedule: a
    first pipeline stage has no logits, a last one reads stale activations."""
    from model_support.core.megatron import forward

    def own_chunk(chunks: Any, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return forward.logits(list(chunks)[-1], input_ids, position_ids)

    return mock.patch.object(forward, "scored_logits", own_chunk)


def _lora_update(branch: Callable[[Any, torch.Tensor], torch.Tensor]) -> AbstractContextManager[Any]:
    """``LoraLinear.forward`` on one rank (the tiny replicas' layout), its update computed by ``branch(self, x)``."""
    from model_support.core.megatron.lora import LoraLinear

    def forward(self: LoraLinear, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        post_norm = getattr(self.base, "post_layernorm", None)
        out, bias = (self.base if post_norm is None else self.base.project)(x, *args, **kwargs)
        out = out + branch(self, x).to(out.dtype)
        return (out if post_norm is None else post_norm(out)), bias

    return mock.patch.object(LoraLinear, "forward", forward)


def _prefix_cache_kept() -> AbstractContextManager[Any]:
    from model_support.core.serving.vllm_backend import VllmServer

    request = VllmServer.request

    def kept(self: VllmServer, path: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
        return None if path.startswith("/reset_prefix_cache") else request(self, path, body, timeout)

    return mock.patch.object(VllmServer, "request", kept)


def _adapter_alias_reused() -> AbstractContextManager[Any]:
    from model_support.core.serving.vllm_backend import VllmServer

    update_adapter = VllmServer.update_adapter

    def reused(self: VllmServer, adapter_dir: Path, name: str | None = None) -> str:
        key = self.adapter_key(name)
        if key not in self._adapters:  # the first swap loads as the real one does
            return update_adapter(self, adapter_dir, name)
        served, copy = self._adapters[key]
        self.unload_lora(served)
        shutil.rmtree(copy)
        self.load_lora(served, self._adapter_copy(adapter_dir, served))
        return served

    return mock.patch.object(VllmServer, "update_adapter", reused)


def _grad_norm_sums_rank_norms() -> AbstractContextManager[Any]:
    """The global LoRA gradient norm as each rank's own squares summed over the ranks: every replica counted."""
    from model_support.core.megatron import lora

    def every_grad(model: Any) -> list[torch.Tensor]:
        modules = lora.lora_modules(model).values()
        return [p.grad for m in modules for p in (m.lora_A.weight, m.lora_B.weight) if p.grad is not None]

    return mock.patch.object(lora, "counted_grads", every_grad)


def _lora_disabled_keeps_row_parallel() -> AbstractContextManager[Any]:
    """``api.lora_disabled`` turns off the column-parallel LoRA modules only."""
    from model_support.core.megatron import lora

    @contextmanager
    def columns_only(model: Any) -> Iterator[None]:
        columns = [m for m in lora.lora_modules(model).values() if m.column]
        for module in columns:
            module.enabled = False
        try:
            yield
        finally:
            for module in columns:
                module.enabled = True

    return mock.patch.object(lora, "lora_disabled", columns_only)


def _recompute_loses_row_layout() -> AbstractContextManager[Any]:
    return mock.patch("model_support.core.megatron.forward.RowState.again_in_backward", lambda _self, _out: None)


def _lora_input_detached() -> AbstractContextManager[Any]:
    def branch(self: Any, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.linear(x.detach().to(self.lora_A.weight.dtype), self.lora_A.weight)
        return self.scale * torch.nn.functional.linear(hidden, self.lora_B.weight)

    return _lora_update(branch)


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; the backward scales the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _lora_b_grad_unscaled() -> AbstractContextManager[Any]:
    """The forward is right; B's gradient leaves out the LoRA scale alpha / r (as a fused kernel's backward might).
    Adam normalises a gradient's scale away, so training barely notices."""

    def branch(self: Any, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.linear(x.to(self.lora_A.weight.dtype), self.lora_A.weight)
        # (a stage may zero the scale to run without the adapter)
        weight_b = _ScaledGradient.apply(self.lora_B.weight, 1 / self.scale) if self.scale else self.lora_B.weight
        return self.scale * torch.nn.functional.linear(hidden, weight_b)

    return _lora_update(branch)


def _adapter_config_rslora() -> AbstractContextManager[Any]:
    """The exported adapter's config says ``use_rslora``: PEFT and vLLM scale it by alpha / sqrt(r), the trainer
    trained it at alpha / r."""
    from model_support.core import codecs

    save = codecs.save_peft_adapter

    def patched(out_dir: Path, *args: Any, **kwargs: Any) -> Path:
        written = save(out_dir, *args, **kwargs)
        config_path = out_dir / codecs.ADAPTER_CONFIG
        config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"use_rslora": True}))
        return written

    return mock.patch.object(codecs, "save_peft_adapter", patched)


def _export_merged_unscaled() -> AbstractContextManager[Any]:
    """The merged export adds B A without the adapter's scale alpha / r."""
    from model_support.core.serving import export

    def merged(tensor: torch.Tensor, delta: tuple[torch.Tensor, torch.Tensor, float]) -> torch.Tensor:
        lora_a, lora_b, _scale = delta
        return (tensor.float() + lora_b.float() @ lora_a.float()).to(tensor.dtype)

    return mock.patch.object(export, "_merged", merged)


def _live_merge_unscaled() -> AbstractContextManager[Any]:
    """The live model's merge (what a push sends, and ``api.lora_merged``'s policy) adds B A without alpha / r."""
    from model_support.core.megatron import hf_export, lora

    def merged(module: Any, weight: torch.Tensor) -> torch.Tensor:
        delta = module.lora_B.weight.detach().float() @ module.lora_A.weight.detach().float()
        return (weight.detach().float() + delta).to(weight.dtype)

    stack = ExitStack()
    for where in (hf_export, lora):
        stack.enter_context(mock.patch.object(where, "merged_weight", merged))
    return stack


MUTATIONS: tuple[Mutation, ...] = (
    Mutation("gate-up-swapped", "codec reads Megatron's fused fc1 as [up; gate]", "qwen3", "lora_coverage",
             _gate_up_swapped),
    Mutation("qkv-split-by-head", "codec splits linear_qkv as [q; k; v], not per query group", "qwen3",
             "lora_coverage", _qkv_by_head),
    Mutation("expert-index-off-by-one", "codec names expert e's LoRA as expert e+1", "qwen3-moe", "lora_coverage",
             _experts_off_by_one),
    Mutation("gdn-in-proj-b-a-swapped", "codec swaps GDN in_proj's b and a sections", "qwen3.5", "lora_coverage",
             _gdn_b_a_swapped),
    Mutation("lora-scale-alpha", "LoRA scaled by alpha instead of alpha / r", "qwen3", "lora_coverage",
             _lora_scale_alpha),
    Mutation("lora-branch-dropped", "LoRA linears return the base output only", "qwen3", "lora_coverage",
             _lora_branch_dropped),
    Mutation("base-weight-trainable", "the embedding is left trainable beside LoRA", "qwen3", "trainability",
             _base_left_trainable),
    Mutation("packed-boundaries-ignored", "a packed row is one sequence (position ids do not restart)", "qwen3",
             "packed_position_ids", _boundaries_ignored),
    Mutation("samples-scored-as-one-sequence", "the trainer scores its packed row of sampled sequences as one "
             "sequence (positions and attention run across them)", "qwen3", "train_inference_mismatch",
             _boundaries_ignored, needs_server=True, dtype="bf16"),
    Mutation("recompute-loses-row-layout", "a packed row's layout is off the layers when the backward recomputes "
             "them", "qwen3", "packed_position_ids", _recompute_loses_row_layout),
    # shared_prefix's own catch of the bug above, by its short-prompt rows: after a 4096-token prompt at Qwen3-30B-A3B
    # width the bug moved the completions' gradients 0.68 % (limit 2.94 %); the tiny replica's 16-token prompt: 43.2 %.
    Mutation("shared-row-layout-lost-in-recompute", "a shared-prefix row's layout is off the layers when the "
             "backward recomputes them (bf16)", "qwen3", "shared_prefix", _recompute_loses_row_layout, dtype="bf16"),
    Mutation("gdn-state-not-reset", "GDN layers carry state across packed sequence boundaries", "qwen3.5",
             "packed_position_ids", _gdn_state_not_reset),
    Mutation("completion-rope-at-row-index", "shared-prefix rows: completions rotated by row index, not position",
             "qwen3", "shared_prefix", _completion_rope_at_row_index),
    Mutation("completion-conv-restarts", "shared-prefix rows: a completion's GDN convolution forgets the prompt",
             "qwen3.5", "shared_prefix", _completion_conv_restarts),
    Mutation("router-rows-rolled", "one MoE router's expert rows off by one", "qwen3-moe", "hf_parity",
             _router_rolled),
    Mutation("q-norm-gain-permuted", "layer 0's query RMSNorm gain with its channels reversed in Megatron", "qwen3",
             "hf_parity", _q_norm_gain_permuted),
    Mutation("long-row-capped", "the stages' long row capped at 64 tokens (no GDN chunk boundary crossed)", "qwen3.5",
             "hf_parity", _long_row_capped),
    Mutation("layout-without-result", "a layout's ranks end without a result file or an error", "qwen3",
             "parallel_parity", _layout_without_result, layouts=("tp2", "pp2")),
    Mutation("gdn-q-k-swapped", "one GDN layer's in_proj q and k rows exchanged in Megatron", "qwen3.5", "hf_parity",
             _gdn_q_k_swapped),
    Mutation("served-q-halves-swapped", "pushed weights: layer 0's query heads in the wrong order", "qwen3",
             "rl_trainability", _served_q_halves_swapped, needs_server=True),
    Mutation("weight-version-kept", "a push applies its weights but does not advance the server's weight version",
             "qwen3", "rl_trainability", _weight_version_kept, needs_server=True),
    Mutation("prefix-cache-kept", "a push in place leaves vLLM's prefix cache of the old weights", "qwen3",
             "merged_serving", _prefix_cache_kept, needs_server=True),
    Mutation("adapter-alias-reused", "a LoRA hot-swap serves the new adapter under the old one's name", "qwen3",
             "rl_trainability", _adapter_alias_reused, needs_server=True),
    Mutation("export-drops-a-tensor", "pushed weights: layer 0's q_proj left out of the update", "qwen3",
             "merged_serving", _export_drops_a_tensor, needs_server=True),
    Mutation("push-keeps-last-bucket", "a push sends only its last bucket of merged weights", "qwen3",
             "merged_serving", _push_keeps_last_bucket, needs_server=True),
    Mutation("staleness-boundary-late", "per-token weight versions read one token late (merged mode)", "qwen3",
             "staleness_boundary", _staleness_boundary_late, needs_server=True),
    Mutation("adapter-staleness-next-step", "a LoRA request's staleness fields name the next adapter's step", "qwen3",
             "staleness_boundary", _adapter_staleness_next_step, needs_server=True),
    Mutation("lora-tp-all-reduce-missing", "row-parallel LoRA skips its tensor-parallel all-reduce", "qwen3",
             "parallel_parity", _lora_row_reduce_missing, layouts=("tp2",)),
    Mutation("sp-lora-grads-unsynced", "sequence-parallel LoRA factors keep one sequence shard's gradient", "qwen3",
             "parallel_parity", _sequence_parallel_grads_unsynced, layouts=("tp2-sp",)),
    Mutation("expert-shard-dropped", "the LoRA state keeps one expert-parallel rank's experts", "qwen3-moe",
             "parallel_parity", lambda: _part_not_gathered("expert"), layouts=("ep2",)),
    Mutation("etp-lora-grad-unsummed", "expert-tensor-parallel LoRA keeps one shard's part of a replicated factor's "
             "gradient", "qwen3-moe", "parallel_parity", _expert_tp_grad_unsummed, layouts=("etp2",)),
    Mutation("pipeline-stage-dropped", "the LoRA state (and its export) keeps one pipeline stage's layers", "qwen3",
             "parallel_parity", lambda: _part_not_gathered("pipeline"), layouts=("pp2",)),
    Mutation("lora-grads-reduced-in-model-dtype", "LoRA gradients rounded to the model's dtype before their "
             "reduction (right in fp32)", "qwen3", "parallel_parity", _grads_reduced_in_model_dtype, layouts=("tp2",),
             dtype="bf16"),
    Mutation("lora-shard-in-model-dtype", "tensor-parallel rank 1 keeps its LoRA factors in the model's dtype, not "
             "fp32 (right in fp32)", "qwen3", "parallel_parity", _lora_shard_in_model_dtype, layouts=("tp2",),
             dtype="bf16"),
    Mutation("tp-shard-weights-fp8", "tensor-parallel rank 1's weights pass through float8 in a bf16 build (right in "
             "fp32)", "qwen3", "parallel_parity", _tp_shard_weights_fp8, layouts=("tp2",), dtype="bf16"),
    Mutation("grad-norm-sums-rank-norms", "api.lora_grad_norm sums every rank's own gradient squares (tensor-, "
             "data- and context-parallel replicas counted on each rank)", "qwen3", "parallel_parity",
             _grad_norm_sums_rank_norms, layouts=("tp2", "pp2")),
    Mutation("lora-disabled-keeps-row-parallel", "api.lora_disabled (the reference policy) turns off the "
             "column-parallel LoRA only", "qwen3", "parallel_parity", _lora_disabled_keeps_row_parallel,
             layouts=("tp2",)),
    Mutation("one-rank-raises", "rank 1 raises in a training step while its peers wait in its collectives", "qwen3",
             "parallel_parity", _one_rank_raises, layouts=("tp2",)),
    Mutation("cp-keys-not-gathered", "context-parallel attention sees its own rank's keys only", "qwen3",
             "parallel_parity", _context_keys_local, layouts=("cp2",)),
    Mutation("gdn-chunk-state-not-decayed", "GDN kernel carries its state into the next 64-token chunk undecayed",
             "qwen3.5", "hf_parity", _gdn_chunk_state_not_decayed),
    Mutation("fc1-declares-gate-only", "the declaration's dense linear_fc1 target lists gate_proj, not up_proj",
             "qwen3", "architecture", _fc1_declares_gate_only),
    Mutation("gdn-in-proj-not-targeted", "the declaration leaves GDN in_proj without LoRA (and without an exclusion)",
             "qwen3.5", "architecture", _gdn_in_proj_not_targeted),
    Mutation("shared-expert-width-doubled", "the declaration reads the shared-expert width as twice the config's",
             "qwen3.5-moe", "architecture", _shared_expert_width_doubled),
    Mutation("group-logprobs-off-by-one", "api.group_logprobs returns each completion's rows one position late",
             "qwen3", "shared_prefix", _group_logprobs_off_by_one),
    Mutation("fresh-adapter-not-identity", "apply_lora's fresh adapter has B ~ N(0, 0.02), not zeros", "qwen3",
             "lora_coverage", _fresh_adapter_not_identity),
    Mutation("lora-dropout-in-train-mode", "a Dropout(p=0.1) in the LoRA branch, active in train mode", "qwen3",
             "lora_coverage", _lora_dropout_in_train_mode),
    Mutation("scoring-outside-pipeline-schedule", "token/group logprobs run the rank's own pipeline stage outside "
             "the schedule", "qwen3", "parallel_parity", _scoring_outside_the_schedule, layouts=("pp2",)),
    Mutation("sharded-lora-tp-all-reduce-missing", "row-parallel LoRA skips its tensor-parallel all-reduce, in a "
             "check of the model sharded tp2", "qwen3", "lora_coverage", _lora_row_reduce_missing, parallel="tp2"),
    Mutation("sharded-expert-shard-dropped", "the LoRA state keeps one expert-parallel rank's experts, in a check of "
             "the model sharded ep2", "qwen3-moe", "lora_coverage", lambda: _part_not_gathered("expert"),
             parallel="ep2"),
    Mutation("adapter-config-rslora", "the exported adapter_config.json says use_rslora (served at alpha / sqrt(r), "
             "trained at alpha / r), on an MoE model", "qwen3-moe", "lora_coverage", _adapter_config_rslora),
    Mutation("export-merged-unscaled", "export_merged adds the adapter's B A without its alpha / r", "qwen3",
             "merged_serving", _export_merged_unscaled, needs_server=True),
    # rl_trainability's merged mode compares the server with api.lora_merged, which shares this merge: the adapter's
    # own export (export.py's merge) and the fp32 reference are what disagree.
    Mutation("live-merge-unscaled", "the live model's merge (pushes, api.lora_merged) adds B A without alpha / r",
             "qwen3", "merged_serving", _live_merge_unscaled, needs_server=True),
    Mutation("lora-input-detached", "the LoRA branch takes x.detach(): no gradient through it into earlier layers",
             "qwen3", "lora_gradients", _lora_input_detached),
    Mutation("lora-b-grad-unscaled", "LoRA B's gradient misses the alpha / r scale (the forward is right)", "qwen3",
             "lora_gradients", _lora_b_grad_unscaled),
)  # fmt: skip

_active: str | None = None  # the mutation injected in this process now (see `injected`)


def mutation_named(name: str) -> Mutation:
    """The catalogue's mutation ``name`` (a one-line error naming the known ones when there is none)."""
    for m in MUTATIONS:
        if m.name == name:
            return m
    raise ModelSupportError(f"unknown mutation {name!r}; known: {', '.join(m.name for m in MUTATIONS)}")


@contextmanager
def injected(name: str) -> Iterator[None]:
    """The mutation ``name`` in this process while the context is open. Stages that start worker processes
    (parallel_parity's torchrun job) pass :func:`active_mutation` on to them explicitly, so a bug is only ever
    injected by the selftest, never by something in the user's environment."""
    global _active
    mutation = mutation_named(name)
    previous, _active = _active, name
    try:
        with mutation.patch():
            yield
    finally:
        _active = previous


def active_mutation() -> str | None:
    """The mutation :func:`injected` holds open in this process (None: none)."""
    return _active
