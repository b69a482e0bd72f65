"""A client for a served model's OpenAI-compatible ``/v1`` endpoints: the ``openai`` package underneath.

The ``openai`` clients bring connection pooling, retries (connection errors, timeouts, 408/409/429 and 5xx
answers, with backoff), timeouts, streaming and an asyncio client; this module adds what the engines' servers
need on top of them:

- token-id prompts, and the engine's own request fields (vLLM's ``return_token_ids``, ``prompt_logprobs``,
  ``allowed_token_ids``, ``top_k``, ...), which the ``openai`` signatures do not name, sent through ``extra_body``;
- answers as the plain dicts the server sent (the engine's extra fields, e.g. ``token_ids``, ``prompt_logprobs``,
  ``prompt_token_ids``, included), which is what the stages and trainers read;
- every failure as one :class:`ServerError` line: what answered what, the server's words and, where it has a log,
  the log's last error line and path.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
from openai.resources import Completions
from openai.resources.chat import Completions as ChatCompletions

from model_support.core.serving.errors import ServerError

# The openai package's HTTP library logs every request at INFO, and the package each retry: a root logger at INFO
# (megatron-bridge's imports set one up) would print a line per request (the error, if it persists, is raised).
for _logger in ("httpx", "httpx2", "openai"):
    logging.getLogger(_logger).setLevel(logging.WARNING)

# The request fields the ``openai`` package knows, taken from its own signatures (they grow with its versions);
# the arguments each call sets itself are left out. Any other field goes to the server through ``extra_body``.
_OWN = {"self", "model", "prompt", "messages", "stream", "extra_headers", "extra_query", "extra_body", "timeout"}
_COMPLETION_FIELDS = frozenset(inspect.signature(Completions.create).parameters) - _OWN
_CHAT_FIELDS = frozenset(inspect.signature(ChatCompletions.create).parameters) - _OWN
_DETAIL_CHARS = 300


def _arguments(params: dict[str, Any], known: frozenset[str]) -> dict[str, Any]:
    """``openai`` keyword arguments for ``params``: fields it knows as arguments, the others in ``extra_body``
    (merged with a caller's own ``extra_body``), ``return_token_ids`` on unless the caller says otherwise."""
    arguments = {key: value for key, value in params.items() if key in known}
    extra = {key: value for key, value in params.items() if key not in known and key != "extra_body"}
    return {**arguments, "extra_body": {"return_token_ids": True, **extra, **(params.get("extra_body") or {})}}


def _by_index(choices: list[Any]) -> list[dict[str, Any]]:
    return sorted((c.to_dict() for c in choices), key=lambda c: c["index"])


def in_own_loop[T](make: Callable[[], Coroutine[Any, Any, T]], name: str) -> T:
    """The coroutine ``make()`` run to its end in an event loop of its own, for the sync twin ``name`` of an async
    call ``a<name>``; a caller inside a running loop is told to await that one instead (nothing is started)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop runs in this thread: the usual case
        return asyncio.run(make())
    raise RuntimeError(f"{name} called inside a running event loop: await a{name} instead")


class ServerClient:
    """Calls to one server's ``/v1`` endpoints, sync and async.

    ``base_url`` is the server's root (``/v1`` is appended). ``label`` names the server in errors ("vLLM");
    ``root_cause`` (the server log's last error line) and ``log_path`` go into the error of a 5xx answer or a
    server that cannot be reached. ``max_retries`` and ``timeout`` (seconds per try) are the ``openai`` clients'.
    ``api_key`` is the server's key (sent as ``Authorization: Bearer``; None: the server checks none).
    ``concurrency`` bounds the requests that :meth:`choices_many` has in flight at once.
    """

    def __init__(
        self,
        base_url: str,
        *,
        label: str = "server",
        root_cause: Callable[[], str] | None = None,
        log_path: Path | None = None,
        max_retries: int = 2,
        timeout: float = 600.0,
        concurrency: int = 32,
        api_key: str | None = None,
    ):
        self.base_url, self.label, self.api_key = base_url.rstrip("/"), label, api_key
        self.root_cause, self.log_path = root_cause, log_path
        self.max_retries, self.timeout, self.concurrency = max_retries, timeout, concurrency
        self._sync = openai.OpenAI(**self._settings())

    def _settings(self) -> dict[str, Any]:
        # A server that checks no key still needs one from the ``openai`` clients.
        return {
            "base_url": f"{self.base_url}/v1",
            "api_key": self.api_key or "EMPTY",
            "max_retries": self.max_retries,
            "timeout": self.timeout,
        }

    # ------------------------------------------------------------------ completions
    def completion(self, prompt_ids: list[int], *, model: str, **params: Any) -> dict[str, Any]:
        """``/v1/completions`` for one token-id prompt: the first choice (``token_ids``, ``logprobs``,
        ``prompt_logprobs`` as the server sent them)."""
        return self.choices(prompt_ids, model=model, **params)[0]

    def choices(self, prompt_ids: list[int], *, model: str, **params: Any) -> list[dict[str, Any]]:
        """Every choice of one ``/v1/completions`` request (``n`` samples of one prompt), in index order."""
        with self._errors():
            answer = self._sync.completions.create(
                model=model, prompt=prompt_ids, **_arguments(params, _COMPLETION_FIELDS)
            )
        return _by_index(answer.choices)

    def choices_many(self, prompts: list[list[int]], *, model: str, **params: Any) -> list[list[dict[str, Any]]]:
        """:meth:`choices` of every prompt, the requests sent concurrently; the results in prompt order. Runs an
        event loop of its own: from a coroutine, await :meth:`achoices_many` instead."""
        return in_own_loop(lambda: self.achoices_many(prompts, model=model, **params), "choices_many")

    async def achoices_many(self, prompts: list[list[int]], *, model: str, **params: Any) -> list[list[dict[str, Any]]]:
        """:meth:`choices_many` in the caller's event loop, at most ``concurrency`` requests in flight."""
        arguments = _arguments(params, _COMPLETION_FIELDS)

        async def one(client: openai.AsyncOpenAI, prompt_ids: list[int]) -> list[dict[str, Any]]:
            answer = await client.completions.create(model=model, prompt=prompt_ids, **arguments)
            return _by_index(answer.choices)

        return await self._concurrently(one, prompts)

    async def apost_many(self, url: str, bodies: list[dict[str, Any]]) -> list[Any]:
        """Each of ``bodies`` POSTed to ``url`` (the server's own routes beside ``/v1``, e.g. vLLM's
        ``/inference/v1/generate``) through the ``openai`` asyncio client (its retries, timeout and key), at most
        ``concurrency`` in flight; the JSON answers in order."""

        async def one(client: openai.AsyncOpenAI, body: dict[str, Any]) -> Any:
            return await client.post(url, cast_to=object, body=body)

        return await self._concurrently(one, bodies)

    async def _concurrently(self, call: Callable[[openai.AsyncOpenAI, Any], Any], items: list[Any]) -> list[Any]:
        """``call(client, item)`` for every item, at most ``concurrency`` at once; the results in order, each
        failure as a :class:`ServerError` (the other calls end before their client closes)."""
        gate = asyncio.Semaphore(self.concurrency)
        # An asyncio client belongs to the loop it runs in: one per batch, closed with it.
        async with openai.AsyncOpenAI(**self._settings()) as client:

            async def one(item: Any) -> Any:
                async with gate:
                    with self._errors():
                        return await call(client, item)

            tasks = [asyncio.ensure_future(one(item)) for item in items]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def stream(self, prompt_ids: list[int], *, model: str, **params: Any) -> Iterator[dict[str, Any]]:
        """A streamed ``/v1/completions`` request: each chunk's choice as the server sent it (its new ``text``,
        ``token_ids`` and ``logprobs``; ``finish_reason`` on the last), in order."""
        with self._errors():
            chunks = self._sync.completions.create(
                model=model, prompt=prompt_ids, stream=True, **_arguments(params, _COMPLETION_FIELDS)
            )
            with chunks:
                for chunk in chunks:
                    yield from (choice.to_dict() for choice in chunk.choices)

    # ------------------------------------------------------------------ other endpoints
    def chat(self, messages: list[dict[str, str]], *, model: str, **params: Any) -> dict[str, Any]:
        """``/v1/chat/completions``: the whole answer (``choices``, and vLLM's ``prompt_token_ids``)."""
        with self._errors():
            answer = self._sync.chat.completions.create(
                model=model,
                messages=messages,  # plain role/content dicts, as the endpoint takes them
                **_arguments(params, _CHAT_FIELDS),
            )
        return answer.to_dict()

    def models(self) -> list[str]:
        """The names ``/v1/models`` lists."""
        with self._errors():
            return [m.id for m in self._sync.models.list().data]

    # ------------------------------------------------------------------ errors
    @contextmanager
    def _errors(self) -> Iterator[None]:
        """The ``openai`` package's errors as one :class:`ServerError` line (after its retries)."""
        try:
            yield
        except openai.APIStatusError as exc:
            path = exc.request.url.path
            detail = " ".join(exc.response.text.split())[:_DETAIL_CHARS]
            cause = self._cause() if exc.status_code >= 500 else ""
            raise ServerError(f"{self.label} {path} answered {exc.status_code}: {detail}{cause}{self._log()}") from None
        except openai.APIConnectionError as exc:  # APITimeoutError included
            why = f"no answer in {self.timeout:g} s" if isinstance(exc, openai.APITimeoutError) else "unreachable"
            reason = " ".join(f"{exc.message} ({exc.__cause__})".split()) if exc.__cause__ else exc.message
            retries = "retry" if self.max_retries == 1 else "retries"
            raise ServerError(
                f"{self.label} {exc.request.url} {why} after {self.max_retries} {retries}: {reason}"
                f"{self._cause()}{self._log()}"
            ) from None
        except openai.APIError as exc:  # an error event inside a stream
            raise ServerError(f"{self.label} {exc.request.url.path} failed: {exc.message}{self._log()}") from None

    def _cause(self) -> str:
        return f"; server log: {self.root_cause()}" if self.root_cause is not None else ""

    def _log(self) -> str:
        return f" (log: {self.log_path})" if self.log_path is not None else ""
