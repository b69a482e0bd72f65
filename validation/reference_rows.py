"""One comparison of the Megatron model under test with the fp32 transformers reference on one batch of token rows,
shared by the stages that hold the model's logits to the reference's (``hf_parity``, ``lora_coverage``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from model_support.core.megatron.builder import MegatronModel


def compare_with_reference(
    ctx: Any,
    built: MegatronModel,
    tokens: torch.Tensor,
    prefix: str,
    *,
    adapter: Any = None,
    routers: bool = False,
) -> tuple[dict[str, Any], dict[str, float], dict[str, float] | None]:
    """(metrics, thresholds, transformers' own low-precision distance) of the built model's logits on ``tokens`` [B, S]
    against the fp32 reference's (carrying ``adapter``), every name under ``prefix``.

    MoE routers replay the reference's routing; with ``routers`` each Megatron router is also fed the reference
    router's input and must choose the same top-k sets (``router_flips`` <= 0, near ties reported apart).
    """
    from model_support.core.megatron.compare import closeness, replayed_routing, routing_agreement, tolerances
    from model_support.core.megatron.forward import logits
    from model_support.validation.megatron_session import reference_and_lowp

    moe = ctx.layout.moe is not None
    model, dtype = built.model, built.numerics.dtype
    ref, routing, lowp = reference_and_lowp(ctx, dtype, tokens, adapter=adapter)
    metrics: dict[str, Any] = {f"{prefix}tokens": tokens.numel()}
    metrics |= {f"{prefix}reference_{built.numerics.dtype_name}_{k}": v for k, v in (lowp or {}).items()}
    thresholds = tolerances(dtype, prefix=prefix, reference_lowp=lowp)
    if moe and routers:
        metrics |= {f"{prefix}{k}": v for k, v in routing_agreement(model, ref.routers, tokens.shape[0]).items()}
        thresholds[f"{prefix}router_flips"] = 0
    with torch.no_grad(), replayed_routing(model, routing, tokens.shape[0]):
        ours = logits(model, tokens)
    metrics |= closeness(ours, ref.logits, prefix=prefix)
    return metrics, thresholds, lowp
