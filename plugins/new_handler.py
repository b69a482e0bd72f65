"""``model-support new-handler``: generate a handler plugin package from the cookiecutter template.

The family's config.json (of a real checkpoint) decides the declaration's starting point:
architecture, model_type, dense or MoE, shared expert, Gated DeltaNet layers, MTP. It is shipped in
the package as the reference config, next to a tiny config fixture for the package's own tests.
"""

from __future__ import annotations

import json
import math
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any

import typer

from model_support.core.errors import ConfigError, ModelSupportError

TEMPLATE = Path(__file__).with_name("template")


class NewHandlerError(ModelSupportError):
    pass


def tiny_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The config a tiny replica of ``raw`` gets (what ``model-support tiny`` writes), without weights."""
    from model_support.core.tiny import SPECIAL_TOKENS, build_tokenizer, shrink_config

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(Path(tmp))
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    return shrink_config(raw, math.ceil(len(tokenizer) / 64) * 64, token_ids)


def _transformers_floor(raw: dict[str, Any]) -> str:
    """The transformers release that wrote the config (else the installed one), as a plain version."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(str(raw["transformers_version"])).base_version
    except (KeyError, InvalidVersion):
        return Version(metadata.version("transformers")).base_version


def template_context(
    config: str, name: str | None = None, description: str | None = None, author: str = ""
) -> dict[str, Any]:
    """The cookiecutter variables for a handler of the family ``config`` (a config.json, model dir or cached id)."""
    from model_support.core.discovery import load_config, locate
    from model_support.core.layout import ConfigFields, derive_layout, text_config
    from model_support.core.spec import _NAME

    source = locate(config)
    if not source.architectures or not source.model_type:
        raise NewHandlerError(f"{config}: config.json must name `architectures` and `model_type`")
    name = name or source.model_type.replace("_", "-")
    if not _NAME.match(name):
        raise NewHandlerError(
            f"handler name {name!r} must be lower-case letters, digits, '_', '-' or '.' (starting with a letter)"
        )
    with tempfile.TemporaryDirectory() as tmp:  # the config file may have any name; transformers wants config.json
        (Path(tmp) / "config.json").write_text(json.dumps(source.raw_config))
        transformers_config = load_config(locate(tmp))
    text = text_config(transformers_config)
    # transformers' common name for a shared expert's width (Qwen2-MoE, Qwen3.5-MoE); other families declare theirs.
    shared_field = "shared_expert_intermediate_size" if getattr(text, "shared_expert_intermediate_size", 0) else ""
    try:
        layout = derive_layout(transformers_config, ConfigFields(shared_expert_intermediate_size=shared_field or None))
    except ConfigError as exc:
        raise NewHandlerError(f"{config}: cannot read the layer layout ({exc})") from None
    architecture = source.architectures[0]
    targets = _targets(transformers_config, layout)
    return {
        "handler_name": name,
        "description": (description or f"{architecture} ({source.model_type}).").replace('"', "'"),
        "architecture": architecture,
        "model_type": source.model_type,
        "topology": "moe" if layout.moe else "dense",
        "linear_attention": bool(layout.gdn_layers),
        "_shared_expert_field": shared_field,
        **targets,
        "disable_mtp_for_training": layout.mtp_layers > 0,
        # The native_vllm_lora stage holds this to account against the installed vLLM.
        "vllm_lora_native": True,
        "vllm_lora_reason": f"vLLM's {architecture} implements SupportsLoRA",
        "transformers_floor": _transformers_floor(source.raw_config),
        "author": author,
        "_reference_config_json": json.dumps(source.raw_config, indent=2),
        "_tiny_config_json": json.dumps(tiny_config(source.raw_config), indent=2),
    }


def _decoder_linears(config: Any) -> set[str]:
    """Leaf names of the HF model's decoder-layer linear modules (built on the meta device)."""
    import torch

    from model_support.core.validate import build_meta_model

    model = build_meta_model(config)
    return {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if ".layers." in name and isinstance(module, torch.nn.Linear)
    }


def _fallback_targets(layout: Any) -> str:
    """The standard targets the layout implies, where no bridge can be read."""
    parts = ["targets.ATTENTION"] + (["targets.GATED_DELTANET"] if layout.gdn_layers else [])
    if layout.moe:
        parts += ["targets.EXPERTS"] + (["targets.SHARED_EXPERT"] if layout.moe.has_shared_expert else [])
    else:
        parts.append("targets.DENSE_MLP")
    return " + ".join(parts)


def _targets(config: Any, layout: Any) -> dict[str, Any]:
    """The template's LoRA-target variables: from the family's megatron-bridge mappings, or (no bridge) the standard
    targets the layout implies, with a comment that says which."""
    from model_support.plugins.bridge_targets import BridgeTargetsError, bridge_targets

    try:
        found = bridge_targets(config, layout, _decoder_linears(config))
    except BridgeTargetsError as exc:
        return {
            "_lora_targets": _fallback_targets(layout),
            "_explicit_targets": False,
            "_targets_note": f"Not derived from a bridge: {exc}. Check these names against the checkpoint.",
            "_bridge": "",
        }
    unmapped = f" Not mapped by it (no LoRA here): {', '.join(found.unmapped)}." if found.unmapped else ""
    expression = found.expression()
    return {
        "_lora_targets": expression,
        "_explicit_targets": "LoraTarget(" in expression,
        "_targets_note": f"Derived from megatron-bridge's {found.bridge} mappings.{unmapped}",
        "_bridge": found.bridge,
    }


def generate(context: dict[str, Any], output_dir: Path, no_input: bool = True, overwrite: bool = False) -> Path:
    """Run the cookiecutter template; returns the generated package directory."""
    try:
        from cookiecutter.exceptions import CookiecutterException, OutputDirExistsException
        from cookiecutter.main import cookiecutter
    except ImportError:
        raise NewHandlerError("cookiecutter is not installed: pip install 'model-support[dev]'") from None

    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        try:
            created = cookiecutter(
                str(TEMPLATE),
                no_input=no_input,
                extra_context=context,
                output_dir=str(output_dir),
                overwrite_if_exists=overwrite,
                # No user config, and the replay file goes to a scratch directory.
                default_config={"replay_dir": scratch, "cookiecutters_dir": scratch},
            )
        except OutputDirExistsException as exc:
            raise NewHandlerError(f"{exc}; pass --overwrite or choose another --output-dir") from None
        except CookiecutterException as exc:
            raise NewHandlerError(f"the plugin template failed: {exc}") from None
    return Path(created)


def new_handler(
    config: Annotated[
        str, typer.Option("--config", "-c", help="config.json, model directory or cached hub id of the family.")
    ],
    name: Annotated[str | None, typer.Option(help="Handler name (default: the config's model_type).")] = None,
    description: Annotated[str | None, typer.Option(help="One-line description of the family.")] = None,
    author: Annotated[str, typer.Option(help="Package author.")] = "",
    output_dir: Annotated[Path, typer.Option("--output-dir", "-o", help="Where to create the package.")] = Path("."),
    no_input: Annotated[bool, typer.Option("--no-input", help="Do not prompt; use the flags and the config.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Overwrite an existing package directory.")] = False,
) -> None:
    """Generate a handler plugin package (pyproject entry point, declaration, reference config, tests)."""
    from model_support.core.registry import load_registry

    context = template_context(config, name, description, author)
    claims = load_registry().claims.get(context["architecture"], [])
    for entry in claims:
        typer.echo(
            f"warning: {context['architecture']} is already claimed by {entry.label()}; "
            "installing both makes the architecture a conflict (settle it with MODEL_SUPPORT_PREFER)",
            err=True,
        )
    package = generate(context, output_dir, no_input=no_input, overwrite=overwrite)
    typer.echo(f"created {package}")
    typer.echo(f"next: pip install -e {package} && model-support list && pytest {package}")
