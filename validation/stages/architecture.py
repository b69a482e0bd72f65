"""Stage `architecture`: the handler's declaration matches a model built from the config."""

from __future__ import annotations

from model_support.core.spec import TargetScope
from model_support.core.validate import (
    build_meta_model,
    checkpoint_modules,
    layout_problems,
    missing_targets,
    modules_under,
    uncovered_targets,
)
from model_support.validation.context import CheckContext
from model_support.validation.stage import Stage, StageResult


class ArchitectureStage(Stage):
    """The config names an architecture whose handler also claims its model_type; the layer layout (dense or
    MoE, shared expert, GDN layers) is what the handler declares; the config asks for nothing the handler's
    ``config_requirements`` refuse (a value the bridge would ignore); every declared LoRA target exists in the
    transformers model *and* is named by the checkpoint's tensors (what PEFT, vLLM and the exporter address):
    a target the checkpoint names otherwise fails with the names expected and the names found."""

    name = "architecture"
    title = "The config's architecture, layer layout and LoRA target modules match the handler declaration."
    order = 20
    requires = ("dependencies",)

    def run(self, ctx: CheckContext) -> StageResult:
        layout = ctx.layout
        archs = getattr(ctx.config, "architectures", None)
        if not archs:
            return self.failed(
                f'config.json names no architectures; add the class, e.g. ["{ctx.spec.architectures[0]}"]'
            )
        model_type = getattr(ctx.config, "model_type", None)
        if model_type not in ctx.spec.model_types:
            return self.failed(
                f"model_type {model_type!r} contradicts {archs[0]}, whose handler {ctx.spec.name} declares "
                f"{', '.join(ctx.spec.model_types)}; fix config.json"
            )
        problems = layout_problems(ctx.spec, layout) + ctx.spec.config_problems(ctx.config)
        model = build_meta_model(ctx.config)
        missing = missing_targets(ctx.spec, model)
        if missing:
            problems.append(f"target modules missing from {type(model).__name__}: {', '.join(missing)}")
        checked, problem = self._checkpoint_names(ctx)
        if problem:
            problems.append(problem)
        metrics = {
            "layers": layout.num_layers,
            "gdn_layers": len(layout.gdn_layers),
            "attention_layers": len(layout.attention_layers),
            "experts": layout.moe.num_experts if layout.moe else 0,
            "lora_targets": len(ctx.spec.hf_target_modules),
        }
        details = [f"model class {type(model).__name__}: {layout.describe()}", checked]
        if layout.mtp_layers and ctx.spec.runtime.disable_mtp_for_training:
            details.append(f"{layout.mtp_layers} MTP layer(s) in the config: disabled for training by policy")
        if problems:
            return self.failed("; ".join(problems), metrics=metrics, details=details)
        return self.passed(layout.describe(), metrics=metrics, details=details)

    @staticmethod
    def _checkpoint_names(ctx: CheckContext) -> tuple[str, str | None]:
        """Check the declared targets against the tensor names in the safetensors (what PEFT, vLLM and the
        exporter address), not only transformers' module tree: (detail line, problem or None)."""
        from model_support.core.checkpoint import CheckpointError, TextCheckpoint

        try:
            names = TextCheckpoint(ctx.model_dir).get_all_keys()
        except CheckpointError:
            return "no weights next to the config: target names checked against transformers' modules only", None
        modules = checkpoint_modules(names)
        missing = uncovered_targets(ctx.spec, modules)
        if not missing:
            return f"every declared target module is named in the checkpoint ({len(names)} tensors)", None
        scopes = dict.fromkeys(TargetScope(m.split(":", 1)[0]) for m in missing)
        found = "; ".join(f"{s}: {', '.join(modules_under(s, modules)) or 'nothing'}" for s in scopes)
        return "checkpoint names checked", (
            f"the checkpoint names no module for {', '.join(missing)} (found under those scopes: {found})"
        )
