"""A trainer's loop with model-support's training-time API, on a tiny random Qwen3 replica (CPU is enough).

Run from the repository root (CI runs it too):

    python docs/examples/train_and_push.py [WORKDIR]

It resolves the handler, builds the Megatron model through megatron-bridge, puts LoRA on the handler's targets,
takes a few optimizer steps, exports the adapter as a PEFT directory, streams the merged weights into a running
vLLM server in place (``qwen3@0`` -> ``qwen3@1``, when the vLLM runtime is installed: ``model-support runtime
install``) and checks that the server and the trainer give the same log-probability to the same token.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from model_support.core import api
from model_support.core.serving.errors import RuntimeMissingError
from model_support.core.tiny import build_tiny
from model_support.handlers.configs import CONFIGS

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23]]
TARGET = 7  # the step makes this token likelier after each prompt


def main(work: Path) -> int:
    model_dir = build_tiny(json.loads((CONFIGS / "qwen3-0.6b.json").read_text()), work / "tiny-qwen3")

    handler = api.resolve(model_dir)  # the registered handler for the checkpoint's architecture
    model = api.build_model(model_dir, handler=handler)  # joins torch.distributed if the caller set it up
    lora = api.apply_lora(model, rank=8, alpha=16.0)
    print(f"{handler.spec.name}: {model.describe()}; LoRA on {len(lora.wrapped)} modules")

    params = [p for p in model.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for step in range(3):
        rows = api.token_logprobs(model, PROMPTS)  # one packed forward, positions restart per sequence
        loss = -torch.stack([r[-1, TARGET] for r in rows]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: -log p(target) = {loss.item():.4f}")

    adapter = api.export_adapter(model, work / "adapter")  # PEFT format, through the handler's codec
    print(f"adapter: {sorted(p.name for p in adapter.iterdir())}")

    with torch.no_grad():
        trainer = api.token_logprobs(model, PROMPTS[:1])[0][-1]
    try:
        server = api.serve(model_dir, "qwen3@0", work / "vllm.log", options=api.ServeOptions(dtype="float32"))
    except RuntimeMissingError as exc:
        print(f"no server to push to: {exc}")
        return 0
    try:
        served_name = server.update_weights(api.merged_weights(model))  # in place, applied after the last bucket
        choice = server.completion(PROMPTS[0], max_tokens=1, temperature=0.0, logprobs=0)
        token, served = choice["token_ids"][0], choice["logprobs"]["token_logprobs"][0]
        delta = abs(served - trainer[token].item())
        print(f"pushed: the server lists {server.models()}; token {token}: |delta log p| = {delta:.2e}")
        return 0 if served_name == "qwen3@1" and delta < 1e-4 else 1
    finally:
        server.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(Path(sys.argv[1])))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(main(Path(tmp)))
