"""In-place weight updates of a live server, one step at a time: ``model@0`` -> ``model@1`` -> ...

A step's weights arrive as buckets (each a dict of HF-named tensors, e.g. from :func:`export.buckets`). Each
bucket is written to the step's staging checkpoint as it arrives; nothing reaches the server until the last
bucket: then the checkpoint is published atomically, the server loads it in place (vLLM: worker
``reload_weights`` through ``/collective_rpc``, same process) and the served model name advances. On CPU the
weights travel through the local file system; vLLM's NCCL weight-transfer engine (``/init_weight_transfer_engine``,
``/update_weights``) is the GPU path and is not driven here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from model_support.core.serving.backend import Server
from model_support.core.serving.errors import ServingError
from model_support.core.serving.export import CheckpointWriter


def served_name(model: str, step: int) -> str:
    return f"{model}@{step}"


class WeightUpdater:
    """Pushes new weights to ``server`` in buckets; applies them once, after the last bucket of a step."""

    def __init__(self, server: Server, model: str, staging_root: Path, support_from: Path, step: int = 0) -> None:
        self.server, self.model, self.step = server, model, step
        self.staging_root, self.support_from = Path(staging_root), Path(support_from)
        self._writer: CheckpointWriter | None = None
        self._expected = 0
        self._received = 0

    def begin(self, num_buckets: int) -> None:
        if num_buckets < 1:
            raise ServingError("a weight update needs at least one bucket")
        if self._writer is not None:
            raise ServingError(
                f"update to step {self.step + 1} is still open ({self._received}/{self._expected} buckets)"
            )
        self._writer = CheckpointWriter(self.staging_root / f"step-{self.step + 1}", support_from=self.support_from)
        self._expected, self._received = num_buckets, 0

    def push(self, bucket: Mapping[str, torch.Tensor]) -> bool:
        """Stage one bucket; returns True when it was the last one and the server now serves the new step."""
        if self._writer is None:
            raise ServingError("push() before begin()")
        self._writer.write_shard(bucket)
        self._received += 1
        if self._received < self._expected:
            return False
        weights_dir = self._writer.commit()
        self._writer = None
        self.server.reload_weights(weights_dir)
        self.step += 1
        self.server.rename(served_name(self.model, self.step))
        return True
