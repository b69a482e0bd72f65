"""Stage `architecture`: the handler's declaration matches a model built from the config."""

from __future__ import annotations

from model_support.core.checkpoint import TextCheckpoint, stored_tensors, weight_files
from model_support.core.megatron.imports import MegatronUnavailableError
from model_support.core.spec import TargetScope
from model_support.core.validate import (
    build_meta_model,
    checkpoint_modules,
    checkpoint_size_problems,
    coverage_problems,
    layout_problems,
    missing_targets,
    model_linears,
    modules_under,
    names_of,
    stored_state,
    stored_tensor_problems,
    target_name_problems,
    uncovered_targets,
)
from model_support.validation.context import CheckContext
from model_support.validation.megatron_session import TRAINING_MODEL
from model_support.validation.stage import Stage, StageResult


class ArchitectureStage(Stage):
    """The config names an architecture whose handler also claims its model_type; the layer layout (dense or
    MoE, shared expert, GDN layers) is what the handler declares; the config asks for nothing the handler's
    ``config_requirements`` refuse (a value the bridge would ignore); every declared LoRA target exists in the
    transformers model *and* is named by the checkpoint's tensors (what PEFT, vLLM and the exporter address):
    a target the checkpoint names otherwise fails with the names expected and the names found. Each checkpoint tensor
    the model holds under its name has the shape the config implies and, where the model's is, a floating-point dtype
    (the checkpoint's files themselves are checked first: :func:`~model_support.core.checkpoint.stored_tensors`
    refuses an ambiguous, escaping or corrupt checkpoint, naming the file). Against the family's
    megatron-bridge mappings: each target's HF modules are those the mapping of its Megatron linear reads (what the
    codec writes); every LoRA linear the bridge maps in this model (attention, GDN, dense MLP, shared and routed
    experts) is a target or a ``lora_exclusions`` entry with its reason; the MoE sizes derived from the config
    (expert count and width, shared-expert width, dense layers) match the checkpoint's tensor shapes. An
    architecture megatron-bridge has no bridge for fails, naming the hook a plugin registers one with (without
    megatron-bridge installed, those checks are named as not run)."""

    name = "architecture"
    title = "The config's architecture, layer layout and LoRA target modules match the handler declaration."
    order = 20
    sharded = True
    requires = ("dependencies",)
    needs = (TRAINING_MODEL,)  # built only where the config asks for a sliding window or rope scaling

    def run(self, ctx: CheckContext) -> StageResult:
        on_disk = stored_tensors(ctx.model_dir)  # CheckpointError (the stage fails with it) for a bad checkpoint
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
        state = stored_state(model)  # what a checkpoint of the model holds, by transformers' own conversion
        stored = names_of(state)
        tensor_problems, tensors_checked = stored_tensor_problems(state, on_disk)
        problems += tensor_problems
        missing = missing_targets(ctx.spec, stored)
        if missing:
            problems.append(f"target modules missing from {type(model).__name__}: {', '.join(missing)}")
        checked, problem = self._checkpoint_names(ctx)
        if problem:
            problems.append(problem)
        bridge_problems, bridge_details = self._bridge_checks(ctx, stored)
        problems += bridge_problems
        ignored, features_checked = self._built_features(ctx)
        problems += ignored
        metrics = {
            "layers": layout.num_layers,
            "gdn_layers": len(layout.gdn_layers),
            "attention_layers": len(layout.attention_layers),
            "experts": layout.moe.num_experts if layout.moe else 0,
            "lora_targets": len(ctx.spec.hf_target_modules),
        }
        details = [f"model class {type(model).__name__}: {layout.describe()}", checked, *bridge_details]
        if on_disk:
            details.append(
                f"shape (as the config implies) and floating-point dtype checked for the {tensors_checked} of the "
                f"checkpoint's {len(on_disk)} tensors the transformers model holds"
            )
        details.append(features_checked)
        if layout.mtp_layers and ctx.spec.runtime.disable_mtp_for_training:
            details.append(f"{layout.mtp_layers} MTP layer(s) in the config: disabled for training by policy")
        if problems:
            return self.failed("; ".join(problems), metrics=metrics, details=details)
        return self.passed(layout.describe(), metrics=metrics, details=details)

    @staticmethod
    def _bridge_checks(ctx: CheckContext, stored: tuple[set[str], set[str]]) -> tuple[list[str], list[str]]:
        """(problems, detail lines) of the declaration against megatron-bridge's mappings of the family: each target's
        HF modules are those the mapping of its Megatron linear reads; every LoRA linear the bridge maps in this model
        is targeted or excluded with a reason; the MoE sizes derived from the config match the checkpoint's shapes."""
        from model_support.core.bridge_linears import bridge_linears
        from model_support.core.megatron.builder import MegatronBuildError

        try:
            bridge, linears = bridge_linears(ctx.config, ctx.layout)
        except (ImportError, MegatronUnavailableError) as exc:
            return [], [f"LoRA targets not checked against megatron-bridge's mappings: {exc}"]
        except MegatronBuildError as exc:  # megatron-bridge is there and maps no such architecture
            return [
                f"{exc}; the Megatron side (the model under test, the codec's splits) comes from its bridge: the "
                "plugin registers one with the model_support_megatron_bridges hook (docs/adding-a-model.md, "
                '"A family megatron-bridge lacks")'
            ], []
        present = model_linears(linears, stored)
        problems = target_name_problems(ctx.spec, bridge, linears)
        covered, details = coverage_problems(ctx.spec, bridge, linears, present)
        problems += covered
        if not covered:
            details.insert(0, f"every LoRA linear {bridge} maps in this model is targeted or excluded ({len(present)})")
        if not weight_files(ctx.model_dir):
            return problems, [*details, "no weights next to the config: MoE sizes not checked against tensor shapes"]
        checkpoint = TextCheckpoint(ctx.model_dir)
        # The mappings the builder loads this checkpoint with (per-expert or stacked expert tensors).
        _, loaded = bridge_linears(ctx.config, ctx.layout, checkpoint)
        sizes, size_details = checkpoint_size_problems(ctx.spec, ctx.config, ctx.layout, loaded, checkpoint)
        return problems + sizes, details + size_details

    @staticmethod
    def _built_features(ctx: CheckContext) -> tuple[list[str], str]:
        """(problems, detail line): the length-dependent features the config asks for (a sliding window, rope
        scaling) that the Megatron model built for training ignores; the build refuses such a model
        (``core/megatron/features.py``), and a model built here is the one the later stages use."""
        from model_support.core.layout import rope_scaling, sliding_window

        features = {"sliding window": sliding_window(ctx.config), "rope scaling": rope_scaling(ctx.config)}
        asked = [feature for feature, value in features.items() if value]
        if not asked:
            return [], "the config asks for no sliding window or rope scaling"
        from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES

        unavailable = next((why for r in MEGATRON_PACKAGES if (why := r.missing_reason())), None)
        if unavailable:
            return [], f"{' and '.join(asked)} not checked against the built model: {unavailable}"
        from model_support.core.megatron.builder import UnimplementedFeatureError
        from model_support.validation.megatron_session import megatron_model

        try:
            megatron_model(ctx)
        except UnimplementedFeatureError as exc:
            return [str(exc)], f"the built Megatron model ignores the config's {' and '.join(asked)}"
        except Exception as exc:  # any other build failure is hf_parity's to report, with its own handling
            return [], f"{' and '.join(asked)} not checked: the Megatron model does not build ({exc})"
        return [], f"the built Megatron model implements the config's {' and '.join(asked)}"

    @staticmethod
    def _checkpoint_names(ctx: CheckContext) -> tuple[str, str | None]:
        """Check the declared targets against the tensor names in the safetensors (what PEFT, vLLM and the
        exporter address), not only transformers' module tree: (detail line, problem or None)."""
        if not weight_files(ctx.model_dir):
            return "no weights next to the config: target names checked against transformers' modules only", None
        names = TextCheckpoint(ctx.model_dir).get_all_keys()
        modules = checkpoint_modules(names)
        missing = uncovered_targets(ctx.spec, modules, names)
        if not missing:
            return f"every declared target module is named in the checkpoint ({len(names)} tensors)", None
        scopes = dict.fromkeys(TargetScope(m.split(":", 1)[0]) for m in missing)
        found = "; ".join(f"{s}: {', '.join(modules_under(s, modules)) or 'nothing'}" for s in scopes)
        return "checkpoint names checked", (
            f"the checkpoint names no module for {', '.join(missing)} (found under those scopes: {found})"
        )
