"""The built-in vLLM backend: an OpenAI-compatible ``vllm serve`` in the runtime venv, under the launcher.

Server settings that matter on CPU: ``--distributed-executor-backend uni`` (the model runs inside vLLM's engine
process, no separate worker: one process fewer to start), ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache, small
here), ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (share the cores). Development endpoints are switched on
(``VLLM_SERVER_DEV_MODE=1`` for ``/collective_rpc``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` for LoRA loading).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
import secrets
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_support.core.codecs import ADAPTER_CONFIG
from model_support.core.serving.errors import RuntimeMissingError, ServerError, ServingError
from model_support.core.serving.options import ServeOptions
from model_support.core.serving.process import ManagedProcess, free_port
from model_support.core.serving.runtime import RuntimeInfo, load_runtime
from model_support.core.serving.update import WeightUpdater, parse_served_name, served_name
from model_support.core.serving.vllm_features import VllmFeatures

if TYPE_CHECKING:
    import numpy as np
    import torch

    from model_support.core.serving.client import ServerClient

EXT_DIR = Path(__file__).with_name("vllm_ext")
# A log line that states a cause: an exception's last line, argparse's refusal of the command line
# ("api_server.py: error: unrecognized arguments: ..."), or an OS error number ("[Errno 98] Address already in use").
_ROOT_CAUSE = (
    re.compile(r"\b((?:[A-Za-z_.]+Error|AssertionError|NotImplementedError)(?::\s.*)?)$"),
    re.compile(r"^(?:usage: .*\n)?(\S+: error: .+)$"),
    re.compile(r"(\[Errno \d+\].*)$"),
)
# How often, and how many times, a sleep or a wake-up is looked for before it counts as failed (120 s).
SLEEP_POLL_S, SLEEP_POLLS = 0.2, 600
SERVER_KEY_ENV = "MODEL_SUPPORT_SERVER_KEY"  # read by vllm_ext/ms_vllm_ext.py in the server
# vLLM's log prefixes: "(EngineCore pid=7) ERROR 11-27 10:00:00 [core.py:123] ", or "(EngineCore pid=7) " alone.
_LOG_PREFIX = re.compile(r"^(?:.*?\[[\w./-]+\.py:\d+\] |\(\w+ pid=\d+\) )")
_NOISE = ("EngineDeadError", "Engine core initialization failed", "APIServer", "Traceback")
# A traceback's frame line, and the marker lines under a frame's code ("    ^^^^~~~~").
_FRAME = re.compile(r'^File "(?P<path>[^"]+)", line (?P<line>\d+), in ')
_MARKERS = re.compile(r"^[\^~\s]+$")


def root_cause(log: str) -> str:
    """The last line of a vLLM log that states a cause (see ``_ROOT_CAUSE``), skipping the lines that only say
    something upstream failed; an exception without a message (a failed ``assert``) comes with the statement that
    raised it. "no error line in the server log" when there is none."""
    lines = [_LOG_PREFIX.sub("", line).strip() for line in log.splitlines()]
    for index in range(len(lines) - 1, -1, -1):
        text = lines[index]
        if any(n in text for n in _NOISE):
            continue
        for pattern in _ROOT_CAUSE:
            match = pattern.search(text)
            if match:
                cause = match.group(1)
                raised = _raising_statement(lines[:index]) if cause.endswith("Error") else None
                return f"{cause} at {raised}" if raised else cause
    return "no error line in the server log"


def _raising_statement(lines: list[str]) -> str | None:
    """``path:line: code`` of the innermost frame of the traceback that ``lines`` end with (``None``: they end
    with no frame), the path from its package on (``vllm/lora/ops/...``), wherever vLLM was installed."""
    code = [line for line in lines[-4:] if line and not _MARKERS.match(line)]
    if len(code) < 2 or not (frame := _FRAME.match(code[-2])):
        return None
    path = re.sub(r"^.*/(?:site|dist)-packages/|^.*?/(?=vllm/)", "", frame["path"])
    return f"{path}:{frame['line']}: {code[-1]}"


# Measured on the CPU build: routed experts' LoRA runs a Triton kernel, and the engine dies on its first request.
CPU_MOE_LORA_GAP = "fused-MoE LoRA needs Triton, which has no CPU backend"


class VllmServer:
    """A running ``vllm serve`` and a small client for the endpoints the stages use."""

    def __init__(
        self,
        process: ManagedProcess,
        port: int,
        served_name: str,
        model_dir: Path,
        options: ServeOptions,
        features: VllmFeatures,
        key: str,
        *,
        on_gpu: bool = False,
    ):
        self.process, self.port, self.served_name = process, port, served_name
        self.on_gpu = on_gpu  # the runtime is vLLM's GPU build (weights over NCCL, not gloo)
        self.model_dir, self.options, self.features = model_dir, options, features
        self._key = key
        self.base_url = f"http://127.0.0.1:{port}"
        self._updater: WeightUpdater | None = None
        self._adapters: dict[str, tuple[str, Path]] = {}  # adapter name -> (its served name @N, the server's copy)
        self._retired: dict[str, Path] = {}  # unloaded adapters' served names -> copies a request may still read
        self._client: ServerClient | None = None  # the /v1 client, made on first use (see `client`)
        self._ready = False
        self._background: threading.Thread | None = None
        self._background_error: Exception | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self) -> VllmServer:
        """Block until the server has answered a first request (:meth:`start_in_background`'s wait, if running)."""
        from model_support.core import progress

        if self._ready:
            return self
        # A start takes minutes: a progress step (spinner and elapsed time) names the log to follow meanwhile.
        with progress.step(f"starting vLLM (log: {self.process.log_path})"):
            if self._background is None:
                self._until_ready()
            else:
                self._background.join()
                if self._background_error is not None:
                    raise self._background_error
        self._ready = True
        return self

    def start_in_background(self) -> VllmServer:
        """Wait for the server (and send its first request) in a thread of this process, so that the caller goes on
        with other work; :meth:`wait_ready` then waits for that thread."""
        if self._background is None and not self._ready:
            self._background = threading.Thread(target=self._until_ready_in_background, daemon=True)
            self._background.start()
        return self

    def _until_ready_in_background(self) -> None:
        try:
            self._until_ready()
        except Exception as exc:  # raised in the thread that waits (wait_ready), where it is reported
            self._background_error = exc

    def _until_ready(self) -> None:
        deadline = time.monotonic() + self.options.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.process.alive():
                raise ServerError(f"vLLM exited while starting: {self.root_cause()} (log: {self.process.log_path})")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        else:
            self.stop()
            raise ServerError(f"vLLM did not become healthy in {self.options.startup_timeout_s:.0f} s")
        # The CPU build's first request that asks for prompt log-probabilities waits about 7 s (idle, once per
        # server): a request of two tokens takes that wait here, where a start in the background hides it.
        self.completion([1, 2], max_tokens=1, temperature=0.0, prompt_logprobs=0)
        if self.features.has("weight_version"):
            # Tokens carry the weight version that sampled them (generate): the step of the name served first.
            self.request("/update_weight_version", {"new_version": str(parse_served_name(self.served_name)[1])})

    def stop(self) -> None:
        self.process.stop()

    def root_cause(self) -> str:
        """The last error line vLLM logged (its own words), for skip/failure reasons."""
        return root_cause(self.process.log_tail(400))

    # ------------------------------------------------------------------ HTTP
    def request(self, path: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            headers={"Content-Type": "application/json", **self.headers},
            method="POST" if data else "GET",
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            cause = f"; server log: {self.root_cause()}" if exc.code >= 500 else ""
            raise ServerError(
                f"vLLM {path} answered {exc.code}: {detail}{cause} (log: {self.process.log_path})"
            ) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:  # no answer at all
            state = "has exited" if not self.process.alive() else "does not answer"
            reason = getattr(exc, "reason", exc)
            raise ServerError(
                f"vLLM {path}: the server {state} ({reason}); server log: {self.root_cause()} "
                f"(log: {self.process.log_path})"
            ) from None
        try:
            return json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError:  # some endpoints (LoRA loading) answer in plain text
            return raw.decode(errors="replace")

    @property
    def headers(self) -> dict[str, str]:
        """What a request to this server carries besides its body: the owner's key (the server answers 401
        without it)."""
        return {"Authorization": f"Bearer {self._key}"}

    @property
    def client(self) -> ServerClient:
        """The ``openai``-based client of the ``/v1`` endpoints (its ``achoices_many`` serves async trainers)."""
        if self._client is None:
            # Imported here: the ``openai`` package loads in half a second, which the CLI's other commands never need.
            from model_support.core.serving.client import ServerClient

            self._client = ServerClient(
                self.base_url,
                label="vLLM",
                root_cause=self.root_cause,
                log_path=self.process.log_path,
                api_key=self._key,
            )
        return self._client

    def completion(self, prompt: list[int], *, model: str | None = None, **params: Any) -> dict[str, Any]:
        """``/v1/completions`` for one token-id prompt; returns the first choice (``prompt_logprobs`` included)."""
        return self.client.completion(prompt, model=model or self.served_name, **params)

    def choices(self, prompt: list[int], *, model: str | None = None, **params: Any) -> list[dict[str, Any]]:
        """Every choice of one ``/v1/completions`` request (``n`` samples of one prompt), in index order."""
        return self.client.choices(prompt, model=model or self.served_name, **params)

    def choices_many(
        self, prompts: list[list[int]], *, model: str | None = None, **params: Any
    ) -> list[list[dict[str, Any]]]:
        """:meth:`choices` of every prompt, sent concurrently; the results in prompt order."""
        return self.client.choices_many(prompts, model=model or self.served_name, **params)

    def stream(self, prompt: list[int], *, model: str | None = None, **params: Any) -> Iterator[dict[str, Any]]:
        """A streamed ``/v1/completions`` request: each chunk's choice (new ``token_ids``, ``text``, ``logprobs``)."""
        return self.client.stream(prompt, model=model or self.served_name, **params)

    def chat(self, messages: list[dict[str, str]], *, model: str | None = None, **params: Any) -> dict[str, Any]:
        """``/v1/chat/completions``: the whole answer (``choices``, ``prompt_token_ids``)."""
        return self.client.chat(messages, model=model or self.served_name, **params)

    def models(self) -> list[str]:
        return self.client.models()

    def load_lora(self, name: str, path: Path) -> None:
        # vLLM resolves a relative path against its own working directory (a 404 for the caller's).
        body: dict[str, Any] = {"lora_name": name, "lora_path": str(Path(path).absolute())}
        # LoRA on stacked expert tensors (PEFT's target_parameters, gpt-oss's experts) is vLLM's "3D" MoE format,
        # which its 2-D MoE LoRA wrapper (--enable-mixed-moe-lora-format) converts when the request says so.
        if json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("target_parameters"):
            body["is_3d_lora_weight"] = True
        self.request("/v1/load_lora_adapter", body)

    def unload_lora(self, name: str) -> None:
        self.request("/v1/unload_lora_adapter", {"lora_name": name})

    def reload_weights(self, weights_dir: Path) -> None:
        """Load a complete checkpoint into the live model in place (the worker extension's reload, the steps of vLLM's
        own ``reload_weights``). The prefix cache still holds what the old weights computed: :meth:`update_weights`
        resets it (running requests too)."""
        body = {"method": "model_support_reload_weights", "kwargs": {"weights_dir": str(Path(weights_dir).absolute())}}
        self.request("/collective_rpc", body)

    def update_weights(self, buckets: Iterable[Mapping[str, torch.Tensor]]) -> str:
        """Apply one step of HF-named weights in place after the last bucket, pausing generation only for the swap;
        returns the new served name (see :mod:`model_support.core.serving.update`)."""
        if self._updater is None:
            model, _ = parse_served_name(self.served_name)
            staging = self.process.log_path.parent / f"{model}-weights"
            self._updater = WeightUpdater(
                self,
                staging,
                support_from=self.model_dir,
                transport=self.options.weight_transfer,
                workers=self.options.tensor_parallel_size,
                backend="nccl" if self.on_gpu else "gloo",
            )
        return self._updater.update(buckets)

    def update_adapter(self, adapter_dir: Path, name: str | None = None) -> str:
        """Hot-swap the LoRA adapter ``name`` (default ``<model>-lora``): load the PEFT adapter at ``adapter_dir`` as
        ``<name>@N+1`` (the base and every other adapter keep their names and weights), then unload ``<name>@N``;
        returns the new served name. Several adapters are served side by side (one per run or task); vLLM batches
        requests of up to ``ServeOptions.max_loras`` of them at once. The server loads its own copy of the adapter's
        files (``adapter_*``, in the server's temporary directory, removed once that adapter is unloaded and no
        request in flight uses it): ``adapter_dir`` is left as it was, and may be reused for the next step."""
        model, _ = parse_served_name(self.served_name)
        name = self.adapter_key(name)
        if not name or "@" in name or name == model:
            raise ServerError(f"adapter name {name!r}: give a name without '@', other than the base model's {model!r}")
        previous = self._adapters.get(name)
        step = 0 if previous is None else parse_served_name(previous[0])[1]
        served = served_name(name, step + 1)
        copy = self._adapter_copy(Path(adapter_dir), served)
        try:
            self.load_lora(served, copy)
        except BaseException:
            shutil.rmtree(copy, ignore_errors=True)
            raise
        self._adapters[name] = (served, copy)
        if previous is not None:
            self._retire(*previous)
        return served

    def _retire(self, served: str, copy: Path) -> None:
        """Unload an adapter, and remove the server's copy of every unloaded adapter no request is using any more.

        A request admitted on an adapter keeps it after the unload: vLLM loads it again from its path if its worker
        let it go (a hot-swap while the request waits, e.g. paused), and an engine that finds no files there dies
        (``LoRAAdapterNotFoundError``). So a copy stays while vLLM lists its adapter among the running or waiting
        requests' (``vllm:lora_requests_info``) or, without that list, while any request is in flight."""
        self.unload_lora(served)
        self._retired[served] = copy
        metrics = str(self.request("/metrics"))
        in_use = _lora_in_use(metrics)
        busy = any(_metric(metrics, f"vllm:num_requests_{state}") for state in ("running", "waiting"))
        for name, path in list(self._retired.items()):
            if not busy or (in_use is not None and name not in in_use):
                shutil.rmtree(path, ignore_errors=True)
                del self._retired[name]

    def _adapter_copy(self, adapter_dir: Path, name: str) -> Path:
        """The adapter's files (its config and weights: ``adapter_*``) copied where only this server reads them."""
        if not (adapter_dir / ADAPTER_CONFIG).is_file():
            raise ServerError(f"{adapter_dir} holds no {ADAPTER_CONFIG}: not a PEFT adapter directory")
        assert self.process.tmp_dir is not None  # a started process has its temporary directory
        copy = self.process.tmp_dir / "adapters" / name
        copy.mkdir(parents=True)
        for path in adapter_dir.iterdir():
            if path.name.startswith("adapter_") and path.is_file():
                shutil.copy2(path, copy / path.name)
        return copy

    def remove_adapter(self, name: str | None = None) -> None:
        """Unload the adapter ``name`` (default ``<model>-lora``) that :meth:`update_adapter` serves, and remove the
        server's copy once no request uses it (see :meth:`_retire`); nothing if there is none."""
        key = self.adapter_key(name)
        if key in self._adapters:
            self._retire(*self._adapters.pop(key))

    @property
    def adapter_name(self) -> str | None:
        """The served name of the default adapter :meth:`update_adapter` serves now (``None``: none yet)."""
        return self.adapters.get(self.adapter_key(None))

    def adapter_key(self, name: str | None) -> str:
        """The adapter ``name`` names: itself, or for ``None`` the default ``<model>-lora``."""
        return f"{parse_served_name(self.served_name)[0]}-lora" if name is None else name

    @property
    def adapters(self) -> dict[str, str]:
        """Every adapter :meth:`update_adapter` serves now: its name -> its served name (``name@N``)."""
        return {name: served for name, (served, _) in self._adapters.items()}

    def prefix_cache_hits(self) -> int | None:
        """The prompt tokens vLLM read from its prefix cache since it started (``vllm:prefix_cache_hits`` on
        ``/metrics``, summed over engines); None where the server reports no such counter."""
        return self._counter("vllm:prefix_cache_hits_total")

    def generated_tokens(self) -> int | None:
        """The tokens vLLM sampled since it started, every request together (``vllm:generation_tokens`` on
        ``/metrics``, summed over engines and served names); None where the server reports no such counter."""
        return self._counter("vllm:generation_tokens_total")

    def _counter(self, name: str) -> int | None:
        value = _metric(str(self.request("/metrics")), name)
        return None if value is None else int(value)

    def rename(self, name: str) -> None:
        """Serve the base model under ``name`` from now on (see ``vllm_ext/ms_vllm_ext.py``)."""
        self.request("/model_support/served_model_name", {"name": name})
        self.served_name = name

    def pause(self) -> None:
        """Stop scheduling: requests in flight stay where they are, their KV cache kept (vLLM's ``/pause`` with
        ``mode=keep``; ``clear_cache=false``, else it also drops the cache of the requests in flight)."""
        self.request("/pause?mode=keep&clear_cache=false", {})

    def resume(self) -> None:
        self.request("/resume", {})

    def sleep(self, level: int = 1) -> None:
        """Give the server's GPU memory back for a trainer on the same GPU (vLLM's sleep mode, ART's shared-GPU
        mode): level 1 moves the weights to host memory and drops the KV cache, level 2 drops both (push the
        weights again after :meth:`wake_up`). Requests in flight are aborted. Returns once vLLM reports it sleeps."""
        self._needs_sleep_mode()
        if level not in (1, 2):
            raise ValueError(f"sleep level is 1 (weights to host memory) or 2 (weights dropped), not {level!r}")
        self.request(f"/sleep?level={level}", {})
        self._until_sleeping(True)

    def wake_up(self) -> None:
        """Take the GPU memory back (weights and KV cache) after :meth:`sleep`; returns once vLLM reports it awake."""
        self._needs_sleep_mode()
        self.request("/wake_up", {})
        self._until_sleeping(False)

    def _needs_sleep_mode(self) -> None:
        if not self.options.enable_sleep_mode:
            raise ServingError(
                "this server was started without sleep mode; start it with ServeOptions(enable_sleep_mode=True)"
            )

    def is_sleeping(self) -> bool:
        return bool(self.request("/is_sleeping")["is_sleeping"])

    def _until_sleeping(self, state: bool) -> None:
        # vLLM 0.26's /sleep answers before its engine has gone to sleep: its state is read until it holds.
        for _ in range(SLEEP_POLLS):
            if self.is_sleeping() is state:
                return
            time.sleep(SLEEP_POLL_S)
        raise ServerError(
            f"vLLM did not {'go to sleep' if state else 'wake up'} in {SLEEP_POLLS * SLEEP_POLL_S:g} s "
            f"(log: {self.process.log_path})"
        )

    def generate(self, prompt: list[int], *, model: str | None = None, **sampling: Any) -> list[dict[str, Any]]:
        """Sample from token ids through vLLM's token-in-token-out route (``/inference/v1/generate``, vLLM's
        ``SamplingParams`` as keyword arguments); every choice, in index order, with the staleness of each token.

        Each choice holds vLLM's fields (``token_ids``, ``logprobs`` ...) and, as NeMo Gym's Megatron Inference
        backend reports them: ``policy_epochs`` (per sampled token, the step of the weights that sampled it),
        ``policy_epoch`` (``[start, step]`` pairs: from token ``start`` on, that step's weights sampled),
        ``kv_cache_epoch`` (``[start, step]`` pairs over the prompt and the tokens: which step's weights computed
        the KV cache the last token was sampled from; an update recomputes the cache of every request in flight,
        so one pair) and ``num_evictions`` (how often the request's KV cache was dropped and recomputed: once per
        update during its generation; vLLM's own preemptions under memory pressure are not counted).

        A request to a LoRA adapter (``model`` names one) is served by that adapter for its whole life: vLLM binds
        it when it admits the request, and a hot-swap loads the next step under the next name while the requests in
        flight finish on theirs (``tests/serving/test_inplace.py``). Its staleness fields are the adapter's step
        (``name@N``: N) for every token, with no eviction; vLLM's weight versions count the base's updates only.
        """
        bodies = self._bodies(prompt, model, sampling)
        return self._finished(model, [self.request("/inference/v1/generate", body) for body in bodies])

    def generate_many(
        self, prompts: list[list[int]], *, model: str | None = None, **sampling: Any
    ) -> list[list[dict[str, Any]]]:
        """:meth:`generate` of every prompt, the requests sent together (at most the client's ``concurrency`` in
        flight: vLLM batches them as one rollout); each prompt's choices, with their staleness fields, in prompt
        order. Runs an event loop of its own: from a coroutine, await :meth:`agenerate_many`."""
        from model_support.core.serving.client import in_own_loop

        return in_own_loop(lambda: self.agenerate_many(prompts, model=model, **sampling), "generate_many")

    async def agenerate_many(
        self, prompts: list[list[int]], *, model: str | None = None, **sampling: Any
    ) -> list[list[dict[str, Any]]]:
        """:meth:`generate_many` in the caller's event loop (an async trainer's rollouts)."""
        requests = [self._bodies(prompt, model, sampling) for prompt in prompts]
        flat = [body for bodies in requests for body in bodies]
        answers = iter(await self.client.apost_many(f"{self.base_url}/inference/v1/generate", flat))
        return [self._finished(model, [next(answers) for _ in bodies]) for bodies in requests]

    def _bodies(self, prompt: list[int], model: str | None, sampling: dict[str, Any]) -> list[dict[str, Any]]:
        """The generate route's request bodies for one prompt: one, or one per choice where the route answers
        n > 1 with the last engine step's choices only (before 0.32: a cumulative output kind), each seeded as vLLM
        seeds its n children (seed + index)."""
        body = {"token_ids": prompt, "model": model or self.served_name}
        n, seed = sampling.get("n", 1), sampling.get("seed")
        if n == 1 or self.features.has("generate_n"):
            return [{**body, "sampling_params": sampling}]
        return [
            {**body, "sampling_params": {**sampling, "n": 1} | ({} if seed is None else {"seed": seed + index})}
            for index in range(n)
        ]

    def _finished(self, model: str | None, answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One prompt's choices from its requests' answers, in index order, with their staleness fields."""
        if len(answers) == 1:
            choices = sorted((with_token_ids(c) for c in answers[0]["choices"]), key=lambda c: c["index"])
        else:  # one answer per choice (see _bodies)
            choices = [{**with_token_ids(a["choices"][0]), "index": i} for i, a in enumerate(answers)]
        if model is not None and model != self.served_name:
            return [adapter_staleness(c, parse_served_name(model)[1]) for c in choices]
        # A vLLM without per-token weight versions (before 0.32) gives none of the staleness fields, not empty ones.
        return [staleness(c) for c in choices] if self.features.has("token_weight_versions") else choices


def _metric(metrics: str, name: str) -> float | None:
    """A metric's values summed over its label sets (engines, served names), from Prometheus' text format (one
    "name{labels} value" line each: one metric needs no parser); None where it is absent."""
    lines = metrics.splitlines()
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((f"{name}{{", f"{name} "))]
    return sum(values) if values else None


_LORA_INFO = re.compile(r"^vllm:lora_requests_info\{(?P<labels>[^}]*)\} (?P<stamp>\S+)$", re.MULTILINE)


def _lora_in_use(metrics: str) -> set[str] | None:
    """The adapters of the running and waiting requests as vLLM last recorded them (``vllm:lora_requests_info``: one
    label set per combination seen, the latest stamped with the newest time); None where it reports none."""
    latest = max(_LORA_INFO.finditer(metrics), key=lambda m: float(m["stamp"]), default=None)
    if latest is None:
        return None
    labels = dict(re.findall(r'(\w+)="([^"]*)"', latest["labels"]))
    names = f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
    return {name for name in names.split(",") if name}


def with_token_ids(choice: dict[str, Any]) -> dict[str, Any]:
    """``choice`` with every log-prob entry carrying its ``token_id``, as vLLM 0.32's generate route gives it; before
    0.32 an entry names its token only as the string ``token_id:N``."""
    for entry in (choice.get("logprobs") or {}).get("content") or []:
        for item in (entry, *(entry.get("top_logprobs") or ())):
            token = item.get("token")
            if "token_id" not in item and isinstance(token, str) and token.startswith("token_id:"):
                item["token_id"] = int(token.removeprefix("token_id:"))
    return choice


def routed_experts_of(choice: dict[str, Any]) -> np.ndarray:
    """A completion's ``routed_experts`` (a server started with ``ServeOptions(return_routed_experts=True)``):
    vLLM sends them as a base64 ``.npy`` of ``[tokens - 1, layers, top-k]`` integer expert ids (prompt and completion
    tokens; the last sampled token was never run). Read without pickle; anything else is a one-line ValueError."""
    import numpy as np

    encoded = choice.get("routed_experts")
    if not encoded:
        raise ValueError(
            "the completion carries no routed experts: start the server with ServeOptions(return_routed_experts=True)"
        )
    try:
        array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    except (ValueError, OSError, binascii.Error) as exc:
        raise ValueError(f"the completion's routed_experts is no base64 .npy array: {exc}") from None
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(f"routed experts are [tokens, layers, top-k] integers, got {array.dtype} {list(array.shape)}")
    return array


def staleness(choice: dict[str, Any]) -> dict[str, Any]:
    """``choice`` with per-token policy steps, ``policy_epoch``, ``kv_cache_epoch`` and ``num_evictions`` derived
    from vLLM's weight-version spans (``[{"version", "start", "end"}]`` over the sampled tokens)."""
    spans = choice.get("weight_versions") or []
    per_token = [int(span["version"]) for span in spans for _ in range(span["start"], span["end"])]
    pairs = [[span["start"], int(span["version"])] for span in spans]
    return {
        **choice,
        "policy_epochs": per_token,
        "policy_epoch": pairs,
        "kv_cache_epoch": [[0, pairs[-1][1]]] if pairs else [],
        "num_evictions": max(len(pairs) - 1, 0),
    }


def adapter_staleness(choice: dict[str, Any], step: int) -> dict[str, Any]:
    """``choice``, sampled by a LoRA adapter of step ``step``, with the staleness fields :func:`staleness` gives:
    every token that step's, one KV-cache epoch, no eviction (a request keeps the adapter it was admitted with)."""
    tokens = len(choice.get("token_ids") or [])
    return {
        **choice,
        "policy_epochs": [step] * tokens,
        "policy_epoch": [[0, step]] if tokens else [],
        "kv_cache_epoch": [[0, step]] if tokens else [],
        "num_evictions": 0,
    }


def server_command(
    runtime: RuntimeInfo, features: VllmFeatures, model_dir: Path, served_name: str, port: int, options: ServeOptions
) -> list[str]:
    """The command that starts vLLM's OpenAI server on ``model_dir`` (the flags the runtime's vLLM has)."""
    args = [
        # `vllm serve` looks up the distribution "vllm", which vllm-cpu is not: start the server module.
        str(runtime.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--middleware",
        "ms_vllm_ext.middleware",
        "--max-logprobs",
        "20",
    ]
    if features.has("scale_out_flag"):  # vLLM's token-in-token-out route (generate: per-token weight versions)
        args.append("--enable-scale-out")
    if runtime.flavor == "gpu" and not runtime.flashinfer:
        # On Hopper vLLM takes FlashInfer's Gated DeltaNet prefill kernel unless told otherwise, and a model with GDN
        # layers then fails at its first forward where FlashInfer is not installed (it is optional to vLLM).
        args += ["--gdn-prefill-backend", "triton"]
    if options.tensor_parallel_size == 1:  # one process fewer to start (see VLLM_ENABLE_V1_MULTIPROCESSING)
        args += ["--distributed-executor-backend", "uni"]
    args += options.vllm_args()
    return args


def server_env(runtime: RuntimeInfo, options: ServeOptions, key: str) -> dict[str, str]:
    """The server's environment: this process's, with the project's vLLM extension and the runtime's path first,
    and the key every request must carry (``vllm_ext/ms_vllm_ext.py``)."""
    env = {
        **os.environ,
        SERVER_KEY_ENV: key,
        "HF_HUB_OFFLINE": "1",
        # The project's vLLM extension, then where the runtime's vLLM lives when it is on a path of its own.
        "PYTHONPATH": os.pathsep.join((str(EXT_DIR), *runtime.pythonpath)),
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(options.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        # vLLM's ZMQ IPC sockets, in the server's own temporary directory like its other temporary files (see
        # ManagedProcess), named relative to it (it is the server's working directory): a socket's path must fit
        # in 107 bytes, which the run directory's absolute path may not. A user's own setting wins (a run
        # directory on a file system that cannot hold sockets).
        "VLLM_RPC_BASE_PATH": os.environ.get("VLLM_RPC_BASE_PATH", "."),
    }
    if options.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = options.gpus
    if options.return_routed_experts and VllmFeatures(runtime.vllm_version).has("routed_experts_mrv2"):
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the runner that captures them there (vLLM's own instruction)
    if options.tensor_parallel_size == 1:
        # vLLM's CPU platform turns the "uni" executor into "mp" (a worker process more to start) unless this is
        # off; the API server runs its engine core in a process of its own either way.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


class VllmBackend:
    """vLLM from the managed runtime (``model-support runtime install``)."""

    name = "vllm"

    def runtime(self) -> RuntimeInfo:
        return load_runtime()

    def unavailable_reason(self) -> str | None:
        try:
            self.runtime()
        except RuntimeMissingError as exc:
            return str(exc)
        return None

    def version(self) -> str:
        return self.runtime().vllm_version

    def serve(
        self, model_dir: Path, served_name: str, options: ServeOptions, log_path: Path, *, wait: bool = True
    ) -> VllmServer:
        runtime = self.runtime()
        port = free_port()
        # vLLM runs in a working directory of its own: a relative path would name another file there.
        model_dir, log_path = Path(model_dir).absolute(), Path(log_path).absolute()
        options = options.for_checkpoint(model_dir)
        if options.enable_sleep_mode and runtime.flavor != "gpu":
            raise ServingError(
                f"sleep mode needs vLLM on a GPU; the runtime is the CPU build ({runtime.distribution} "
                f"{runtime.vllm_version}): start the server without ServeOptions(enable_sleep_mode=True)"
            )
        if options.enable_lora and options.moe and runtime.flavor != "gpu":
            raise ServingError(
                f"LoRA on an MoE model needs vLLM on a GPU: {CPU_MOE_LORA_GAP} (the runtime is the CPU build, "
                f"{runtime.distribution} {runtime.vllm_version}): start the server without "
                "ServeOptions(enable_lora=True) and push merged weights"
            )
        if options.return_routed_experts and not options.moe:
            raise ServingError(
                f"{model_dir.name} has no routed experts to return: start the server without "
                "ServeOptions(return_routed_experts=True)"
            )
        if options.return_routed_experts and runtime.flavor != "gpu":
            raise ServingError(
                f"routed experts need vLLM on a GPU: the CPU build ({runtime.distribution} {runtime.vllm_version}) "
                'refuses to capture them ("AuxOutput Connector requires Model Runner V2"): start the server '
                "without ServeOptions(return_routed_experts=True)"
            )
        features = VllmFeatures(runtime.vllm_version)
        args = server_command(runtime, features, model_dir, served_name, port, options)
        key = secrets.token_urlsafe(32)
        env = server_env(runtime, options, key)
        process = ManagedProcess(runtime.python, args, env=env, log_path=log_path).start()
        on_gpu = runtime.flavor == "gpu"
        server = VllmServer(process, port, served_name, model_dir, options, features, key, on_gpu=on_gpu)
        return server.wait_ready() if wait else server.start_in_background()
