"""Stage `weights`: every tensor of the checkpoint is finite, and no weight matrix is all zeros."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from model_support.core.checkpoint import INDEX, SINGLE, open_weights, stored_tensors, weight_files
from model_support.core.megatron.dist import my_share, sum_over_ranks, union_over_ranks
from model_support.validation.context import CheckContext
from model_support.validation.stage import Stage, StageResult


class WeightsStage(Stage):
    """Streams every tensor of every safetensors file (one tensor in memory at a time): a tensor with a
    NaN or an infinity fails the stage by name, and so does an all-zero matrix (a 2-D or larger tensor;
    a trained or randomly initialised weight matrix is never all zeros, while 1-D norm or bias vectors
    may be). A few random tokens would miss a NaN row of the embedding; this does not. The files are the
    checkpoint's own (:func:`~model_support.core.checkpoint.weight_files`), their headers checked first: a bad one
    fails the stage naming the file."""

    name = "weights"
    title = "Every checkpoint tensor is finite and no weight matrix is all zeros."
    order = 25
    sharded = True
    requires = ("architecture",)
    thresholds: ClassVar[dict[str, float]] = {"nonfinite_tensors": 0, "zero_matrices": 0}

    def run(self, ctx: CheckContext) -> StageResult:
        # weight_files and stored_tensors raise CheckpointError (the stage fails with it) for an ambiguous,
        # escaping or corrupt checkpoint.
        files = weight_files(ctx.model_dir)
        if not files:
            return self.failed(f"no safetensors weights in {ctx.model_dir} (no {SINGLE} or {INDEX})")
        by_file: dict[Path, list[str]] = {path: [] for path in files}
        # Under check --parallel each rank reads its share of the tensors, and the counts are added up.
        for key, (path, _, _) in my_share(sorted(stored_tensors(ctx.model_dir).items())):
            by_file[path].append(key)
        nonfinite: list[str] = []
        zero: list[str] = []
        tensors = elements = 0
        for path, keys in by_file.items():
            with open_weights(path) as f:
                for key in keys:
                    tensor = f.get_tensor(key)
                    tensors += 1
                    elements += tensor.numel()
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        bad = int((~torch.isfinite(tensor)).sum())
                        nonfinite.append(f"{key} ({bad} of {tensor.numel()} not finite) in {path.name}")
                    elif tensor.dim() >= 2 and tensor.numel() and not bool(tensor.any()):
                        zero.append(f"{key} in {path.name}")
        tensors, elements = sum_over_ranks(tensors), sum_over_ranks(elements)
        nonfinite, zero = sorted(union_over_ranks(nonfinite)), sorted(union_over_ranks(zero))
        metrics = {
            "files": len(files),
            "tensors": tensors,
            "elements": elements,
            "nonfinite_tensors": len(nonfinite),
            "zero_matrices": len(zero),
        }
        details = [f"not finite: {name}" for name in nonfinite[:8]] + [f"all zeros: {name}" for name in zero[:8]]
        return self.judge(
            metrics, self.thresholds, f"{tensors} tensors in {len(files)} file(s), all finite", details, ctx=ctx
        )
