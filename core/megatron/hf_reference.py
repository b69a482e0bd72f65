"""The transformers side of the Megatron checks: reference logits computed one decoder layer at a time.

:class:`StreamedReference` builds the transformers model of a checkpoint with every parameter on the
``meta`` device (buffers such as RoPE frequencies are real). The embedding, final norm and LM head are
loaded once; each decoder layer's tensors are read from the safetensors just before the layer runs,
converted by transformers' own loading code (e.g. per-expert checkpoint tensors fused into 3-D expert
parameters) onto the reference device, and dropped right after it. Peak memory is the non-layer
weights plus one layer, so a model that fits on a GPU once can be checked against it on the same GPU.

An adapter is applied as a server merges it: ``W + alpha / r * B @ A`` on each checkpoint tensor the
adapter names, computed when that tensor's layer is loaded. A name the checkpoint lacks is an error,
so an adapter addressed to modules that do not exist never passes silently.

Each MoE block's router input, router logits and top-k indices are recorded (``ReferenceOutput.routers``), so
the model under test can be fed the same router inputs and replay the same routing. The top-k is read where the
block hands it to its experts module (``experts(hidden_states, top_k_index, top_k_weights)``, transformers'
common MoE interface), so it does not matter whether the router or the block itself chooses the experts.

For gradients, :func:`streamed_gradients` streams the layers too: every row's hidden state at each layer boundary is
kept (forward, one layer loaded at a time), the loss's gradient at the last layer's output is taken through the
final norm and head, and each layer is loaded again in reverse order to recompute its rows and back-propagate
through them (the same MoE routing replayed). Peak memory is still one layer (with its activations for one row)
plus the rows' boundary states, so the gradients of a checkpoint larger than the GPU can be taken on it.
:func:`checkpoint_gradients` names each layer's weight gradients after the checkpoint tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint

from model_support.core import timing
from model_support.core.checkpoint import TextCheckpoint
from model_support.core.codecs import PEFT_PREFIX, load_peft_adapter
from model_support.core.errors import ModelSupportError
from model_support.core.precision import exact_fp32


class ReferenceError(ModelSupportError):
    """The transformers reference could not be built or fed from the checkpoint."""


@dataclass(frozen=True)
class LoraDelta:
    """One adapter module as a merge: ``scale * B @ A`` added to a checkpoint tensor."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float

    def on(self, device: torch.device) -> torch.Tensor:
        return self.scale * (self.lora_b.to(device, torch.float32) @ self.lora_a.to(device, torch.float32))


@dataclass(frozen=True)
class StackedLoraDelta(LoraDelta):
    """The LoRA of a stacked expert tensor [E, in, out] in PEFT's ``target_parameters`` layout: A [r * E, in] expert
    by expert, B [out, r * E] with expert e's rank k in column k * E + e; expert e's merge is ``scale * (B_e A_e)^T``.
    """

    experts: int = 1
    peft_module: str = ""  # the PEFT key of its factors, less ``.lora_A.weight``

    def factors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each expert's (A_e, B_e)."""
        from model_support.core.codecs import expert_factors

        return expert_factors(self.lora_a, self.lora_b, self.experts)

    def on(self, device: torch.device) -> torch.Tensor:
        parts = [(b.to(device, torch.float32) @ a.to(device, torch.float32)).T for a, b in self.factors()]
        return self.scale * torch.stack(parts)


def adapter_deltas(adapter_dir: Path) -> dict[str, LoraDelta]:
    """The PEFT adapter in ``adapter_dir`` as merges, keyed by the checkpoint tensor each one changes, each module
    at the rank and scale PEFT and vLLM read from its config (``use_rslora``, ``rank_pattern``, ``alpha_pattern``):
    the reference runs what a server of the adapter runs, not what its trainer meant. A factor whose rows are not
    that rank is refused (PEFT and vLLM refuse it)."""
    from model_support.core.codecs import peft_rank_and_scale, stacked_target

    config, tensors = load_peft_adapter(adapter_dir)
    stacked = config.get("target_parameters") or ()
    deltas: dict[str, LoraDelta] = {}
    for key, lora_a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        lora_b = tensors[key.replace(".lora_A.", ".lora_B.")]
        target = stacked_target(key, stacked)
        rank, scale = peft_rank_and_scale(config, key[len(PEFT_PREFIX) : -len(".lora_A.weight")])
        rows = lora_a.shape[0]
        if (rows % rank != 0) if target else (rows != rank):  # stacked experts: one rank's rows per expert
            raise ReferenceError(f"{key}: {rows} rows where its config gives rank {rank}")
        if target:
            name = target[0][len(PEFT_PREFIX) :]
            experts = rows // rank
            deltas[name] = StackedLoraDelta(lora_a, lora_b, scale, experts, key.removesuffix(".lora_A.weight"))
        else:
            deltas[f"{key[len(PEFT_PREFIX) : -len('.lora_A.weight')]}.weight"] = LoraDelta(lora_a, lora_b, scale)
    return deltas


@dataclass
class RouterCapture:
    """One MoE router call of the reference: its input [T, H], logits [T, E] and top-k indices [T, k]."""

    name: str
    inputs: torch.Tensor
    logits: torch.Tensor
    indices: torch.Tensor


@dataclass
class ReferenceOutput:
    logits: torch.Tensor  # [B, S, V] float32
    routers: list[RouterCapture] = field(default_factory=list)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create every ``nn.Parameter`` on the meta device while buffers stay real.

    Written by hand because ``torch.device("meta")`` would also put computed buffers (RoPE inverse
    frequencies) on meta, and accelerate's equivalent is not a dependency of this package.
    """
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _model_class(config: Any) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    arch = (getattr(config, "architectures", None) or [""])[0]
    return AutoModelForImageTextToText if arch.endswith("ForConditionalGeneration") else AutoModelForCausalLM


def _decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The text decoder's layer list (the one ModuleList named ``layers`` with one entry per layer)."""
    found = [
        m
        for name, m in model.named_modules()
        if name.endswith("layers")
        and isinstance(m, torch.nn.ModuleList)
        and len(m) == num_layers
        and "visual" not in name
        and "mtp" not in name
    ]
    if len(found) != 1:
        raise ReferenceError(f"cannot find the {num_layers} decoder layers in {type(model).__name__}")
    return found[0]


# Attention features of a text config that transformers' SDPA path ignores, which its eager path applies: a reference
# with one of them set runs the family's eager attention (honoured, not dropped).
SDPA_IGNORES = ("attn_logit_softcapping",)


class StreamedReference:
    """A transformers model that holds at most one decoder layer's weights at a time (see module docstring)."""

    def __init__(self, model_dir: Path, config: Any, device: torch.device, dtype: torch.dtype = torch.float32):
        from transformers.conversion_mapping import get_model_conversion_mapping

        from model_support.core.layout import text_config

        self.checkpoint = TextCheckpoint(Path(model_dir))
        self.device, self.dtype = device, dtype
        if device.type == "cuda":  # transformers' own fla kernels (below fp32) read the shipped tuned settings too
            from model_support.kernels.tuning import seed_triton_cache

            seed_triton_cache()
        with _parameters_on_meta():
            self.model = _model_class(config).from_config(config, dtype=dtype).eval()
        self.routers = _router_modules(config)
        ignored = [f for f in SDPA_IGNORES if getattr(text_config(config), f, None)]
        if ignored and self.model.config._attn_implementation != "eager":
            # transformers' SDPA attention drops these (it has no soft-cap): the family's eager attention applies them.
            self.model.set_attn_implementation("eager")
        self.attention = self.model.config._attn_implementation + (f" ({', '.join(ignored)})" if ignored else "")
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
        # Gated DeltaNet layers on transformers' torch path (fp32: the oracle): none autotunes a kernel.
        self.torch_gdn_layers = _torch_kernels(self.model) if dtype == torch.float32 else 0
        num_layers = int(text_config(config).num_hidden_layers)
        self.layers = _decoder_layers(self.model, num_layers)
        self._by_layer: dict[int | None, list[str]] = {}
        for name in self.checkpoint.get_all_keys():
            self._by_layer.setdefault(self.checkpoint.layer_of(name), []).append(name)
        self._raw_names = {self.checkpoint.raw_key(n): n for n in self.checkpoint.get_all_keys()}
        self._deltas: dict[str, LoraDelta] = {}
        self._merge_dtype: torch.dtype | None = None  # forward's ``merge_dtype`` while it runs
        # transformers' checkpoint -> model renames and conversions (e.g. per-expert tensors fused), once.
        self._conversions = get_model_conversion_mapping(self.model)
        self._load(self._by_layer.get(None, []))
        self.model.tie_weights()
        self._check_loaded(self.model, exclude=self.layers, what="the embedding, final norm and LM head")

    def _load(self, names: list[str]) -> None:
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging as hf_logging

        state = {}
        for key, tensor in self.checkpoint.read(names):
            delta = self._deltas.get(key)
            # On the device first: transformers' conversions (experts stacked, gate and up joined) run there.
            tensor = tensor.to(self.device)
            if delta is not None:
                tensor = tensor.float() + delta.on(self.device)
                tensor = tensor if self._merge_dtype is None else tensor.to(self._merge_dtype)
            state[key] = tensor
        load = LoadStateDictConfig(
            dtype=self.dtype, weight_mapping=self._conversions, device_map={"": str(self.device)}
        )
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # one bar per decoder layer would flood the terminal
        try:
            convert_and_load_state_dict_in_model(self.model, state, load, None)
        finally:
            if bars:
                hf_logging.enable_progress_bar()

    @staticmethod
    def _check_loaded(scope: torch.nn.Module, *, exclude: torch.nn.Module | None = None, what: str) -> None:
        skip = set() if exclude is None else {id(p) for p in exclude.parameters()}
        meta = [n for n, p in scope.named_parameters() if p.device.type == "meta" and id(p) not in skip]
        meta = [n for n in meta if "visual" not in n]  # the vision tower of a multimodal model never runs here
        if meta:
            raise ReferenceError(f"the checkpoint does not fill {what}: {meta[:3]}")

    def _enter_layer(self, index: int) -> None:
        self._load(self._by_layer.get(index, []))
        self._check_loaded(self.layers[index], what=f"decoder layer {index}")

    def _checked(self, adapter: dict[str, LoraDelta] | None) -> dict[str, LoraDelta]:
        """``adapter`` (or none), refused when it names a tensor the checkpoint lacks or one outside the layers."""
        deltas = adapter or {}
        unknown = sorted(k for k in deltas if k not in self._raw_names)
        if unknown:
            raise ReferenceError(f"adapter modules not in the checkpoint: {unknown[:3]}")
        global_deltas = [k for k in deltas if self.checkpoint.layer_of(self._raw_names[k]) is None]
        if global_deltas:
            raise ReferenceError(f"adapter changes tensors outside the decoder layers: {global_deltas[:3]}")
        return deltas

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        adapter: dict[str, LoraDelta] | None = None,
        merge_dtype: torch.dtype | None = None,
        routers: bool = False,
        replay: list[torch.Tensor] | None = None,
    ) -> ReferenceOutput:
        """Logits of ``input_ids`` ([B, S]) with the adapter merged (``adapter_deltas``).

        ``merge_dtype``: each merged tensor rounded to that dtype before the reference's own (the policy a server
        holds after a merged push in that dtype, computed at the reference's precision). ``routers``: record each
        MoE router's input, logits and top-k. ``replay``: one top-k index tensor per router (e.g. another run's),
        taken instead of the router's own choice.
        """
        self._deltas, self._merge_dtype = self._checked(adapter), merge_dtype
        handles = []
        for index, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(lambda _m, _a, i=index: self._enter_layer(i)))
            handles.append(layer.register_forward_hook(lambda m, _a, _o: _drop_weights(m)))
        captures: list[RouterCapture] = []
        try:
            with (
                timing.phase("oracle"),
                routing_hooks(self.model, captures if routers else None, replay, self.routers),
                exact_fp32(self.dtype == torch.float32),
            ):
                out = self.model(input_ids=input_ids.to(self.device), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
            self._deltas, self._merge_dtype = {}, None
            for layer in self.layers:
                _drop_weights(layer)
        return ReferenceOutput(out.logits.float(), captures)


@dataclass
class StreamedGradients:
    """What :func:`streamed_gradients` returns for each case (a named list of rows)."""

    losses: dict[str, torch.Tensor]  # each row's per-token losses, the case's rows in order (float64, CPU)
    grads: dict[str, dict[str, torch.Tensor]]  # what ``keep`` made of the case's checkpoint gradients, every layer's
    routing: dict[str, list[list[torch.Tensor]]]  # per row, the top-k indices each MoE block ran, in layer order


class _Stop(Exception):
    """Raised by the last decoder layer's stand-in once every layer's inputs are captured: the head need not run."""


def streamed_gradients(
    model_dir: Path,
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    adapter: dict[str, LoraDelta],
    cases: dict[str, list[torch.Tensor]],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    keep: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    replay: dict[str, list[list[torch.Tensor]]] | None = None,
) -> StreamedGradients:
    """Each row ([1, S]) of each case alone through the transformers model carrying ``adapter``, the gradient of the
    sum of ``loss(logits [1, S, V], row)`` (per-token losses) over the case's rows with respect to the decoder
    layers' checkpoint tensors, streamed one layer at a time (module docstring). ``keep`` turns one layer's
    checkpoint gradients (keyed as :func:`checkpoint_gradients` keys them) into what the caller keeps of them (e.g.
    LoRA factor gradients: a layer's weight gradients are as large as its weights); the case's results of every
    layer are merged. ``replay``: per case, each row's routing to take instead of the routers' choice."""
    with timing.phase("oracle"):
        return _StreamedBackward(model_dir, config, device, dtype, adapter).run(cases, loss, keep, replay or {})


class _StreamedBackward:
    """The state of one :func:`streamed_gradients` run: a :class:`StreamedReference` of its own (its GDN layers on
    transformers' torch path, its attention holding O(S) memory in the backward), and each row's layer inputs."""

    def __init__(self, model_dir: Path, config: Any, device: torch.device, dtype: torch.dtype, adapter: Any):
        self.ref = StreamedReference(model_dir, config, device, dtype)
        # Below fp32 too: fla's Gated DeltaNet backward refuses Hopper with Triton < 3.7.1; transformers' torch path
        # runs.
        _torch_kernels(self.ref.model)
        self.ref._deltas = self.ref._checked(adapter)
        if self.ref.model.config._attn_implementation == "sdpa":
            self.ref.model.set_attn_implementation(_register_repeated_kv_sdpa())
        elif self.ref.model.config._attn_implementation == "eager":
            self.ref.model.set_attn_implementation(_register_query_blocked_eager())
        for param in self.ref.model.parameters():  # the embedding and head take no gradient
            param.requires_grad_(False)
        self.layers = self.ref.layers
        self.blocks = [len(_moe_blocks(layer, self.ref.routers)) for layer in self.layers]

    @contextmanager
    def _forwards(self, stand_in: Callable[[int], Callable[..., Any]]) -> Iterator[None]:
        """Every decoder layer's forward replaced by ``stand_in(index)`` while open."""
        for index, layer in enumerate(self.layers):
            layer.forward = stand_in(index)
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward

    def _inputs(self, tokens: torch.Tensor) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """Each decoder layer's call arguments for ``tokens`` (the first the hidden state: the embedding's output for
        every layer here, since each stand-in passes its input on); masks and position embeddings are the model's."""
        calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

        def capture(index: int) -> Callable[..., Any]:
            def stand_in(*args: Any, **kwargs: Any) -> Any:
                calls.append((args, kwargs))
                if index == len(self.layers) - 1:
                    raise _Stop
                return args[0]

            return stand_in

        with self._forwards(capture), contextlib.suppress(_Stop):
            self.ref.model(input_ids=tokens.to(self.ref.device), use_cache=False)
        if len(calls) != len(self.layers) or any(not args for args, _ in calls):
            raise ReferenceError("the decoder layers are not called once each with the hidden state first")
        return calls

    def _layer(self, index: int, hidden: torch.Tensor, call: tuple[tuple[Any, ...], dict[str, Any]]) -> torch.Tensor:
        args, kwargs = call
        out = self.layers[index](hidden, *args[1:], **kwargs)
        if not isinstance(out, torch.Tensor):
            raise ReferenceError(f"decoder layer {index} returns {type(out).__name__}, not the hidden state")
        return out

    def _routes(self, index: int, routing: list[torch.Tensor]) -> list[torch.Tensor]:
        start = sum(self.blocks[:index])
        return routing[start : start + self.blocks[index]]

    def _head(self, tokens: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """The logits of ``last`` (the last layer's output) through the model's final norm and head."""

        def stand_in(index: int) -> Callable[..., Any]:
            return lambda *args, **_kwargs: last if index == len(self.layers) - 1 else args[0]

        with self._forwards(stand_in):
            return self.ref.model(input_ids=tokens.to(self.ref.device), use_cache=False).logits

    def run(
        self,
        cases: dict[str, list[torch.Tensor]],
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        keep: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
        replay: dict[str, list[list[torch.Tensor]]],
    ) -> StreamedGradients:
        rows = [(case, i, tokens) for case, case_rows in cases.items() for i, tokens in enumerate(case_rows)]
        calls = {(case, i): self._inputs(tokens) for case, i, tokens in rows}
        # Each row's hidden state entering each layer, and after the last (forward, no autograd).
        states = {key: [call[0][0][0]] for key, call in calls.items()}
        routing: dict[tuple[str, int], list[torch.Tensor]] = {key: [] for key in calls}
        exact = self.ref.dtype == torch.float32
        with exact_fp32(exact), torch.no_grad():
            for index in range(len(self.layers)):
                self.ref._enter_layer(index)
                for case, i, _ in rows:
                    key, captures = (case, i), []
                    chosen = None if case not in replay else self._routes(index, replay[case][i])
                    with routing_hooks(self.layers[index], captures, chosen, self.ref.routers):
                        states[key].append(self._layer(index, states[key][index], calls[key][index]))
                    # What the forward ran: the replayed routing, or the routers' own choice.
                    routing[key] += chosen if chosen is not None else [c.indices for c in captures]
                _drop_weights(self.layers[index])
        # The loss's gradient at the last layer's output, through the final norm and head.
        losses: dict[tuple[str, int], torch.Tensor] = {}
        upstream: dict[tuple[str, int], torch.Tensor] = {}
        with exact_fp32(exact):
            for case, i, tokens in rows:
                last = states[(case, i)][-1].detach().requires_grad_(True)
                per_token = loss(self._head(tokens, last), tokens)
                per_token.sum().backward()
                losses[(case, i)], upstream[(case, i)] = per_token.detach().double().cpu(), last.grad
        # Each layer again, last first: recompute each row on the forward's routing and back-propagate through it.
        grads: dict[str, dict[str, torch.Tensor]] = {case: {} for case in cases}
        with exact_fp32(exact):
            for index in reversed(range(len(self.layers))):
                self.ref._enter_layer(index)
                layer = self.layers[index]
                layer.requires_grad_(True)
                for case in cases:
                    for case_, i, _ in rows:
                        if case_ != case:
                            continue
                        key = (case, i)
                        hidden = states[key][index].detach().requires_grad_(True)
                        with routing_hooks(layer, None, self._routes(index, routing[key]), self.ref.routers):
                            out = self._layer(index, hidden, calls[key][index])
                        out.backward(upstream[key])
                        upstream[key] = hidden.grad
                        states[key].pop()  # this layer's output: its gradient is taken
                    grads[case] |= keep(checkpoint_gradients(self.ref.model))
                    layer.zero_grad(set_to_none=True)
                _drop_weights(layer)
        return StreamedGradients(
            {case: torch.cat([losses[(case, i)] for i in range(len(cases[case]))]) for case in cases},
            grads,
            {case: [routing[(case, i)] for i in range(len(cases[case]))] for case in cases},
        )


_REPEATED_KV_SDPA = "model_support_repeated_kv_sdpa"


def _repeated_kv_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **_kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with the key / value heads repeated instead of SDPA's ``enable_gqa``, which only
    the math kernel takes in fp32: its backward holds [heads, S, S] probabilities (6 GiB a layer at 96 heads and 4096
    tokens), where the memory-efficient kernel this allows holds O(S)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = getattr(module, "num_key_value_groups", 1)
    causal = (
        query.shape[2] > 1
        and attention_mask is None
        and (getattr(module, "is_causal", True) if is_causal is None else is_causal)
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=attention_mask, dropout_p=dropout,
        scale=scaling, is_causal=causal,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _register_repeated_kv_sdpa() -> str:
    """Register :func:`_repeated_kv_sdpa` (and SDPA's own masks for it) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_REPEATED_KV_SDPA, _repeated_kv_sdpa)
    AttentionMaskInterface.register(_REPEATED_KV_SDPA, sdpa_mask)
    return _REPEATED_KV_SDPA


_QUERY_BLOCKED_EAGER = "model_support_query_blocked_eager"
QUERY_BLOCK_BYTES = 256 * 2**20  # the most one block's [batch, heads, queries, keys] scores may take


def _query_blocked_eager(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The family's own eager attention (its modeling module's ``eager_attention_forward``, attention sinks
    included), run on blocks of queries, each block recomputed in the backward. Eager attention holds [heads, S, S]
    scores several times over (4 GiB each at 64 heads and 4097 fp32 tokens: gpt-oss, whose sinks SDPA cannot
    take); each query's output depends on that query's row alone, so the blocks compute what one call does."""
    import sys

    eager = sys.modules[type(module).__module__].eager_attention_forward
    batch, heads, queries, _ = query.shape
    block = max(1, QUERY_BLOCK_BYTES // (batch * heads * key.shape[2] * query.element_size()))
    if queries <= block:
        out, _ = eager(module, query, key, value, attention_mask, **kwargs)
        return out, None
    outs = []
    for start in range(0, queries, block):
        rows = slice(start, start + block)
        mask = attention_mask
        if mask is not None and mask.shape[2] == queries:
            mask = mask[:, :, rows]
        out, _ = torch.utils.checkpoint.checkpoint(
            eager, module, query[:, :, rows], key, value, mask, use_reentrant=False, **kwargs
        )
        outs.append(out)
    return torch.cat(outs, dim=1), None


def _register_query_blocked_eager() -> str:
    """Register :func:`_query_blocked_eager` (and the eager masks for it) with transformers; returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(_QUERY_BLOCKED_EAGER, _query_blocked_eager)
    AttentionMaskInterface.register(_QUERY_BLOCKED_EAGER, eager_mask)
    return _QUERY_BLOCKED_EAGER


def checkpoint_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradients held by ``model``'s parameters (:func:`whole_reference`), keyed by the checkpoint tensors they
    were loaded from: transformers' own reverse of its loading conversions (its save path) splits a fused parameter
    (e.g. stacked experts, gate and up concatenated) back into the checkpoint's tensors. Those conversions only move
    elements, so the reverse of a parameter's gradient is the gradient of the checkpoint tensors."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})


def _torch_kernels(model: torch.nn.Module) -> int:
    """Run the fp32 oracle's Gated DeltaNet layers on transformers' own torch reference where transformers would
    dispatch to fla's Triton kernels: ``torch_chunk_gated_delta_rule``, the torch causal convolution and the
    family's torch gated RMSNorm (``*RMSNormGated`` of its modeling module, in place of fla's
    ``FusedRMSNormGated``; built on the meta device, its weight is loaded with the layer's). The oracle's job is
    exactness, and fla would autotune its kernels anew at full precision for minutes on a fresh GPU. Returns how
    many layers it switched."""
    import sys

    switched = 0
    for module in list(model.modules()):
        if not hasattr(module, "chunk_gated_delta_rule"):
            continue
        modeling = sys.modules[type(module).__module__]
        module.chunk_gated_delta_rule = getattr(modeling, "torch_chunk_gated_delta_rule", module.chunk_gated_delta_rule)
        if hasattr(module, "causal_conv1d_fn"):
            module.causal_conv1d_fn = None  # the modeling code's own conv1d + silu path
        # The modeling module's own class (fla's FusedRMSNormGated is imported into its namespace too).
        own = (getattr(modeling, n) for n in dir(modeling) if n.endswith("RMSNormGated"))
        torch_norm = next((c for c in own if getattr(c, "__module__", None) == modeling.__name__), None)
        norm = getattr(module, "norm", None)
        if torch_norm is not None and norm is not None and not isinstance(norm, torch_norm):
            with torch.device("meta"):
                module.norm = torch_norm(norm.weight.shape[0], eps=module.layer_norm_epsilon)
        switched += 1
    return switched


def _drop_weights(module: torch.nn.Module) -> None:
    module.to_empty(device="meta")


def _router_modules(config: Any) -> tuple[str, ...] | None:
    """Where the family keeps its MoE router, as megatron-bridge maps megatron-core's router from it (paths inside a
    decoder layer, :func:`~model_support.core.bridge_linears.bridge_routers`); None without a bridge for it."""
    from model_support.core.bridge_linears import bridge_routers
    from model_support.core.megatron.builder import MegatronBuildError
    from model_support.core.megatron.imports import MegatronUnavailableError

    try:
        return bridge_routers(config) or None
    except (MegatronBuildError, MegatronUnavailableError):
        return None


def _moe_blocks(
    model: torch.nn.Module, routers: tuple[str, ...] | None = None
) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """(name, router, experts) of each MoE block in layer order: a module with an ``experts`` child and a router
    child, the child named as the last part of one of the ``routers`` paths (the bridge's mapping: a plain linear
    ``gate`` included; only the name counts, as a checkpoint's block may load into a module named otherwise, e.g.
    Mixtral's ``block_sparse_moe`` into transformers' ``mlp``), or without them one whose class name contains
    "Router"."""
    leaves = None if routers is None else {path.rsplit(".", 1)[-1] for path in routers}
    blocks = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        children = module.named_children()
        if leaves is None:
            router = next((m for _, m in children if "Router" in type(m).__name__), None)
        else:
            router = next((m for leaf, m in children if leaf in leaves), None)
        if isinstance(experts, torch.nn.Module) and router is not None:
            blocks.append((name, router, experts))
    return blocks


@contextmanager
def routing_hooks(
    model: torch.nn.Module,
    captures: list[RouterCapture] | None = None,
    replay: list[torch.Tensor] | None = None,
    routers: tuple[str, ...] | None = None,
) -> Iterator[None]:
    """While open, each MoE block of ``model`` (in layer order; ``routers``: see :func:`_moe_blocks`) appends its
    routing to ``captures`` and/or takes the top-k indices of ``replay`` (one tensor per block) instead of its
    router's choice. Under autograd the replayed weights stay functions of the router's logits, as the router's own
    would."""
    blocks = _moe_blocks(model, routers)
    if replay is not None and len(replay) != len(blocks):
        raise ReferenceError(f"{len(replay)} routings to replay for {len(blocks)} MoE routers")
    handles = []
    for position, (name, router, experts) in enumerate(blocks):
        seen: dict[str, torch.Tensor] = {}
        handles.append(router.register_forward_hook(_router_hook(seen)))
        target = None if replay is None else replay[position]
        handles.append(experts.register_forward_pre_hook(_experts_hook(name, seen, captures, target), with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _router_hook(seen: dict[str, torch.Tensor]) -> Any:
    """Keep the router's input rows [T, H] and logits [T, E] (its output, or the first of its outputs), and the
    logits as computed (``live``: with their autograd history, for replayed weights)."""

    def record(_module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
        live = out if isinstance(out, torch.Tensor) else out[0]
        seen["inputs"] = args[0].reshape(-1, args[0].shape[-1]).detach()
        seen["logits"], seen["live"] = live.detach().float(), live.float()

    return record


_EXPERTS_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


def _experts_hook(
    name: str, seen: dict[str, torch.Tensor], captures: list[RouterCapture] | None, target: torch.Tensor | None
) -> Any:
    """At the experts module's ``(hidden_states, top_k_index, top_k_weights)`` input: record the routing
    (``captures``) and/or replace it by ``target``'s experts (:func:`_replayed_weights`)."""

    def before(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rest = dict(kwargs)
        hidden, chosen, weights = (*args, *(rest.pop(k) for k in _EXPERTS_INPUTS[len(args) :]))[:3]
        if captures is not None:
            captures.append(RouterCapture(name, seen["inputs"], seen["logits"], chosen.detach()))
        if target is None:
            return None
        indices = target.to(chosen.device, chosen.dtype)
        replayed = _replayed_weights(name, seen["live"], chosen, weights, indices)
        return (hidden, indices, replayed.to(weights.dtype)), rest

    return before


def _replayed_weights(
    name: str, logits: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """The weights the router would give ``target``'s experts: its own weights are read as ``scale * score``
    or ``scale * score / sum(top-k scores)``, the score a softmax or a sigmoid of the logits; that rule is
    applied to ``target``, so only the choice of experts changes."""
    weights = weights.float()
    for score in (torch.softmax(logits, dim=-1), torch.sigmoid(logits)):
        picked = score.gather(1, chosen)
        for normalise in (False, True):
            base = picked / picked.sum(-1, keepdim=True) if normalise else picked
            scale = (weights / base).mean().detach()  # the rule's constant (e.g. a routed scaling factor)
            if torch.allclose(weights.detach(), scale * base.detach(), rtol=1e-2, atol=1e-4):
                replayed = score.gather(1, target)
                return scale * (replayed / replayed.sum(-1, keepdim=True) if normalise else replayed)
    raise ReferenceError(
        f"cannot replay routing through {name}: its expert weights are no softmax or sigmoid top-k of its logits"
    )
