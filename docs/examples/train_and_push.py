"""A trainer's loop with model-support's training-time API, on a tiny random Qwen3 replica (CPU is enough).

Run from the repository root (CI runs it too), on one process or under torchrun in any layout:

    python docs/examples/train_and_push.py [WORKDIR]
    torchrun --nproc-per-node 2 docs/examples/train_and_push.py WORKDIR --layout tp2     # or pp2, ...
    torchrun --nproc-per-node 2 docs/examples/train_and_push.py WORKDIR --model qwen3-moe --layout ep2

On a node with a GPU per rank each rank trains on its own GPU (NCCL), in bf16; on CPUs over gloo, in fp32.

It resolves the handler, builds the Megatron model through megatron-bridge, puts LoRA on the handler's targets,
takes a few optimizer steps, exports the adapter as a PEFT directory, and, when the vLLM runtime is installed
(``model-support runtime install``), syncs a server it configured in both ways a trainer does: the LoRA adapter
hot-swapped (``qwen3-lora@1``, the base untouched) and the merged weights streamed in place (``qwen3@0`` ->
``qwen3@1``), checking each time that the server and the trainer give the same log-probability to the same token
and that the sampled tokens carry the version of the weights that sampled them. Every rank runs the same code;
rank 0 talks to the server, the other ranks take part in the gathers.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from model_support.core import api
from model_support.core.serving.errors import RuntimeMissingError
from model_support.core.tiny import build_tiny
from model_support.handlers.configs import CONFIGS

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23]]
TARGET = 7  # the steps make this token likelier after each prompt
TOLERANCE = 1e-4  # fp32 server and trainer


MODELS = {"qwen3": "qwen3-0.6b.json", "qwen3-moe": "qwen3-30b-a3b.json"}  # reference configs the replicas take


def main(work: Path, layout: str, family: str = "qwen3") -> int:
    rank = dist.get_rank() if dist.is_initialized() else 0
    model_dir = work / f"tiny-{family}"
    if rank == 0 and not model_dir.exists():
        build_tiny(json.loads((CONFIGS / MODELS[family]).read_text()), model_dir)
    if dist.is_initialized():
        dist.barrier()

    handler = api.resolve(model_dir)  # the registered handler for the checkpoint's architecture
    model = api.build_model(model_dir, handler=handler, parallel=api.ParallelLayout.parse(layout))
    lora = api.apply_lora(model, rank=8, alpha=16.0)
    say = print if rank == 0 else (lambda *_: None)
    say(f"{handler.spec.name} in {layout}: {model.describe()}; LoRA on {len(lora.wrapped)} modules")

    tokens = torch.tensor([[*PROMPTS[0], TARGET]])

    def loss_fn(logits: torch.Tensor, micro: object) -> torch.Tensor:  # the last prompt token -> TARGET
        return -torch.log_softmax(logits[:, -2], dim=-1)[:, TARGET].mean()

    params = [p for chunk in model.chunks for p in chunk.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for step in range(3):
        optimizer.zero_grad()
        out = api.forward_backward(model, tokens, loss_fn)  # megatron-core's schedule for the layout
        api.reduce_lora_grads(model)
        optimizer.step()
        say(f"step {step}: -log p(target) = {out.loss.item():.4f}")

    adapter = api.export_adapter(model, work / "adapter")  # PEFT format, through the handler's codec
    if rank == 0:
        print(f"adapter: {sorted(p.name for p in adapter.iterdir())}")
    with torch.no_grad():
        trainer = api.token_logprobs(model, PROMPTS[:1])[0][-1]  # every rank takes part and gets the rows

    server = None
    if rank == 0:
        try:
            options = api.ServeOptions(dtype="float32", enable_lora=True)  # LoRA on: the hot-swap mode
            server = api.serve(model_dir, f"{family}@0", work / "vllm.log", options=options)
        except RuntimeMissingError as exc:
            print(f"no server to push to: {exc}")
    if dist.is_initialized():  # every rank learns whether there is a server to sync
        flag = torch.tensor([server is not None], dtype=torch.int64, device=trainer.device)  # NCCL: on the GPU
        dist.broadcast(flag, 0)
        if not flag.item():
            return 0
    elif server is None:
        return 0

    ok = True
    try:
        for mode in ("lora", "merged"):
            # Every rank calls the push (gathers are collectives); rank 0 passes the server. "lora": the adapter
            # hot-swapped beside the untouched base; "merged": streamed in place, applied after the last bucket.
            push = api.push_adapter if mode == "lora" else api.push_weights
            name = push(server, model)
            if server is None:
                continue
            (choice,) = server.generate(PROMPTS[0], model=name, max_tokens=1, temperature=0.0, logprobs=0)
            token, served = choice["token_ids"][0], choice["logprobs"]["content"][0]["logprob"]
            delta = abs(served - trainer[token].item())
            print(
                f"{mode}: served {name}, token {token}: |delta log p| = {delta:.2e}, "
                f"policy_epoch {choice['policy_epoch']}, the server lists {sorted(server.models())}"
            )
            ok = ok and delta < TOLERANCE
            if mode == "lora":
                server.remove_adapter()  # the merged push changes the base under it
        ok = ok and (server is None or server.served_name == f"{family}@1")
    finally:
        if server is not None:
            server.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", nargs="?", type=Path)
    parser.add_argument("--layout", default="tp1", help="a ParallelLayout, e.g. tp2 or pp2 (under torchrun)")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3", help="the tiny replica to train")
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # the trainer's own process group: build_model joins it
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        if args.workdir is not None:
            code = main(args.workdir, args.layout, args.model)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                code = main(Path(tmp), args.layout, args.model)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    raise SystemExit(code)
