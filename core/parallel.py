"""Parallel layouts (how a model is split across ranks): plain data, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass

from model_support.core.errors import ModelSupportError


class ParallelLayoutError(ModelSupportError):
    """The requested parallel layout does not fit the world or the caller's initialised groups."""


@dataclass(frozen=True)
class ParallelLayout:
    """How the model is split across ranks.

    ``tensor_parallel`` x ``expert_parallel`` must divide the world size (the rest is data parallel);
    ``sequence_parallel`` shards the activations between tensor-parallel linears along the sequence (megatron-core
    requires it for an MoE model at tensor parallel > 1).
    """

    tensor_parallel: int = 1
    sequence_parallel: bool = False
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.expert_parallel < 1:
            raise ParallelLayoutError(f"parallel sizes must be >= 1, got {self}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ParallelLayoutError(
                "sequence parallel shards along tensor-parallel ranks: it needs tensor_parallel > 1"
            )

    @property
    def name(self) -> str:
        """Short form, as ``check --layouts`` takes it: ``tp2``, ``tp2-sp``, ``ep2``, ``tp2-sp-ep2``."""
        parts = [f"tp{self.tensor_parallel}"] if self.tensor_parallel > 1 else []
        parts += ["sp"] if self.sequence_parallel else []
        parts += [f"ep{self.expert_parallel}"] if self.expert_parallel > 1 else []
        return "-".join(parts) or "single"

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """``tp2``, ``tp2-sp``, ``ep2``, ``tp2-sp-ep2`` -> the layout."""
        sizes = {"tp": 1, "ep": 1}
        sp = False
        for part in filter(None, text.lower().replace("x", "-").split("-")):
            if part == "sp":
                sp = True
            elif part[:2] in sizes and part[2:].isdigit():
                sizes[part[:2]] = int(part[2:])
            else:
                raise ParallelLayoutError(f"layout {text!r}: parts are tpN, epN and sp (e.g. tp2-sp-ep2)")
        return cls(tensor_parallel=sizes["tp"], sequence_parallel=sp, expert_parallel=sizes["ep"])

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.expert_parallel


def parse_layouts(text: str) -> tuple[str, ...]:
    """``"tp2,ep2"`` -> the layouts' canonical names; a malformed one is a :class:`ParallelLayoutError`."""
    names = tuple(ParallelLayout.parse(part.strip()).name for part in text.split(",") if part.strip())
    if not names or "single" in names:
        raise ParallelLayoutError(f"--layouts {text!r}: name parallel layouts, e.g. tp2,tp2-sp,ep2")
    return names
