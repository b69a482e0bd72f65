"""In-place weight updates of a live server, one step at a time: ``model@0`` -> ``model@1`` -> ...

A step's weights arrive as buckets (dicts of HF-named tensors, e.g. from
:func:`model_support.core.api.merged_weights` or :func:`export.buckets`). Each bucket is written to the step's
staging checkpoint as it arrives; nothing reaches the server until the last bucket: then the checkpoint is
published atomically, the server loads it in place (vLLM: worker ``reload_weights`` through ``/collective_rpc``,
same process) and the served model name advances. The previous step's checkpoint is removed once the new one
is loaded, so the disk holds one step at a time.

Transport: the local file system (the server reads the published checkpoint). It is what runs on CPU and what
the tests exercise; vLLM's NCCL weight-transfer engine (``/init_weight_transfer_engine``, ``/update_weights``)
is the GPU path and is not driven here.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from model_support.core.checkpoint import stored_tensors
from model_support.core.serving.errors import ServingError
from model_support.core.serving.export import write_checkpoint

if TYPE_CHECKING:
    from model_support.core.serving.backend import Server


def served_name(model: str, step: int) -> str:
    return f"{model}@{step}"


def parse_served_name(name: str) -> tuple[str, int]:
    """``"qwen3@4"`` -> ``("qwen3", 4)``; a name without a step is step 0."""
    model, sep, step = name.rpartition("@")
    if sep and step.isdigit():
        return model, int(step)
    return name, 0


class WeightUpdater:
    """Applies whole steps of weights to ``server``; ``staging_root`` holds the step being written."""

    def __init__(self, server: Server, staging_root: Path, support_from: Path) -> None:
        self.server = server
        self.model, self.step = parse_served_name(server.served_name)
        self.staging_root, self.support_from = Path(staging_root), Path(support_from)
        self._loaded: Path | None = None
        self._expected: set[str] | None = None

    def update(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> str:
        """Stage every bucket, then load the step in place and advance the name; returns the new served name.

        A failure while staging leaves the server untouched (same weights, same name) and nothing on disk.
        """
        step_dir = self.staging_root / f"step-{self.step + 1}"
        weights_dir = write_checkpoint(buckets, step_dir, support_from=self.support_from, check=self._check_complete)
        self.server.reload_weights(weights_dir)
        self.step += 1
        self.server.rename(served_name(self.model, self.step))
        if self._loaded is not None:
            shutil.rmtree(self._loaded, ignore_errors=True)
        self._loaded = weights_dir
        return self.server.served_name

    def _check_complete(self, pushed: Mapping[str, str]) -> None:
        """A step must carry exactly the served checkpoint's tensors: vLLM would keep whatever a partial update
        leaves out in an undefined state (a tensor left out of a reload serves NaN on the CPU build)."""
        if self._expected is None:
            self._expected = set(stored_tensors(self.support_from))
        missing, extra = sorted(self._expected - set(pushed)), sorted(set(pushed) - self._expected)
        if missing or extra:
            raise ServingError(
                f"the update to {served_name(self.model, self.step + 1)} does not match the served checkpoint: "
                f"{len(missing)} tensor(s) missing {missing[:3]}, {len(extra)} unknown {extra[:3]}; nothing was applied"
            )
