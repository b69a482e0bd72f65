"""In-place weight updates of a live server, one step at a time: ``model@0`` -> ``model@1`` -> ...

A step's weights arrive as buckets (dicts of HF-named tensors, e.g. from
:func:`model_support.core.api.merged_weights` or :func:`export.buckets`) and must carry exactly the served
checkpoint's tensors, in its dtypes and shapes. Nothing reaches the model before the last bucket; then
generation is paused, the step is applied, the requests in flight are moved back to the waiting queue (their KV
cache is recomputed with the new weights when they resume: vLLM's ``reset_prefix_cache`` with running requests),
the weight version and the served name advance, and generation resumes. Requests in flight keep going; every
token they sample carries the version of the weights that sampled it (:meth:`VllmServer.generate`).

Four transports, chosen by ``ServeOptions.weight_transfer``:

- ``"stream"``: vLLM's weight-transfer routes (``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``) with the project's local engine (``vllm_ext/ms_weights.py``): every tensor's name,
  dtype and shape is announced first, then each bucket is written to a file in memory (``/dev/shm`` while it has
  room, else the staging directory) and handed over as soon as it is produced, at most two buckets in flight; the
  worker applies the step after the last (``is_last``), all or nothing. No checkpoint is written.
- ``"collective"``: the same routes and engine: the trainer opens a process group with
  the server's workers once (``/init_weight_transfer_engine``: the trainer is rank 0, each worker one rank after it),
  then announces every tensor as ``"stream"`` does and sends each bucket, its tensors packed into one byte buffer,
  as a broadcast from the trainer's device while ``/update_weights`` tells the workers what it holds: GPU to GPU over
  NCCL where the server runs on a GPU (the trainer's current device sends), over gloo on the CPU build. The worker
  holds the step on its device until the last bucket, then applies it all or nothing. A step that fails closes the
  group; the next step opens a new one.
- ``"ipc"``: the same routes and engine, for a server on the trainer's own GPU (ART's shared-GPU mode): each
  bucket's tensors are packed into one byte buffer on the trainer's GPU and the worker opens it through a CUDA IPC
  handle and copies it into its own memory before ``/update_weights`` returns; no byte leaves the GPU.
- ``"files"``: each bucket is written to the step's staging checkpoint, published atomically and loaded by the
  worker's ``reload_weights`` (``/collective_rpc``); the previous step's checkpoint is removed once the new one is
  loaded, so the disk holds one step at a time.
"""

from __future__ import annotations

import base64
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch

from model_support.core.checkpoint import stored_tensors
from model_support.core.outputs import hold, release, sweep
from model_support.core.serving.errors import ServingError
from model_support.core.serving.export import write_checkpoint
from model_support.core.serving.options import TRANSPORTS
from model_support.core.serving.process import free_port
from model_support.core.serving.vllm_features import VllmFeatures

# safetensors' dtype names (a checkpoint header's) as torch names them.
_TORCH_DTYPE = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}  # fmt: skip
IN_FLIGHT = 2  # buckets written and not yet taken by the server
# How long a collective step's broadcast or the group's opening may wait for the server's workers: past it the
# step fails (a server that died mid-step) instead of waiting forever.
COLLECTIVE_TIMEOUT_S = 300.0
# The key prefix of the weight group in the trainer's store (vllm_ext/ms_weights.py joins under the same one).
STORE_PREFIX = "model_support_weights"
SHM_MARGIN = 64 * 1024**2  # left free in /dev/shm for whoever else uses it


def served_name(model: str, step: int) -> str:
    return f"{model}@{step}"


def parse_served_name(name: str) -> tuple[str, int]:
    """``"qwen3@4"`` -> ``("qwen3", 4)``; a name without a step is step 0."""
    model, sep, step = name.rpartition("@")
    if sep and step.isdigit():
        return model, int(step)
    return name, 0


def memory_dir() -> Path | None:
    """A directory in memory (tmpfs) for streamed buckets, or ``None`` where there is none."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def bucket_root(nbytes: int, fallback: Path) -> Path:
    """Where a streamed bucket of ``nbytes`` is written: the memory directory while it has room for it (a container's
    /dev/shm is often 64 MiB), else ``fallback`` on disk (still one bucket file at a time, never a checkpoint)."""
    shm = memory_dir()
    if shm is not None and shutil.disk_usage(shm).free >= nbytes + SHM_MARGIN:
        return shm
    return fallback


class UpdatableServer(Protocol):
    """What :class:`WeightUpdater` uses of a live server (``vllm_backend.VllmServer``, which builds the updater: this
    module does not import it back)."""

    served_name: str
    features: VllmFeatures

    def request(self, path: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any: ...

    def reload_weights(self, weights_dir: Path) -> None: ...

    def rename(self, name: str) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


def pack(bucket: Mapping[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[list[Any]]]:
    """A bucket's tensors as one byte buffer on ``device``, and the header (name, dtype, shape of each, in order) the
    worker reads them back with (``ms_weights.unpack``)."""
    packed = torch.cat([t.detach().to(device).contiguous().view(-1).view(torch.uint8) for t in bucket.values()])
    return packed, [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in bucket.items()]


def ipc_handle(packed: torch.Tensor) -> dict[str, Any]:
    """The CUDA IPC handle of ``packed`` (a byte buffer on a GPU) as JSON: torch's own export
    (``reduce_tensor``), its fields named, byte strings in base64; no pickle crosses the HTTP route."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(packed)
    (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _, counter, counter_offset,
     event, event_sync) = args  # fmt: skip

    def text(raw: bytes | None) -> str | None:
        return None if raw is None else base64.b64encode(raw).decode()

    return {
        "gpu": str(torch.cuda.get_device_properties(device).uuid), "size": list(size), "stride": list(stride),
        "offset": offset, "handle": text(handle), "storage_bytes": storage_bytes, "storage_offset": storage_offset,
        "counter": text(counter), "counter_offset": counter_offset, "event": text(event), "event_sync": event_sync,
    }  # fmt: skip


def _broadcast_root() -> Any:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return options


class WeightGroup:
    """The trainer's end of the collective transport: rank 0 of a process group with the server's ``workers``
    (ranks 1 ..), over NCCL from this process's current GPU (``backend="nccl"``) or over gloo. Built on torch's
    process groups directly (not ``init_process_group``): a trainer's own default group is left alone."""

    def __init__(self, server: UpdatableServer, workers: int, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        if backend == "nccl" and not torch.cuda.is_available():
            raise ServingError(
                "the server runs on a GPU and the collective weight transfer sends from the trainer's GPU, but this "
                "process has none; push with weight_transfer='stream' instead"
            )
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.timeout = timedelta(seconds=timeout_s)
        port, world = free_port(), 1 + workers
        store = dist.PrefixStore(
            STORE_PREFIX, dist.TCPStore("127.0.0.1", port, world, True, timeout=self.timeout, wait_for_workers=False)
        )
        if backend == "nccl":  # opened lazily by its first broadcast, which the workers join in their first bucket
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.group: Any = dist.ProcessGroupNCCL(store, 0, world, options)
            server.request("/init_weight_transfer_engine", {"init_info": self._init_info(port, world, backend)})
            return
        # gloo meets its peers while it is built: the workers join it inside the request.
        opened: list[Any] = []

        def join() -> None:
            try:
                opened.append(dist.ProcessGroupGloo(store, 0, world, self.timeout))
            except RuntimeError as exc:  # reported in the caller's thread
                opened.append(exc)

        joining = threading.Thread(target=join, daemon=True)
        joining.start()
        server.request("/init_weight_transfer_engine", {"init_info": self._init_info(port, world, backend)})
        joining.join(timeout_s)
        if not opened:
            raise ServingError(f"the server's workers did not join the weight group in {timeout_s:g} s")
        if isinstance(opened[0], RuntimeError):
            raise ServingError(f"the weight group could not be opened: {opened[0]}") from opened[0]
        self.group = opened[0]

    def _init_info(self, port: int, world: int, backend: str) -> dict[str, Any]:
        timeout_s = self.timeout.total_seconds()
        return {"host": "127.0.0.1", "port": port, "world_size": world, "rank_offset": 1, "backend": backend,
                "timeout_s": timeout_s}  # fmt: skip

    def send(self, server: UpdatableServer, bucket: Mapping[str, torch.Tensor], last: bool) -> None:
        """One bucket: its tensors packed into one byte buffer on the group's device, broadcast while
        ``/update_weights`` tells the workers what it holds (both wait for each other: neither is sent alone)."""
        packed, header = pack(bucket, self.device)
        update = {"update_info": {"bucket": header, "nbytes": packed.numel(), "is_last": last}}
        failures: list[BaseException] = []
        sending = threading.Thread(target=self._broadcast, args=(packed, failures), daemon=True)
        sending.start()
        server.request("/update_weights", update)
        sending.join(self.timeout.total_seconds())
        if sending.is_alive():
            raise ServingError(f"the bucket's broadcast did not end in {self.timeout.total_seconds():g} s")
        if failures:
            raise ServingError(f"the bucket's broadcast failed: {failures[0]}") from failures[0]

    def _broadcast(self, packed: torch.Tensor, failures: list[BaseException]) -> None:
        try:
            self.group.broadcast([packed], _broadcast_root()).wait()
            if packed.is_cuda:
                torch.cuda.synchronize(packed.device)
        except BaseException as exc:  # reported in the caller's thread
            failures.append(exc)


class WeightUpdater:
    """Applies whole steps of weights to ``server``; ``staging_root`` holds what a step writes. ``transport``: one
    of :data:`TRANSPORTS` (the module's docstring); ``workers`` and ``backend`` (``"nccl"`` or ``"gloo"``) say how
    many processes the server's model runs in and how the collective transport reaches them."""

    def __init__(
        self,
        server: UpdatableServer,
        staging_root: Path,
        support_from: Path,
        *,
        transport: str = "stream",
        workers: int = 1,
        backend: str = "gloo",
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        self.server, self.transport, self.workers, self.backend = server, transport, workers, backend
        self.staging_root, self.support_from = Path(staging_root), Path(support_from)
        self._loaded: Path | None = None
        self._expected: dict[str, tuple[str, tuple[int, ...]]] | None = None
        self._group: WeightGroup | None = None
        self.peak_buckets_in_flight = 0

    def update(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> str:
        """Apply one step; returns the new served name. A failure before the last bucket is applied leaves the
        server as it was (same weights, same name) and nothing on disk."""
        self.model, self.step = parse_served_name(self.server.served_name)
        if self.transport == "stream":
            self._stream(buckets)
        elif self.transport == "collective":
            self._collective(buckets)
        elif self.transport == "ipc":
            self._ipc(buckets)
        else:
            self._files(buckets)
        return self.server.served_name

    # ------------------------------------------------------------------ the swap
    def _swap(self, apply: Callable[[], None], finish: Callable[[str], None]) -> None:
        """Pause generation, apply the step, recompute the KV cache of the requests in flight, advance the weight
        version and the served name, resume."""
        version = self.step + 1
        self.server.pause()
        try:
            apply()
            finish(str(version))
            self.server.request("/reset_prefix_cache?reset_running_requests=true", {})
            self.step = version
            self.server.rename(served_name(self.model, version))
        finally:
            self.server.resume()

    def _set_version(self, version: str) -> None:
        """The server's weight version after a staged reload (vLLM 0.27 on; an older one keeps none)."""
        if self.server.features.has("weight_version"):
            self.server.request("/update_weight_version", {"new_version": version})

    def _version_body(self, version: str) -> dict[str, str]:
        """``/finish_weight_update``'s body: the new weight version where vLLM keeps one (0.27 on), else empty."""
        return {"weight_version": version} if self.server.features.has("weight_version") else {}

    # ------------------------------------------------------------------ files
    def _files(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        step_dir = self.staging_root / f"step-{self.step + 1}"
        weights_dir = write_checkpoint(
            self._checked(buckets), step_dir, support_from=self.support_from, check=self._check_complete
        )
        try:
            self._swap(
                lambda: self.server.reload_weights(weights_dir),
                self._set_version,
            )
        except BaseException:
            shutil.rmtree(step_dir, ignore_errors=True)
            raise
        if self._loaded is not None:
            shutil.rmtree(self._loaded.parent, ignore_errors=True)
        self._loaded = weights_dir

    def expected(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Name -> (torch dtype name, shape) of every tensor the served checkpoint stores."""
        if self._expected is None:
            stored = stored_tensors(self.support_from)
            self._expected = {name: (_TORCH_DTYPE.get(dt, dt), shape) for name, (_, shape, dt) in stored.items()}
        return self._expected

    def _check_complete(self, pushed: Mapping[str, str]) -> None:
        """A step must carry exactly the served checkpoint's tensors: vLLM would keep whatever a partial update
        leaves out in an undefined state (a tensor left out of a reload serves NaN on the CPU build)."""
        expected = self.expected()
        missing, extra = sorted(set(expected) - set(pushed)), sorted(set(pushed) - set(expected))
        if missing or extra:
            raise self._mismatch(f"{len(missing)} tensor(s) missing {missing[:3]}, {len(extra)} unknown {extra[:3]}")

    def _mismatch(self, what: str) -> ServingError:
        return ServingError(
            f"the update to {served_name(self.model, self.step + 1)} does not match the served checkpoint: {what}; "
            "nothing was applied"
        )

    # ------------------------------------------------------------------ stream
    def _check_bucket(self, bucket: Mapping[str, torch.Tensor], sent: set[str]) -> None:
        expected = self.expected()
        for name, tensor in bucket.items():
            if name not in expected:
                raise self._mismatch(f"unknown tensor {name!r}")
            if name in sent:
                raise self._mismatch(f"tensor {name!r} sent twice")
            dtype, shape = expected[name]
            got = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
            if got != (dtype, shape):
                raise self._mismatch(f"{name} is {got[0]} {list(got[1])}, the checkpoint's {dtype} {list(shape)}")
            # A NaN or infinite weight serves garbage (every sample token 0) and no later request says why.
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise self._mismatch(f"{name} holds {bad} non-finite value(s)")

    def _announce(self) -> None:
        """Tell the worker every tensor of the step (name, dtype, shape) before any of them is sent."""
        params = [[name, dtype, list(shape)] for name, (dtype, shape) in self.expected().items()]
        self.server.request("/update_weights", {"update_info": {"params": params}})

    def _announced(
        self, buckets: Iterable[Mapping[str, torch.Tensor]]
    ) -> Iterator[tuple[Mapping[str, torch.Tensor], bool]]:
        """Each non-empty bucket of a streamed step, checked (:meth:`_check_bucket`), with whether it completes the
        step; a bucket after the step's last tensor, or a step that ends short of it, is refused."""
        expected, sent = self.expected(), set[str]()
        for bucket in buckets:
            if not bucket:
                continue
            if len(sent) == len(expected):
                raise self._mismatch(f"{len(bucket)} tensor(s) after every tensor of the step was sent")
            self._check_bucket(bucket, sent)
            sent |= set(bucket)
            yield bucket, len(sent) == len(expected)
        if len(sent) != len(expected):
            missing = sorted(set(expected) - sent)
            raise self._mismatch(f"{len(missing)} tensor(s) missing {missing[:3]}")

    def _checked(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> Iterator[Mapping[str, torch.Tensor]]:
        """``buckets``, each checked as the stream's are (names, duplicates, dtypes, shapes, finite values) before
        it goes on: the staged transport refuses what the stream refuses."""
        sent: set[str] = set()
        for bucket in buckets:
            self._check_bucket(bucket, sent)
            sent.update(bucket)
            yield bucket

    def _stream(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        self.expected()  # the served checkpoint's tensors, read before the step starts
        workdirs: dict[Path, tuple[Path, int]] = {}  # bucket root -> this push's directory there and its lock
        for root in {memory_dir(), self.staging_root} - {None}:
            if root is not None and root.is_dir():
                sweep(root, "push-*")  # the buckets of a trainer killed mid-push (up to a bucket of RAM each)

        def bucket_path(index: int, nbytes: int) -> Path:
            root = bucket_root(nbytes, self.staging_root)
            if root not in workdirs:
                root.mkdir(parents=True, exist_ok=True)
                workdir = Path(tempfile.mkdtemp(prefix="push-", dir=root))
                workdirs[root] = (workdir, hold(workdir))
            return workdirs[root][0] / f"bucket-{index}.safetensors"

        slots = threading.Semaphore(IN_FLIGHT)
        handoff: queue.Queue[tuple[Path, bool] | None] = queue.Queue()
        failures: list[BaseException] = []
        applied = threading.Event()
        in_flight = [0]
        lock = threading.Lock()

        def post(path: Path, last: bool) -> None:
            update = {"update_info": {"path": str(Path(path).absolute()), "is_last": last}}
            if not last:
                self.server.request("/update_weights", update)
                return
            self._swap(
                lambda: self.server.request("/update_weights", update),
                lambda version: self.server.request("/finish_weight_update", self._version_body(version)),
            )
            applied.set()

        def sender() -> None:  # hands buckets to the server while the trainer produces the next ones
            while (item := handoff.get()) is not None:
                path, last = item
                try:
                    if not failures:
                        post(path, last)
                except BaseException as exc:  # reported in the trainer's thread
                    failures.append(exc)
                finally:
                    path.unlink(missing_ok=True)
                    with lock:
                        in_flight[0] -= 1
                    slots.release()

        self.server.request("/start_weight_update", {})
        thread = threading.Thread(target=sender, daemon=True)
        try:
            self._announce()
            thread.start()
            for index, (bucket, last) in enumerate(self._announced(buckets)):
                slots.acquire()
                if failures:
                    slots.release()
                    break
                path = bucket_path(index, sum(t.numel() * t.element_size() for t in bucket.values()))
                save_file({name: tensor.detach().cpu().contiguous() for name, tensor in bucket.items()}, str(path))
                with lock:
                    in_flight[0] += 1
                    self.peak_buckets_in_flight = max(self.peak_buckets_in_flight, in_flight[0])
                handoff.put((path, last))
        finally:
            handoff.put(None)
            if thread.is_alive():
                thread.join()
            for workdir, fd in workdirs.values():
                shutil.rmtree(workdir, ignore_errors=True)
                release(workdir, fd)
            if not applied.is_set():
                self._abort()
        if failures:
            raise failures[0]

    # ------------------------------------------------------------------ collective
    def _collective(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        self.expected()  # the served checkpoint's tensors, read before the step starts
        if self._group is None:
            self._group = WeightGroup(self.server, self.workers, self.backend, COLLECTIVE_TIMEOUT_S)
        group = self._group
        try:
            self._send_step(buckets, lambda bucket, last: group.send(self.server, bucket, last))
        except BaseException:
            self._group = None  # a broadcast may have been left half-way: the next step opens a new group
            raise

    def _send_step(
        self, buckets: Iterable[Mapping[str, torch.Tensor]], send: Callable[[Mapping[str, torch.Tensor], bool], None]
    ) -> None:
        """Announce the step, hand each bucket to ``send`` (the last inside the swap); a step that does not reach its
        swap is aborted on the server."""
        applied = False
        self.server.request("/start_weight_update", {})
        try:
            self._announce()
            for bucket, last in self._announced(buckets):
                if not last:
                    send(bucket, False)
                    continue
                self._swap(
                    lambda bucket=bucket: send(bucket, True),
                    lambda version: self.server.request("/finish_weight_update", self._version_body(version)),
                )
                applied = True
        finally:
            if not applied:
                self._abort()

    # ------------------------------------------------------------------ ipc
    def _ipc(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> None:
        if self.backend != "nccl" or not torch.cuda.is_available():
            raise ServingError(
                "weight_transfer='ipc' hands buckets over through CUDA IPC: it needs the server and this process on "
                "one GPU; push with 'stream' (or 'collective' from another device)"
            )
        if self.workers != 1:
            raise ServingError(
                f"weight_transfer='ipc' serves a one-GPU server on the trainer's GPU, this one runs on {self.workers}; "
                "push with 'collective'"
            )
        self.expected()  # the served checkpoint's tensors, read before the step starts
        device = torch.device("cuda", torch.cuda.current_device())

        def send(bucket: Mapping[str, torch.Tensor], last: bool) -> None:
            packed, header = pack(bucket, device)
            torch.cuda.synchronize(device)  # the worker reads the buffer on its own stream
            update = {"bucket": header, "nbytes": packed.numel(), "ipc": ipc_handle(packed), "is_last": last}
            self.server.request("/update_weights", {"update_info": update})  # returns once the worker holds a copy

        try:
            self._send_step(buckets, send)
        finally:
            torch.cuda.ipc_collect()  # frees the buffers the worker has released

    def _abort(self) -> None:
        """End a step that will not be applied (the worker drops what it received); a worker that already failed the
        step has ended it itself, so errors here are not reported."""
        for path, body in (("/update_weights", {"update_info": {"abort": True}}), ("/finish_weight_update", {})):
            try:
                self.server.request(path, body)
            except ServingError:
                return
