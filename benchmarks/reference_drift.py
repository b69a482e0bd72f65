"""How far transformers' own bf16 run of a replica is from its fp32 run on sampled-like tokens (k3 KL, |delta|).

    python -m benchmarks.reference_drift CONFIG DIR [--layers 4] [--device cpu] [--completion 16] [--draw 48 ...]

Builds ``model-support replica CONFIG DIR --layers N --dtype bf16`` (kept in DIR for a second run), then scores
three rows (two 8-token prompts and one of 65, each with ``--completion`` completion tokens, 16 by default: the rows
``train_inference_mismatch`` scored when it sampled 48 tokens) with the streamed transformers reference in fp32 and
in bf16. The completion tokens are random: a random replica's next-token distribution is close to uniform, so they
stand for sampled ones. Prints the k3 KL estimate and the mean and largest |log p_bf16 - log p_fp32| over the
completion tokens: the floor a correct bf16 implementation of that replica keeps from fp32, which the serving
stages' limits scale with. ``--completion`` scores
more tokens per row; each ``--draw N`` then also reports the figures of each disjoint draw of N of them (their smallest
and largest): how far one draw of N tokens can be from another, i.e. how steady a calibration on N tokens is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig

from model_support.core.megatron.hf_reference import StreamedReference
from model_support.core.replica import build_replica
from model_support.handlers.configs import CONFIGS
from model_support.validation.serving_session import token_logprobs
from model_support.validation.stages.train_inference_mismatch import mismatch

PROMPTS = (8, 8, 65)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a reference config in handlers/configs (qwen3.5-35b-a3b.json)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--completion", type=int, default=16, help="completion tokens per row")
    parser.add_argument(
        "--draw", type=int, action="append", default=[], help="also the figures of disjoint draws of this many tokens"
    )
    args = parser.parse_args()
    if any(n > len(PROMPTS) * args.completion for n in args.draw):
        parser.error(f"--draw: at most the {len(PROMPTS) * args.completion} tokens scored (--completion per row)")
    if not (args.out / "config.json").exists():
        raw = json.loads((CONFIGS / args.config).read_text())
        build_replica(raw, args.out, layers=args.layers, experts=None, dtype=torch.bfloat16, device=args.device,
                      seed=0, overwrite=True)  # fmt: skip
    config = AutoConfig.from_pretrained(args.out)
    gen = torch.Generator().manual_seed(18)
    rows = [torch.randint(10, 500, (n + args.completion,), generator=gen) for n in PROMPTS]
    scored = {}
    for dtype in (torch.float32, torch.bfloat16):
        reference = StreamedReference(args.out, config, torch.device(args.device), dtype)
        scored[dtype] = []
        for row in rows:
            logprobs = torch.log_softmax(reference.forward(row[None]).logits[0].double().cpu(), dim=-1)
            scored[dtype].append(token_logprobs(logprobs, row.tolist(), len(row) - args.completion))
        del reference
    delta = torch.cat(scored[torch.bfloat16]) - torch.cat(scored[torch.float32])
    print(json.dumps({"config": args.config, "layers": args.layers, "tokens": delta.numel()} | mismatch(delta)))
    order = torch.randperm(delta.numel(), generator=gen)  # disjoint draws of the tokens, in a seeded random order
    for n in args.draw:
        draws = [mismatch(delta[order[i : i + n]]) for i in range(0, delta.numel() - n + 1, n)]
        spread = {k: (min(d[k] for d in draws), max(d[k] for d in draws)) for k in draws[0]}
        print(json.dumps({"draw": n, "draws": len(draws), "min_max": spread}))


if __name__ == "__main__":
    main()
