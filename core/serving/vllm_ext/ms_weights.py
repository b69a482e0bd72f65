"""Loaded into vLLM's worker (``--worker-extension-cls ms_weights.WorkerExtension``); standard library + vLLM only.

Registers ``model_support_local``, a weight-transfer engine written to vLLM's interface
(``vllm.distributed.weight_transfer.base.WeightTransferEngine``; the server runs with
``--weight-transfer-config '{"backend": "model_support_local"}'``) and driven through vLLM's own routes:
``/start_weight_update``, ``/update_weights`` once per message, ``/finish_weight_update``.

One step is, in order:

1. ``{"params": [[name, dtype, shape], ...]}``: every tensor of the step announced (HF names, as the checkpoint
   stores them) before any data;
2. ``{"path": "<file>.safetensors", "is_last": bool}`` per bucket: the trainer wrote the bucket to a local file
   (``/dev/shm`` where there is one: memory, not disk); the worker reads it, deletes it and keeps its tensors after
   checking each against the announcement;
3. on ``is_last`` (every announced tensor received, nothing else) the whole step is loaded with vLLM's in-place
   reload (``reload_weights`` over the received tensors, as the file-system transport loads a checkpoint); before
   that nothing of the step reaches the model, so a failed step changes nothing;
4. ``{"abort": true}`` drops a step that will not be completed.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

BACKEND = "model_support_local"


@dataclass
class LocalInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the transport is the local file system."""


@dataclass
class LocalUpdateInfo(WeightTransferUpdateInfo):
    params: list[list[Any]] | None = None
    path: str | None = None
    is_last: bool = False
    abort: bool = False


@dataclass
class _Step:
    expected: dict[str, tuple[str, tuple[int, ...]]]
    received: dict[str, torch.Tensor] = field(default_factory=dict)


class LocalWeightTransferEngine(WeightTransferEngine[LocalInitInfo, LocalUpdateInfo]):
    init_info_cls = LocalInitInfo
    update_info_cls = LocalUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._step: _Step | None = None
        self.applied = 0

    def init_transfer_engine(self, init_info: LocalInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        self._step = None

    def finish_weight_update(self) -> None:
        if self._step is not None:
            missing = len(self._step.expected) - len(self._step.received)
            self._step = None
            raise ValueError(f"the weight update finished with {missing} announced tensor(s) never sent; dropped")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after each message; on the CPU build there is none to wait for.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: LocalUpdateInfo) -> None:
        if update_info.abort:
            self._step = None
            return
        if update_info.params is not None:
            self._step = _Step({str(n): (str(d), tuple(int(x) for x in s)) for n, d, s in update_info.params})
            return
        if self._step is None:
            raise ValueError("a weight bucket arrived before the step's tensors were announced")
        if update_info.path is None:
            raise ValueError("a weight bucket message needs 'path'")
        try:
            self._take(self._step, update_info.path)
            if update_info.is_last:
                self._apply(self._step)
        except BaseException:
            self._step = None
            raise

    @staticmethod
    def _take(step: _Step, path: str) -> None:
        from safetensors.torch import load_file

        try:
            tensors = load_file(path)
        finally:
            if os.path.exists(path):
                os.unlink(path)
        for name, tensor in tensors.items():
            if name not in step.expected:
                raise ValueError(f"tensor {name!r} was not announced for this step")
            if name in step.received:
                raise ValueError(f"tensor {name!r} arrived twice")
            dtype, shape = step.expected[name]
            got = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
            if got != (dtype, shape):
                raise ValueError(f"tensor {name!r} is {got[0]} {list(got[1])}, announced {dtype} {list(shape)}")
            step.received[name] = tensor

    def _apply(self, step: _Step) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        missing = sorted(set(step.expected) - set(step.received))
        if missing:
            raise ValueError(f"the last bucket came with {len(missing)} announced tensor(s) missing: {missing[:3]}")
        received, self._step = step.received, None
        reload_weights(self.vllm_config, self.model, iter(received.items()), None, True)
        self.applied += 1

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """vLLM 0.26 and 0.27 declare this abstract (later releases moved the trainer's side out of the engine): the
        project's trainer side is :mod:`model_support.core.serving.update`, which writes each bucket itself."""
        raise NotImplementedError("model_support_local is sent to by model_support.core.serving.update")

    def shutdown(self) -> None:
        self._step = None


with contextlib.suppress(ValueError):  # the module was imported before in this process
    WeightTransferEngineFactory.register_engine(BACKEND, LocalWeightTransferEngine)


class WorkerExtension:
    """Mixed into vLLM's worker: importing this module registers the engine in the worker's process before the
    worker creates it (after loading the model)."""

    def model_support_weight_updates(self) -> int:
        """How many steps the local engine has applied (for tests and logs)."""
        engine = getattr(self, "weight_transfer_engine", None)
        return engine.applied if isinstance(engine, LocalWeightTransferEngine) else 0
