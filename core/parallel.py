"""Parallel layouts (how a model is split across ranks): plain data, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass

from model_support.core.errors import ModelSupportError


class ParallelLayoutError(ModelSupportError):
    """The requested parallel layout does not fit the world or the caller's initialised groups."""


# Short names of the parallel sizes, in the order a layout's name lists them.
_SIZES = (
    ("tp", "tensor_parallel"),
    ("ep", "expert_parallel"),
    ("etp", "expert_tensor_parallel"),
    ("pp", "pipeline_parallel"),
    ("vp", "virtual_pipeline"),
    ("cp", "context_parallel"),
)


# Every kind of parallelism a layout can use (field names; a handler's ``parallel_limits`` keys).
DIMENSIONS = (
    "tensor_parallel",
    "sequence_parallel",
    "expert_parallel",
    "expert_tensor_parallel",
    "pipeline_parallel",
    "virtual_pipeline",
    "context_parallel",
)


@dataclass(frozen=True)
class ParallelLayout:
    """How the model is split across ranks, as megatron-core's parallel state splits it.

    ``tensor_parallel`` x ``context_parallel`` x ``pipeline_parallel`` ranks hold one copy of the model (the rest of
    the world is data parallel); ``expert_parallel`` splits the experts over tensor-, context- and data-parallel
    ranks, and ``expert_tensor_parallel`` splits each expert's linears (1: experts whole on each rank).
    ``sequence_parallel`` shards the activations between tensor-parallel linears along the sequence (megatron-core
    requires it for an MoE model at tensor parallel > 1). ``virtual_pipeline`` > 1 gives each
    pipeline rank that many model chunks (the interleaved schedule). ``context_parallel`` splits every sequence
    across ranks in 2 x cp chunks, rank i holding chunks i and 2 x cp - 1 - i (megatron-core's load balancing).
    """

    tensor_parallel: int = 1
    sequence_parallel: bool = False
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline: int = 1
    context_parallel: int = 1

    def __post_init__(self) -> None:
        sizes = {field: getattr(self, field) for _, field in _SIZES}
        if any(size < 1 for size in sizes.values()):
            raise ParallelLayoutError(f"parallel sizes must be >= 1, got {self}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ParallelLayoutError(
                "sequence parallel shards along tensor-parallel ranks: it needs tensor_parallel > 1"
            )
        if self.virtual_pipeline > 1 and self.pipeline_parallel == 1:
            raise ParallelLayoutError(
                "virtual pipeline stages interleave pipeline ranks: they need pipeline_parallel > 1"
            )

    @property
    def name(self) -> str:
        """Short form, as ``check --layouts`` takes it: ``tp2``, ``tp2-sp``, ``ep2``, ``pp2-vp2``, ``tp2-cp2``."""
        parts = []
        for short, field in _SIZES:
            parts += [f"{short}{getattr(self, field)}"] if getattr(self, field) > 1 else []
            if short == "tp" and self.sequence_parallel:
                parts.append("sp")
        return "-".join(parts) or "single"

    @classmethod
    def parse(cls, text: str) -> ParallelLayout:
        """``tp2``, ``tp2-sp``, ``ep2``, ``ep2-etp2``, ``pp2-vp2``, ``tp2-sp-ep2``, ``cp2`` -> the layout."""
        fields = dict(_SIZES)
        sizes: dict[str, int] = {}
        sp = False
        for part in filter(None, text.lower().replace("x", "-").split("-")):
            if part == "sp":
                sp = True
            elif part.rstrip("0123456789") in fields and part[-1].isdigit():
                short = part.rstrip("0123456789")
                sizes[fields[short]] = int(part[len(short) :])
            else:
                raise ParallelLayoutError(
                    f"layout {text!r}: parts are tpN, epN, etpN, ppN, vpN, cpN and sp (e.g. tp2-sp-ep2, pp2-vp2)"
                )
        return cls(sequence_parallel=sp, **sizes)

    def used(self) -> tuple[str, ...]:
        """The kinds of parallelism the layout uses, by field name (``tensor_parallel``, ``sequence_parallel``...)."""
        return tuple(name for name in DIMENSIONS if getattr(self, name) is True or getattr(self, name) > 1)

    @property
    def model_parallel(self) -> int:
        """The ranks the layout is run on: tensor x context x pipeline ranks, times expert x expert tensor parallel
        (experts split over data-parallel replicas of that)."""
        dense = self.tensor_parallel * self.context_parallel * self.pipeline_parallel
        return dense * self.expert_parallel * self.expert_tensor_parallel


def parse_layouts(text: str) -> tuple[str, ...]:
    """``"tp2,ep2"`` -> the layouts' canonical names; a malformed one is a :class:`ParallelLayoutError`."""
    names = tuple(ParallelLayout.parse(part.strip()).name for part in text.split(",") if part.strip())
    if not names or "single" in names:
        raise ParallelLayoutError(f"--layouts {text!r}: name parallel layouts, e.g. tp2,tp2-sp,ep2,pp2")
    return names
