"""Comparing the model under test with the fp32 reference: closeness metrics, routing, routing replay.

Closeness of two tensors is reported four ways: the largest absolute difference (``max_abs_err``, and
``rel_err`` relative to the largest reference magnitude), the relative L2 norm of the difference
(``rel_l2``) and the mean absolute difference as a percentage of the mean reference magnitude
(``mean_abs_pct``, the metric ART's workflow holds parallel layouts to). An fp32 model is held to the
max-abs metrics; a bf16 model to the relative ones, at most ``LOWP_TOLERANCE_FACTOR`` times as far from the fp32
reference as transformers' own bf16 run of the same weights, tokens and routing is (a bf16 result
carries a relative error of about 2**-8 per rounding, compounded by depth: a fixed bound would be wrong
at some depth, a max-abs bound at fp32 scale says nothing about it).

MoE routing is compared router by router on the *same* input (the reference router's input, in the
model's dtype): a token whose top-k expert set differs is a *flip*, unless the reference's margin
between its k-th and (k+1)-th logits is within what rounding the input to the model's dtype can move
(``eps / 2 * sum |w| |x|`` for each of the two logits), in which case it is a *near tie* and reported
apart. Logits are then compared under megatron-core's routing replay of the reference's top-k sets, so
a near tie is not counted as a logit error and a real flip is not hidden inside one.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from math import inf
from pathlib import Path
from typing import Any

import torch

# Tolerances of a logit comparison against the fp32 reference, by the model's dtype. A bf16 model's distance
# from fp32 grows with depth and differs by architecture (a Gated DeltaNet recurrence amplifies rounding of its
# inputs), so it is held to a multiple of the distance transformers' own bf16 run keeps (same weights, tokens
# and routing): LOWP_TOLERANCE_FACTOR times that, never less than LOWP_FLOOR.
LOGIT_TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"max_abs_err": 1e-4, "rel_err": 1e-4},
}
LOWP_TOLERANCE_FACTOR = 2.0
LOWP_FLOOR = {"rel_l2": 1e-3, "mean_abs_pct": 0.1}

# Tolerances between two runs of the *same* fp32 model that must compute the same function by different kernels
# (e.g. a packed row against its sequences run alone): logits, and the worst LoRA parameter's gradient.
SAME_MODEL_FP32_TOLERANCES = {"logits_max_abs_err": 1e-4, "logits_rel_err": 1e-4, "grad_max_rel_err": 1e-4}

# The smallest relative L2 change a perturbation (e.g. an adapter) must make for a comparison at the
# tolerances above to see it: ten times what the comparison lets pass.
EFFECT_FLOOR: dict[torch.dtype, float] = {torch.float32: 1e-3, torch.bfloat16: 0.2}


# Elements of each tensor :func:`closeness` takes at once in float64 (256 MiB each of ours, the reference and their
# difference): 4096 tokens of logits over a 150k vocabulary are 5 GB in float64.
CLOSENESS_BLOCK = 1 << 25


def closeness(ours: torch.Tensor, ref: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """``max_abs_err``, ``rel_err``, ``rel_l2`` and ``mean_abs_pct`` of ``ours`` against ``ref``, in float64 on
    ``ref``'s device (a GPU's logits are not copied to the host), a block of elements at a time."""
    if ours.shape != ref.shape:
        raise ValueError(f"cannot compare a {tuple(ours.shape)} tensor with a {tuple(ref.shape)} reference")
    ours, ref = ours.detach().reshape(-1), ref.detach().reshape(-1)
    zero = torch.zeros((), dtype=torch.float64, device=ref.device)
    max_diff, max_ref, sq_diff, sq_ref, abs_diff, abs_ref = (zero.clone() for _ in range(6))
    for start in range(0, ref.numel(), CLOSENESS_BLOCK):
        y = ref[start : start + CLOSENESS_BLOCK].to(torch.float64)
        diff = ours[start : start + CLOSENESS_BLOCK].to(ref.device, torch.float64) - y
        diff.abs_(), y.abs_()
        max_diff, max_ref = torch.maximum(max_diff, diff.max()), torch.maximum(max_ref, y.max())
        sq_diff, sq_ref = sq_diff + diff.square().sum(), sq_ref + y.square().sum()
        abs_diff, abs_ref = abs_diff + diff.sum(), abs_ref + y.sum()
    return {
        f"{prefix}max_abs_err": max_diff.item(),
        f"{prefix}rel_err": (max_diff / max_ref).item(),
        f"{prefix}rel_l2": (sq_diff.sqrt() / sq_ref.sqrt()).item(),
        f"{prefix}mean_abs_pct": (100 * abs_diff / abs_ref).item(),
    }


def worst_closeness(
    ours: torch.Tensor, ref: torch.Tensor, bounds: Sequence[tuple[int, int]], prefix: str = ""
) -> dict[str, float]:
    """:func:`closeness` of each span ``[start, end)`` of the first dimension (a packed row's sequences), the worst
    of each metric: a wrong short sequence beside a long right one is not averaged away by the long one's tokens."""
    spans = [closeness(ours[start:end], ref[start:end], prefix) for start, end in bounds]
    return {key: max(span[key] for span in spans) for key in spans[0]}


def tolerances(
    dtype: torch.dtype, prefix: str = "", reference_lowp: dict[str, float] | None = None
) -> dict[str, float]:
    """The logit tolerances for a model in ``dtype``, under metric names with ``prefix``.

    Below fp32, ``reference_lowp`` is :func:`closeness` of transformers' run in ``dtype`` against its fp32 run.
    """
    if dtype in LOGIT_TOLERANCES:
        return {f"{prefix}{k}": v for k, v in LOGIT_TOLERANCES[dtype].items()}
    if reference_lowp is None:
        raise ValueError(f"a {dtype} model is held to transformers' own {dtype} error: measure it first")
    return {f"{prefix}{k}": LOWP_TOLERANCE_FACTOR * max(reference_lowp[k], floor) for k, floor in LOWP_FLOOR.items()}


def gradient_closeness(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Two runs' gradients of the same parameters: the worst relative error of any one, the mean-abs-percent of all
    of them as one vector and of the worst parameter, and how many there are."""
    per_param = [closeness(ours[name], ref[name]) for name in ref]
    every = closeness(torch.cat([ours[n].flatten() for n in ref]), torch.cat([ref[n].flatten() for n in ref]))
    return {
        "grad_max_rel_err": max(g["rel_err"] for g in per_param),
        "grad_mean_abs_pct": every["mean_abs_pct"],
        "grad_worst_param_mean_abs_pct": max(g["mean_abs_pct"] for g in per_param),
        "grad_params": len(ref),
    }


def same_model_tolerances(
    dtype: torch.dtype,
    reference_lowp: dict[str, float] | None = None,
    reference_grad_lowp: dict[str, float] | None = None,
) -> dict[str, float]:
    """Tolerances between two runs of one model (see ``SAME_MODEL_FP32_TOLERANCES``).

    Below fp32 each run is within its rounding distance of the exact function: the logits are held to a multiple of
    transformers' own low-precision distance from fp32 on logits (``reference_lowp``), and all LoRA gradients taken
    as one vector (a parameter that sees one token has a gradient that is all rounding noise) to the same multiple
    of its distance on gradients (``reference_grad_lowp``; without it no gradient limit is given). The gradients'
    distance is their own: through a backward it is larger than the logits' (the tiny Qwen3.5 in bf16 on an H100:
    3.31 % between two correct runs, against twice the logits' 1.47 %).
    """
    if dtype == torch.float32:
        return dict(SAME_MODEL_FP32_TOLERANCES)
    limits = tolerances(dtype, prefix="logits_", reference_lowp=reference_lowp)
    if reference_grad_lowp is None:
        return limits
    grads = tolerances(dtype, prefix="grad_", reference_lowp=reference_grad_lowp)
    return limits | {"grad_mean_abs_pct": grads["grad_mean_abs_pct"]}


def tolerance_note(dtype: torch.dtype) -> str:
    """One line saying what a logit comparison of a ``dtype`` model is held to."""
    if dtype in LOGIT_TOLERANCES:
        return f"tolerances ({dtype}): " + ", ".join(f"{k} <= {v:g}" for k, v in LOGIT_TOLERANCES[dtype].items())
    return (
        f"tolerances ({dtype}): at most {LOWP_TOLERANCE_FACTOR:g}x the distance of transformers' own {dtype} run "
        f"from fp32 (same weights, tokens and routing), floors {LOWP_FLOOR}"
    )


def routers(model: torch.nn.Module) -> list[Any]:
    """megatron-core's MoE routers of ``model`` in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def sequence_major(rows: torch.Tensor, batch: int) -> torch.Tensor:
    """Token rows of a [B, S] batch in transformers' order (b, s) -> megatron-core's order (s, b)."""
    return rows.reshape(batch, -1, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def routing_agreement(model: torch.nn.Module, captures: Sequence[Any], batch: int) -> dict[str, Any]:
    """Feed each reference router's input to the matching Megatron router and compare the top-k sets.

    ``captures``: the reference's :class:`~model_support.core.megatron.hf_reference.RouterCapture` list.
    """
    ours = routers(model)
    if len(ours) != len(captures):
        raise ValueError(f"the model has {len(ours)} MoE routers, the reference {len(captures)}")
    flips = ties = tokens = 0
    worst_flip_margin = 0.0
    for router, cap in zip(ours, captures, strict=True):
        weight = router.weight.detach()
        x = sequence_major(cap.inputs, batch).to(weight.device)
        ref_idx = sequence_major(cap.indices, batch).to(weight.device)
        ref_logits = sequence_major(cap.logits, batch).to(weight.device)
        with torch.no_grad():
            _, routing_map = router(x.to(weight.dtype)[:, None, :])
        ref_map = torch.zeros_like(routing_map).scatter_(1, ref_idx, True)
        differ = (routing_map != ref_map).any(dim=1)
        tokens += int(differ.numel())
        if not differ.any():
            continue
        k = ref_idx.shape[1]
        top = ref_logits[differ].topk(k + 1, dim=1)
        margin = top.values[:, k - 1] - top.values[:, k]
        # Largest change rounding x to the model dtype can make in each logit: u * sum_i |w_ei| |x_i|.
        unit = torch.finfo(weight.dtype).eps / 2
        bound = unit * (x[differ].abs().float() @ weight.abs().float().T)
        movable = bound.gather(1, top.indices[:, k - 1 : k + 1]).sum(dim=1)
        is_tie = margin <= movable
        ties += int(is_tie.sum())
        flips += int((~is_tie).sum())
        if (~is_tie).any():
            worst_flip_margin = max(worst_flip_margin, margin[~is_tie].max().item())
    return {
        "router_layers": len(ours),
        "router_tokens": tokens,
        "router_flips": flips,
        "router_near_ties": ties,
        "router_worst_flip_margin": worst_flip_margin,
    }


def replayed_routing(
    model: torch.nn.Module, indices: Sequence[torch.Tensor] | None, batch: int
) -> AbstractContextManager[None]:
    """Run ``model`` with each MoE router taking the given top-k indices (transformers' token order)."""
    from model_support.core.megatron.routing import replaying

    if not indices:
        return nullcontext()
    ours = routers(model)
    if len(ours) != len(indices):
        raise ValueError(f"the model has {len(ours)} MoE routers, {len(indices)} routings given")
    if any(r.router_replay is None for r in ours):
        raise ValueError("the model was built without moe_enable_routing_replay")
    return replaying([(r, sequence_major(idx, batch)) for r, idx in zip(ours, indices, strict=True)])


def recorded_routing(model: torch.nn.Module) -> AbstractContextManager[list[list[torch.Tensor]]]:
    """Record each MoE router's top-k indices, one list per router with one entry per forward."""
    from model_support.core.megatron.routing import recording

    return recording([r for r in routers(model) if r.router_replay is not None])


def merged_distance(oracle_file: Path, merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """How far one run's merged HF weights are from the oracle's, as that run writes them: the largest distance beyond
    rounding (:func:`beyond_rounding`) and how many tensors are missing on either side or of another shape. Read from
    the oracle's results one tensor at a time, so a run never writes (nor holds twice) the whole merged model; an
    oracle that did not run leaves every tensor mismatched."""
    from safetensors import safe_open

    if not oracle_file.exists():
        return {"merged_max_abs_err": torch.tensor([inf]), "merged_mismatches": torch.tensor([len(merged)])}
    worst, mismatches = 0.0, 0
    with safe_open(str(oracle_file), "pt") as f:
        names = {k.removeprefix("merged.") for k in f.keys() if k.startswith("merged.")}  # noqa: SIM118 (no __iter__)
        mismatches += len(names ^ merged.keys())
        for name in sorted(names & merged.keys()):
            reference, mine = f.get_tensor(f"merged.{name}"), merged[name].cpu()
            if reference.shape != mine.shape:
                mismatches += 1
            else:
                worst = max(worst, beyond_rounding(reference, mine))
    return {
        "merged_max_abs_err": torch.tensor([worst], dtype=torch.float64),
        "merged_mismatches": torch.tensor([mismatches]),
    }


def beyond_rounding(reference: torch.Tensor, other: torch.Tensor) -> float:
    """The largest distance between two exported weights beyond one rounding to their dtype: ``|a - b|`` less one
    unit in the last place at the larger of the two (nothing off for fp32).

    The merged weight is base + LoRA rounded to the checkpoint's dtype; two layouts' LoRA updates differ by
    round-off (1e-8), and a sum that lands near a rounding boundary rounds the other way in one of them (a bf16
    step: 4.9e-4 at 0.1). Units in the last place of the result alone are no measure: where base and LoRA cancel,
    the result is tiny and so is its unit, while the round-off of the sum is that of its terms."""
    a, b = reference.double(), other.double()
    if reference.dtype == torch.float32 or not a.numel():
        return (a - b).abs().max().item() if a.numel() else 0.0
    info = torch.finfo(reference.dtype)
    _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))
    unit = (info.eps * torch.pow(2.0, exponent.double() - 1)).clamp_min(info.smallest_normal * info.eps)
    return ((a - b).abs() - unit).clamp_min(0).max().item()
