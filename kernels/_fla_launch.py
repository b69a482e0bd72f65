"""fla's Triton kernels launched straight through their JIT functions once tuned.

Each of fla 0.6's kernels is ``triton.heuristics`` over fla's ``CachedAutotuner`` over a JIT function, and
each of its host functions runs under fla's backend dispatch (a ``torch.compiler.disable`` frame and a
backend check per call) and input guard. That Python costs the host more per launch than a shared-prefix
step's small kernels take on the GPU (``python -m benchmarks.gdn_host_profile``). :class:`TunedKernel` runs
the autotuner once per tuning key, as fla does, then launches the kernel Triton compiled for the chosen
setting through that kernel's launcher, with no Python of Triton's in between once a call's arguments have
been seen: on a slow host, Triton's own path (argument binder, launch wrapper, and the launcher's driver query
per tensor) costs several times the launch itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from triton import knobs
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.driver import driver
from triton.runtime.errors import OutOfResources

Grid = tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]

PLANS_PER_KERNEL = 256
"""Launch plans a kernel keeps (one per fingerprint of its arguments: a new length makes a new one)."""


class Plan(NamedTuple):
    """How to launch a compiled kernel again for arguments fingerprinted alike (:func:`_fingerprint`)."""

    run: Callable[..., Any]
    """The compiled kernel's launcher."""
    function: int
    metadata: Any
    values: list[Any]
    """The kernel's arguments in its own order; None where each call's tensors go."""
    tensors: tuple[tuple[int, str], ...]
    """(position, name) of each tensor argument."""
    meta: dict[str, Any]
    """Every argument but the tensors, and the setting: what a callable grid reads."""

    def grid_for(self, grid: Grid, args: dict[str, Any]) -> tuple[int, int, int]:
        """``grid`` for ``args`` under this plan's setting, as three dimensions."""
        if callable(grid):
            grid = grid({**self.meta, **args})
        x, y, z = (*grid, 1, 1)[:3]
        return x, y, z

    def call(self, grid: tuple[int, int, int], stream: int, values: list[Any]) -> None:
        """The launcher itself, ``values`` in the kernel's argument order (no launch metadata or hooks)."""
        self.run(*grid, stream, self.function, self.metadata, None, None, None, *values)

    def launch(self, grid: Grid, args: dict[str, Any], stream: int) -> None:
        values = self.values.copy()
        for position, name in self.tensors:
            # Addresses, not tensors: Triton's launcher asks the driver (cuPointerGetAttribute) to translate
            # every tensor's address, which for device memory is the address itself.
            values[position] = args[name].data_ptr()
        self.call(self.grid_for(grid, args), stream, values)


def launch_hooks() -> bool:
    """Whether a launch hook (a profiler's) is set: Triton's own launch path calls it with each launch."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(hook is not None and getattr(hook, "calls", True) for hook in hooks)  # a HookChain, or one hook


def _fingerprint(value: Any) -> Any:
    """What Triton specialises a kernel on, or finer: a tensor's dtype, device kind and 16-byte alignment,
    any other argument's type and value (``True``, ``1`` and ``1.0`` are equal keys, not equal kernels)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.is_cuda, value.data_ptr() % 16 == 0
    return type(value), value


class TunedKernel:
    """One of fla's kernels (or ours): the first launch for a tuning key goes through fla's autotuner (which
    tunes, or reads Triton's cache), later ones straight to the kernel Triton compiled for that key's setting.

    The tuning key is the autotuner's own: its ``key`` arguments and the dtype of every tensor argument. Each
    launch through ``JITFunction.run`` (which picks or compiles the kernel for its arguments' specialisation)
    leaves a plan keyed by the arguments' fingerprint (:func:`_fingerprint`: every argument that is not a
    tensor by type and value, every tensor by what Triton specialises it on), and a later call fingerprinted alike
    launches that plan's compiled kernel directly. Arguments other than tensors must be hashable. Under
    Triton's CPU interpreter, or with Triton's launch hooks set (a profiler), every launch goes through
    ``run``.
    """

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self._rules: list[tuple[str, Callable[[dict[str, Any]], Any]]] = []
        self._autotuner: Autotuner | None = None
        node = kernel
        while isinstance(node, Heuristics | Autotuner):
            if isinstance(node, Heuristics):
                if self._autotuner is not None:  # its rules could read the tuned setting's values
                    raise TypeError(f"{kernel}: heuristics inside an autotuner are not supported")
                self._rules.extend(node.values.items())
            else:
                self._autotuner = node
            node = node.fn
        self._jit = node
        self._keys: list[str] = self._autotuner.keys if self._autotuner is not None else []
        self._settings: dict[tuple[Any, ...], dict[str, Any]] = {}
        self._unfit: set[tuple[Any, ...]] = set()
        self._plans: dict[tuple[Any, ...], Plan] = {}

    def __call__(self, grid: Grid, setting: dict[str, Any] | None = None, **args: Any) -> Plan | None:
        """Launch over ``grid``. ``setting`` (launch parameters and block sizes the autotuner would choose,
        e.g. ``{"BV": 16, "num_warps": 4, "num_stages": 3}``) overrides the tuned one; where it needs more
        shared memory than the GPU has, Triton refuses it before it runs and the tuned setting is used.
        Returns the plan of this launch (None where it went through the autotuner or has no plan)."""
        for name, rule in self._rules:
            args[name] = rule(args)
        call = None
        if getattr(self._jit, "device_caches", None) is not None and not launch_hooks():
            device = driver.active.get_current_device()
            call = (device, None if setting is None else tuple(setting.items()), tuple(args))
            call += tuple(map(_fingerprint, args.values()))
            plan = self._plans.get(call)
            if plan is not None:
                plan.launch(grid, args, driver.active.get_current_stream(device))
                return plan
        key = (*(args.get(n) for n in self._keys), *(a.dtype for a in args.values() if isinstance(a, torch.Tensor)))
        if setting is not None:
            site = (key, *setting.items())
            if site not in self._unfit:
                try:
                    return self._launch(call, grid, args, setting)
                except OutOfResources:
                    self._unfit.add(site)
        tuned = self._settings.get(key)
        if tuned is not None:
            return self._launch(call, grid, args, tuned)
        for name, _ in self._rules:  # the heuristics run again inside the wrapper chain
            del args[name]
        self._kernel[grid](**args)
        config = self._autotuner.best_config if self._autotuner is not None else None
        if config is None or config.pre_hook is None:
            self._settings[key] = {} if config is None else config.all_kwargs()
        return None

    def _launch(
        self, call: tuple[Any, ...] | None, grid: Grid, args: dict[str, Any], setting: dict[str, Any]
    ) -> Plan | None:
        """Launch through ``JITFunction.run`` with ``setting``; remember the compiled kernel as ``call``'s plan."""
        compiled = self._jit.run(grid=grid, warmup=False, **args, **setting)
        if call is None or compiled is None:
            return None
        binder = self._jit.device_caches[call[0]][-1]  # Triton's argument binder, as JITFunction.run calls it
        bound = binder(**args, **setting)[0]
        tensors = tuple((i, n) for i, (n, v) in enumerate(bound.items()) if isinstance(v, torch.Tensor))
        values = [None if isinstance(v, torch.Tensor) else v for v in bound.values()]
        meta = {n: v for n, v in {**bound, **setting}.items() if not isinstance(v, torch.Tensor)}
        if len(self._plans) >= PLANS_PER_KERNEL:
            self._plans.clear()
        plan = Plan(compiled.run, compiled.function, compiled.packed_metadata, values, tensors, meta)
        self._plans[call] = plan
        return plan
