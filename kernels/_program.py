"""A pass of GPU work declared as data, issued with almost no Python once its kernels are compiled.

fla-hybrid's step is a dozen launches of small kernels. Issued by Python that allocates, shapes and launches
each one, it costs the host more time than its kernels take on the GPU (docs/benchmarks.md). Here a pass is
declared once per input signature: the buffers it allocates (:class:`Buffer`, grouped in workspaces that live
and die together; a workspace of one buffer is that tensor), and its kernel launches (:class:`Launch`, their
tensor arguments named by :class:`Ref`). A pass has no torch operations between its launches: a torch
operation on part of a workspace needs views of it, which cost the host more than a launch.

:class:`Pass` runs its launches through :class:`~model_support.kernels._fla_launch.TunedKernel` (which tunes,
compiles and plans) until every one of them has a launch plan. Then it is fixed: each launch becomes its compiled
kernel's launcher called with an argument list built once, whose tensor slots are filled with the base address
of an input or workspace plus an offset, and a later run allocates its workspaces, reads a few base addresses
and issues the launches. The caller declares a pass for one signature (device, dtypes, shapes, every value that
is not a tensor) and runs it only on inputs of that signature; what a plan depends on beyond it is checked at every
fixed run: the inputs' 16-byte alignment (what Triton specialises a kernel on), which inputs are None, the
current device. Under Triton's interpreter, or with a profiler's launch hooks set, a pass runs through
:class:`TunedKernel`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from triton.runtime.driver import driver

from model_support.kernels._fla_launch import Grid, Plan, TunedKernel, launch_hooks

ALIGN = 256
"""Byte alignment of every buffer in a workspace (the caching allocator aligns a block to 512)."""

Env = dict[str, torch.Tensor | None]
"""A pass's tensors by name: its inputs, and each workspace it allocates."""


class Ref(NamedTuple):
    """An input or a declared buffer by name, or rows ``start:stop`` of its first dimension."""

    name: str
    start: int = 0
    stop: int | None = None


class Buffer(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    zero: bool = False
    """Filled with zeros when its workspace is allocated (other buffers are left as allocated)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Launch(NamedTuple):
    """One kernel launch: :class:`TunedKernel` arguments, tensors given as :class:`Ref` inside a pass."""

    kernel: TunedKernel
    grid: Grid
    args: dict[str, Any]
    setting: dict[str, Any] | None = None

    def __call__(self) -> Plan | None:
        """Launch with tensor arguments (no :class:`Ref`); the plan it ran through, if any."""
        return self.kernel(self.grid, self.setting, **self.args)


class Layout:
    """Where every declared buffer lives: ``workspaces`` maps a workspace's name to its buffers."""

    def __init__(self, workspaces: Mapping[str, Sequence[Buffer]]) -> None:
        self._workspaces: dict[str, tuple[int, int, Buffer | None]] = {}  # name -> (bytes, zeroed bytes, sole)
        self._where: dict[str, tuple[str, int, Buffer]] = {}  # buffer -> (workspace, byte offset, buffer)
        for name, buffers in workspaces.items():
            if len(buffers) == 1:
                self._workspaces[name] = (buffers[0].nbytes, 0, buffers[0])
                self._where[buffers[0].name] = (name, 0, buffers[0])
                continue
            offset = zeroed = 0
            for buffer in sorted(buffers, key=lambda b: not b.zero):  # zeroed buffers first: one fill
                self._where[buffer.name] = (name, offset, buffer)
                offset += -(-buffer.nbytes // ALIGN) * ALIGN
                zeroed = offset if buffer.zero else zeroed
            self._workspaces[name] = (offset, zeroed, None)

    def allocate(self, workspace: str, device: torch.device) -> torch.Tensor:
        nbytes, zeroed, sole = self._workspaces[workspace]
        if sole is not None:
            make = torch.zeros if sole.zero else torch.empty
            return make(sole.shape, dtype=sole.dtype, device=device)
        memory = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if zeroed:
            memory[:zeroed].zero_()
        return memory

    def home(self, ref: Ref) -> str:
        """The input or workspace ``ref`` lies in."""
        return self._where[ref.name][0] if ref.name in self._where else ref.name

    def tensor(self, env: Env, ref: Ref) -> torch.Tensor | None:
        """The tensor ``ref`` names in ``env`` (None for an input given as None)."""
        located = self._where.get(ref.name)
        if located is None:
            tensor = env[ref.name]
        else:
            workspace, offset, buffer = located
            tensor = env[workspace]
            if self._workspaces[workspace][2] is None:
                tensor = tensor[offset : offset + buffer.nbytes].view(buffer.dtype).view(buffer.shape)
        if tensor is None or (ref.start == 0 and ref.stop is None):
            return tensor
        return tensor[ref.start : ref.stop]


class _Fixed(NamedTuple):
    """A launch with its compiled kernel's launcher and every argument but the addresses decided."""

    plan: Plan
    grid: tuple[int, int, int]
    values: list[Any]
    slots: tuple[tuple[int, str, int], ...]
    """(argument position, input or workspace, byte offset) of each tensor argument."""

    def __call__(self, bases: dict[str, int], stream: int) -> None:
        values = self.values.copy()
        for position, base, offset in self.slots:
            values[position] = bases[base] + offset
        self.plan.call(self.grid, stream, values)


class Pass:
    """Allocate ``allocates`` (workspaces of ``layout``) and run ``ops`` over them and a pass's inputs."""

    def __init__(self, layout: Layout, allocates: Sequence[str], ops: Sequence[Launch]) -> None:
        self._layout = layout
        self._allocates = tuple(allocates)
        self._ops = tuple(ops)
        self._fixed: tuple[_Fixed, ...] | None = None
        self._inputs: tuple[str, ...] = ()
        self._device = -1

    @property
    def fixed(self) -> bool:
        """Whether the next run on an aligned input issues the compiled kernels directly."""
        return self._fixed is not None

    def __call__(self, inputs: Env, device: torch.device) -> Env:
        """Run over ``inputs`` (tensors, or None where a kernel takes None); returns them with the workspaces."""
        env = dict(inputs)
        for workspace in self._allocates:
            env[workspace] = self._layout.allocate(workspace, device)
        present = tuple(name for name, tensor in inputs.items() if tensor is not None)
        bases = {name: tensor.data_ptr() for name, tensor in env.items() if tensor is not None}
        # A kernel Triton specialised on aligned pointers is wrong for others: a pass is fixed from aligned inputs
        # only, and a fixed run checks that its inputs are aligned.
        aligned = not any(bases[name] % 16 for name in present)
        fixed = self._fixed
        if (
            fixed is not None
            and present == self._inputs
            and aligned
            and not launch_hooks()
            and driver.active.get_current_device() == self._device
        ):
            stream = driver.active.get_current_stream(self._device)
            for launch in fixed:
                launch(bases, stream)
            return env
        self._run(env, present if aligned and fixed is None else None)
        return env

    def _run(self, env: Env, fix_for: tuple[str, ...] | None) -> None:
        """Run every op through :class:`TunedKernel`; unless ``fix_for`` is None, fix the pass for inputs where
        those named are not None once each launch ran through a plan."""
        fixed: list[_Fixed] | None = None if fix_for is None else []
        for op in self._ops:
            args = {k: self._layout.tensor(env, v) if isinstance(v, Ref) else v for k, v in op.args.items()}
            plan = op._replace(args=args)()
            step = None if plan is None or fixed is None else self._fix(op, plan, args, env)
            if step is None:
                fixed = None
            elif fixed is not None:
                fixed.append(step)
        if fixed is not None and fix_for is not None:
            self._fixed, self._inputs = tuple(fixed), fix_for
            self._device = driver.active.get_current_device()

    def _fix(self, op: Launch, plan: Plan, args: dict[str, Any], env: Env) -> _Fixed | None:
        """``op`` as a fixed launch of ``plan`` (None where an offset would change a tensor's alignment)."""
        values = list(plan.values)
        slots = []
        for position, name in plan.tensors:
            ref = op.args[name]
            if isinstance(ref, Ref):
                home = self._layout.home(ref)
                offset = args[name].data_ptr() - env[home].data_ptr()  # the same for every input of the signature
                if offset % 16:
                    return None
                slots.append((position, home, offset))
            else:  # a tensor of the declaration itself (an index): it lives as long as the pass
                values[position] = ref.data_ptr()
        return _Fixed(plan, plan.grid_for(op.grid, args), values, tuple(slots))
