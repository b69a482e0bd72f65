"""Random models at a real config's width, for memory, speed and sharding work on real-sized weights.

Where ``core.tiny`` shrinks every dimension for CPU tests, a replica keeps the text model's width:
hidden size, heads, head dims, intermediate sizes, GDN head counts and dims, expert sizes and vocab
size stay as the real config has them. ``replica_config`` changes only the depth (``layers``, cut
on the layer_types pattern), the expert count (``experts``), the special token ids (those of tiny's
offline chat tokenizer, ids < 512) and the saved dtype; a multimodal config's vision tower is shrunk
as tiny shrinks it, since the harness checks the text model only. ``build_replica`` builds the model
directly in the target dtype on the target device, so a large model never exists in fp32 or on the
host, and saves it in shards into a temporary sibling of the output directory that is renamed into
place at the end: a failure leaves nothing half-written.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_support.core.errors import ConfigError, ModelSupportError
from model_support.core.layout import ConfigFields
from model_support.core.outputs import check_out_dir, staged_dir
from model_support.core.tiny import (
    build_tokenizer,
    copy_config,
    layer_types,
    model_class,
    period,
    randomize_constant_init,
    set_depth,
    set_dtype,
    set_experts,
    set_token_ids,
    shrink_vision,
    special_token_ids,
    text_section,
)

if TYPE_CHECKING:
    import torch

# Largest safetensors shard save_pretrained writes (it splits the state dict through huggingface_hub).
MAX_SHARD_SIZE = "5GB"


class ReplicaError(ModelSupportError):
    """A replica request that the config or the output directory does not allow (one line, exit status 2)."""


@dataclass(frozen=True)
class ReplicaInfo:
    """What ``build_replica`` wrote."""

    out_dir: Path
    architecture: str
    parameters: int
    layers: int
    experts: int | None  # experts per MoE layer; None for a dense model
    dtype: str  # torch's name, e.g. "bfloat16"
    device: str
    seconds: float

    def describe(self) -> str:
        """One line: architecture, parameter count, layers, experts, dtype, device and time taken."""
        parts = [f"{_count(self.parameters)} parameters", f"{self.layers} layer{'s' if self.layers != 1 else ''}"]
        if self.experts is not None:
            parts.append(f"{self.experts} expert{'s' if self.experts != 1 else ''}")
        parts += [self.dtype, self.device, f"{self.seconds:.1f} s"]
        return f"{self.architecture} replica written to {self.out_dir}: {', '.join(parts)}"


def _count(n: int) -> str:
    """A parameter count as people write it: 3.07B, 751.6M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def replica_config(
    raw: dict[str, Any], *, layers: int | None, experts: int | None, dtype: str, fields: ConfigFields | None = None
) -> dict[str, Any]:
    """A copy of a config.json dict at the real width with ``layers`` layers and ``experts`` experts (see module).

    ``dtype`` is torch's name of the saved dtype. The special token ids are the tokenizer's to set (``set_token_ids``).
    Raises ``ReplicaError`` for a request the config does not allow.
    """
    cfg = copy_config(raw)
    text = text_section(cfg)
    arch = cfg["architectures"][0]
    total = text.get("num_hidden_layers")
    if not isinstance(total, int):
        raise ConfigError(f"{arch}'s config.json has no num_hidden_layers")
    n_layers = total if layers is None else layers
    if not 1 <= n_layers <= total:
        raise ReplicaError(f"--layers {n_layers}: {arch} has {total} layers; pass 1 to {total}")
    pattern = layer_types(raw)
    lost = sorted(set(pattern) - set(pattern[:n_layers]))
    if lost:
        shortest = period(pattern)
        raise ReplicaError(
            f"--layers {n_layers} leaves no {' or '.join(lost)} layer in {arch}'s layer_types; "
            f"pass --layers {shortest} or more (one full period of the pattern)"
        )
    fields = fields or ConfigFields()
    if experts is not None:
        if fields.expert_field(text.get) is None:
            raise ReplicaError(
                f"--experts applies to MoE configs only; {arch} is dense (no {' / '.join(fields.experts)})"
            )
        if experts < 1:
            raise ReplicaError(f"--experts {experts}: pass at least 1")
        set_experts(text, experts, min(int(text.get(fields.experts_per_token, experts)), experts), fields)
    set_depth(text, n_layers, fields)
    shrink_vision(cfg)
    set_dtype(cfg, dtype)
    return cfg


def _resolve_device(device: str) -> torch.device:
    """``auto`` is CUDA when torch sees a GPU, else the CPU; any other name is taken as a torch device."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except RuntimeError:
        raise ReplicaError(f"--device {device}: not a device; pass auto, cpu or cuda") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ReplicaError(f"--device {device}: torch sees no CUDA device; pass --device cpu (or auto)")
    return target


def redraw_nonfinite(model: torch.nn.Module) -> list[str]:
    """Redraw in fp32 the parameters that transformers' initialiser made non-finite in low precision.

    Some init formulas overflow when drawn in bf16: Qwen3.5's Gated DeltaNet ``A_log = log(uniform(0, 16))``
    draws an exact 0 (so -inf) about once in 500 values. A real checkpoint has no such value, and the
    ``weights`` stage rightly fails one, so the owning module's own parameters are initialised again by
    the model's ``_init_weights`` in fp32 and cast back. Returns the redrawn parameters' names.
    """
    import torch

    redrawn = []
    for name, param in list(model.named_parameters()):
        if bool(torch.isfinite(param).all()):
            continue
        module = model.get_submodule(name.rpartition(".")[0])
        own = list(module.parameters(recurse=False))
        dtypes = [p.dtype for p in own]
        for p in own:
            p.data = p.data.float()
        model._init_weights(module)  # transformers' own per-module init: the same distributions, in fp32
        for p, dtype in zip(own, dtypes, strict=True):
            p.data = p.data.to(dtype)
        if not bool(torch.isfinite(param).all()):
            raise ReplicaError(f"{name}: transformers' initialiser draws non-finite values even in fp32")
        redrawn.append(name)
    return redrawn


def check_fits(model_cls: Any, cfg: dict[str, Any], dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before anything is allocated or written, a replica whose weights alone exceed the free memory of the
    device it is built on (counted on the meta device: exact, and no memory)."""
    import psutil
    import torch
    import transformers

    with torch.device("meta"):
        kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
        config = transformers.AutoConfig.for_model(cfg["model_type"], **kwargs)
        params = sum(p.numel() for p in model_cls(config).parameters())
    need = params * torch.finfo(dtype).bits // 8
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], f"{device} has"
    else:
        free, where = psutil.virtual_memory().available, "this machine has"
    if need > free:
        raise ReplicaError(
            f"the replica's weights alone take {need / 1024**3:.1f} GiB ({params / 1e9:.2f}B parameters in "
            f"{str(dtype).removeprefix('torch.')}) and {where} {free / 1024**3:.1f} GiB free: keep fewer --layers or "
            "--experts, or build it on a larger device"
        )


def build_replica(
    raw_config: dict[str, Any],
    out_dir: Path,
    *,
    layers: int | None,
    experts: int | None,
    dtype: torch.dtype,
    device: str,
    seed: int,
    overwrite: bool,
    fields: ConfigFields | None = None,
) -> ReplicaInfo:
    """Build a random model at ``raw_config``'s width and save it, with tiny's chat tokenizer, to ``out_dir``.

    ``layers`` / ``experts`` default to the config's own; ``device`` is ``auto``, ``cpu``, ``cuda`` or any torch
    device. ``out_dir`` must not exist or be an empty directory unless ``overwrite`` is set.
    """
    import torch
    import transformers

    start = time.perf_counter()
    out_dir = Path(out_dir).absolute()
    # Everything that can be refused is refused before anything is written.
    check_out_dir(out_dir, overwrite)
    dtype_name = str(dtype).removeprefix("torch.")
    fields = fields or ConfigFields()
    cfg = replica_config(raw_config, layers=layers, experts=experts, dtype=dtype_name, fields=fields)
    model_cls = model_class(cfg["architectures"][0])
    target = _resolve_device(device)
    check_fits(model_cls, cfg, dtype, target)

    with staged_dir(out_dir) as tmp:
        set_token_ids(cfg, special_token_ids(build_tokenizer(tmp)))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        config = transformers.AutoConfig.from_pretrained(tmp)
        torch.manual_seed(seed)
        # Parameters are created in the target dtype on the target device: no fp32 or host copy of the model.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with target:
                model = model_cls(config)
                redraw_nonfinite(model)
                randomize_constant_init(model, float(getattr(config.get_text_config(), "initializer_range", 0.02)))
        finally:
            torch.set_default_dtype(default_dtype)
        parameters = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp, max_shard_size=MAX_SHARD_SIZE)
    text = text_section(cfg)
    key = fields.expert_field(text.get)
    return ReplicaInfo(
        out_dir=out_dir,
        architecture=cfg["architectures"][0],
        parameters=parameters,
        layers=int(text["num_hidden_layers"]),
        experts=int(text[key]) if key else None,
        dtype=dtype_name,
        device=str(target),
        seconds=time.perf_counter() - start,
    )
