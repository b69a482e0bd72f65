"""Layer-level benchmark: one Gated DeltaNet layer and one full-attention layer of a built model, fwd+bwd, packed
rows against shared-prefix rows of the same GRPO groups.

Run from the repository root on a CUDA machine (megatron-core, megatron-bridge and fla importable) on a replica at
the width to measure, e.g. Qwen3.6-27B's::

    model-support replica qwen3.5 /tmp/r --layers 4 --dtype bf16
    python -m benchmarks.layer_benchmark /tmp/r --out layers.json

The model is built through the training-time API as a trainer runs it (bf16, megatron-core's ``GatedDeltaNet``
with the recurrence on the kernel the handler's policy picks, ``SDPAttention`` as core attention). For each of
the two layers (the first GDN layer, the first attention layer, each a whole megatron-core ``TransformerLayer``
with its norms and MLP) it times one forward and backward of random hidden states laid out as

* packed: ``G`` rows ``[prompt, completion_i]`` back to back (``G * (P + C)`` tokens, each sequence alone), and
* shared: one row ``[prompt, c1, ..., cG]`` (``P + G * C`` tokens, the prompt computed once),

and reports the median milliseconds (CUDA events, after warm-up, eager: as issued from Python), completion tokens
per second, and the shared / packed ratio against the ideal work ratio ``(P + G * C) / (G * (P + C))``. Ratios
come from one run; no threshold is applied.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch


def _layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The first Gated DeltaNet layer and the first attention layer of the decoder."""
    from model_support.core.megatron.gdn import GDN_MODULES

    found: dict[str, torch.nn.Module] = {}
    for layer in model.decoder.layers:
        kind = "gdn" if isinstance(layer.self_attention, GDN_MODULES) else "attention"
        found.setdefault(kind, layer)
    return found


def _time(step: Any, repeats: int, warmup: int) -> float:
    """Median milliseconds of ``step()`` over ``repeats`` runs after ``warmup`` (CUDA events)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench(model_dir: Path, group: int, prompt: int, completion: int, repeats: int, warmup: int) -> dict[str, Any]:
    from model_support.core import api
    from model_support.core.megatron.forward import packed_rows
    from model_support.core.megatron.rows import RowLayout

    model = api.build_model(model_dir)
    module = model.module
    hidden_size = module.config.hidden_size
    dtype = next(module.parameters()).dtype
    packed = RowLayout.from_position_ids(torch.cat([torch.arange(prompt + completion)] * group))
    shared = RowLayout.shared_prefix(prompt, [completion] * group)
    results: dict[str, Any] = {
        "model": model.describe(),
        "group": group,
        "prompt": prompt,
        "completion": completion,
        "ideal_ratio": (prompt + group * completion) / (group * (prompt + completion)),
        "layers": {},
    }
    for kind, layer in _layers(module).items():
        row_times = {}
        for name, rows in (("packed", packed), ("shared", shared)):
            hidden = torch.randn(rows.length, 1, hidden_size, device="cuda", dtype=dtype, requires_grad=True)
            positions = rows.positions.cuda()
            rotary = module.rotary_pos_emb(int(positions.max()) + 1)[positions] if kind == "attention" else None

            def step(layer=layer, rows=rows, hidden=hidden, rotary=rotary) -> None:
                with packed_rows(layer, rows):
                    out, _ = layer(hidden, attention_mask=None, rotary_pos_emb=rotary)
                out.float().square().mean().backward()

            row_times[name] = _time(step, repeats, warmup)
        results["layers"][kind] = {
            "packed_ms": row_times["packed"],
            "shared_ms": row_times["shared"],
            "ratio": row_times["shared"] / row_times["packed"],
            "packed_completion_tokens_per_s": group * completion / row_times["packed"] * 1e3,
            "shared_completion_tokens_per_s": group * completion / row_times["shared"] * 1e3,
        }
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"G={results['group']}, P={results['prompt']}, C={results['completion']}; {results['model']}; ideal "
        f"shared / packed work ratio {results['ideal_ratio']:.3f}",
        "",
        "| layer | packed ms | shared ms | shared / packed | packed completion tok/s | shared completion tok/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind, r in results["layers"].items():
        lines.append(
            f"| {kind} | {r['packed_ms']:.2f} | {r['shared_ms']:.2f} | {r['ratio']:.3f} | "
            f"{r['packed_completion_tokens_per_s']:.3g} | {r['shared_completion_tokens_per_s']:.3g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="a replica or checkpoint directory (GDN and attention layers)")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens (P)")
    parser.add_argument("--completion", type=int, default=512, help="tokens per completion (C)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("the layer benchmark needs a CUDA GPU")
    results = bench(args.model_dir, args.group, args.prompt, args.completion, args.repeats, args.warmup)
    print(markdown(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
