"""fla's Triton kernels launched straight through their JIT functions once tuned.

Each of fla 0.6's kernels is ``triton.heuristics`` over fla's ``CachedAutotuner`` over a JIT function, and
each of its host functions runs under fla's backend dispatch (a ``torch.compiler.disable`` frame and a
backend check per call) and input guard. That Python costs the host more per launch than a shared-prefix
step's small kernels take on the GPU (``python -m benchmarks.gdn_host_profile``). :class:`TunedKernel` runs
the autotuner once per tuning key, as fla does, then launches the JIT function with the chosen setting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.driver import driver
from triton.runtime.errors import OutOfResources

Grid = tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]


class TunedKernel:
    """One of fla's kernels (or ours): the first launch for a tuning key goes through fla's autotuner (which
    tunes, or reads Triton's cache), later ones straight to the kernel Triton compiled for that key's setting.

    The tuning key is the autotuner's own: its ``key`` arguments and the dtype of every tensor argument. A
    compiled kernel is reused only while Triton's own binder specialises the arguments as it did when the
    kernel was compiled (pointer alignment, integer divisibility); otherwise ``JITFunction.run`` picks or
    compiles the right one. Under Triton's CPU interpreter every launch goes through ``run``.
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
        self._compiled: dict[tuple[Any, ...], tuple[list[Any], Any]] = {}

    def __call__(self, grid: Grid, setting: dict[str, Any] | None = None, **args: Any) -> None:
        """Launch over ``grid``. ``setting`` (launch parameters and block sizes the autotuner would choose,
        e.g. ``{"BV": 16, "num_warps": 4, "num_stages": 3}``) overrides the tuned one; where it needs more
        shared memory than the GPU has, Triton refuses it before it runs and the tuned setting is used."""
        for name, rule in self._rules:
            args[name] = rule(args)
        key = (*(args.get(n) for n in self._keys), *(a.dtype for a in args.values() if isinstance(a, torch.Tensor)))
        if setting is not None:
            site = (key, *setting.items())
            if site not in self._unfit:
                try:
                    self._launch(site, grid, args, setting)
                    return
                except OutOfResources:
                    self._unfit.add(site)
        tuned = self._settings.get(key)
        if tuned is not None:
            self._launch(key, grid, args, tuned)
            return
        for name, _ in self._rules:  # the heuristics run again inside the wrapper chain
            del args[name]
        self._kernel[grid](**args)
        config = self._autotuner.best_config if self._autotuner is not None else None
        if config is None or config.pre_hook is None:
            self._settings[key] = {} if config is None else config.all_kwargs()

    def _launch(self, site: tuple[Any, ...], grid: Grid, args: dict[str, Any], setting: dict[str, Any]) -> None:
        caches = getattr(self._jit, "device_caches", None)  # None under the CPU interpreter
        if caches is None:
            self._jit.run(grid=grid, warmup=False, **args, **setting)
            return
        device = driver.active.get_current_device()
        binder = caches[device][-1]  # Triton's argument binder, as JITFunction.run calls it
        site = (device, *site)  # a compiled kernel belongs to one device, as in Triton's own cache
        bound, specialization, _ = binder(**args, **setting)
        known = self._compiled.get(site)
        if known is not None and specialization == known[0]:
            if callable(grid):
                grid = grid(bound)
            known[1][(*grid, 1, 1)[:3]](*bound.values())
            return
        compiled = self._jit.run(grid=grid, warmup=False, **args, **setting)
        if compiled is not None:
            self._compiled[site] = (specialization, compiled)
