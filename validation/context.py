"""What every stage of one ``model-support check`` run sees."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Limits of one rendering of the check's conversations by a checkpoint's chat template (CheckContext.chat_prompts).
CHAT_RENDER_LIMIT_S = 60  # loading the tokenizer included
CHAT_RENDER_MAX_CHARS = 1_000_000
CHAT_RENDER_MAX_BYTES = 8 * 2**30  # the child's address space

if TYPE_CHECKING:
    from model_support.core.layout import ModelLayout
    from model_support.core.registry import RegisteredHandler, Registry


@dataclass
class CheckContext:
    """The model under check, its handler, and a place for stages to share what they built.

    ``model_dir`` holds config.json, weights and tokenizer (a tiny replica under ``--tiny``).
    ``artifacts`` lets a stage reuse what an earlier one built (keyed by a documented name),
    so e.g. the Megatron model is converted once per run.
    """

    target: str
    model_dir: Path
    handler: RegisteredHandler
    config: Any
    layout: ModelLayout
    registry: Registry
    workdir: Path
    tiny: bool = False
    seed: int = 0
    # The Megatron model's dtype ("bf16" or "fp32"); None: the device's (bf16 on a GPU, fp32 on a CPU).
    dtype: str | None = None
    # Parallel layouts for `parallel_parity` ("tp2", "tp2-sp", "ep2", ...); None: the stage's default for the model.
    layouts: tuple[str, ...] | None = None
    artifacts: dict[str, Any] = field(default_factory=dict)

    @property
    def spec(self):  # -> HandlerSpec
        return self.handler.spec

    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (loaded once); a one-line error when there is none that loads."""
        if "tokenizer" not in self.artifacts:
            from transformers import AutoTokenizer

            from model_support.core.errors import ModelSupportError

            try:
                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            except Exception as exc:  # transformers raises OSError, ValueError or TypeError here
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ModelSupportError(
                    f"no usable tokenizer in {self.model_dir} ({type(exc).__name__}: {reason}); add the checkpoint's "
                    "tokenizer files"
                ) from None
            # Without tokenizer files transformers builds the family's tokenizer class with an empty vocabulary.
            if len(tokenizer) <= len(tokenizer.all_special_ids):
                raise ModelSupportError(
                    f"no tokenizer files in {self.model_dir}: transformers' {type(tokenizer).__name__} from it has "
                    f"{len(tokenizer)} token(s); add the checkpoint's tokenizer files (e.g. tokenizer.json)"
                )
            self.artifacts["tokenizer"] = tokenizer
        return self.artifacts["tokenizer"]

    def chat_prompts(self, conversations: list[list[dict[str, str]]]) -> list[str]:
        """Each conversation rendered by the checkpoint's chat template (``add_generation_prompt=True``), as
        ``tokenizer.apply_chat_template(..., tokenize=False)`` renders it, in a child process held to
        ``CHAT_RENDER_LIMIT_S`` seconds, ``CHAT_RENDER_MAX_CHARS`` characters a prompt and ``CHAT_RENDER_MAX_BYTES``
        of memory: a template's loops and output are bounded by nothing else."""
        import json
        import resource
        import subprocess
        import sys

        from model_support.core.errors import ModelSupportError

        def limit_memory() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (CHAT_RENDER_MAX_BYTES, CHAT_RENDER_MAX_BYTES))

        script = Path(__file__).with_name("chat_render.py")
        what = f"the chat template of {self.model_dir}"
        try:
            proc = subprocess.run(
                [sys.executable, "-P", str(script), str(self.model_dir), str(CHAT_RENDER_MAX_CHARS)],
                input=json.dumps(conversations),
                capture_output=True,
                text=True,
                timeout=CHAT_RENDER_LIMIT_S,
                preexec_fn=limit_memory,
            )
        except subprocess.TimeoutExpired:
            raise ModelSupportError(
                f"{what} did not render {len(conversations)} short conversation(s) in {CHAT_RENDER_LIMIT_S} s; "
                "fix its loops (a correct template renders them in milliseconds)"
            ) from None
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
            raise ModelSupportError(f"{what} failed to render: {lines[-1]}")
        return json.loads(proc.stdout)
