"""Stage `native_vllm_lora`: vLLM serving the PEFT adapter itself (no merge) matches transformers + the adapter.

For a handler that declares native LoRA, the policy adapter is loaded through ``/v1/load_lora_adapter`` into the
run's one server while it holds the base weights (it runs before ``merged_serving`` pushes the policy in place),
and its prompt log-probabilities (one prompt across every length-dependent structure of the model) are compared with
transformers + adapter. Where the build cannot run the adapter on the shared server (``session.lora_gap``: routed
experts on the CPU build) a server of its own is started with LoRA, so a build that has since gained the feature is
noticed.

For a merged-only handler the stage skips with the handler's reason, after checking that the reason still
holds: it asks the installed vLLM whether the architecture's class implements ``SupportsLoRA`` and, if it
does, tries the adapter for real; if vLLM now serves it correctly, the stage fails and says so (the
declaration is out of date).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar

from model_support.core.serving.errors import ServingError
from model_support.validation.context import CheckContext
from model_support.validation.megatron_session import HF_REFERENCES
from model_support.validation.serving_session import LORA_SERVER, POLICY, SERVER
from model_support.validation.stage import Requirement, Stage, StageResult
from model_support.validation.stages.hf_parity import MEGATRON_PACKAGES
from model_support.validation.stages.merged_serving import calibrated_tolerance, cannot_serve

_PROBE = """
import json, sys
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.interfaces import supports_lora
cls = ModelRegistry._try_load_model_cls(sys.argv[1])
answer = {"class": None if cls is None else cls.__name__,
          "supports_lora": bool(cls is not None and supports_lora(cls)),
          "packed_modules_mapping": getattr(cls, "packed_modules_mapping", {})}
with open(sys.argv[2], "w") as f:
    json.dump(answer, f)
"""
PROBE_LIMIT_S = 600


def lora_probe(architecture: str, workdir: Path) -> dict[str, Any]:
    """What the installed vLLM declares about LoRA for ``architecture``: asked in the runtime venv by a managed child
    (it dies with the check), whose log and answer are written in ``workdir``."""
    from model_support.core.serving.process import ManagedProcess
    from model_support.core.serving.runtime import load_runtime

    runtime = load_runtime()
    answer = workdir / "vllm-lora-probe.json"
    command = [str(runtime.python), "-c", _PROBE, architecture, str(answer)]
    probe = ManagedProcess(runtime.python, command, env=os.environ, log_path=workdir / "vllm-lora-probe.log").start()
    try:
        code = probe.wait(PROBE_LIMIT_S)
        tail = probe.log_tail(1)
    finally:
        probe.stop()
    if code is None:
        raise ServingError(f"vLLM LoRA probe did not finish in {PROBE_LIMIT_S} s (stopped); see {probe.log_path}")
    if code != 0 or not answer.exists():
        raise ServingError(f"vLLM LoRA probe failed (exit {code}): {tail or 'no output'}")
    return json.loads(answer.read_text())


class NativeVllmLoraStage(Stage):
    name = "native_vllm_lora"
    title = (
        "vLLM serving the PEFT adapter natively matches transformers + the adapter (or the merged-only reason holds)."
    )
    order = 65
    packages: ClassVar = (Requirement("peft", "peft", "dev"), *MEGATRON_PACKAGES)
    needs = (*POLICY, SERVER, LORA_SERVER, HF_REFERENCES)
    prompts, prompt_len = 1, 24  # and one long prompt (session.random_prompts)

    def skip_reason(self, ctx: CheckContext) -> str | None:
        from model_support.validation.serving_session import GPU_FP32_LORA_GAP, backend, lora_gap

        unavailable = backend().unavailable_reason()
        if unavailable is None and lora_gap(ctx) == GPU_FP32_LORA_GAP:
            return f"{GPU_FP32_LORA_GAP} (check --dtype fp32); merged_serving checks the adapter merged"
        return unavailable

    def prepare(self, ctx: CheckContext) -> None:
        from model_support.validation.serving_session import prestart_native_lora

        prestart_native_lora(ctx)

    def run(self, ctx: CheckContext) -> StageResult:
        from model_support.validation.serving_session import backend, lora_gap, serving_workdir

        declared = ctx.spec.vllm_lora
        arch = ctx.config.architectures[0]
        version = backend().version()
        if declared.native:
            return self._serve_adapter(ctx, shared=lora_gap(ctx) is None)
        probe = lora_probe(arch, serving_workdir(ctx))
        if not probe["supports_lora"]:
            return self.skipped(
                f"merged-only: {declared.reason} (confirmed: vLLM {version}'s {probe['class']} does not implement "
                "SupportsLoRA)"
            )
        result = self._serve_adapter(ctx, shared=False)
        if result.status == "pass":
            return self.failed(
                f"declared merged-only ({declared.reason}), but vLLM {version} serves the adapter natively within "
                f"tolerance: declare vllm_lora native=True",
                metrics=result.metrics,
                thresholds=result.thresholds,
                details=result.details,
            )
        return self.skipped(f"merged-only: {declared.reason} (confirmed on vLLM {version}: {result.summary})")

    def _serve_adapter(self, ctx: CheckContext, *, shared: bool) -> StageResult:
        """The adapter served natively: on the run's server (holding the base weights) when ``shared``, else on
        a LoRA-enabled server of its own, stopped at the end."""
        import torch

        from model_support.core import timing
        from model_support.validation import serving_session as session

        adapter, origin = session.policy_adapter(ctx)
        prompts = session.random_prompts(ctx, self.prompts, self.prompt_len)
        options = session.serve_options(ctx, enable_lora=True)
        own = None
        lora_name = f"{ctx.spec.name}-lora"
        try:
            if shared:
                server = session.serve_base(ctx)
            else:
                with timing.phase("server_start"):
                    own = server = ctx.state.get(LORA_SERVER).wait_ready()
            server.load_lora(lora_name, adapter)
            choices = [
                server.completion(p, model=lora_name, max_tokens=1, temperature=0.0, prompt_logprobs=0) for p in prompts
            ]
            if shared:  # the run's server goes on serving the base model alone
                server.unload_lora(lora_name)
        except ServingError as exc:
            return cannot_serve(self, ctx, exc)
        finally:
            if own is not None:
                ctx.state.drop(LORA_SERVER)
        reference = session.trainer_logprobs(ctx, adapter, prompts)
        delta = torch.cat(
            [
                (session.served_prompt_logprobs(c, p) - session.token_logprobs(r, p, 1)).abs()
                for p, c, r in zip(prompts, choices, reference, strict=True)
            ]
        )
        tol, own = calibrated_tolerance(ctx, adapter, prompts, reference, options.dtype)
        metrics = {
            **own,
            "lora_logprob_max_abs_err": delta.max().item(),
            "lora_logprob_mean_abs_err": delta.mean().item(),
            "tokens_compared": delta.numel(),
            "prompt_lengths": "+".join(str(len(p)) for p in prompts),
            "serving_dtype": options.dtype,
        }
        return self.judge(
            metrics,
            {"lora_logprob_max_abs_err": tol},
            f"adapter served natively: {metrics['tokens_compared']} prompt tokens within {tol:g} ({options.dtype})",
            [f"adapter: {origin}", "served on " + ("the run's server" if shared else "a server of its own")],
            ctx=ctx,
        )
