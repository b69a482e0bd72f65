"""Tiny random replicas of real architectures, built offline.

``shrink_config`` keeps what makes an architecture itself (the class, the layer_types pattern,
MoE routing with a shared expert, GDN head grouping, q/k-norm, gated attention, MTP fields,
multimodal sub-configs) and shrinks every dimension. ``build_tiny`` saves the random model with
``save_pretrained`` next to an offline byte-level BPE tokenizer with a ChatML chat template. The config
helpers (``copy_config``, ``set_depth``, ``set_experts``, ``set_token_ids``, ...) and the tokenizer are shared
with ``core.replica``, which keeps the real width.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_support.core.errors import ConfigError
from model_support.core.layout import ConfigFields, text_config

if TYPE_CHECKING:
    from collections.abc import Mapping

    from model_support.core.spec import HandlerSpec

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
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_num_key_heads": 2,
    "max_position_embeddings": 2048,
    "initializer_range": 0.05,
}
# Length-dependent structures shrunk so that a long row on a CPU stays short (core.layout.length_structures): a
# sliding window and the position where rope scaling starts (YaRN's, Llama 3's original_max_position_embeddings).
TINY_SLIDING_WINDOW = 48
TINY_ROPE_ORIGINAL_MAX = 128
_VISION_DIMS = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
# The smallest head size vLLM's CPU attention runs (a config without head_dim gets hidden / heads = this).
_HEAD_DIM = 32
TINY_EXPERTS = 4
TINY_TOP_K = 2


def _layer_count(raw: dict[str, Any]) -> int:
    """Enough layers to hold every layer kind of the pattern (at least two)."""
    kinds = layer_types(raw)
    return max([2] + [kinds.index(kind) + 1 for kind in set(kinds)])


def _scale_sections(sections: list[int], total: int) -> list[int]:
    """Scale mrope sections to a new sum, by largest remainders."""
    exact = [s * total / sum(sections) for s in sections]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: exact[i] - out[i], reverse=True)[: total - sum(out)]:
        out[i] += 1
    return out


def layer_types(raw: dict[str, Any]) -> list[str]:
    """The original per-layer kinds: config.json's layer_types, or what transformers derives when it lists none."""
    listed = text_section(raw).get("layer_types")
    if listed or not raw.get("model_type"):
        return list(listed or [])
    import transformers

    # Families derive the pattern from other fields (Qwen3.5 from full_attention_interval, Qwen3 from the sliding
    # window); the config class knows how.
    model_type = raw.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    except (KeyError, ValueError):
        raise ConfigError(
            f"transformers {transformers.__version__} has no config class for model_type {model_type!r}; "
            "upgrade transformers to build it"
        ) from None
    return list(getattr(text_config(config), "layer_types", None) or [])


def period(pattern: list[str]) -> int:
    """The length of the shortest prefix that the pattern repeats."""
    return next(p for p in range(1, len(pattern) + 1) if all(t == pattern[i % p] for i, t in enumerate(pattern)))


def text_section(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config.json dict: its ``text_config`` when multimodal, else itself."""
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def copy_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a config.json dict to derive a replica from, less the fields ``save_pretrained`` rewrites."""
    if not raw.get("architectures"):
        raise ConfigError("config.json names no architectures; cannot build a replica of it")
    cfg = copy.deepcopy(raw)
    cfg.pop("torch_dtype", None)
    cfg.pop("transformers_version", None)
    return cfg


def set_experts(text: dict[str, Any], experts: int, top_k: int, fields: ConfigFields) -> None:
    """Give a MoE text config ``experts`` experts, ``top_k`` of them routed per token."""
    key = fields.expert_field(text.get)
    if key is None:
        raise ConfigError(f"the config has no experts ({' / '.join(fields.experts)}) to set")
    text[key] = experts
    text[fields.experts_per_token] = top_k


def set_depth(text: dict[str, Any], n_layers: int, fields: ConfigFields) -> None:
    """Keep the first ``n_layers`` layers: the layer count and the fields (the family's) that index or count layers."""
    text["num_hidden_layers"] = n_layers
    if text.get("layer_types"):
        text["layer_types"] = text["layer_types"][:n_layers]
    for name in fields.layer_lists:
        if text.get(name):
            text[name] = [i for i in text[name] if i < n_layers]
    for name in fields.layer_counts:
        if name in text:
            text[name] = n_layers


def set_token_ids(cfg: dict[str, Any], token_ids: dict[str, int]) -> None:
    """Point the config's special token ids (bos/eos/pad, image/video/vision) at the offline tokenizer's tokens."""
    text = text_section(cfg)
    text["bos_token_id"] = token_ids["<|endoftext|>"]
    text["eos_token_id"] = token_ids["<|im_end|>"]
    text["pad_token_id"] = token_ids["<|endoftext|>"]
    for key, token in (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ):
        if key in cfg:
            cfg[key] = token_ids[token]


def set_dtype(cfg: dict[str, Any], dtype: str) -> None:
    """Record the saved dtype (e.g. ``"float32"``) in the config and, when multimodal, its text config."""
    text = text_section(cfg)
    text["dtype"] = dtype
    if text is not cfg:
        cfg["dtype"] = dtype


def shrink_vision(cfg: dict[str, Any]) -> None:
    """Shrink a multimodal config's vision tower to ``_VISION_DIMS``, projecting into the text model's width."""
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        return
    for key, value in _VISION_DIMS.items():
        if key in vision:
            vision[key] = value
    if "out_hidden_size" in vision:
        vision["out_hidden_size"] = text_section(cfg)["hidden_size"]
    # Lists of vision-layer indexes (e.g. the layers a vision tower taps for its merger) follow the shrunk depth.
    depth = vision.get("depth", _VISION_DIMS["depth"])
    for key, value in vision.items():
        if key.endswith("_indexes") and isinstance(value, list) and value:
            vision[key] = [i for i in value if i < depth] or [0]


def _shrink_text(text: dict[str, Any], vocab_size: int, n_layers: int, fields: ConfigFields) -> None:
    gdn_ratio = max(1, text.get("linear_num_value_heads", 1) // max(1, text.get("linear_num_key_heads") or 1))
    mha = text.get("num_key_value_heads") in (None, text.get("num_attention_heads"))
    for key, value in _TEXT_DIMS.items():
        if key in text:
            text[key] = value
    if "head_dim" not in text and "hidden_size" in text and "num_attention_heads" in text:
        text["num_attention_heads"] = text["hidden_size"] // _HEAD_DIM
    heads = text.get("num_attention_heads", 4)
    if "num_key_value_heads" in text:
        text["num_key_value_heads"] = heads if mha else heads // 2
    if "linear_num_value_heads" in text:
        text["linear_num_value_heads"] = _TEXT_DIMS["linear_num_key_heads"] * gdn_ratio
    if fields.expert_field(text.get):
        set_experts(text, TINY_EXPERTS, TINY_TOP_K, fields)
    set_depth(text, n_layers, fields)
    if text.get("sliding_window"):
        text["sliding_window"] = min(int(text["sliding_window"]), TINY_SLIDING_WINDOW)
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    for params in [rope, *(rope.values() if isinstance(rope, dict) else ())]:
        if isinstance(params, dict) and params.get("original_max_position_embeddings"):
            params["original_max_position_embeddings"] = TINY_ROPE_ORIGINAL_MAX
    if isinstance(rope, dict) and rope.get("mrope_section"):
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        rope["mrope_section"] = _scale_sections(list(rope["mrope_section"]), int(head_dim * partial) // 2)
    text["vocab_size"] = vocab_size


def shrink_config(
    raw: dict[str, Any],
    vocab_size: int,
    token_ids: dict[str, int],
    fields: ConfigFields | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A tiny copy of a config.json dict (see module docstring); ``overrides`` (the handler's ``tiny_config``) are
    set on the text config last."""
    cfg = copy_config(raw)
    text = text_section(cfg)
    _shrink_text(text, vocab_size, _layer_count(raw), fields or ConfigFields())
    text.update(overrides or {})
    set_token_ids(cfg, token_ids)
    shrink_vision(cfg)
    set_dtype(cfg, "float32")
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


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """The ids of ``SPECIAL_TOKENS`` in a tokenizer made by ``build_tokenizer``."""
    return {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def model_class(arch: str) -> type:
    """The transformers model class named ``arch`` (one line to upgrade when this transformers lacks it)."""
    import transformers

    model_cls = getattr(transformers, arch, None)
    if model_cls is None:
        raise ConfigError(
            f"transformers {transformers.__version__} has no class {arch}; upgrade transformers to build it"
        )
    return model_cls


def build_tiny(raw_config: dict[str, Any], out_dir: Path, seed: int = 0, spec: HandlerSpec | None = None) -> Path:
    """Build and save a tiny random replica of the architecture ``raw_config`` describes, with the sizes and
    config fields its handler ``spec`` declares."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    vocab_size = math.ceil(len(tokenizer) / 64) * 64
    fields, overrides = (spec.config_fields, spec.tiny_config) if spec else (None, None)
    cfg = shrink_config(raw_config, vocab_size, special_token_ids(tokenizer), fields, overrides)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    model_cls = model_class(cfg["architectures"][0])
    config = transformers.AutoConfig.from_pretrained(out_dir)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    randomize_constant_init(model, float(getattr(text_config(config), "initializer_range", 0.02)))
    # A tiny model is one small shard: transformers' "Writing model shards" bar would only interrupt the output.
    shown = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
    finally:
        if shown:
            transformers.utils.logging.enable_progress_bar()
    return out_dir


# The spread of a vector drawn around its constant init: gains 1 +- 0.2, so a gain on the wrong channel, head or
# layer moves the output by O(10%), far beyond any comparison's tolerance.
GAIN_SPREAD = 0.2


def randomize_constant_init(model: Any, std: float) -> None:
    """Draw at random what transformers initialises to a constant, so a check can tell every value from a misplaced
    or never loaded one: vectors (norm gains, zero-centred gains, biases, GDN's ``dt_bias``) around their constant
    ``c``, ``c + 0.2 max(|c|, 1) N(0, 1)``; persistent floating-point buffers (a router's score-correction bias) and
    matrices (gpt-oss's stacked expert biases) still all zero, ``N(0, std)`` as the other parameters'. With gains
    all equal a permuted or exchanged gain would be invisible; an all-zero matrix would fail the weights stage."""
    import torch

    saved = model.state_dict(keep_vars=True).keys()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in (*model.named_buffers(), *params.items()):
            if name not in saved or not tensor.is_floating_point() or not tensor.numel():
                continue
            first = float(tensor.flatten()[0])
            if not bool((tensor == first).all()):
                continue  # drawn at random already
            if tensor.dim() == 1 and name in params:
                tensor.add_(GAIN_SPREAD * max(abs(first), 1.0) * torch.randn_like(tensor))
            elif first == 0:
                tensor.normal_(0.0, std)
