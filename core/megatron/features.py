"""Length-dependent features a config asks for that a built megatron-core model may silently lack.

A layer spec that builds no sliding window, or a provider that sets no rope scaling, gives a model that computes the
checkpoint's function on short rows and another one past the window or the scaling threshold. :func:`unimplemented`
reads what the built modules do and names each config field they ignore, so a build refuses instead.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from model_support.core.layout import scaled_ropes, sliding_window, text_config

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.self_attention\.core_attention$")


def _windows(chunks: Sequence[torch.nn.Module]) -> dict[int, int | None]:
    """The attention window of each decoder layer this rank holds, by global layer index (None: full attention)."""
    from model_support.core.megatron.names import global_name
    from model_support.core.megatron.spec import SDPAttention

    out: dict[int, int | None] = {}
    for chunk in chunks:
        for name, module in chunk.named_modules():
            match = _LAYER.match(global_name(chunk, name))
            if match and isinstance(module, SDPAttention):
                out[int(match.group(1))] = module.window
    return out


def _window_problem(config: Any, chunks: Sequence[torch.nn.Module]) -> str | None:
    window = sliding_window(config)
    if window is None:
        return None
    kinds = getattr(text_config(config), "layer_types", None)
    built = _windows(chunks)
    wrong = sorted(i for i, got in built.items() if got != (window if kinds is None or "sliding" in kinds[i] else None))
    if not wrong:
        return None
    found = ", ".join(f"layer {i}: {built[i]}" for i in wrong[:4])
    return (
        f"config sets sliding_window={window}, but the built model's attention ignores it ({found}): its layer spec "
        "builds no window; declare a megatron_layer_spec that does (see the gemma3 plugin)"
    )


def _expected_frequencies(config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(what the config asks, transformers' inverse frequencies) for each scaled rotary embedding of the config."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for layer_type, p in scaled_ropes(config).items():
        kind = p.get("rope_type", p.get("type"))
        if kind not in ROPE_INIT_FUNCTIONS:
            continue
        inv_freq, _ = ROPE_INIT_FUNCTIONS[kind](text_config(config), torch.device("cpu"), layer_type=layer_type)
        yield f"rope_type={kind!r} ({', '.join(f'{k}={v}' for k, v in p.items() if k != 'rope_type')})", inv_freq


def _frequencies(module: torch.nn.Module) -> torch.Tensor:
    """The angle a rotary embedding gives position 1, per rotated pair: its inverse frequencies as applied, whatever
    scaling it computes at run time (YaRN ramps them in ``forward``)."""
    with torch.no_grad():  # get_emb: every position, not this context-parallel rank's part (forward's)
        out = module.get_emb(2)
    emb = out[0] if isinstance(out, tuple) else out  # YaRN also returns its attention scale
    return emb[1].flatten().float().cpu()


def _rope_problems(config: Any, chunks: Sequence[torch.nn.Module]) -> list[str]:
    if not scaled_ropes(config):
        return []
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    built = [_frequencies(m) for c in chunks for m in c.modules() if isinstance(m, RotaryEmbedding)]
    problems = []
    for asked, expected in _expected_frequencies(config):
        half = expected.numel()
        if not any(f.numel() >= half and torch.allclose(f[:half], expected.float(), rtol=1e-4) for f in built):
            problems.append(
                f"config sets {asked}, but no rotary embedding of the built model has its frequencies: the provider "
                "does not apply this rope scaling"
            )
    return problems


def unimplemented(config: Any, chunks: Sequence[torch.nn.Module]) -> list[str]:
    """What the config asks that the built model (this rank's ``chunks``) does not do, one line per config field."""
    window = _window_problem(config, chunks)
    return ([window] if window else []) + _rope_problems(config, chunks)
