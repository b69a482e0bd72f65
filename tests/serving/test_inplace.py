"""In-place update of a live vLLM server: buckets applied once after the last (streamed through vLLM's weight-transfer
routes, or staged as a checkpoint), same PID, served name advances; a push during a long generation; LoRA hot-swap."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model_support.core.serving.backend import Server, get_backend
from model_support.core.serving.errors import ServerError, ServingError
from model_support.core.serving.export import base_tensors, buckets, export_merged, merged_tensors, write_checkpoint
from model_support.core.serving.update import WeightGroup, WeightUpdater, memory_dir
from model_support.core.serving.vllm_backend import ServeOptions
from tests.serving.adapters import PROMPT, TARGETS, random_adapter, served_logprobs

FP32_TOL = 1e-4


# Longer than two of the CPU build's 128-token KV blocks: only whole blocks enter the prefix cache.
CACHED_PROMPT = PROMPT * 27


def _cached_tokens_read(server: Server) -> int:
    """How many prompt tokens one more request for ``CACHED_PROMPT`` reads from the server's prefix cache."""
    start = server.prefix_cache_hits()
    server.completion(CACHED_PROMPT, max_tokens=1, temperature=0.0)
    return server.prefix_cache_hits() - start


def _reference(model_dir: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].double(), -1)
    return logprobs[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])].float()


def _pushes_left() -> list[Path]:
    return list(memory_dir().glob("push-*")) if memory_dir() else []


@pytest.mark.slow
def test_weights_update_in_place_bucket_by_bucket(qwen3_server, tiny_model_dir, tmp_path):
    """Step 1 streams (the server's default transport), step 2 goes through a staged checkpoint, step 3 is broadcast
    bucket by bucket over a process group with the server's worker (gloo here, NCCL between GPUs)."""
    server, base = qwen3_server, tiny_model_dir("qwen3")
    pid, start = server.pid, int(server.served_name.rpartition("@")[2])
    previous = served_logprobs(server)
    assert (previous - _reference(base)).abs().max().item() < FP32_TOL
    files = WeightUpdater(server, server.process.log_path.parent / "qwen3-weights", base, transport="files")
    collective = WeightUpdater(server, tmp_path / "unused", base, transport="collective")
    for step, update in ((start + 1, server.update_weights), (start + 2, files.update), (start + 3, collective.update)):
        adapter = random_adapter(base, TARGETS, tmp_path / f"adapter-{step}", seed=20 + step)
        expected = _reference(export_merged(base, adapter, tmp_path / f"reference-{step}"))
        parts = list(buckets(merged_tensors(base, adapter), max_bytes=150_000))
        assert len(parts) >= 3

        def stream(parts=parts, step=step, previous=previous) -> Iterator[dict[str, torch.Tensor]]:
            for i, part in enumerate(parts):
                if i:  # nothing is applied before the last bucket: same name, same outputs
                    assert server.models() == [f"qwen3@{step - 1}"]
                    assert (served_logprobs(server) - previous).abs().max().item() < 1e-6
                yield part

        _cached_tokens_read(server)
        assert _cached_tokens_read(server) >= 256  # the prompt's whole blocks, cached at the old weights
        assert update(stream()) == f"qwen3@{step}"
        assert _cached_tokens_read(server) == 0  # the swap reset the prefix cache
        assert server.models() == [f"qwen3@{step}"]
        assert server.pid == pid and server.process.alive()
        with pytest.raises(ServerError, match=rf"404.*qwen3@{step - 1}.*does not exist"):
            server.completion(PROMPT, model=f"qwen3@{step - 1}", max_tokens=1)
        now = served_logprobs(server)
        assert (now - expected).abs().max().item() < FP32_TOL
        assert (now - previous).abs().max().item() > 1e-2
        previous = now
    assert 1 <= server._updater.peak_buckets_in_flight <= 2  # the stream: bounded, nothing left in memory or on disk
    assert not _pushes_left() and not list((server.process.log_path.parent / "qwen3-weights").glob("push-*"))
    staged = sorted(server.process.log_path.parent.glob("qwen3-weights/step-*"))
    assert [p.name for p in staged] == [f"step-{start + 2}"]  # the files transport keeps the loaded step only


def test_a_broadcast_bucket_is_checked_by_the_worker_and_a_refused_one_changes_nothing(qwen3_server, tiny_model_dir):
    """The worker receives a broadcast bucket before it checks it (the trainer never waits alone in the
    broadcast), then refuses what was not announced as it came; the step is dropped, the next one opens a new
    group and applies."""
    server, base = qwen3_server, tiny_model_dir("qwen3")
    name, before = server.served_name, served_logprobs(server)
    group = WeightGroup(server, 1, "gloo", 60.0)
    server.request("/start_weight_update", {})
    server.request("/update_weights", {"update_info": {"params": [["model.norm.weight", "float32", [64]]]}})
    with pytest.raises(ServerError, match=r"'model\.norm\.weight' is bfloat16 \[64\], announced float32 \[64\]"):
        group.send(server, {"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}, True)
    assert server.models() == [name]
    assert (served_logprobs(server) - before).abs().max().item() < 1e-6
    collective = WeightUpdater(server, base, base, transport="collective")
    assert collective.update(buckets(base_tensors(base), max_bytes=200_000)) != name
    # The base weights, under the next name.
    assert (served_logprobs(server) - _reference(base)).abs().max().item() < FP32_TOL


def test_a_failed_update_changes_nothing(qwen3_server, tiny_model_dir, tmp_path):
    server = qwen3_server
    name, before = server.served_name, served_logprobs(server)
    embed = dict(base_tensors(tiny_model_dir("qwen3")))["model.embed_tokens.weight"]

    def broken() -> Iterator[dict[str, torch.Tensor]]:
        yield {"model.embed_tokens.weight": torch.zeros_like(embed)}
        raise RuntimeError("trainer died mid-push")

    with pytest.raises(RuntimeError, match="trainer died mid-push"):
        server.update_weights(broken())
    assert server.models() == [name]
    assert (served_logprobs(server) - before).abs().max().item() < 1e-6
    assert not _pushes_left()

    wrong = {"model.embed_tokens.weight": torch.zeros_like(embed, dtype=torch.bfloat16)}
    with pytest.raises(ServingError, match=r"model.embed_tokens.weight is bfloat16 \[.*\], the checkpoint's float32"):
        server.update_weights([wrong])
    # The worker checks what it receives too: a tensor it was not told of fails the step there, nothing applied.
    server.request("/start_weight_update", {})
    server.request("/update_weights", {"update_info": {"params": [["model.norm.weight", "float32", [64]]]}})
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(tmp_path / "stray.safetensors"))
    with pytest.raises(ServerError, match=r"'lm_head\.weight' was not announced"):
        server.request("/update_weights", {"update_info": {"path": str(tmp_path / "stray.safetensors")}})
    assert not (tmp_path / "stray.safetensors").exists()
    assert server.models() == [name]
    assert (served_logprobs(server) - before).abs().max().item() < 1e-6


def test_a_non_finite_weight_is_refused_on_either_transport(qwen3_server, tiny_model_dir):
    server, base = qwen3_server, tiny_model_dir("qwen3")
    name, before = server.served_name, served_logprobs(server)
    staging = server.process.log_path.parent / "qwen3-weights"
    files, staged = WeightUpdater(server, staging, base, transport="files"), sorted(staging.glob("step-*"))
    dead = staging / "push-killed"  # a trainer killed mid-push left its buckets: the next push removes them
    dead.mkdir(parents=True)
    (dead / ".owner-lock").write_text("1\n")
    (dead / "bucket-0.safetensors").write_bytes(b"x" * 100)
    for poison in (float("nan"), float("inf")):
        steps = list(buckets(base_tensors(base), max_bytes=1 << 30))
        steps[-1] = {k: v.clone() for k, v in steps[-1].items()}
        key = next(iter(steps[-1]))
        steps[-1][key].view(-1)[3] = poison
        for update in (server.update_weights, files.update):
            with pytest.raises(ServingError, match=rf"{re.escape(key)} holds 1 non-finite value\(s\); nothing was"):
                update(steps)
            assert server.models() == [name]
            assert (served_logprobs(server) - before).abs().max().item() < 1e-6
    assert sorted(staging.glob("step-*")) == staged and not _pushes_left()  # nothing of the refused steps left
    assert not dead.exists()


def test_an_update_that_misses_a_tensor_is_refused(qwen3_server, tiny_model_dir):
    server = qwen3_server
    name, before = server.served_name, served_logprobs(server)
    partial = [{k: v for k, v in b.items() if k != "model.layers.0.self_attn.q_proj.weight"} for b in
               buckets(base_tensors(tiny_model_dir("qwen3")), max_bytes=1 << 30)]  # fmt: skip
    with pytest.raises(ServingError, match=r"1 tensor\(s\) missing \['model.layers.0.self_attn.q_proj.weight'\]"):
        server.update_weights(partial)
    assert server.models() == [name]
    assert (served_logprobs(server) - before).abs().max().item() < 1e-6


def test_a_reload_that_leaves_a_layer_on_its_old_weights_is_an_error(qwen3_server, tiny_model_dir, tmp_path):
    """vLLM's in-place reload only logs a layer that took none of the reloaded tensors and serves its old weights
    beside the new ones; the project's reload (every transport's) names it. Reloading the whole checkpoint after
    serves the checkpoint again."""
    server, base = qwen3_server, tiny_model_dir("qwen3")
    lost = "model.layers.1.mlp.down_proj.weight"
    partial = write_checkpoint(
        buckets(((k, v) for k, v in base_tensors(base) if k != lost), 1 << 30), tmp_path / "partial", support_from=base
    )
    with pytest.raises(
        ServerError, match=r"left 1 layer\(s\) on their old weights .*'model\.layers\.1\.mlp\.down_proj[.']"
    ):
        server.reload_weights(partial)
    server.reload_weights(write_checkpoint(buckets(base_tensors(base), 1 << 30), tmp_path / "whole", support_from=base))
    assert (served_logprobs(server) - _reference(base)).abs().max().item() < FP32_TOL


def _running(server: Server) -> float:
    """vLLM's gauge of the requests being generated now (its Prometheus /metrics)."""
    import urllib.request

    request = urllib.request.Request(f"{server.base_url}/metrics", headers=server.headers)
    with urllib.request.urlopen(request, timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:num_requests_running{"))


@pytest.mark.slow
def test_a_push_during_a_long_generation_keeps_it_going_with_per_token_epochs(qwen3_server, tiny_model_dir, tmp_path):
    import threading

    server, base = qwen3_server, tiny_model_dir("qwen3")
    _, step = server.served_name.rsplit("@", 1)
    old, new = int(step), int(step) + 1
    adapter = random_adapter(base, TARGETS, tmp_path / "adapter", seed=41)
    merged = list(buckets(merged_tensors(base, adapter), max_bytes=1 << 30))
    sampling = {"max_tokens": 300, "min_tokens": 300, "temperature": 0.0, "logprobs": 0}
    out: list[list[dict]] = []
    generation = threading.Thread(target=lambda: out.append(server.generate(PROMPT, **sampling)))
    generation.start()
    for _ in range(2000):  # until the engine runs it (bounded by count)
        if _running(server) >= 1:
            break
        generation.join(0.01)
    assert server.update_weights(merged) == f"qwen3@{new}"
    generation.join()
    choice = out[0][0]
    epochs = choice["policy_epochs"]
    boundary = epochs.index(new)
    assert len(epochs) == 300 and 0 < boundary < 300, "the push did not land inside the generation"
    assert epochs == [old] * boundary + [new] * (300 - boundary)
    assert choice["policy_epoch"] == [[0, old], [boundary, new]]
    assert choice["kv_cache_epoch"] == [[0, new]] and choice["num_evictions"] == 1
    # After the boundary the tokens are the new weights' own: the same prefix scored afresh on them agrees (the KV
    # cache of the tokens before it was recomputed, not kept from the old weights).
    prefix = [*PROMPT, *choice["token_ids"][:boundary]]
    fresh = server.generate(prefix, max_tokens=8, min_tokens=8, temperature=0.0, logprobs=0)[0]
    assert fresh["policy_epoch"] == [[0, new]] and fresh["num_evictions"] == 0
    got = [c["logprob"] for c in choice["logprobs"]["content"][boundary : boundary + 8]]
    want = [c["logprob"] for c in fresh["logprobs"]["content"]]
    assert fresh["token_ids"] == choice["token_ids"][boundary : boundary + 8]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4


@pytest.mark.slow
def test_a_lora_hot_swap_during_a_generation_leaves_it_on_its_adapter(qwen3_server, tiny_model_dir, tmp_path):
    """A request in flight when the next adapter is swapped in (the old one unloaded) finishes on the adapter it
    named: its tokens are that adapter's own greedy tokens, and its staleness fields say that adapter's step for
    every token, where vLLM's weight versions, which count the base's updates only, would say nothing changed."""
    import threading

    server, base = qwen3_server, tiny_model_dir("qwen3")
    sampling = {"max_tokens": 300, "min_tokens": 300, "temperature": 0.0}
    try:
        old = server.update_adapter(random_adapter(base, TARGETS, tmp_path / "first", seed=71))
        alone = server.generate(PROMPT, model=old, **sampling)[0]["token_ids"]
        out: list[list[dict]] = []
        generation = threading.Thread(target=lambda: out.append(server.generate(PROMPT, model=old, **sampling)))
        generation.start()
        for _ in range(2000):  # until the engine runs it (bounded by count)
            if _running(server) >= 1:
                break
            generation.join(0.01)
        new = server.update_adapter(random_adapter(base, TARGETS, tmp_path / "second", seed=72))
        still_running = _running(server)
        generation.join()
        assert still_running >= 1, "the swap did not land inside the generation"
        choice, step = out[0][0], int(old.rpartition("@")[2])
        assert choice["token_ids"] == alone
        assert choice["policy_epochs"] == [step] * 300 and choice["policy_epoch"] == [[0, step]]
        assert choice["kv_cache_epoch"] == [[0, step]] and choice["num_evictions"] == 0
        swapped = server.generate(PROMPT, model=new, **sampling)[0]
        assert swapped["token_ids"] != alone  # the next adapter samples otherwise: staying on the old one shows
        assert swapped["policy_epoch"] == [[0, step + 1]]
    finally:
        server.remove_adapter()


@pytest.mark.slow
def test_a_hot_swap_while_the_old_adapters_request_waits_keeps_its_files(qwen3_server, tiny_model_dir, tmp_path):
    """vLLM loads an unloaded adapter again from its path for a request admitted on it whose worker let it go (here:
    paused while the swap lands); with the server's copy removed at the swap its engine died. The copy now stays
    while the request is in flight and goes at the next swap or removal once nothing uses it."""
    import threading

    server, base = qwen3_server, tiny_model_dir("qwen3")
    copies = server.process.tmp_dir / "adapters"
    sampling = {"max_tokens": 64, "min_tokens": 64, "temperature": 0.0}
    old = server.update_adapter(random_adapter(base, TARGETS, tmp_path / "first", seed=73))
    try:
        out: list[list[dict]] = []
        generation = threading.Thread(target=lambda: out.append(server.generate(PROMPT, model=old, **sampling)))
        start = server.generated_tokens()
        generation.start()
        for _ in range(20_000):  # until it has sampled a few tokens (bounded by count)
            if server.generated_tokens() - start >= 4:
                break
            generation.join(0.001)
        server.pause()
        try:
            new = server.update_adapter(random_adapter(base, TARGETS, tmp_path / "second", seed=74))
            assert (copies / old).is_dir()  # the waiting request still needs it
        finally:
            server.resume()
        generation.join()
        assert len(out[0][0]["token_ids"]) == 64 and server.models()
    finally:
        server.remove_adapter()
    assert not any(copies.iterdir())  # nothing in flight: every unloaded adapter's copy is gone
    assert sorted(server.models()) == [server.served_name] and new not in server.models()


@pytest.mark.slow
def test_lora_hot_swap_advances_the_adapter_and_keeps_the_base(qwen3_server, tiny_model_dir, tmp_path):
    """Each step exported into one fixed directory (as a trainer does), a file of the user's beside it: the server
    loads its own copy, so nothing of the caller's is deleted, and the copy of an unloaded adapter is removed."""
    server, base = qwen3_server, tiny_model_dir("qwen3")
    name = server.update_weights(buckets(base_tensors(base), max_bytes=1 << 30))  # the checkpoint's own weights again
    base_out = served_logprobs(server)
    fixed = tmp_path / "adapter"
    names = []
    for step in (1, 2):
        adapter = random_adapter(base, TARGETS, tmp_path / f"hot-{step}", seed=60 + step)
        expected = _reference(export_merged(base, adapter, tmp_path / f"merged-{step}"))
        shutil.copytree(adapter, fixed, dirs_exist_ok=True)
        (fixed / "notes.txt").write_text("the user's")
        names.append(server.update_adapter(fixed))
        assert names[-1] == f"qwen3-lora@{step}"
        assert (served_logprobs(server, names[-1]) - expected).abs().max().item() < FP32_TOL
    assert sorted(server.models()) == sorted([name, "qwen3-lora@2"])
    copies = server.process.tmp_dir / "adapters"
    assert sorted(p.name for p in copies.iterdir()) == ["qwen3-lora@2"]  # the unloaded adapter's copy is removed
    assert (fixed / "notes.txt").read_text() == "the user's" and (fixed / "adapter_config.json").exists()
    with pytest.raises(ServerError, match=r"404.*qwen3-lora@1"):
        server.completion(PROMPT, model="qwen3-lora@1", max_tokens=1)
    assert (served_logprobs(server) - base_out).abs().max().item() < 1e-6  # the base is untouched
    server.remove_adapter()
    assert server.models() == [name] and not any(copies.iterdir()) and (fixed / "notes.txt").exists()


@pytest.mark.slow
def test_moe_weights_reload_in_place_as_they_load(tiny_model_dir, tmp_path):
    """A push into an MoE server serves the pushed experts: vLLM 0.32 packs fused-MoE weights for its kernel only at
    the first load, and a reload left them in checkpoint order inside the packed storage (the CPU build: 0.15 off
    after reloading the model's own weights). Pushed back and forth: the checkpoint's own weights, then experts
    changed, each matching transformers on those weights."""
    model = tiny_model_dir("qwen3-moe")
    tensors = dict(base_tensors(model))
    generator = torch.Generator().manual_seed(3)
    moved = {
        name: t + 0.05 * torch.randn(t.shape, generator=generator, dtype=t.dtype) if ".experts." in name else t
        for name, t in tensors.items()
    }
    changed = write_checkpoint(buckets(moved.items(), 1 << 30), tmp_path / "changed", support_from=model)
    server = get_backend("vllm").serve(model, "moe@0", ServeOptions(dtype="float32"), tmp_path / "vllm.log")
    try:
        before = served_logprobs(server)
        assert server.update_weights(buckets(tensors.items(), max_bytes=1 << 30)) == "moe@1"
        same = (served_logprobs(server) - before).abs().max().item()
        assert server.update_weights(buckets(moved.items(), max_bytes=1 << 30)) == "moe@2"
        served_changed = served_logprobs(server)
    finally:
        server.stop()
    assert same < 1e-6, f"reloading the model's own weights moved its log-probs by {same:.2e}"
    assert (served_changed - _reference(changed)).abs().max().item() < FP32_TOL
    assert (_reference(changed) - _reference(model)).abs().max().item() > 1e-2  # the experts did change
