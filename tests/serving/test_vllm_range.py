"""The serving side across vLLM releases (0.26 on GPU images with torch 2.11, 0.32 / 0.33 elsewhere): each feature
used where the running vLLM has it, refused in one line naming the release where it is missing; a vLLM the node
already has recorded as the runtime; the server log's cause found in argparse and OS-error lines. No server runs
here except through the installed runtime's interpreter (``runtime use``)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from model_support.core.serving.errors import ServingError
from model_support.core.serving.options import ServeOptions
from model_support.core.serving.runtime import RuntimeInfo, load_runtime
from model_support.core.serving.vllm_backend import root_cause, server_command, server_env, with_token_ids
from model_support.core.serving.vllm_features import VllmFeatures


def _runtime(version: str, pythonpath: tuple[str, ...] = ()) -> RuntimeInfo:
    return RuntimeInfo("/r", "/r/venv/bin/python", "gpu", "vllm", version, "2.11.0", "3.12.3", 0.0, 0, pythonpath)


@pytest.mark.parametrize(
    ("version", "scale_out", "weight_version", "token_versions"),
    [("0.26.0", False, False, False), ("0.27.1", False, True, False), ("0.30.0", True, True, False),
     ("0.32.0", True, True, True), ("0.33.0+cu130", True, True, True)],
)  # fmt: skip
def test_features_follow_the_release(version: str, scale_out: bool, weight_version: bool, token_versions: bool):
    features = VllmFeatures(version)
    assert features.has("scale_out_flag") is scale_out
    assert features.has("weight_version") is weight_version
    assert features.has("token_weight_versions") is token_versions
    assert features.has("generate_n") is token_versions


def test_a_missing_feature_is_refused_in_one_line_naming_the_release():
    VllmFeatures("0.32.0").require("token_weight_versions", "per-token staleness")
    with pytest.raises(ServingError) as exc:
        VllmFeatures("0.26.0").require("token_weight_versions", "per-token staleness")
    assert str(exc.value).startswith(
        "per-token staleness needs per-token weight versions in /inference/v1/generate, which vLLM has from 0.32 on; "
        "the runtime's vLLM is 0.26.0"
    )
    assert "\n" not in str(exc.value)


def test_the_server_command_has_the_flags_its_vllm_has(tmp_path: Path):
    for version, flagged in (("0.26.0", False), ("0.32.0", True)):
        runtime = _runtime(version)
        cmd = server_command(runtime, VllmFeatures(version), tmp_path, "m@0", 8000, ServeOptions())
        assert ("--enable-scale-out" in cmd) is flagged  # 0.26 has no such flag (argparse refuses it)
        assert cmd[:3] == [runtime.python, "-m", "vllm.entrypoints.openai.api_server"]


@pytest.mark.parametrize(
    ("flavor", "flashinfer", "triton"), [("gpu", False, True), ("gpu", True, False), ("cpu", False, False)]
)
def test_a_gpu_runtime_without_flashinfer_serves_gdn_with_triton(flavor: str, flashinfer: bool, triton: bool):
    """vLLM on Hopper asks for FlashInfer's GDN prefill kernel by default; where the runtime has no FlashInfer the
    server is told to use its Triton kernel (a Qwen3.5 server failed at its first forward without)."""
    runtime = dataclasses.replace(_runtime("0.26.0"), flavor=flavor, flashinfer=flashinfer)
    cmd = server_command(runtime, VllmFeatures("0.26.0"), Path("/m"), "m@0", 8000, ServeOptions())
    assert (cmd[cmd.index("--gdn-prefill-backend") + 1] == "triton") if triton else "--gdn-prefill-backend" not in cmd


def test_generate_log_probs_of_vllm_026_get_their_token_ids():
    """A choice as vLLM 0.26's generate route writes it (its tokens named ``token_id:N`` only) reads as 0.32's."""
    entry = {"token": "token_id:17", "logprob": -0.5, "bytes": None}
    top = [{"token": "token_id:17", "logprob": -0.5, "bytes": None}, {"token": "token_id:4", "logprob": -1.5}]
    choice = {"index": 0, "token_ids": [17], "logprobs": {"content": [{**entry, "top_logprobs": top}]}}
    (got,) = with_token_ids(choice)["logprobs"]["content"]
    assert (got["token_id"], [t["token_id"] for t in got["top_logprobs"]]) == (17, [17, 4])
    as_032 = {"index": 0, "logprobs": {"content": [{"token_id": 3, "logprob": -0.1, "top_logprobs": []}]}}
    assert with_token_ids(as_032) == as_032
    assert with_token_ids({"index": 0, "logprobs": None}) == {"index": 0, "logprobs": None}


def test_a_runtime_on_a_path_of_its_own_is_put_after_the_extension():
    env = server_env(_runtime("0.26.0", ("/tmp/vsite", "/opt/more")), ServeOptions(), "k")
    ext, *rest = env["PYTHONPATH"].split(":")
    assert ext.endswith("vllm_ext") and rest == ["/tmp/vsite", "/opt/more"]
    assert env["MODEL_SUPPORT_SERVER_KEY"] == "k"  # the key in the environment, never on the command line
    # A server on GPUs of its own (the trainer on GPU 0): only those are visible to it.
    assert server_env(_runtime("0.26.0"), ServeOptions(gpus="1"), "k")["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize(
    ("log", "cause"),
    [
        (
            "(APIServer pid=7) INFO 11-27 10:00:00 [api_server.py:12] starting\n"
            "usage: api_server.py [-h] [--model MODEL]\n"
            "api_server.py: error: unrecognized arguments: --enable-scale-out\n",
            "api_server.py: error: unrecognized arguments: --enable-scale-out",
        ),
        (
            "(APIServer pid=7) ERROR 11-27 10:00:00 [launcher.py:9] OSError: [Errno 98] Address already in use\n"
            "Traceback (most recent call last):\n",
            "OSError: [Errno 98] Address already in use",
        ),
        (
            "ERROR 11-27 [shm.py:1] could not map: [Errno 28] No space left on device",
            "[Errno 28] No space left on device",
        ),
        (
            "(EngineCore pid=3) ERROR [core.py:5] ValueError: bad rank\n"
            "(APIServer) ERROR [x.py:2] RuntimeError: Engine core initialization failed. See root cause above.\n",
            "ValueError: bad rank",
        ),
        (  # a failed assert has no message: the statement that raised it is the cause (vLLM 0.26 on an H100)
            '(EngineCore pid=1135) ERROR 11-27 20:56:57 [core.py:1330]   File "/tmp/vsite/vllm/lora/ops/triton_ops/'
            'lora_expand_op.py", line 183, in _lora_expand\n'
            "(EngineCore pid=1135) ERROR 11-27 20:56:57 [core.py:1330]     assert weight.dtype in [torch.float16, "
            "torch.bfloat16]\n"
            "(EngineCore pid=1135) ERROR 11-27 20:56:57 [core.py:1330]            ^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
            "(EngineCore pid=1135) ERROR 11-27 20:56:57 [core.py:1330] AssertionError\n"
            "(EngineCore pid=1135) Process EngineCore:\n"
            "(EngineCore pid=1135) Traceback (most recent call last):\n"
            '(EngineCore pid=1135)   File "/usr/lib/python3.12/site-packages/vllm/lora/ops/triton_ops/'
            'lora_expand_op.py", line 183, in _lora_expand\n'
            "(EngineCore pid=1135)     assert weight.dtype in [torch.float16, torch.bfloat16]\n"
            "(EngineCore pid=1135)            ^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
            "(EngineCore pid=1135) AssertionError\n"
            "(APIServer pid=893) RuntimeError: Engine core initialization failed. See root cause above.\n",
            "AssertionError at vllm/lora/ops/triton_ops/lora_expand_op.py:183: "
            "assert weight.dtype in [torch.float16, torch.bfloat16]",
        ),
        ("INFO all good\n", "no error line in the server log"),
    ],
)
def test_the_server_logs_cause_is_found(log: str, cause: str):
    assert root_cause(log) == cause


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "model_support.core.cli", "runtime", *args], capture_output=True, text=True, check=False
    )


def test_runtime_use_records_a_vllm_the_node_already_has(tmp_path: Path):
    try:
        installed = load_runtime()
    except ServingError as exc:
        pytest.skip(str(exc))
    result = _cli("use", "--python", installed.python, "--pythonpath", str(tmp_path), "--root", str(tmp_path / "rt"))
    assert result.returncode == 0, result.stderr
    recorded = load_runtime(tmp_path / "rt")
    assert (recorded.python, recorded.vllm_version, recorded.distribution) == (
        installed.python,
        installed.vllm_version,
        installed.distribution,
    )
    assert recorded.pythonpath == (str(tmp_path),) and recorded.managed is False
    assert recorded.flashinfer is False  # probed: neither build here has FlashInfer
    assert json.loads((tmp_path / "rt" / "runtime.json").read_text())["managed"] is False


@pytest.mark.parametrize(
    ("python", "message"),
    [
        ("/nonexistent/python", "/nonexistent/python is not a Python interpreter; name the one of the environment"),
        (sys.executable, "cannot import vLLM and torch (ModuleNotFoundError: No module named 'vllm'); name an"),
    ],
)
def test_runtime_use_refuses_an_interpreter_without_vllm_and_writes_nothing(python: str, message: str, tmp_path: Path):
    result = _cli("use", "--python", python, "--root", str(tmp_path / "rt"))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert message in line
    assert not (tmp_path / "rt").exists()


def test_runtime_install_refuses_a_directory_it_did_not_make(tmp_path: Path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.txt").write_text("years of work")
    result = _cli("install", "--root", str(tmp_path))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert f"{tmp_path} is not empty and holds no model-support runtime (runtime.json)" in line
    assert (tmp_path / "notes" / "thesis.txt").read_text() == "years of work"


def test_a_failed_reinstall_leaves_the_working_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from model_support.core.serving import runtime as rt

    root = tmp_path / "rt"
    root.mkdir()
    (root / "runtime.json").write_text(json.dumps({"managed": True}))
    (root / "venv").mkdir()
    (root / "venv" / "marker").write_text("the working runtime")

    def failing(build: Path, *args: object) -> None:
        (build / "venv").mkdir()  # half-built
        raise ServingError("runtime install: pip install vllm==9 failed (exit 1): no such version")

    monkeypatch.setattr(rt, "_install_into", failing)
    with pytest.raises(ServingError, match="no such version"):
        rt.install_runtime(root, "cpu", "9")
    assert (root / "venv" / "marker").read_text() == "the working runtime"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rt"]  # nothing half-built left beside it

    def succeeding(build: Path, *args: object) -> str:
        (build / "venv").mkdir()
        (build / "runtime.json").write_text("{}")
        return "installed"

    monkeypatch.setattr(rt, "_install_into", succeeding)
    assert rt.install_runtime(root, "cpu", "9") == "installed"
    assert not (root / "venv" / "marker").exists() and (root / "runtime.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rt"]


def test_an_install_step_dies_with_a_killed_install(tmp_path: Path):
    """``runtime install``'s pip runs under the project's launcher: SIGKILL the install and pip goes too."""
    import os
    import signal
    import time

    import psutil

    marker = f"ms-install-step-{os.getpid()}"
    code = (
        "import os; from model_support.core.serving.runtime import _run; "
        f"_run(['python3', '-c', 'import time; time.sleep(120)', '{marker}'], dict(os.environ), 'a long step')"
    )
    installer = subprocess.Popen([sys.executable, "-c", code])

    def step() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            if marker in (proc.info["cmdline"] or []) and "-c" in (proc.info["cmdline"] or [])[1:2]:
                found.append(proc)
        return found

    for _ in range(600):  # up to 60 s for the step to start on a loaded machine
        if step():
            break
        time.sleep(0.1)
    assert step(), "the install step never started"
    installer.send_signal(signal.SIGKILL)
    installer.wait()
    for _ in range(300):  # the launcher sees its parent die at once; bounded by count on a loaded machine
        if not step():
            break
        time.sleep(0.1)
    assert not step()


def test_a_server_that_is_gone_is_named_not_a_raw_urlerror(tmp_path: Path):
    """A request to a server whose process has exited: one ServerError naming that, with the log's cause."""
    from model_support.core.serving.errors import ServerError
    from model_support.core.serving.process import ManagedProcess
    from model_support.core.serving.vllm_backend import VllmServer, free_port

    code = "import sys; print('OSError: [Errno 98] Address already in use', flush=True); sys.exit(1)"
    process = ManagedProcess(
        Path(sys.executable), [sys.executable, "-c", code], env={}, log_path=tmp_path / "server.log"
    ).start()
    assert process.wait(60) == 1
    server = VllmServer(process, free_port(), "m@0", tmp_path, ServeOptions(), VllmFeatures("0.32.0"), "k")
    with pytest.raises(ServerError) as caught:
        server.request("/v1/models")
    message = str(caught.value)
    assert message.startswith("vLLM /v1/models: the server has exited (")
    assert "server log: OSError: [Errno 98] Address already in use" in message
    process.stop()


@pytest.mark.parametrize(
    ("flavor", "handler", "dtype", "served", "gap"),
    [
        ("gpu", "qwen3", "bf16", "bfloat16", None),
        ("gpu", "qwen3", "fp32", "float32", "vLLM's GPU LoRA kernels take fp16 / bf16 weights only"),
        ("cpu", "qwen3", "bf16", "float32", None),  # the CPU build serves the checkpoint's own
        ("cpu", "qwen3.5", None, "bfloat16", None),  # unless the handler's CPU policy names another
    ],
)
def test_the_servers_dtype_is_the_checks_training_dtype_on_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flavor: str, handler: str, dtype: str | None, served: str, gap
):
    """On a GPU the servers run in the dtype the check trains in (vLLM's GPU LoRA kernels refuse fp32 weights: an
    fp32 tiny replica served as its checkpoint says failed every serving stage on an H100); a check in fp32 there
    serves no adapter natively."""
    from transformers import AutoConfig

    from model_support.core.layout import ModelLayout
    from model_support.core.registry import load_registry
    from model_support.core.serving.runtime import RUNTIME_ENV
    from model_support.validation.context import CheckContext
    from model_support.validation.serving_session import lora_gap, serving_dtype

    runtime = tmp_path / "runtime"
    runtime.mkdir()
    info = dict(_runtime("0.26.0").__dict__, root=str(runtime), python=sys.executable, flavor=flavor)
    (runtime / "runtime.json").write_text(json.dumps(info))
    monkeypatch.setenv(RUNTIME_ENV, str(runtime))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3", "dtype": "float32"}))
    registry = load_registry(env={})
    layout = ModelLayout(num_layers=2, layer_types=("full_attention",) * 2, moe=None, mtp_layers=0)
    ctx = CheckContext("t", model, registry.get(handler), AutoConfig.from_pretrained(model), layout, registry, tmp_path)
    ctx.dtype = dtype
    assert serving_dtype(ctx)[0] == served
    assert (lora_gap(ctx) or "").startswith(gap or "")
    assert (lora_gap(ctx) is None) is (gap is None)
