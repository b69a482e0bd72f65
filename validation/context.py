"""What every stage of one ``model-support check`` run sees."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
                self.artifacts["tokenizer"] = AutoTokenizer.from_pretrained(self.model_dir)
            except Exception as exc:  # transformers raises OSError, ValueError or TypeError here
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ModelSupportError(
                    f"no usable tokenizer in {self.model_dir} ({type(exc).__name__}: {reason}); add the checkpoint's "
                    "tokenizer files"
                ) from None
        return self.artifacts["tokenizer"]
