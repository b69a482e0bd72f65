"""Stage `staleness_boundary`: a push or an adapter swap that lands inside a generation is reported token by token."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from model_support.core.serving.errors import ServingError
from model_support.core.serving.vllm_features import VllmFeatures
from model_support.validation.context import CheckContext
from model_support.validation.serving_session import POLICY, SERVER
from model_support.validation.stage import Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES
from model_support.validation.stages.merged_serving import cannot_serve

GENERATION = 64  # tokens of the probe's generation
LANDING = 4  # tokens sampled before the probe pauses the server and swaps
AFTER = 8  # tokens after the boundary held to the new weights' own scoring
POLLS = 20_000  # /metrics reads while waiting for LANDING tokens (a count, not a time: see the brief)
SECOND_ADAPTER_SEED = 9  # added to the run's seed: the adapter swapped in during LoRA mode's generation
# The probe's tolerance is this many times the server's own spread between sampling a token and scoring it afresh
# on the same weights (prefill against decode), with a floor per dtype; an off-by-one boundary must move a
# log-prob by at least twice the tolerance (the control), or the comparison could not see it.
SPREAD_FACTOR = 2.0
FLOOR = {"float32": 1e-5, "bfloat16": 1e-3, "float16": 1e-3}
CONTROL_FACTOR = 2.0


class StalenessBoundaryStage(Stage):
    """A weight update that lands inside a generation, in each mode the run's server takes updates in:

    - **merged**: the server holds the checkpoint's own weights (``@N``); a greedy generation of ``GENERATION``
      tokens is paused after ``LANDING`` of them, the policy's merged weights are pushed in place
      (``api.push_weights``, ``@N+1``) and the generation goes on. Its staleness fields must place the boundary
      where the weights changed: every token before it is the old weights' own (the same tokens and log-probs as the
      same generation alone before the push), the first from it is not, and the ones from it on are the new weights'
      own (the median over ``AFTER`` tokens of |sampled - the same tokens scored afresh on the new weights|: a cache
      or state kept from the old weights moves every one of them), ``policy_epoch`` is ``[[0, N], [b, N+1]]``,
      ``kv_cache_epoch`` ``[[0, N+1]]`` and ``num_evictions`` 1. Needs per-token weight versions (vLLM 0.32 on).
    - **lora**: the policy adapter is served as ``<handler>-lora@N``; the same generation on it is paused after
      ``LANDING`` tokens, a second adapter is hot-swapped in as ``@N+1`` (the first unloaded) and the generation goes
      on. It must finish on the adapter it named (its tokens and log-probs those of the same generation alone) and
      report that adapter's step for every token, with no eviction; a request to the new name samples otherwise.

    Tolerances: ``SPREAD_FACTOR`` times the server's own spread between a sampled token's log-prob and the same token
    scored afresh on the same weights (measured on the generation alone), floored per dtype. Control, per mode: the
    update changes the boundary's token against the generation alone (``<mode>_boundary_token_changed``) or moves its
    log-prob by at least ``CONTROL_FACTOR`` times that tolerance (``<mode>_boundary_effect``; in LoRA mode, the
    swapped-in adapter's own generation against the old one's), so a boundary reported one token early or late
    fails."""

    name = "staleness_boundary"
    title = "A weight push or adapter swap inside a generation: each token reports the weights that sampled it."
    order = 105
    packages = MEGATRON_PACKAGES
    needs = (*POLICY, SERVER)
    thresholds: ClassVar[dict[str, float]] = {
        "merged_fields_wrong": 0,
        "merged_tokens_before_changed": 0,
        "lora_fields_wrong": 0,
        "lora_tokens_changed": 0,
    }

    @staticmethod
    def modes(ctx: CheckContext) -> tuple[list[str], list[str]]:
        """(modes probed, why each other mode is not): "lora" where the run's server serves the handler's adapter
        natively, "merged" where the build takes weights in place and reports per-token weight versions."""
        from model_support.validation.serving_session import backend, inplace_gap, lora_gap

        modes, gaps = [], []
        if not ctx.spec.vllm_lora.native:
            gaps.append(f"lora: {ctx.spec.name}'s adapter is served merged only")
        elif (gap := lora_gap(ctx)) is not None:
            gaps.append(f"lora: {gap}")
        else:
            modes.append("lora")
        if (gap := inplace_gap(ctx)) is not None:
            gaps.append(f"merged: {gap}")
        elif not VllmFeatures(backend().version()).has("token_weight_versions"):
            gaps.append(f"merged: vLLM {backend().version()} reports no per-token weight versions (vLLM 0.32 on)")
        else:
            modes.append("merged")
        return modes, gaps

    def skip_reason(self, ctx: CheckContext) -> str | None:
        from model_support.validation.serving_session import backend

        unavailable = backend().unavailable_reason()
        if unavailable is not None:
            return unavailable
        modes, gaps = self.modes(ctx)
        if modes:
            return None
        from model_support.core.serving.runtime import load_runtime

        build = "the CPU vLLM build" if load_runtime().flavor == "cpu" else "vLLM"
        return f"{build} ({backend().version()}) cannot update {ctx.spec.name} inside a generation: {'; '.join(gaps)}"

    def prepare(self, ctx: CheckContext) -> None:
        from model_support.validation.serving_session import start_server

        start_server(ctx)

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.validation import serving_session as session

        modes, gaps = self.modes(ctx)
        prompt = session.random_prompts(ctx, 1, 16)[0]
        metrics: dict[str, Any] = {"modes": ", ".join(modes)}
        details = [f"{gap} (not probed)" for gap in gaps]
        try:
            server = session.serve_base(ctx)
            for mode in modes:
                probe = _merged if mode == "merged" else _lora
                found, lines = probe(ctx, server, prompt)
                metrics |= found
                details += lines
        except ServingError as exc:
            return cannot_serve(self, ctx, exc)
        except _NotInside as exc:
            return self.failed(str(exc), metrics=metrics, details=details)
        thresholds = {k: v for k, v in self.thresholds.items() if k.split("_", 1)[0] in modes}
        thresholds |= {f"{m}_{k}": metrics[f"{m}_tolerance"] for m in modes for k in _LOGPROB_METRICS[m]}
        for mode in modes:
            floor = CONTROL_FACTOR * metrics[f"{mode}_tolerance"]
            if not metrics[f"{mode}_boundary_token_changed"] and not metrics[f"{mode}_boundary_effect"] >= floor:
                return self.failed(
                    f"{mode}_boundary_effect={metrics[f'{mode}_boundary_effect']:.3g} < {floor:.3g}, same token: "
                    f"{_BLIND[mode]}",
                    metrics=metrics,
                    thresholds=thresholds,
                    details=details,
                )
        return self.judge(
            metrics,
            thresholds,
            ", ".join(f"{m}: boundary at token {metrics[f'{m}_boundary']} of {GENERATION}" for m in modes),
            details,
            ctx=ctx,
        )


_BLIND = {
    "merged": "the first token the fields attribute to the new weights is the old weights' own (a boundary reported "
    "early), or the update changes the next token too little for a misplaced boundary to show",
    "lora": "the swapped-in adapter samples what the old one does, so a request that moved to it would not show",
}
_LOGPROB_METRICS = {
    "merged": ("before_logprob_max_abs_err", "after_logprob_median_abs_err"),
    "lora": ("logprob_max_abs_err",),
}
SAMPLING = {"max_tokens": GENERATION, "min_tokens": GENERATION, "temperature": 0.0, "logprobs": 0}


class _NotInside(Exception):
    """The update did not land inside the probe's generation (it ended first): no boundary to judge."""


def _sampled_logprobs(choice: dict[str, Any]) -> torch.Tensor:
    return torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]], dtype=torch.float64)


def _scored(server: Any, prompt: list[int], tokens: list[int], model: str | None = None) -> torch.Tensor:
    """The log-prob of each of ``tokens`` after ``prompt`` and the tokens before it, scored afresh in one prefill."""
    from model_support.validation.serving_session import served_prompt_logprobs

    seq = [*prompt, *tokens]
    choice = server.completion(seq, model=model, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    return served_prompt_logprobs(choice, seq)[len(prompt) - 1 :]


def _tolerance(server: Any, prompt: list[int], alone: dict[str, Any], model: str | None = None) -> float:
    """``SPREAD_FACTOR`` times the spread between ``alone``'s sampled log-probs and the same tokens scored afresh on
    the same weights, at least the serving dtype's floor."""
    spread = (_sampled_logprobs(alone) - _scored(server, prompt, alone["token_ids"], model)).abs().max().item()
    return max(SPREAD_FACTOR * spread, FLOOR.get(server.options.dtype, 1e-3))


def _paused_inside(
    server: Any, prompt: list[int], update: Callable[[], Any], model: str | None = None
) -> tuple[dict[str, Any], int]:
    """The generation, paused once ``LANDING`` of its tokens are sampled, ``update`` applied while it waits, then
    resumed: (its choice, the tokens it had sampled when the server paused)."""
    out: list[Any] = []
    failed: list[BaseException] = []

    def generate() -> None:
        try:
            out.append(server.generate(prompt, model=model, **SAMPLING)[0])
        except BaseException as exc:  # re-raised in the caller's thread
            failed.append(exc)

    start = server.generated_tokens() or 0
    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    for _ in range(POLLS):
        if (server.generated_tokens() or 0) - start >= LANDING or not thread.is_alive():
            break
        time.sleep(0.001)
    server.pause()
    try:
        at_pause = (server.generated_tokens() or 0) - start
        if not thread.is_alive() or at_pause >= GENERATION:
            raise _NotInside(
                f"the generation ended ({at_pause} of {GENERATION} tokens) before the update could land inside it"
            )
        update()
    finally:
        server.resume()
    thread.join()
    if failed:
        raise failed[0]
    return out[0], at_pause


def _merged(ctx: CheckContext, server: Any, prompt: list[int]) -> tuple[dict[str, Any], list[str]]:
    from model_support.core import api
    from model_support.core.serving.update import parse_served_name
    from model_support.validation.serving_session import policy_model, push_bucket_bytes

    old = parse_served_name(server.served_name)[1]
    alone = server.generate(prompt, **SAMPLING)[0]
    tol = _tolerance(server, prompt, alone)
    choice, _ = _paused_inside(
        server, prompt, lambda: api.push_weights(server, policy_model(ctx), bucket_bytes=push_bucket_bytes(ctx))
    )
    ctx.state.get(SERVER).holds = "policy"
    new = parse_served_name(server.served_name)[1]
    epochs = choice["policy_epochs"]
    boundary = next((i for i, e in enumerate(epochs) if e != old), len(epochs))
    if not 0 < boundary < len(epochs):
        raise _NotInside(
            f"merged: the reported boundary is at token {boundary} of {len(epochs)}: {choice['policy_epoch']}"
        )
    tokens, sampled, before = choice["token_ids"], _sampled_logprobs(choice), _sampled_logprobs(alone)
    # The tokens from the boundary on, scored afresh on the new weights.
    end = min(boundary + AFTER, len(tokens))
    after = (sampled[boundary:end] - _scored(server, [*prompt, *tokens[:boundary]], tokens[boundary:end])).abs()
    fields_wrong = int(epochs != [old] * boundary + [new] * (len(tokens) - boundary))
    fields_wrong += choice["policy_epoch"] != [[0, old], [boundary, new]]
    fields_wrong += choice["kv_cache_epoch"] != [[0, new]]
    fields_wrong += choice["num_evictions"] != 1
    found = {
        "merged_boundary": boundary,
        "merged_tolerance": tol,
        "merged_fields_wrong": int(fields_wrong),
        # Before the boundary: the old weights' own tokens, the computation of the generation alone (a boundary
        # reported late puts a token of the new weights here).
        "merged_tokens_before_changed": int(tokens[:boundary] != alone["token_ids"][:boundary]),
        "merged_before_logprob_max_abs_err": (sampled[:boundary] - before[:boundary]).abs().max().item(),
        # From the boundary on: the new weights' own (a cache or state kept from the old weights moves every token
        # after it; the median leaves out one token whose MoE routing a near tie flips between decode and prefill).
        "merged_after_logprob_median_abs_err": after.median().item(),
        "merged_after_logprob_worst_abs_err": after.max().item(),
    }
    # The first token reported as the new weights' must differ from the old weights' own there (another token, or its
    # log-prob beyond the tolerance): a boundary reported early names a token of the old weights, and a correct one
    # where the update changes the next token too little could not tell early from right, or late (above) from right.
    found["merged_boundary_token_changed"] = int(tokens[boundary] != alone["token_ids"][boundary])
    found["merged_boundary_effect"] = abs(sampled[boundary] - before[boundary]).item()
    lines = [
        f"merged: {server.served_name} pushed after {LANDING}+ tokens of a {GENERATION}-token generation at step "
        f"{old}: policy_epoch {choice['policy_epoch']}, kv_cache_epoch {choice['kv_cache_epoch']}, "
        f"num_evictions {choice['num_evictions']}; tolerance {tol:.2e} (server's own sample/score spread x "
        f"{SPREAD_FACTOR:g}); |sampled - rescored on the new weights| from the boundary on: "
        + " ".join(f"{d:.1e}" for d in after.tolist())
    ]
    return found, lines


def _lora(ctx: CheckContext, server: Any, prompt: list[int]) -> tuple[dict[str, Any], list[str]]:
    from model_support.core.serving.update import parse_served_name
    from model_support.validation.megatron_session import export_random_lora
    from model_support.validation.serving_session import policy_adapter, serving_workdir

    first = server.update_adapter(policy_adapter(ctx)[0])
    try:
        step = parse_served_name(first)[1]
        alone = server.generate(prompt, model=first, **SAMPLING)[0]
        tol = _tolerance(server, prompt, alone, model=first)
        second = export_random_lora(ctx, SECOND_ADAPTER_SEED, serving_workdir(ctx) / "staleness-adapter")
        names: list[str] = []
        choice, landed = _paused_inside(
            server, prompt, lambda: names.append(server.update_adapter(second)), model=first
        )
        swapped = server.generate(prompt, model=names[0], **SAMPLING)[0]
    finally:
        server.remove_adapter()
    tokens = choice["token_ids"]
    fields_wrong = int(choice["policy_epochs"] != [step] * len(tokens))
    fields_wrong += choice["policy_epoch"] != [[0, step]]
    fields_wrong += choice["kv_cache_epoch"] != [[0, step]]
    fields_wrong += choice["num_evictions"] != 0
    sampled, before = _sampled_logprobs(choice), _sampled_logprobs(alone)
    found = {
        "lora_boundary": landed,
        "lora_tolerance": tol,
        "lora_fields_wrong": int(fields_wrong),
        "lora_tokens_changed": sum(a != b for a, b in zip(tokens, alone["token_ids"], strict=True)),
        "lora_logprob_max_abs_err": (sampled - before).abs().max().item(),
    }
    # The control: the swapped-in adapter samples otherwise (a request that moved to it would show).
    diverged = next((i for i, (a, b) in enumerate(zip(swapped["token_ids"], tokens, strict=True)) if a != b), None)
    found["lora_boundary_token_changed"] = int(diverged is not None)
    end = len(tokens) if diverged is None else diverged + 1  # the log-probs of the same prefix
    found["lora_boundary_effect"] = (_sampled_logprobs(swapped)[:end] - before[:end]).abs().max().item()
    lines = [
        f"lora: {names[0]} swapped in after {landed} tokens of a {GENERATION}-token generation on {first}: "
        f"policy_epoch {choice['policy_epoch']}, num_evictions {choice['num_evictions']}; the new adapter's own "
        f"generation {'diverges at token ' + str(diverged) if diverged is not None else 'keeps the tokens'}"
    ]
    return found, lines
