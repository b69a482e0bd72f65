"""What one packed row holds: sequences back to back, and shared-prefix groups ``[prompt, completion...]``.

A row's position ids say it all. A segment is a run of position ids rising by one; a segment starting at 0
begins a new sequence (a group); a segment starting at ``p > 0`` is a completion of the group whose prompt (its
first segment) is ``p`` tokens long: it continues that prompt, so ``[0..P-1, P..P+C1-1, P..P+C2-1]`` is one prompt
with two completions, each seeing the prompt and itself (the first completion's positions run on from the prompt's,
so the second one's start tells where the prompt ends; a prompt with one completion is one sequence). Trailing
negative position ids are padding (one more segment, seeing only itself).

Attention uses the groups block by block (the prompt causally, each completion against the prompt and itself),
never through a [S, S] mask; Gated DeltaNet layers run the prompt once and fan its state out to the completions
(:func:`model_support.kernels.shared_prefix.packed_shared_prefix_gated_delta_rule`), their causal convolution
seeing the prompt's last tokens before each completion; rotary embeddings take every token's true position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class Segment:
    """Row indices ``[start, end)`` of consecutive positions, the first at ``position``."""

    start: int
    end: int
    position: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class RowLayout:
    """The groups of one packed row: each a prompt (or a whole sequence) followed by its completions."""

    groups: tuple[tuple[Segment, ...], ...]
    length: int
    # Tensors of the layout moved to a device once per row, not once per layer that reads them.
    _on_device: dict[tuple[str, torch.device], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> RowLayout:
        """The layout the position ids of one row ([S] or [1, S]) describe (see the module doc)."""
        pos = (position_ids[0] if position_ids.dim() == 2 else position_ids).tolist()
        padding = next((i for i, p in enumerate(pos) if p < 0), len(pos))
        if any(p >= 0 for p in pos[padding:]):
            raise ValueError("padding (negative position ids) may only appear at the end of the row")
        groups: list[list[Segment]] = []
        start = 0
        for i in range(1, padding + 1):
            if i < padding and pos[i] == pos[i - 1] + 1:
                continue
            segment = Segment(start, i, pos[start])
            if segment.position == 0:
                groups.append([segment])
            elif groups and len(groups[-1]) == 1 and groups[-1][0].length > segment.position:
                # The first completion's positions run on from its prompt's: the prompt is the first ones.
                whole, cut = groups[-1][0], groups[-1][0].start + segment.position
                groups[-1] = [Segment(whole.start, cut, 0), Segment(cut, whole.end, segment.position), segment]
            elif groups and groups[-1][0].length == segment.position:
                groups[-1].append(segment)
            else:
                raise ValueError(
                    f"position ids: the run at index {start} starts at position {segment.position}, which neither "
                    "starts a sequence (0) nor continues the prompt before it (a completion starts at the prompt's "
                    "length)"
                )
            start = i
        if padding < len(pos):
            groups.append([Segment(padding, len(pos), 0)])
        return cls(tuple(tuple(group) for group in groups), len(pos))

    @classmethod
    def shared_prefix(cls, prompt: int, completions: list[int] | tuple[int, ...]) -> RowLayout:
        """One prompt of ``prompt`` tokens and completions of the given lengths, back to back."""
        segments, start = [Segment(0, prompt, 0)], prompt
        for length in completions:
            segments.append(Segment(start, start + length, prompt))
            start += length
        return cls((tuple(segments),), start)

    @property
    def segments(self) -> list[Segment]:
        return [segment for group in self.groups for segment in group]

    @property
    def shared(self) -> bool:
        """Whether some group has completions (else every segment is a sequence of its own)."""
        return any(len(group) > 1 for group in self.groups)

    def _on(self, name: str, device: torch.device, values: list[int]) -> torch.Tensor:
        key = (name, torch.device(device))
        if key not in self._on_device:
            self._on_device[key] = torch.tensor(values, dtype=torch.int32).to(device)
        return self._on_device[key]

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """int32 boundaries of every segment."""
        return self._on("cu_seqlens", device, [0, *(segment.end for segment in self.segments)])

    def group_cu_seqlens(self, index: int, device: torch.device) -> torch.Tensor:
        """int32 boundaries of group ``index``'s segments, from its first token."""
        group = self.groups[index]
        return self._on(f"group{index}", device, [0, *(s.end - group[0].start for s in group)])

    def positions_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`positions` on ``device``."""
        return self._on("positions", device, self.positions.tolist())

    @cached_property
    def positions(self) -> torch.Tensor:
        """[S] every token's position in its own sequence (a completion's continue its prompt's)."""
        return torch.cat([torch.arange(s.position, s.position + s.length) for s in self.segments])

    def position_ids(self) -> torch.Tensor:
        """[1, S] position ids that describe this layout."""
        return self.positions[None]
