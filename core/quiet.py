"""Known third-party warnings that tell a model-support user nothing: hidden where they are raised, and counted.

A check imports megatron-core, megatron-bridge, transformers and torch, which warn about their own set-up: Transformer
Engine and Apex are missing (megatron falls back to torch, as it must on a CPU or a machine without them),
``GPTModel`` is deprecated upstream, megatron-bridge reads transformers' deprecated ``torch_dtype``, a CPU machine has
no CUDA runtime. None of them is about the model under test or something the user can act on; between a check's
progress lines they bury what the check says.

:data:`KNOWN` lists each by where it comes from and how its message starts. :func:`hidden_noise` hides exactly those
while it is active: a warning of the listed category raised by code of the listed package (through
:func:`warnings.showwarning`, after Python's own filters chose to show it) and a log record of the listed logger (a
filter on that logger). Any other warning or record still shows. The counts it yields (message pattern -> number
hidden) go into the JSON report as ``suppressed_warnings``.
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class Noise:
    """One known message: a ``warning`` raised by code of package ``source``, or a ``log`` record of logger
    ``source``, whose text starts with ``message``."""

    kind: Literal["warning", "log"]
    source: str
    message: str
    category: type[Warning] = UserWarning

    @property
    def pattern(self) -> str:
        """The key its count is reported under."""
        return f"{self.source}: {self.message}"


KNOWN: tuple[Noise, ...] = (
    # megatron-core at import: optional fused kernels are missing, it uses its torch implementations.
    Noise("warning", "megatron", "Transformer Engine and Apex are not installed"),
    Noise("warning", "megatron", "Apex is not installed"),
    Noise("warning", "megatron", "Only transformer-engine>="),
    Noise("warning", "megatron", "absl.logging is not installed"),
    # megatron-core's TransformerConfig about a CUDA-graph default that megatron-bridge's providers set.
    Noise("warning", "megatron", "full scope is deprecated"),
    # megatron-bridge turns gradient-accumulation fusion off without TE / Apex (the trainer's concern, not a check's).
    Noise("log", "megatron.bridge.utils.fusions", "gradient_accumulation_fusion requires"),
    # megatron-core's deprecation notice of the GPTModel class megatron-bridge builds.
    Noise("log", "megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
    # megatron-bridge reads config.torch_dtype.
    Noise("log", "transformers.configuration_utils", "`torch_dtype` is deprecated"),
    # The Qwen3.5 reference and tiny replica run transformers' torch Gated DeltaNet on purpose; its "install fla and
    # causal-conv1d" advice is about transformers' speed, not the check.
    Noise("log", "transformers.models.qwen3_5.modeling_qwen3_5", "The fast path is not available"),
    Noise("log", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "The fast path is not available"),
    # torch's C++-extension helper on a machine with a CUDA toolkit directory but no GPU.
    Noise("log", "torch.utils.cpp_extension", "No CUDA runtime is found"),
)


def _in_package(filename: str, package: str) -> bool:
    """Whether ``filename`` is a file of ``package``, which is imported when its code warns."""
    module = sys.modules.get(package)
    roots = getattr(module, "__path__", None) or ()
    return any(Path(filename).is_relative_to(root) for root in roots)


class _Hider(logging.Filter):
    """Counts and drops the known messages; one instance is the warnings hook and the filter of every listed logger."""

    def __init__(self, known: tuple[Noise, ...]) -> None:
        super().__init__()
        self.known = known
        self.counts: Counter[str] = Counter()
        self.show = warnings.showwarning

    def showwarning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        text = str(message)
        for noise in self.known:
            if (
                noise.kind == "warning"
                and issubclass(category, noise.category)
                and text.startswith(noise.message)
                and _in_package(filename, noise.source)
            ):
                self.counts[noise.pattern] += 1
                return
        self.show(message, category, filename, lineno, file, line)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        for noise in self.known:
            if noise.kind == "log" and record.name == noise.source and text.startswith(noise.message):
                self.counts[noise.pattern] += 1
                return False
        return True


@contextmanager
def hidden_noise(known: tuple[Noise, ...] = KNOWN) -> Iterator[Counter[str]]:
    """Hide the ``known`` messages inside the block; yields their counts by :attr:`Noise.pattern` as they come."""
    hider = _Hider(known)
    loggers = [logging.getLogger(name) for name in dict.fromkeys(n.source for n in known if n.kind == "log")]
    warnings.showwarning = hider.showwarning
    for logger in loggers:
        logger.addFilter(hider)
    try:
        yield hider.counts
    finally:
        for logger in loggers:
            logger.removeFilter(hider)
        if warnings.showwarning == hider.showwarning:
            warnings.showwarning = hider.show
