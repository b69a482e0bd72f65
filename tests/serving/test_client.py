"""The ``openai``-based client behind ``Server``: the same answers as raw HTTP, batches, streams, one-line errors."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from model_support.core.serving.backend import Server
from model_support.core.serving.client import ServerClient
from model_support.core.serving.errors import ServerError
from model_support.core.serving.vllm_backend import free_port
from model_support.core.serving.vllm_features import VllmFeatures

PROMPTS = [[17, 101, 44, 250, 9, 311], [66, 140, 23], [77, 5, 300, 12, 8]]
GREEDY: dict[str, Any] = {"max_tokens": 4, "temperature": 0.0, "logprobs": 2}
TOL = 1e-6


@pytest.fixture
def server(qwen3_server: Server) -> Server:
    return qwen3_server


def _raw_completion(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """The first choice of a ``/v1/completions`` request sent with urllib, without the client."""
    request = urllib.request.Request(
        f"{server.base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **server.headers},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]


def _assert_close(ours: list[float], theirs: list[float]) -> None:
    assert len(ours) == len(theirs)
    assert max((abs(a - b) for a, b in zip(ours, theirs, strict=True)), default=0.0) < TOL


def _prompt_logprobs(choice: dict[str, Any], prompt: list[int]) -> list[float]:
    return [row[str(t)]["logprob"] for row, t in zip(choice["prompt_logprobs"][1:], prompt[1:], strict=True)]


@pytest.mark.slow
def test_completion_answers_what_raw_http_answers(server):
    """Known fields go as openai arguments, vLLM's own (prompt_logprobs, top_k) through extra_body; the answer keeps
    vLLM's extra fields (token_ids, prompt_logprobs, prompt_token_ids)."""
    prompt = PROMPTS[0]
    params = {**GREEDY, "prompt_logprobs": 1, "top_k": 5}
    ours = server.completion(prompt, **params)
    raw = _raw_completion(server, {"model": server.served_name, "prompt": prompt, "return_token_ids": True, **params})
    assert len(ours["token_ids"]) == 4 and ours["token_ids"] == raw["token_ids"]
    assert ours["prompt_token_ids"] == prompt
    _assert_close(ours["logprobs"]["token_logprobs"], raw["logprobs"]["token_logprobs"])
    assert [sorted(row) for row in ours["logprobs"]["top_logprobs"]] == [
        sorted(row) for row in raw["logprobs"]["top_logprobs"]
    ]
    assert len(ours["prompt_logprobs"]) == len(prompt) and ours["prompt_logprobs"][0] is None
    _assert_close(_prompt_logprobs(ours, prompt), _prompt_logprobs(raw, prompt))


@pytest.mark.slow
def test_choices_many_equals_sequential_choices(server):
    """The batch (sync, and the async variant in the caller's loop) answers what one request at a time does."""
    sequential = [server.choices(p, **GREEDY) for p in PROMPTS]
    in_loop = asyncio.run(server.client.achoices_many(PROMPTS, model=server.served_name, **GREEDY))
    for batch in (server.choices_many(PROMPTS, **GREEDY), in_loop):
        assert len(batch) == len(PROMPTS)
        for prompt, got, expected in zip(PROMPTS, batch, sequential, strict=True):
            assert [c["prompt_token_ids"] for c in got] == [prompt]  # in prompt order
            assert [c["token_ids"] for c in got] == [c["token_ids"] for c in expected]
            _assert_close(got[0]["logprobs"]["token_logprobs"], expected[0]["logprobs"]["token_logprobs"])


@pytest.mark.slow
def test_n_choices_come_in_index_order(server):
    group = server.choices(PROMPTS[1], n=3, max_tokens=2, temperature=1.0, seed=7)
    assert [c["index"] for c in group] == [0, 1, 2] and all(len(c["token_ids"]) == 2 for c in group)


@pytest.mark.slow
def test_generate_gives_all_n_choices_on_a_vllm_that_answers_with_some(server, monkeypatch: pytest.MonkeyPatch):
    """vLLM 0.26's generate route answers n > 1 with the choices of the last engine step only; there the server asks
    one choice at a time, seeded as vLLM seeds its n children, and gets what this vLLM gives for n at once."""
    sampling = {"n": 4, "max_tokens": 3, "temperature": 1.0, "seed": 11, "logprobs": 0}
    whole = server.generate(PROMPTS[0], **sampling)
    monkeypatch.setattr(server, "features", VllmFeatures("0.26.0"))
    asked, request = [], server.request

    def counted(path: str, body: dict[str, Any]) -> Any:
        asked.append(body["sampling_params"])
        return request(path, body)

    monkeypatch.setattr(server, "request", counted)
    one_by_one = server.generate(PROMPTS[0], **sampling)
    assert [(a["n"], a["seed"]) for a in asked] == [(1, 11), (1, 12), (1, 13), (1, 14)]
    assert [c["index"] for c in one_by_one] == [0, 1, 2, 3]
    assert len({tuple(c["token_ids"]) for c in whole}) > 1  # the seeds differ by choice
    assert [c["token_ids"] for c in one_by_one] == [c["token_ids"] for c in whole]
    _assert_close(
        [e["logprob"] for c in one_by_one for e in c["logprobs"]["content"]],
        [e["logprob"] for c in whole for e in c["logprobs"]["content"]],
    )


@pytest.mark.slow
def test_generate_many_equals_generate_of_each_prompt(server, monkeypatch: pytest.MonkeyPatch):
    """A rollout's prompts in flight together (sync, and the async variant in the caller's loop) give what
    ``generate`` gives one prompt at a time: the same choices in prompt and index order, with the staleness fields;
    a vLLM that answers n > 1 with some choices is asked one choice at a time here too."""
    sampling = {"n": 3, "max_tokens": 4, "temperature": 1.0, "seed": 5, "logprobs": 0}
    sequential = [server.generate(p, **sampling) for p in PROMPTS]
    in_loop = asyncio.run(server.agenerate_many(PROMPTS, **sampling))
    for batch in (server.generate_many(PROMPTS, **sampling), in_loop):
        assert len(batch) == len(PROMPTS)
        for got, expected in zip(batch, sequential, strict=True):
            assert [c["index"] for c in got] == [0, 1, 2]
            assert [c["token_ids"] for c in got] == [c["token_ids"] for c in expected]
            assert [c["policy_epoch"] for c in got] == [c["policy_epoch"] for c in expected]
            _assert_close(
                [e["logprob"] for c in got for e in c["logprobs"]["content"]],
                [e["logprob"] for c in expected for e in c["logprobs"]["content"]],
            )
    monkeypatch.setattr(server, "features", VllmFeatures("0.26.0"))
    fanned = server.generate_many(PROMPTS, **sampling)
    assert [[c["token_ids"] for c in group] for group in fanned] == [
        [c["token_ids"] for c in group] for group in sequential
    ]


@pytest.mark.slow
def test_an_adapter_path_relative_to_the_callers_directory_loads(server, tiny_model_dir, tmp_path, monkeypatch):
    """vLLM runs in a directory of its own: a relative adapter path is the caller's, sent made absolute."""
    from model_support.handlers import BUILTIN_HANDLERS
    from tests.serving.adapters import random_adapter

    targets = next(h for h in BUILTIN_HANDLERS if h.name == "qwen3").hf_target_modules
    random_adapter(tiny_model_dir("qwen3"), targets, tmp_path / "adapter", seed=3)
    monkeypatch.chdir(tmp_path)
    server.load_lora("relative-adapter", Path("adapter"))
    try:
        assert len(server.completion(PROMPTS[0], model="relative-adapter", max_tokens=2)["token_ids"]) == 2
    finally:
        server.unload_lora("relative-adapter")


@pytest.mark.slow
def test_stream_concatenates_to_the_completion(server):
    whole = server.completion(PROMPTS[2], **GREEDY)
    chunks = list(server.stream(PROMPTS[2], **GREEDY))
    assert len(chunks) >= 2  # streamed, not one answer
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    _assert_close([lp for c in chunks for lp in c["logprobs"]["token_logprobs"]], whole["logprobs"]["token_logprobs"])
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [c["finish_reason"] for c in chunks][-1] == "length" and chunks[0]["finish_reason"] is None


@pytest.mark.slow
def test_chat_and_models(server):
    answer = server.chat([{"role": "user", "content": "hi"}], max_tokens=3, temperature=0.0, logprobs=True)
    choice = answer["choices"][0]
    assert answer["prompt_token_ids"] and len(choice["token_ids"]) == 3
    assert len(choice["logprobs"]["content"]) == 3
    assert server.models() == [server.served_name]


@pytest.mark.slow
def test_unknown_model_is_a_one_line_404(server):
    with pytest.raises(
        ServerError, match=r"^vLLM /v1/completions answered 404: .*qwen3@missing.*does not exist"
    ) as info:
        server.completion(PROMPTS[0], model="qwen3@missing", max_tokens=1)
    assert "\n" not in str(info.value) and str(server.process.log_path) in str(info.value)
    with pytest.raises(ServerError, match=r"404.*qwen3@missing"):
        list(server.stream(PROMPTS[0], model="qwen3@missing", max_tokens=1))
    with pytest.raises(ServerError, match=r"404.*qwen3@missing"):
        server.choices_many(PROMPTS, model="qwen3@missing", max_tokens=1)


def test_an_unreachable_server_is_a_one_line_error_after_bounded_retries():
    url = f"http://127.0.0.1:{free_port()}"
    client = ServerClient(url, label="vLLM", max_retries=1, timeout=2.0)
    start = time.monotonic()
    with pytest.raises(ServerError, match=rf"^vLLM {url}/v1/completions unreachable after 1 retry: ") as info:
        client.completion([1, 2], model="m", max_tokens=1)
    assert time.monotonic() - start < 10 and "\n" not in str(info.value)
    with pytest.raises(ServerError, match=rf"^vLLM {url}/v1/models unreachable"):
        client.models()


def test_a_5xx_answer_is_retried_then_names_the_server_logs_root_cause(tmp_path: Path):
    """A server that answers 500 is asked 1 + max_retries times; the error carries its words, the root cause the
    server's log gives and the log's path."""
    asked: list[str] = []

    class Failing(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            asked.append(self.path)
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"error": {"message": "EngineCore encountered an issue."}}'
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        log = tmp_path / "server.log"
        client = ServerClient(
            f"http://127.0.0.1:{http.server_port}",
            label="vLLM",
            root_cause=lambda: "ValueError: nan",
            log_path=log,
            max_retries=1,
        )
        with pytest.raises(ServerError) as info:
            client.completion([1, 2], model="m", max_tokens=1)
    finally:
        http.shutdown()
        http.server_close()
    assert asked == ["/v1/completions"] * 2
    assert str(info.value) == (
        'vLLM /v1/completions answered 500: {"error": {"message": "EngineCore encountered an issue."}}; '
        f"server log: ValueError: nan (log: {log})"
    )


def test_choices_many_inside_an_event_loop_points_to_the_async_variant():
    client = ServerClient(f"http://127.0.0.1:{free_port()}")

    async def inside() -> None:
        client.choices_many([[1]], model="m")

    with pytest.raises(RuntimeError, match="await achoices_many"):
        asyncio.run(inside())


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/collective_rpc", {"method": "model_support_reload_weights", "kwargs": {"weights_dir": "/tmp"}}),
        ("POST", "/model_support/served_model_name", {"name": "stolen@9"}),
        ("POST", "/pause?mode=abort", None),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": "x", "prompt": [1, 2], "max_tokens": 1}),
    ],
)
def test_a_request_without_the_owners_key_is_refused_and_changes_nothing(
    server: Server, method: str, path: str, body: dict[str, Any] | None
):
    before = server.completion([11, 12, 13], max_tokens=1, temperature=0.0, logprobs=0)
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        request = urllib.request.Request(
            f"{server.base_url}{path}",
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **headers},
            method=method,
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 401
    # still serving, under the same name, the same answer
    assert server.models() == [server.served_name]
    after = server.completion([11, 12, 13], max_tokens=1, temperature=0.0, logprobs=0)
    assert after["token_ids"] == before["token_ids"]
    assert after["logprobs"]["token_logprobs"] == before["logprobs"]["token_logprobs"]


def test_the_adapters_in_use_are_the_latest_label_set_vllm_recorded() -> None:
    from model_support.core.serving.vllm_backend import _lora_in_use, _metric

    metrics = "\n".join(
        [
            "# TYPE vllm:lora_requests_info gauge",
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="m-lora@1",waiting_lora_adapters=""} 1.7e9',
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters="a@2,m-lora@2"} 1.8e9',
            'vllm:num_requests_running{engine="0",model_name="m@0"} 1.0',
            'vllm:num_requests_running{engine="1",model_name="m@0"} 2.0',
        ]
    )
    assert _lora_in_use(metrics) == {"a@2", "m-lora@2"}
    assert _lora_in_use("vllm:num_requests_running 0.0") is None
    assert _metric(metrics, "vllm:num_requests_running") == 3.0
    assert _metric(metrics, "vllm:num_requests_waiting") is None
