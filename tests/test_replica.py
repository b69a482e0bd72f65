"""Replicas keep a real config's width and cut only its depth and expert count."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from model_support.core import replica
from model_support.core.replica import ReplicaError, build_replica, replica_config
from model_support.handlers.configs import CONFIGS
from tests.helpers import run_cli

QWEN3 = json.loads((CONFIGS / "qwen3-0.6b.json").read_text())
QWEN35_MOE = json.loads((CONFIGS / "qwen3.5-35b-a3b.json").read_text())
LINEAR, FULL = "linear_attention", "full_attention"
MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]


def _tensors(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every saved tensor's shape and dtype, over all shards."""
    found = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = f.get_slice(name)
                found[name] = (tuple(tensor.get_shape()), tensor.get_dtype())
    return found


def _chat_ids(model_dir: Path) -> torch.Tensor:
    """The tokenizer's chat template applied to MESSAGES, as model input ids."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nIs the sky blue?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert int(ids.max()) < 512
    return ids


def test_replica_command_writes_a_real_width_model(tmp_path):
    out = tmp_path / "q3"
    out.mkdir()  # an empty OUT is written into
    result = run_cli("replica", "qwen3", str(out), "--layers", "2", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
        assert config[key] == QWEN3[key], key
    assert config["vocab_size"] == QWEN3["vocab_size"] == 151936
    assert (config["num_hidden_layers"], config["max_window_layers"], config["dtype"]) == (2, 2, "bfloat16")

    tensors = _tensors(out)
    assert {dtype for _, dtype in tensors.values()} == {"BF16"}
    assert tensors["model.embed_tokens.weight"][0] == (151936, 1024)
    assert tensors["model.layers.1.self_attn.q_proj.weight"][0] == (16 * 128, 1024)
    assert tensors["model.layers.1.self_attn.k_proj.weight"][0] == (8 * 128, 1024)
    assert tensors["model.layers.1.mlp.gate_proj.weight"][0] == (3072, 1024)
    assert {int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")} == {0, 1}
    parameters = sum(torch.Size(shape).numel() for shape, _ in tensors.values())
    line = f"Qwen3ForCausalLM replica written to {out}: {parameters / 1e6:.1f}M parameters, 2 layers, bfloat16, cpu, "
    assert re.fullmatch(re.escape(line) + r"\d+\.\d s", result.stdout.strip()), result.stdout

    ids = _chat_ids(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert config["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert config["bos_token_id"] == config["pad_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 151936)
    assert torch.isfinite(logits).all()


def test_replica_in_fp32_is_sharded_and_replaces_out(tmp_path, monkeypatch):
    monkeypatch.setattr(replica, "MAX_SHARD_SIZE", "300MB")  # the embedding alone is 622 MB in fp32
    out = tmp_path / "q3"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier run")
    info = build_replica(QWEN3, out, layers=1, experts=None, dtype=torch.float32, device="cpu", seed=0, overwrite=True)
    assert (info.layers, info.experts, info.dtype, info.device) == (1, None, "float32", "cpu")
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q3"]  # no temporary sibling is left
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    tensors = _tensors(out)
    assert set(index["weight_map"]) == set(tensors)
    assert {dtype for _, dtype in tensors.values()} == {"F32"}
    assert tensors["model.embed_tokens.weight"][0] == (151936, 1024)
    assert info.parameters == sum(torch.Size(shape).numel() for shape, _ in tensors.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32 and model.config.num_hidden_layers == 1
    assert model(input_ids=_chat_ids(out)).logits.shape[-1] == 151936


def test_moe_multimodal_config_keeps_the_text_width_at_one_period():
    cfg = replica_config(QWEN35_MOE, layers=4, experts=2, dtype="bfloat16")
    text, real = cfg["text_config"], QWEN35_MOE["text_config"]
    for key in (
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
        "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "moe_intermediate_size",
        "shared_expert_intermediate_size", "vocab_size", "rope_parameters", "mtp_num_hidden_layers",
    ):  # fmt: skip
        assert text[key] == real[key], key
    assert text["layer_types"] == [LINEAR, LINEAR, LINEAR, FULL]
    assert (text["num_hidden_layers"], text["num_experts"], text["num_experts_per_tok"]) == (4, 2, 2)
    assert text["dtype"] == cfg["dtype"] == "bfloat16"
    vision = cfg["vision_config"]
    assert (vision["depth"], vision["hidden_size"], vision["out_hidden_size"]) == (1, 32, 2048)
    assert real["num_experts"] == 256 and len(real["layer_types"]) == 40  # the input is not modified
    # top-k is kept while it fits the expert count; all layers by default
    wide = replica_config(QWEN35_MOE, layers=None, experts=16, dtype="float32")["text_config"]
    assert (wide["num_experts"], wide["num_experts_per_tok"], wide["num_hidden_layers"]) == (16, 8, 40)


def test_layers_must_keep_every_layer_kind():
    five = replica_config(QWEN35_MOE, layers=5, experts=None, dtype="bfloat16")["text_config"]
    assert five["layer_types"] == [LINEAR, LINEAR, LINEAR, FULL, LINEAR] and five["num_experts"] == 256
    with pytest.raises(ReplicaError, match=r"--layers 3 leaves no full_attention layer .* pass --layers 4 or more"):
        replica_config(QWEN35_MOE, layers=3, experts=None, dtype="bfloat16")
    # without layer_types, the pattern is what transformers derives from full_attention_interval
    derived = json.loads(json.dumps(QWEN35_MOE))
    del derived["text_config"]["layer_types"]
    with pytest.raises(ReplicaError, match="pass --layers 4 or more"):
        replica_config(derived, layers=2, experts=None, dtype="bfloat16")
    assert replica_config(derived, layers=4, experts=None, dtype="bfloat16")["text_config"]["num_hidden_layers"] == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["qwen3", "--layers", "0"], "error: --layers 0: Qwen3ForCausalLM has 28 layers; pass 1 to 28"),
        (["qwen3", "--layers", "29"], "error: --layers 29: Qwen3ForCausalLM has 28 layers; pass 1 to 28"),
        (
            ["qwen3", "--experts", "2"],
            "error: --experts applies to MoE configs only; Qwen3ForCausalLM is dense (no num_experts / "
            "num_local_experts)",
        ),
        (
            ["qwen3.5-moe", "--layers", "2", "--experts", "2"],
            "error: --layers 2 leaves no full_attention layer in Qwen3_5MoeForConditionalGeneration's layer_types; "
            "pass --layers 4 or more (one full period of the pattern)",
        ),
    ],
    ids=["layers-0", "layers-above-the-config", "experts-on-dense", "layers-lose-a-kind"],
)
def test_requests_the_config_does_not_allow_are_one_line_errors(tmp_path, args, message):
    result = run_cli("replica", args[0], str(tmp_path / "out"), *args[1:], "--device", "cpu")
    assert result.returncode == 2
    assert result.stderr.strip() == message
    assert list(tmp_path.iterdir()) == []


def test_non_empty_out_is_refused_without_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli("replica", "qwen3", str(out), "--layers", "1", "--device", "cpu")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {out} exists and is not an empty directory; pass --overwrite to replace it"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_a_failed_build_leaves_out_as_it_was(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("interrupted")

    # fails after the tokenizer is written into the temporary directory
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fail)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="interrupted"):
        build_replica(QWEN3, out, layers=1, experts=None, dtype=torch.bfloat16, device="cpu", seed=0, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(RuntimeError, match="interrupted"):
        build_replica(
            QWEN3, tmp_path / "new", layers=1, experts=None, dtype=torch.bfloat16, device="cpu", seed=0, overwrite=False
        )
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.slow
def test_moe_multimodal_replica_command_at_its_smallest_period(tmp_path):
    out = tmp_path / "q35moe"
    args = ("replica", "qwen3.5-moe", str(out), "--layers", "4", "--experts", "2", "--device", "cpu")
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert "Qwen3_5MoeForConditionalGeneration" in result.stdout and "4 layers, 2 experts, bfloat16" in result.stdout
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert (text["hidden_size"], text["vocab_size"], text["mtp_num_hidden_layers"]) == (2048, 248320, 1)
    assert (text["num_hidden_layers"], text["num_experts"], text["dtype"]) == (4, 2, "bfloat16")
    tensors = _tensors(out)
    assert {dtype for _, dtype in tensors.values()} == {"BF16"}
    prefix = "model.language_model."
    expected = {
        f"{prefix}embed_tokens.weight": (248320, 2048),
        "lm_head.weight": (248320, 2048),
        f"{prefix}layers.0.linear_attn.in_proj_qkv.weight": (2 * 16 * 128 + 32 * 128, 2048),
        f"{prefix}layers.0.linear_attn.in_proj_z.weight": (32 * 128, 2048),
        f"{prefix}layers.0.mlp.gate.weight": (2, 2048),
        f"{prefix}layers.0.mlp.experts.1.gate_proj.weight": (512, 2048),
        f"{prefix}layers.0.mlp.shared_expert.up_proj.weight": (512, 2048),
        f"{prefix}layers.3.self_attn.q_proj.weight": (2 * 16 * 256, 2048),  # gated attention: query and gate
        f"{prefix}layers.3.self_attn.k_proj.weight": (2 * 256, 2048),
        "model.visual.merger.linear_fc2.weight": (2048, 128),
    }
    assert {name: tensors[name][0] for name in expected} == expected
    assert not any(".experts.2." in name or ".layers.4." in name for name in tensors)

    model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    ids = _chat_ids(out)
    logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 248320)
    assert torch.isfinite(logits).all()


def test_low_precision_init_that_draws_non_finite_values_is_redrawn_in_fp32():
    """transformers' Qwen3.5 init draws GDN's A_log as log(uniform(0, 16)): in bf16 an exact 0 gives -inf."""
    config = transformers.Qwen3_5TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        layer_types=[LINEAR, FULL],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=512,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        vocab_size=128,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        for seed in range(20):
            torch.manual_seed(seed)
            model = transformers.Qwen3_5ForCausalLM(config)
            a_log = model.model.layers[0].linear_attn.A_log
            if not bool(torch.isfinite(a_log).all()):
                break
        else:
            pytest.fail("no seed drew a non-finite A_log in bf16: the planted fault is gone")
        assert replica.redraw_nonfinite(model) == ["model.layers.0.linear_attn.A_log"]
    finally:
        torch.set_default_dtype(default)
    assert a_log.dtype == torch.bfloat16
    assert bool(torch.isfinite(a_log).all())
    # Still transformers' distribution, log(uniform(0, 16)): at most log 16, with spread.
    assert float(a_log.detach().max()) <= math.log(16) + 1e-2
    assert float(a_log.detach().float().std()) > 0.5
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_a_replica_larger_than_the_free_memory_is_refused_before_anything_is_written(tmp_path):
    # Qwen3-30B-A3B at full depth: 30.5B parameters, 57 GiB in bf16 (the CPU machines have 24 GiB)
    result = run_cli("replica", "qwen3-moe", str(tmp_path / "out"), "--device", "cpu")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: the replica's weights alone take 56.9 GiB (30.53B parameters in bfloat16) and ")
    assert line.endswith("GiB free: keep fewer --layers or --experts, or build it on a larger device")
    assert list(tmp_path.iterdir()) == []
