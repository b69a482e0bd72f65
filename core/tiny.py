"""Tiny random replicas of real architectures, built offline.

``shrink_config`` keeps what makes an architecture itself (the class, the layer_types pattern,
MoE routing with a shared expert, GDN head grouping, q/k-norm, gated attention, MTP fields,
multimodal sub-configs) and shrinks every dimension. ``build_tiny`` saves the random model with
``save_pretrained`` next to an offline byte-level BPE tokenizer with a ChatML chat template.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from model_support.core.errors import ConfigError

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER_VOCAB = 512
_CORPUS = """\
The quick brown fox jumps over the lazy dog. Is the sky blue? yes. Is fire cold? no.
A model family is supported when its handler declares the architecture, the LoRA targets and the codec.
Gated DeltaNet layers keep a recurrent state; full attention layers look at every earlier token.
Mixture of experts layers route each token to the top experts and may add a shared expert.
user assistant system question answer true false one two three four five six seven eight nine ten
Training with low rank adapters changes a few matrices while the base weights stay frozen.
The server answers with the same tokens that the trainer scored, or the run is not on policy.
"""

# Dimensions of the text model, by config field; only fields the original config has are set.
_TEXT_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "head_dim": 32,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    # The real models' GDN head size: vLLM's CPU GDN kernel runs 128 and rejects 16 and 32 (so the serving stages
    # run on the replicas).
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.05,
}
_VISION_DIMS = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
TINY_EXPERTS = 4
TINY_TOP_K = 2


def _layer_count(text: dict[str, Any]) -> int:
    """Enough layers to keep one whole period of the layer_types pattern (at least two)."""
    layer_types = text.get("layer_types")
    if layer_types and "full_attention" in layer_types and "linear_attention" in layer_types:
        return layer_types.index("full_attention") + 1
    interval = text.get("full_attention_interval")
    if interval and "linear_num_key_heads" in text:
        return int(interval)
    return 2


def _scale_sections(sections: list[int], total: int) -> list[int]:
    """Scale mrope sections to a new sum, by largest remainders."""
    exact = [s * total / sum(sections) for s in sections]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: exact[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out


def _shrink_text(text: dict[str, Any], vocab_size: int, token_ids: dict[str, int]) -> None:
    n_layers = _layer_count(text)
    gdn_ratio = max(1, text.get("linear_num_value_heads", 1) // max(1, text.get("linear_num_key_heads") or 1))
    for key, value in _TEXT_DIMS.items():
        if key in text:
            text[key] = value
    heads, kv = text.get("num_attention_heads", 4), text.get("num_key_value_heads")
    if kv is not None:
        text["num_key_value_heads"] = heads if kv == heads else 2
    if "linear_num_value_heads" in text:
        text["linear_num_value_heads"] = _TEXT_DIMS["linear_num_key_heads"] * gdn_ratio
    if text.get("num_experts") or text.get("num_local_experts"):
        key = "num_experts" if "num_experts" in text else "num_local_experts"
        text[key] = TINY_EXPERTS
        text["num_experts_per_tok"] = TINY_TOP_K
    text["num_hidden_layers"] = n_layers
    if text.get("layer_types"):
        text["layer_types"] = text["layer_types"][:n_layers]
    if text.get("mlp_only_layers"):
        text["mlp_only_layers"] = [i for i in text["mlp_only_layers"] if i < n_layers]
    if "max_window_layers" in text:
        text["max_window_layers"] = n_layers
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("mrope_section"):
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        rope["mrope_section"] = _scale_sections(list(rope["mrope_section"]), int(head_dim * partial) // 2)
    text["vocab_size"] = vocab_size
    text["bos_token_id"] = token_ids["<|endoftext|>"]
    text["eos_token_id"] = token_ids["<|im_end|>"]
    text["pad_token_id"] = token_ids["<|endoftext|>"]
    text["dtype"] = "float32"


def shrink_config(raw: dict[str, Any], vocab_size: int, token_ids: dict[str, int]) -> dict[str, Any]:
    """A tiny copy of a config.json dict (see module docstring)."""
    if not raw.get("architectures"):
        raise ConfigError("config.json names no architectures; cannot build a replica of it")
    cfg = copy.deepcopy(raw)
    text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    _shrink_text(text, vocab_size, token_ids)
    vision = cfg.get("vision_config")
    if isinstance(vision, dict):
        for key, value in _VISION_DIMS.items():
            if key in vision:
                vision[key] = value
        if "out_hidden_size" in vision:
            vision["out_hidden_size"] = text["hidden_size"]
        if vision.get("deepstack_visual_indexes"):
            vision["deepstack_visual_indexes"] = [0]
    for key, token in (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ):
        if key in cfg:
            cfg[key] = token_ids[token]
    if text is not cfg:
        cfg["dtype"] = "float32"
    cfg.pop("torch_dtype", None)
    cfg.pop("transformers_version", None)
    return cfg


def build_tokenizer(out_dir: Path):
    """Train a small byte-level BPE offline and save it with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_tiny(raw_config: dict[str, Any], out_dir: Path, seed: int = 0) -> Path:
    """Build and save a tiny random replica of the architecture ``raw_config`` describes."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = math.ceil(len(tokenizer) / 64) * 64
    cfg = shrink_config(raw_config, vocab_size, token_ids)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    arch = cfg["architectures"][0]
    model_cls = getattr(transformers, arch, None)
    if model_cls is None:
        raise ConfigError(
            f"transformers {transformers.__version__} has no class {arch}; upgrade transformers to build it"
        )
    config = transformers.AutoConfig.from_pretrained(out_dir)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    model.save_pretrained(out_dir)
    return out_dir
